"""The DeepSpeed training backend: a plain class (a thin Ray shell hosts one per rank later)
that owns the policy under ZeRO-1/2/3 with AdamW, trains one GRPO step per call over
packed micro-batches, and hands out full weights under Hugging Face names for the push.

deepspeed and torch.distributed are imported inside the methods that need them. On CPU
the accelerator is DeepSpeed's `cpu` one with gloo (DS_ACCELERATOR=cpu must be set before
deepspeed is first imported; the backend sets it when it is unset).

Nothing is compiled at start: the optimizer is torch's fused AdamW (DeepSpeed's `torch_adam`)
and DeepSpeed's CPU shared-memory all-reduce op is switched off (gloo does the CPU
collectives). Both of DeepSpeed's own kernels are JIT-built with a compiler on first use
(40-130 s; on GPU, nvcc must match torch's CUDA exactly) behind one lock file per op, and a
rank killed while it builds leaves that lock behind: every later start waits on it forever.
"""

from __future__ import annotations

import logging
import os
import socket
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

logger = logging.getLogger(__name__)

def find_free_port() -> int:
    """A TCP port free right now on localhost (another process may take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_process_group(device: torch.device) -> None:
    """Join the torch.distributed group, creating a one-process group when no launcher
    (torchrun, Ray shell) set RANK/WORLD_SIZE. gloo on cpu, nccl on cuda."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    from deepspeed.utils import groups

    # A new world: groups DeepSpeed cached from an earlier one in this process are dead. A
    # world torn down without deepspeed.comm (an in-process vLLM destroys it through
    # torch.distributed) leaves them cached, and ZeRO-3's first broadcast then fails with
    # "Group ... is not registered". DeepSpeed's own teardown releases them with this call.
    groups._release_process_group_references(None)

    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")


SHM_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME


def _skip_jit_comm_op() -> None:
    """Mark DeepSpeed's CPU shared-memory all-reduce op as unavailable, so its comm backend
    uses plain torch.distributed (gloo) instead of JIT-building the op (see the module
    docstring). DeepSpeed keeps its probe of compatible ops in one module-level dict for
    this purpose; the op exists only for the CPU accelerator."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def build_deepspeed_config(cfg: TrainConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The DeepSpeed config of a TrainConfig.

    Gradient accumulation is unmanaged: micro-batch counts vary from step to step, so the
    step loop calls backward per micro-batch and `step()` once per minibatch, and scales
    each micro-batch loss itself (see trainer.train.backends.step).
    """
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"train.zero_stage must be 0, 1, 2 or 3, got {cfg.zero_stage}")
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        # torch's fused AdamW, not DeepSpeed's FusedAdam: nothing to JIT-compile at start.
        "optimizer": {"type": "AdamW", "params": {
            "lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": list(ADAM_BETAS),
            "eps": ADAM_EPS, "torch_adam": True, "fused": True}},
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 2**31 - 1,  # metrics go through sluice's logger, not DeepSpeed's
        "wall_clock_breakdown": False,
    }


def _import_deepspeed(device: torch.device) -> Any:
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if device.type == "cpu":  # the op is the cpu accelerator's; elsewhere skip DeepSpeed's probe of ops
        _skip_jit_comm_op()
    found = get_accelerator().device_name()
    if found != device.type:
        raise ValueError(f"DeepSpeed chose the {found!r} accelerator for a {device.type!r} "
                         f"backend; set DS_ACCELERATOR={device.type} before deepspeed is "
                         f"first imported")
    return deepspeed


class DeepSpeedBackend:
    """Trains the policy with DeepSpeed; one instance per training rank.

    Every rank calls every method (they contain collectives). `version` counts completed
    `train_step`s, starting at 0 for the loaded weights.
    """

    def __init__(self, cfg: TrainConfig, model_path: str | Path, *, dtype: str = "auto",
                 device: str | None = None, temperature: float = 1.0,
                 attn_implementation: str | None = None,
                 config_overrides: Mapping[str, Any] | None = None) -> None:
        self._cfg = cfg
        self._device = resolve_device(device)
        self._dtype = resolve_dtype(dtype, self._device)
        self._temperature = temperature
        deepspeed = _import_deepspeed(self._device)
        if self._device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        init_process_group(self._device)
        model = build_policy_model(model_path, self._dtype, self._device,
                                   cfg.gradient_checkpointing, attn_implementation,
                                   config_overrides)
        schedule = partial(compute_warmup_factor, num_warmup_steps=cfg.num_warmup_steps)
        self._engine, *_ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=build_deepspeed_config(cfg, self._dtype),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        self._version = 0

    # --- StepOps: what the shared step loop drives -------------------------------------
    @property
    def forward_model(self) -> torch.nn.Module:
        return self._engine

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    def backward(self, loss: torch.Tensor) -> None:
        # The step loop already scaled the loss by the micro-batch's share of the minibatch.
        self._engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self) -> float:
        self._engine.step()
        norm = self._engine.get_global_grad_norm()  # None at stage 0 without clipping stats
        return float("nan") if norm is None else float(norm)

    def all_reduce(self, values: list[float], op: str) -> list[float]:
        import torch.distributed as dist

        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        comm_device = self._device if self._device.type == "cuda" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=comm_device)
        dist.all_reduce(t, op=reduce_op)
        return t.tolist()

    # --- the backend API ------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def current_lr(self) -> float:
        return float(self._engine.get_lr()[0])

    def compute_proximal_logprobs(self, batches: Sequence[PackedBatch]) -> list[torch.Tensor]:
        """logprobs_T of each packed batch under the current weights, no gradients."""
        return compute_proximal_logprobs(self, batches, self._temperature,
                                         self._cfg.logprob_chunk_tokens)

    def train_step(self, batch: TrainBatch, cfg_loss: LossConfig) -> StepResult:
        """One policy version: `train.num_minibatches` optimizer steps over `batch` (this
        rank's shard), with proximal logprobs computed once before the first."""
        result = run_train_step(self, batch, self._cfg, cfg_loss, self._temperature,
                                self._version + 1)
        self._version += 1
        return result

    def iter_push_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) for every weight, one at a time, on the training
        device. Under ZeRO-3 each parameter is all-gathered for the copy and re-partitioned
        right after, so at most one full parameter beyond the shards is alive."""
        deepspeed = _import_deepspeed(self._device)
        for name, tensor in iter_weight_names(self._engine.module):
            if hasattr(tensor, "ds_id"):  # a ZeRO-3 partitioned parameter
                with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                    full = tensor.detach().clone()
            else:
                full = tensor.detach().clone()
            yield name, full

    def push_specs(self) -> list[tuple[str, tuple[int, ...], str, int]]:
        """(name, full shape, dtype name, element size) of what `iter_push_tensors` yields."""
        return weight_specs(self._engine.module)

    def save_state(self, folder: str | Path) -> None:
        """Model, optimizer, scheduler and version (DeepSpeed's own sharded format; every
        rank writes its shard, so all ranks call it)."""
        self._engine.save_checkpoint(str(folder), tag="state", client_state={"version": self._version},
                                     save_latest=False)

    def load_state(self, folder: str | Path) -> None:
        path, client = self._engine.load_checkpoint(str(folder), tag="state",
                                                    load_optimizer_states=True,
                                                    load_lr_scheduler_states=True)
        if path is None:
            raise ValueError(f"no DeepSpeed checkpoint under {folder}")
        self._version = int(client["version"])

    def state_dict_for_push(self) -> dict[str, torch.Tensor]:
        """Full weights under Hugging Face names as CPU tensors (all ranks must call it)."""
        return {name: t.cpu() for name, t in self.iter_push_tensors()}
