"""Training backends: plain classes that own the policy weights and optimizer, train one
GRPO step over packed micro-batches, and hand out full weights for the push to engines.

Built-ins are listed in BACKENDS (`train.backend` picks one) and imported only when built,
so choosing `torch` never imports deepspeed.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from envs.types import Trajectory
    from trainer.train.backends.packing import PackedBatch
    from trainer.train.backends.step import StepResult
    from trainer.train.config import LossConfig, TrainConfig

BACKENDS = {
    "deepspeed": "trainer.train.backends.deepspeed_backend:DeepSpeedBackend",
    "torch": "trainer.train.backends.torch_backend:TorchBackend",
}


class TrainBackend(Protocol):
    """What the controller (and its Ray shell) may call on a training backend."""

    @property
    def version(self) -> int: ...  # completed train_steps; 0 for the loaded weights

    def compute_proximal_logprobs(self, batches: Sequence[PackedBatch]) -> list[torch.Tensor]: ...

    def train_step(self, trajectories: Sequence[Trajectory], advantages_per_traj: Any,
                   cfg_loss: LossConfig) -> StepResult: ...

    def state_dict_for_push(self) -> dict[str, torch.Tensor]: ...

    def save_state(self, folder: str | Path) -> None: ...  # model, optimizer, scheduler, version

    def load_state(self, folder: str | Path) -> None: ...


def build_backend(cfg: TrainConfig, model_path: str | Path, **kwargs: Any) -> TrainBackend:
    """The backend named by `train.backend`, built on the model folder `model_path`."""
    if cfg.backend not in BACKENDS:
        raise ValueError(f"train.backend must be one of {sorted(BACKENDS)}, got {cfg.backend!r}")
    module_name, cls_name = BACKENDS[cfg.backend].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(cfg, model_path, **kwargs)
