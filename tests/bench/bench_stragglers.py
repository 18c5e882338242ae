"""The straggler policies side by side on the heavy-tail toy, run by hand:

    python tests/bench/bench_stragglers.py [--steps 12] [--rounds 1] [--deadline-s 6]
                                           [--base-s 0.2] [--slow-fraction 0.03] [--slowdown 100]

Each run is `python -m trainer.main recipe=quickstart.yaml` (real Ray, vLLM, sandboxes,
DeepSpeed; no held-out eval) with `agent.loop=heavy_tail_loop:HeavyTailToolLoop`: every
tool turn takes an extra `--base-s`, and a `--slow-fraction` of them `--slowdown` times that
(with the defaults, a 20 s "hang" in about a third of the groups of 8). Runs alternate
between `buffer.straggler_policy` wait, drop and partial (`buffer.group_deadline_s` =
`--deadline-s`, `min_group_size` 4), so machine noise hits them alike. Reports, from each
run's metrics.jsonl, excluding the first step (engine start-up, first batch): step time
p50 and p99 (the p99 of 11 steps is their maximum), trainer idle ratio, reward, what the
policy did (late, cut, partial and dropped groups) and the length bias it introduces: the
turns and generated tokens per trained sample, and the cut samples by turns reached.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from quickstart_runs import bench_env, percentile, run_alternating, run_quickstart

POLICIES = ("wait", "drop", "partial")


def run_once(policy: str, args: argparse.Namespace, out_dir: Path, env: dict[str, str]) -> dict:
    rows = run_quickstart(f"{policy}-{int(time.time())}", [
        f"train.num_steps={args.steps}", "agent.loop=heavy_tail_loop:HeavyTailToolLoop",
        f"buffer.straggler_policy={policy}", f"buffer.group_deadline_s={args.deadline_s}",
        "buffer.min_group_size=4"], out_dir, env)
    last, rows = rows[-1], rows[1:]  # the first step includes start-up
    steps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    samples_per_step = 32  # the quickstart's 4 groups of 8
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
    cut_turns = {k.rsplit("/", 1)[1]: int(v) for k, v in last.items()
                 if k.startswith("buffer/deadline_cut_by_turns/")}
    return {"p50_s": percentile(steps, 50), "p99_s": percentile(steps, 99),
            "trainer_idle": mean("perf/trainer_idle_ratio"), "reward": mean("reward/mean"),
            "turns": mean("rollout/turns"),
            "tokens": mean("rollout/tokens_generated") / samples_per_step,
            "late": last.get("buffer/deadline_late_groups", 0.0),
            "cut": last.get("buffer/deadline_cut_samples", 0.0),
            "partial": last.get("buffer/deadline_partial_groups", 0.0),
            "dropped": last.get("buffer/dropped_deadline", 0.0),
            "cut_by_turns": " ".join(f"{k}:{v}" for k, v in sorted(cut_turns.items())) or "-"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--deadline-s", type=float, default=6.0)
    parser.add_argument("--base-s", type=float, default=0.2)
    parser.add_argument("--slow-fraction", type=float, default=0.03)
    parser.add_argument("--slowdown", type=float, default=100.0)
    args = parser.parse_args()

    env = bench_env(HEAVY_TAIL_BASE_S=str(args.base_s),
                    HEAVY_TAIL_SLOW_FRACTION=str(args.slow_fraction),
                    HEAVY_TAIL_SLOWDOWN=str(args.slowdown))
    results = run_alternating(POLICIES, args.rounds,
                              lambda policy, out: run_once(policy, args, out, env))
    print(f"command: python tests/bench/bench_stragglers.py --steps {args.steps} --rounds "
          f"{args.rounds} --deadline-s {args.deadline_s:g} --base-s {args.base_s:g} "
          f"--slow-fraction {args.slow_fraction:g} --slowdown {args.slowdown:g}")
    print(f"workload: quickstart recipe, {args.steps} steps (first excluded); tool turns take "
          f"+{args.base_s:g} s, {args.slow_fraction:.0%} of them +{args.slowdown * args.base_s:g} s; "
          f"buffer.group_deadline_s={args.deadline_s:g}, min_group_size=4\n")
    keys = ("p50_s", "p99_s", "trainer_idle", "reward", "turns", "tokens", "late", "cut",
            "partial", "dropped")
    print("| policy | " + " | ".join(keys) + " | cut by turns reached |")
    print("|---" * (len(keys) + 2) + "|")
    for policy, runs in results.items():
        cells = [f"{statistics.fmean(r[k] for r in runs):.2f}" for k in keys]
        print(f"| {policy} | " + " | ".join(cells) + f" | {runs[-1]['cut_by_turns']} |")


if __name__ == "__main__":
    main()
