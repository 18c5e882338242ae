"""DeepSpeed's start and step with the optimizer it used to JIT-build against the one it uses
now, run by hand:

    python tests/bench/bench_optimizer_start.py [--steps 5] [--extensions DIR]

Each variant runs in a fresh process on the tiny model (ZeRO-2, CPU, gloo): the backend's
start (`deepspeed.initialize`, with any op build it needs) and the mean of `--steps` GRPO
train steps on one batch of tests/bench/bench_train.py, after one untimed warm-up step.

- `FusedAdam (JIT)`: DeepSpeed's own FusedAdam and shared-memory comm op, compiled into
  `--extensions` (default: a new empty folder, so the first start pays the build; pass a
  folder that holds them to time a warm start).
- `torch fused AdamW`: what the backend does now (`torch_adam`, `fused`; no op built).

The first step's loss and grad norm are printed too: they must agree (the optimizer acts
only after them). Prints a table with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

VARIANT = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "bench"))
variant, steps = sys.argv[2], int(sys.argv[3])
from trainer.train.backends import deepspeed_backend as ds
if variant == "jit":
    built = ds.build_deepspeed_config
    def with_fused_adam(cfg, dtype):
        config = built(cfg, dtype)
        for key in ("torch_adam", "fused"):
            config["optimizer"]["params"].pop(key)
        return config
    ds.build_deepspeed_config = with_fused_adam
    ds._skip_jit_comm_op = lambda: None
from bench_train import build_batch
from buffer.batch import TrainBatch
from trainer.run.recipe import build_config
from trainer.run.tiny_model import ensure_tiny_model
import numpy as np
cfg = build_config({})
path = ensure_tiny_model()
start = time.perf_counter()
backend = ds.DeepSpeedBackend(cfg.train, path, device="cpu")
start_s = time.perf_counter() - start
trajs = build_batch(32, 200, 512)
advantages = np.linspace(-1.0, 1.0, len(trajs)).astype(np.float32)
batch = TrainBatch(trajs, advantages, 0)
first = backend.train_step(batch, cfg.loss)
times = []
for _ in range(steps):
    t = time.perf_counter()
    backend.train_step(TrainBatch(trajs, advantages, backend.version), cfg.loss)
    times.append(time.perf_counter() - t)
print(json.dumps({"start_s": start_s, "step_s": sum(times) / len(times),
                  "loss": first.minibatch_metrics[0].loss, "grad_norm": first.grad_norm,
                  "optimizer": type(backend._engine.optimizer.optimizer).__name__}))
"""


def run_variant(variant: str, steps: int, extensions: str) -> dict:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": extensions, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", VARIANT, str(ROOT), variant, str(steps)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--extensions", help="TORCH_EXTENSIONS_DIR for the JIT variant")
    args = parser.parse_args()
    extensions = args.extensions or tempfile.mkdtemp(prefix="sluice-bench-ext-")
    rows = [("FusedAdam (JIT)", run_variant("jit", args.steps, extensions)),
            ("torch fused AdamW", run_variant("torch", args.steps, tempfile.mkdtemp()))]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}")
    print(f"ZeRO-2, tiny model, 32 trajectories x ~200 tokens, mean of {args.steps} steps; "
          f"JIT folder {extensions}")
    print(f"{'variant':<20} {'optimizer':<12} {'start s':>8} {'step s':>8} {'first loss':>12} "
          f"{'first grad norm':>16}")
    for name, r in rows:
        print(f"{name:<20} {r['optimizer']:<12} {r['start_s']:>8.2f} {r['step_s']:>8.3f} "
              f"{r['loss']:>12.6f} {r['grad_norm']:>16.6f}")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s in all)")
