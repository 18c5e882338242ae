"""Trainer model: a step's time from the planner's training formula (12N FLOPs per token
over the train GPUs at an MFU), and a weight push's time from bytes over a bandwidth plus
a fixed latency (engine pause, checksum, resume)."""

from __future__ import annotations

from dataclasses import dataclass

from launch.plan import Plan, compute_train_s


@dataclass(frozen=True, slots=True)
class TrainerModel:
    params_b: float
    dtype_bytes: int
    num_gpus: int
    gpu_flops: float
    mfu: float
    push_bytes_per_s: float = 50e9  # NCCL broadcast, ~400 Gb/s per link
    push_latency_s: float = 1.0

    @classmethod
    def from_plan(cls, plan: Plan, push_bytes_per_s: float = 50e9,
                  push_latency_s: float = 1.0) -> TrainerModel:
        p = plan.inputs
        return cls(params_b=p.model_params_b, dtype_bytes=plan.dtype_bytes,
                   num_gpus=p.train_gpus, gpu_flops=p.gpu_flops, mfu=p.mfu_train,
                   push_bytes_per_s=push_bytes_per_s, push_latency_s=push_latency_s)

    def step_s(self, train_tokens: int) -> float:
        return compute_train_s(self.params_b * 1e9, train_tokens, self.num_gpus, self.gpu_flops,
                               self.mfu)

    def push_s(self) -> float:
        return self.push_latency_s + self.params_b * 1e9 * self.dtype_bytes / self.push_bytes_per_s
