"""A single-process training backend with plain torch AdamW: the same packing, logprobs and
step loop as the DeepSpeed backend without DeepSpeed, for fast tests and debugging."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from buffer.batch import TrainBatch
from trainer.train.backends.packing import PackedBatch
from trainer.train.backends.policy_model import (build_policy_model, iter_weight_names,
                                                 resolve_device, resolve_dtype, weight_specs)
from trainer.train.backends.step import (ADAM_BETAS, ADAM_EPS, StepResult,
                                         compute_proximal_logprobs, compute_warmup_factor,
                                         run_train_step)
from trainer.train.config import LossConfig, TrainConfig


class TorchBackend:
    """One process, one device, fp32 master weights only if the model is fp32."""

    def __init__(self, cfg: TrainConfig, model_path: str | Path, *, dtype: str = "auto",
                 device: str | None = None, temperature: float = 1.0,
                 attn_implementation: str | None = None,
                 config_overrides: Mapping[str, Any] | None = None) -> None:
        self._cfg = cfg
        self._device = resolve_device(device)
        self._temperature = temperature
        self._model = build_policy_model(model_path, resolve_dtype(dtype, self._device),
                                         self._device, cfg.gradient_checkpointing,
                                         attn_implementation, config_overrides)
        self._params = [p for p in self._model.parameters() if p.requires_grad]
        # Fused: one kernel over all parameters (CPU and CUDA have one) instead of a
        # Python loop of small ops per tensor; the DeepSpeed backend uses the same.
        self._optimizer = torch.optim.AdamW(self._params, lr=cfg.lr, betas=ADAM_BETAS,
                                            eps=ADAM_EPS, weight_decay=cfg.weight_decay,
                                            fused=self._device.type in ("cpu", "cuda"))
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(
            self._optimizer, partial(compute_warmup_factor, num_warmup_steps=cfg.num_warmup_steps))
        self._version = 0

    # --- StepOps ----------------------------------------------------------------------------
    @property
    def forward_model(self) -> torch.nn.Module:
        return self._model

    @property
    def world_size(self) -> int:
        return 1

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> float:
        max_norm = self._cfg.max_grad_norm if self._cfg.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm)
        self._optimizer.step()
        self._scheduler.step()
        self._optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def all_reduce(self, values: list[float], op: str) -> list[float]:
        return list(values)  # one process: nothing to reduce

    # --- the backend API --------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def current_lr(self) -> float:
        return float(self._optimizer.param_groups[0]["lr"])

    def compute_proximal_logprobs(self, batches: Sequence[PackedBatch]) -> list[torch.Tensor]:
        """logprobs_T of each packed batch under the current weights, no gradients."""
        return compute_proximal_logprobs(self, batches, self._temperature,
                                         self._cfg.logprob_chunk_tokens)

    def train_step(self, batch: TrainBatch, cfg_loss: LossConfig) -> StepResult:
        """One policy version; see DeepSpeedBackend.train_step."""
        result = run_train_step(self, batch, self._cfg, cfg_loss, self._temperature,
                                self._version + 1)
        self._version += 1
        return result

    def save_state(self, folder: str | Path) -> None:
        """Model, optimizer, scheduler and version in one torch file."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        torch.save({"model": self._model.state_dict(), "optimizer": self._optimizer.state_dict(),
                    "scheduler": self._scheduler.state_dict(), "version": self._version},
                   Path(folder) / "torch_state.pt")

    def load_state(self, folder: str | Path) -> None:
        state = torch.load(Path(folder) / "torch_state.pt", map_location=self._device,
                           weights_only=True)
        self._model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        self._scheduler.load_state_dict(state["scheduler"])
        self._version = int(state["version"])

    def push_specs(self) -> list[tuple[str, tuple[int, ...], str, int]]:
        """(name, shape, dtype name, element size) of what `state_dict_for_push` holds."""
        return weight_specs(self._model)

    def state_dict_for_push(self) -> dict[str, torch.Tensor]:
        """Full weights under Hugging Face names as CPU tensors."""
        return {name: t.detach().to("cpu", copy=True) for name, t in
                iter_weight_names(self._model)}

    def iter_push_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) for every weight: those of `state_dict_for_push`."""
        return iter(self.state_dict_for_push().items())
