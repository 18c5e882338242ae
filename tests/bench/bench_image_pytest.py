"""Grading time with the image's own pytest vs the grader's bundled one, same task side by
side (run by hand; docs/tasks.md quotes it):

    python tests/bench/bench_image_pytest.py [TASKS.jsonl] [--rows N] [--repeat K]

Rows: the first N of TASKS.jsonl (default: the swe_smith_images set, whose images carry
pytest 9.2.0) and the calc row of tests/integration/test_image_tasks.py on an image with
pytest 7.4.4. For each row, the gold patch is graded K times with each pytest, the two
alternating (reward.grading.hidden_tests.HiddenTests(use_image_pytest=...).grade), in a fresh container
of the task's image; printed: which pytest ran, the reward, the driver's run ("tests",
where the two differ) and the whole grading (apply + container start + tests), medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from envs.cache import default_cache_dir
from envs.sandbox.container import ContainerSandbox
from envs.tasks.build_swe_smith import build_bundled_image_set
from reward.base import RewardContext
from reward.grading.hidden_tests import HiddenTests, pytest_label, score_run
from reward.grading.validate import gold_changes, read_swe_rows

HERE = Path(__file__).resolve().parent


def pytest7_rows(tmp: str) -> str:
    """The calc row on a project layer with pytest 7.4.4 (the integration test's)."""
    sys.path[:0] = [str(HERE.parent), str(HERE.parent / "integration")]
    from test_image_tasks import PYTEST7, calc_image_row

    path, _, _ = calc_image_row(Path(tmp), "demo/calc7", "test-calc-pytest7", PYTEST7)
    return str(path)


async def main(paths: list[str], num_rows: int, repeat: int) -> None:
    ctx = RewardContext(create_sandbox=ContainerSandbox.create, timeout_s=300)
    rows = [r for p in paths[:-1] for r in read_swe_rows(p, str(default_cache_dir()))[:num_rows]]
    rows += read_swe_rows(paths[-1], str(default_cache_dir()))
    print("| task | pytest | reward | tests_s (median) | total_s (median) |")
    print("|---|---|---|---|---|")
    sums: dict[bool, list[float]] = {True: [], False: []}
    for row, task, why in rows:
        assert task is not None, why
        changes = gold_changes(task, row["patch"])
        runs: dict[bool, list[tuple[float, float, float, str]]] = {True: [], False: []}
        for _ in range(repeat):
            for use_image in (True, False):
                start = time.monotonic()
                run = await HiddenTests(use_image_pytest=use_image).grade(task, changes, ctx)
                total = time.monotonic() - start
                reward = score_run(task, run, partial_credit=False).reward
                runs[use_image].append((run.tests_s, total, reward, pytest_label(run.driver)))
        for use_image in (True, False):
            got = runs[use_image]
            tests_s = statistics.median(g[0] for g in got)
            total_s = statistics.median(g[1] for g in got)
            sums[use_image].append(tests_s)
            print(f"| {task.id} | {got[0][3]} | {min(g[2] for g in got):.0f} | {tests_s:.2f} | "
                  f"{total_s:.2f} |", flush=True)
    for use_image, name in ((True, "image's pytest"), (False, "bundled pytest")):
        print(f"mean tests_s over {len(sums[use_image])} tasks, {name}: "
              f"{statistics.mean(sums[use_image]):.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tasks", nargs="?", default=None)
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    source = args.tasks or build_bundled_image_set(str(default_cache_dir()))
    with tempfile.TemporaryDirectory(prefix="bench-pytest7-") as tmp:
        asyncio.run(main([source, pytest7_rows(tmp)], args.rows, args.repeat))
