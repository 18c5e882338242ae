"""Grading time per image task and image sizes (run by hand; docs/tasks.md quotes it):

    python tests/bench/bench_image_grading.py [TASKS.jsonl]   (default: the swe_smith_images set)

For every row: the gold patch graded once in a fresh container of the task's image
(reward.grading.hidden_tests.HiddenTests.grade), split into the grading folder (base copy, the agent's
changes, the test patch: "apply"), the container's create ("start") and the driver's
run ("tests"); then the size of each layer (base, project, task) of the images.
"""

from __future__ import annotations

import asyncio
import sys
import time

from envs.cache import default_cache_dir
from envs.sandbox.container import ContainerSandbox
from envs.sandbox.engine import detect_engine, run_engine
from envs.tasks.build_swe_smith import build_bundled_image_set
from envs.tasks.images import image_size_mb
from reward.base import RewardContext
from reward.grading.hidden_tests import HiddenTests, score_run
from reward.grading.validate import gold_changes, read_swe_rows


def parent_of(engine, image: str) -> str:
    return run_engine(engine, "image", "inspect", "--format",
                      '{{index .Labels "sluice.parent"}}', image).strip()


async def main(path: str) -> None:
    rows = read_swe_rows(path, str(default_cache_dir()))
    ctx = RewardContext(create_sandbox=ContainerSandbox.create, timeout_s=300)
    print("instance_id  project  kind  F2P  P2P  reward  apply_s  start_s  tests_s  total_s")
    totals = []
    for row, task, why in rows:
        assert task is not None, why
        changes = gold_changes(task, row["patch"])
        start = time.monotonic()
        run = await HiddenTests().grade(task, changes, ctx)
        total = time.monotonic() - start
        reward = score_run(task, run, partial_credit=False).reward
        totals.append((run.prepare_s, run.start_s, run.tests_s, total))
        print(f"{task.id}  {row['repo']}  {row.get('bug_kind', '-')}  {len(task.grading.fail_to_pass)}  "
              f"{len(task.grading.pass_to_pass)}  {reward:.0f}  {run.prepare_s:.2f}  {run.start_s:.2f}  "
              f"{run.tests_s:.2f}  {total:.2f}", flush=True)
    n = len(totals)
    means = [sum(t[i] for t in totals) / n for i in range(4)]
    print(f"mean of {n}: apply {means[0]:.2f}s, start {means[1]:.2f}s, tests {means[2]:.2f}s, "
          f"total {means[3]:.2f}s")
    engine = detect_engine()
    seen: dict[str, float] = {}
    for row, task, _ in rows:
        assert task is not None and task.image is not None
        project = parent_of(engine, task.image)
        for image in (task.image, project):
            if image and image not in seen:
                seen[image] = image_size_mb(engine, image)
    projects = sorted({parent_of(engine, t.image) for _, t, _ in rows if t and t.image})
    base_tag = run_engine(engine, "images", "--format", "{{.Repository}}:{{.Tag}}",
                          "localhost/sluice-swe-base").split()[0]
    base_mb = image_size_mb(engine, base_tag)
    print(f"base {base_tag}: {base_mb:.1f} MB")
    for p in projects:
        print(f"project {p}: {seen[p]:.1f} MB ({seen[p] - base_mb:.1f} MB over the base)")
    task_layers = [seen[t.image] - seen[parent_of(engine, t.image)]
                   for _, t, _ in rows if t and t.image]
    print(f"task layers (the repository at /testbed): {min(task_layers):.2f}-"
          f"{max(task_layers):.2f} MB over their project image, {len(task_layers)} images")


if __name__ == "__main__":
    source = sys.argv[1] if len(sys.argv) > 1 else build_bundled_image_set(str(default_cache_dir()))
    asyncio.run(main(source))
