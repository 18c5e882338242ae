"""The quickstart workload with a heavy-tailed environment, in `train.mode=sync` and
`async` side by side, run by hand:

    python tests/bench/bench_sync_vs_async.py [--steps 12] [--rounds 1] [--base-s 0.2]
                                              [--slow-fraction 0.1]

Each run is `python -m trainer.main recipe=quickstart.yaml` (real Ray, vLLM, sandboxes,
DeepSpeed; no held-out eval, whose time would land in the last step) with `agent.loop`
set to heavy_tail_loop:HeavyTailToolLoop: every tool turn
takes an extra `--base-s`, a `--slow-fraction` of them ten times that. Modes alternate
(sync, async, sync, ...) so machine noise hits both. Reports, from each run's
metrics.jsonl and excluding the first step (engine start-up, first batch): steps per
minute, rollout and trainer idle ratios, staleness; then the ratio of seconds per step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from quickstart_runs import bench_env, run_alternating, run_quickstart


def run_once(mode: str, steps: int, out_dir: Path, env: dict[str, str]) -> dict[str, float]:
    start = time.monotonic()
    rows = run_quickstart(f"{mode}-{int(time.time())}", [
        f"train.mode={mode}", f"train.num_steps={steps}",
        "agent.loop=heavy_tail_loop:HeavyTailToolLoop"], out_dir, env)
    wall = time.monotonic() - start
    rows = rows[1:]  # the first step includes start-up
    seconds = rows[-1]["time"] - rows[0]["time"]
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    return {"s_per_step": seconds / (len(rows) - 1), "steps_per_min": 60 * (len(rows) - 1) / seconds,
            "rollout_idle": mean("perf/rollout_idle_ratio"),
            "trainer_idle": mean("perf/trainer_idle_ratio"),
            "staleness_mean": mean("staleness/mean"),
            "staleness_max": max(r["staleness/max"] for r in rows),
            "reward": mean("reward/mean"), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--base-s", type=float, default=0.2)
    parser.add_argument("--slow-fraction", type=float, default=0.1)
    args = parser.parse_args()

    env = bench_env(HEAVY_TAIL_BASE_S=str(args.base_s),
                    HEAVY_TAIL_SLOW_FRACTION=str(args.slow_fraction))
    results = run_alternating(("sync", "async"), args.rounds,
                              lambda mode, out: run_once(mode, args.steps, out, env))
    print(f"command: python tests/bench/bench_sync_vs_async.py --steps {args.steps} --rounds "
          f"{args.rounds} --base-s {args.base_s} --slow-fraction {args.slow_fraction}")
    print(f"workload: quickstart recipe, {args.steps} steps (first excluded); tool turns take "
          f"+{args.base_s:g} s, {args.slow_fraction:.0%} of them +{10 * args.base_s:g} s\n")
    keys = ("s_per_step", "steps_per_min", "rollout_idle", "trainer_idle", "staleness_mean",
            "staleness_max", "reward")
    print("| mode | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for mode, runs in results.items():
        cells = [f"{statistics.fmean(r[k] for r in runs):.3f}" for k in keys]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    ratio = (statistics.fmean(r["s_per_step"] for r in results["sync"])
             / statistics.fmean(r["s_per_step"] for r in results["async"]))
    print(f"\nsync / async seconds per step: {ratio:.2f}x (the seed article estimates ~5x for "
          "its SWE workload)")


if __name__ == "__main__":
    main()
