"""A training backend for bench_sync_vs_async.py: the real DeepSpeed backend, made to do
the work of a batch `BENCH_TRAIN_BATCH_COPIES` times larger with the same update.

The tiny quickstart model trains a step in a fraction of a second, a few percent of its
rollout time; in the seed's account the training step (1,213 s) is ~2/3 of the rollout
window (1,800 s) and ~1.5x a typical trajectory. Each step here trains on every
trajectory of the batch k times over (k copies, each with its own advantage): the
proximal pass, forward and backward run on k times the tokens, as for a k-times larger
batch. Under the token-mean loss (and the per-sequence aggregations) the mean over k
identical copies is the mean over one, so the update, the loss and the learning curve
are those of the real batch; only the compute is k times larger.

Set from an environment variable so that the train rank's Ray worker sees the bench's
choice; named in a run as `train.backend=weighted_backend:WeightedDeepSpeedBackend`.
"""

from __future__ import annotations

import os

import numpy as np

from buffer.batch import TrainBatch
from trainer.train.backends.deepspeed_backend import DeepSpeedBackend
from trainer.train.backends.step import StepResult
from trainer.train.config import LossConfig


def tile_batch(batch: TrainBatch, copies: int) -> TrainBatch:
    """`batch` with every trajectory (and its advantage) `copies` times."""
    if copies < 1:
        raise ValueError(f"BENCH_TRAIN_BATCH_COPIES={copies}: use 1 or more")
    return TrainBatch(batch.trajectories * copies, np.tile(batch.advantages, copies),
                      batch.version)


class WeightedDeepSpeedBackend(DeepSpeedBackend):
    def train_step(self, batch: TrainBatch, cfg_loss: LossConfig) -> StepResult:
        copies = int(os.environ.get("BENCH_TRAIN_BATCH_COPIES", "1"))
        return super().train_step(tile_batch(batch, copies), cfg_loss)
