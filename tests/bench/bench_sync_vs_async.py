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
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent


def run_once(mode: str, steps: int, out_dir: Path, env: dict[str, str]) -> dict[str, float]:
    name = f"{mode}-{int(time.time())}"
    cmd = [sys.executable, "-m", "trainer.main", "recipe=quickstart.yaml", f"train.mode={mode}",
           f"train.num_steps={steps}", "agent.loop=heavy_tail_loop:HeavyTailToolLoop",
           f"logging.output_dir={out_dir}", f"logging.run_name={name}", "eval.tasks=null",
           "logging.wandb_mode=disabled", "logging.console=false"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r][1:]  # the first step includes start-up
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

    env = dict(os.environ, HEAVY_TAIL_BASE_S=str(args.base_s),
               HEAVY_TAIL_SLOW_FRACTION=str(args.slow_fraction),
               # Ray workers inherit it, so they can import the bench's agent loop
               PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")])))
    env.setdefault("SLUICE_CACHE_DIR", str(ROOT / ".cache" / "sluice"))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(env["SLUICE_CACHE_DIR"]) / "torch_extensions"))
    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        for _ in range(args.rounds):
            for mode in ("sync", "async"):
                results[mode].append(run_once(mode, args.steps, Path(tmp), env))
                print(f"{mode}: {results[mode][-1]}", flush=True)

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}")
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
