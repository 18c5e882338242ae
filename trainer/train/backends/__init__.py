"""Training backends: plain classes that own the policy weights and optimizer, train one
GRPO step over packed micro-batches, and hand out full weights for the push to engines.

`train.backend` is a plug-in point: a built-in name of TRAIN_BACKENDS or an import string
of a class meeting TrainBackend (`load_train_backend` checks it at start-up). Built-ins are
imported only when resolved, so choosing `torch` never imports deepspeed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from envs.plugins import PluginPoint, signature_problem

if TYPE_CHECKING:
    import torch

    from buffer.batch import TrainBatch
    from trainer.train.backends.packing import PackedBatch
    from trainer.train.backends.step import StepResult
    from trainer.train.config import LossConfig, TrainConfig

TRAIN_BACKENDS = PluginPoint("train backend", "train.backend", {
    "deepspeed": "trainer.train.backends.deepspeed_backend:DeepSpeedBackend",
    "torch": "trainer.train.backends.torch_backend:TorchBackend",  # single process, for tests
})


class TrainBackend(Protocol):
    """What the controller (and its Ray shell) may call on a training backend."""

    @property
    def version(self) -> int: ...  # completed train_steps; 0 for the loaded weights

    def compute_proximal_logprobs(self, batches: Sequence[PackedBatch]) -> list[torch.Tensor]: ...

    def train_step(self, batch: TrainBatch, cfg_loss: LossConfig) -> StepResult: ...

    def state_dict_for_push(self) -> dict[str, torch.Tensor]: ...  # full weights, HF names, CPU

    def push_specs(self) -> list[tuple[str, tuple[int, ...], str, int]]: ...  # name, shape, dtype, size

    def iter_push_tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...  # one full tensor at a time

    def save_state(self, folder: str | Path) -> None: ...  # model, optimizer, scheduler, version

    def load_state(self, folder: str | Path) -> None: ...


def load_train_backend(name: str) -> Callable[..., TrainBackend]:
    """The backend class a built-in name or `package.module:Class` names, checked against
    TrainBackend without building it (also the start-up check); ValueError says what to
    change."""
    cls = TRAIN_BACKENDS.resolve(name)
    if not inspect.isclass(cls):
        raise ValueError(f"train backend {name!r} is not a class; point train.backend at a "
                         "class built as cls(train_config, model_path, **options)")
    required = sorted(n for n in vars(TrainBackend) if not n.startswith("_"))
    missing = [n for n in required if not hasattr(cls, n)]
    if missing:
        raise ValueError(f"train backend {name!r}: {cls.__name__} lacks {', '.join(missing)} "
                         "(trainer.train.backends.TrainBackend)")
    problem = signature_problem(cls, ("cfg", "model_path"))
    if problem:
        raise ValueError(f"train backend {name!r}: {cls.__name__}{problem}")
    return cls  # type: ignore[return-value]  # checked just above


def build_backend(cfg: TrainConfig, model_path: str | Path, **kwargs: Any) -> TrainBackend:
    """The backend named by `train.backend`, built on the model folder `model_path`."""
    return load_train_backend(cfg.backend)(cfg, model_path, **kwargs)
