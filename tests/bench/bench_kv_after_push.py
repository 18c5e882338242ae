"""`rollout.kv_after_push` recompute against reuse on the quickstart, run by hand:

    python tests/bench/bench_kv_after_push.py [--steps 12] [--rounds 1] [--tool-s 1.0]

Each run is `python -m trainer.main recipe=quickstart.yaml` (real Ray, vLLM, sandboxes,
DeepSpeed; no held-out eval): a push after every step. Every tool turn takes `--tool-s`
more (heavy_tail_loop:HeavyTailToolLoop, no tail), so that trajectories outlive a step and
their later turns come after a push, the case the two policies differ on: the plain
quickstart's trajectories start after one push and end before the next (0: run it so).
Modes alternate (recompute, reuse, ...) so machine noise hits both. Reports per
mode, from each run's metrics.jsonl, excluding the first step: the prompt tokens the
engines computed per step (`rollout/prefill_tokens`), those served from KV of older
weights (`rollout/stale_kv_tokens`), the prefix-cache hit rate, and the price of reuse in
the units users read: `loss/mismatch_kl` (behaviour against proximal logprobs) and
`loss/is_weight_mean`; then seconds per step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from quickstart_runs import bench_env, run_alternating, run_quickstart

MODES = ("recompute", "reuse")
KEYS = {"prefill_tokens": "rollout/prefill_tokens", "stale_kv_tokens": "rollout/stale_kv_tokens",
        "hit_rate": "rollout/prefix_cache_hit_rate", "mismatch_kl": "loss/mismatch_kl",
        "is_weight_mean": "loss/is_weight_mean", "reward": "reward/mean"}


def run_once(mode: str, args: argparse.Namespace, out_dir: Path, env: dict[str, str]) -> dict[str, float]:
    loop = ["agent.loop=heavy_tail_loop:HeavyTailToolLoop"] if args.tool_s > 0 else []
    rows = run_quickstart(f"{mode}-{int(time.time())}", [
        f"rollout.kv_after_push={mode}", f"train.num_steps={args.steps}", *loop], out_dir, env)[1:]
    out = {name: statistics.fmean(r[key] for r in rows) for name, key in KEYS.items()}
    out["s_per_step"] = (rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tool-s", type=float, default=1.0)
    args = parser.parse_args()

    env = bench_env(HEAVY_TAIL_BASE_S=str(args.tool_s), HEAVY_TAIL_SLOW_FRACTION="0")
    results = run_alternating(MODES, args.rounds,
                              lambda mode, out: run_once(mode, args, out, env))
    print(f"command: python tests/bench/bench_kv_after_push.py --steps {args.steps} "
          f"--rounds {args.rounds} --tool-s {args.tool_s:g}")
    print(f"workload: quickstart recipe, tool turns +{args.tool_s:g} s, {args.steps} steps "
          "(first excluded), means per step\n")
    keys = (*KEYS, "s_per_step")
    print("| kv_after_push | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for mode, runs in results.items():
        print(f"| {mode} | " + " | ".join(f"{statistics.fmean(r[k] for r in runs):.4g}"
                                           for k in keys) + " |")


if __name__ == "__main__":
    main()
