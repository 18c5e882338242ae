"""Benchmark of hidden-test grading time per trajectory, before and after the grading
integrity work, side by side in one run (needs root and bubblewrap; podman for the
container backend):

    .venv/bin/python tests/bench/bench_grading.py [--before 2abf3e4] [--repeats 5]
                                                  [--backends local,container]

"before" is the grader of a git revision, checked out into a temporary worktree; "after"
is this working tree. Each side grades the same workspaces in its own process (so each
imports only its own code): a bundled code task's reference and stub, and a SWE-style
task's gold and empty patches, one grading at a time. Prints one table of seconds per
grading (median, and the reward as a check that both sides agree). Nothing is asserted;
numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
CASES = ("code reference", "code stub", "swe gold", "swe empty")


async def measure(backend: str, repeats: int, work: Path) -> dict[str, dict[str, float]]:
    """Seconds per grading of each case with the grader importable as `reward` (the
    tree this process was started with)."""
    from grading_tasks import CALC, build_swe_task, trajectory_of

    from envs.tasks import load_tasks
    from envs.tasks.code import spec_by_name
    from reward.base import RewardContext
    from reward.grading.hidden_tests import HiddenTests
    from reward.workspace import WorkspaceChanges

    if backend == "local":
        from envs.sandbox.local import LocalSandbox as Backend
    else:
        from envs.sandbox.container import ContainerSandbox as Backend  # type: ignore[assignment]
    code = next(t for t in load_tasks("code_functions", cache_dir=str(work / "code"))
                if t.id.endswith("/run_length_encode"))
    spec = spec_by_name(code.id)
    swe = build_swe_task(CALC, work / "swe")
    cases = {"code reference": (code, {spec.module: spec.reference.encode()}),
             "code stub": (code, {}), "swe gold": (swe, {"calc/ops.py": CALC.fix["calc/ops.py"]
                                                         .encode()}),
             "swe empty": (swe, {})}
    grader = HiddenTests()
    out = {}
    for name, (task, files) in cases.items():
        ctx = RewardContext(workspace=WorkspaceChanges(written=files),
                            create_sandbox=Backend.create, timeout_s=120)
        await grader(trajectory_of(task), task, ctx)  # warm: runtime zip, images, caches
        seconds, reward = [], 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            result = await grader(trajectory_of(task), task, ctx)
            seconds.append(time.perf_counter() - start)
            reward = result.reward
        out[name] = {"median_s": statistics.median(seconds), "min_s": min(seconds),
                     "reward": reward}
    return out


def run_side(tree: Path, backend: str, repeats: int) -> dict[str, dict[str, float]]:
    """`measure` in a fresh process whose `reward`, `envs`, ... come from `tree`."""
    with tempfile.TemporaryDirectory(prefix="sluice-bench-grading-") as work:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(tree), str(TESTS / "integration"), str(TESTS)])}
        proc = subprocess.run([sys.executable, __file__, "--inner", backend, str(repeats), work],
                              env=env, cwd=work, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the {tree} side failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worktree(rev: str, folder: str) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", folder, rev],
                   check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="2abf3e4", help="git revision of the old grader")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="local,container")
    parser.add_argument("--inner", nargs=3, metavar=("BACKEND", "REPEATS", "WORK"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        backend, repeats, work = args.inner
        print(json.dumps(asyncio.run(measure(backend, int(repeats), Path(work)))))
        return
    before_tree = tempfile.mkdtemp(prefix="sluice-before-")
    os.rmdir(before_tree)
    worktree(args.before, before_tree)
    try:
        report(args, Path(before_tree))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", before_tree],
                       check=False, capture_output=True)
        shutil.rmtree(before_tree, ignore_errors=True)


def report(args: argparse.Namespace, before_tree: Path) -> None:
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; python {platform.python_version()}; "
          f"{args.repeats} gradings per case, one at a time")
    print(f"{'backend':<10} {'case':<15} {'before s':>9} {'after s':>9} {'after/before':>13} "
          f"{'reward b/a':>11}")
    for backend in args.backends.split(","):
        before = run_side(before_tree, backend, args.repeats)
        after = run_side(ROOT, backend, args.repeats)
        for case in CASES:
            b, a = before[case], after[case]
            print(f"{backend:<10} {case:<15} {b['median_s']:>9.3f} {a['median_s']:>9.3f} "
                  f"{a['median_s'] / b['median_s']:>13.2f} "
                  f"{b['reward']:>5.1f}/{a['reward']:<5.1f}")


if __name__ == "__main__":
    main()
