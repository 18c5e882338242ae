"""Helper process for test_checkpoint_resume.py (not a test): trains the tiny model with
the DeepSpeed backend on a deterministic stream of synthetic GRPO batches, checkpointing
after every step, optionally killing itself with SIGKILL in the middle of a step.

    python tests/integration/resume_run.py RUN_DIR --steps N [--kill-during-step K] [--resume]
Prints one JSON line per completed step: {"step", "version", "loss", "cursor"}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal

import numpy as np
import torch

from buffer.batch import TrainBatch
from trainer.run.tiny_model import ensure_tiny_model
from envs.types import NO_VERSION, Trajectory
from trainer.train.backends.deepspeed_backend import DeepSpeedBackend
from buffer.replay_buffer import BufferState
from trainer.run.checkpoint import RunState, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.train.config import LossConfig, TrainConfig
from trainer.run.controller import ControllerState

GROUPS_PER_STEP = 2


def fresh_state() -> RunState:
    """A run at step 0: nothing buffered, nothing in flight."""
    return RunState(ControllerState(0, 0, (), BufferState((), 0, 0, {}, 0, 0, {}), 0))


def synthetic_batch(cursor: int) -> tuple[list[Trajectory], np.ndarray]:
    """Batch number `cursor` of the data stream: the same for every run."""
    rng = np.random.default_rng(1000 + cursor)
    trajs, rewards = [], []
    for i in range(GROUPS_PER_STEP * 4):
        n = int(rng.integers(8, 24))
        mask = (rng.random(n) < 0.7).astype(np.int8)
        trajs.append(Trajectory("t", f"g{cursor}", i, rng.integers(3, 500, 6), rng.integers(3, 500, n),
                                mask, np.where(mask == 1, -rng.random(n) * 3, 0.0),
                                np.where(mask == 1, 0, NO_VERSION), "finished"))
        rewards.append(float(rng.random() < 0.5))
    r = np.array(rewards)
    return trajs, (r - r.mean()) / (r.std() + 1e-6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-during-step", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = TrainConfig(zero_stage=2, lr=1e-3, num_minibatches=2, micro_batch_tokens=128)
    backend = DeepSpeedBackend(cfg, ensure_tiny_model())
    state = fresh_state()
    if args.resume:
        state = load_checkpoint(latest_checkpoint(args.run_dir), backend)
    while state.step < args.steps:
        trajs, adv = synthetic_batch(state.controller.data_cursor)
        # RNG consumed by training (as a real run's sampling would): resume must restore it.
        adv = adv + 0.01 * torch.randn(len(adv)).numpy()
        if state.step == args.kill_during_step:
            os.kill(os.getpid(), signal.SIGKILL)
        result = backend.train_step(TrainBatch(trajs, adv, backend.version), LossConfig())
        state.controller = dataclasses.replace(state.controller, version=backend.version,
                                               data_cursor=state.controller.data_cursor + 1)
        save_checkpoint(args.run_dir, backend, state, keep_last=2)
        print(json.dumps({"step": state.step, "version": backend.version, "loss": result.loss,
                          "cursor": state.controller.data_cursor}), flush=True)


if __name__ == "__main__":
    main()
