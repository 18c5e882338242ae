"""The train side's sections of the recipe (`train`, `loss`, `sync`) and `TrainRecipe`,
the view of the whole recipe that the ranks read. `trainer.run.config` composes these
sections into the one schema; code here is typed against the view, so that `trainer.train`
never imports `trainer.run`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from envs.knobs import knob

@dataclass(frozen=True, slots=True)
class TrainConfig:
    mode: Literal["async", "sync"] = knob("async", "async: rollout and training overlap; sync: "
                                          "generate a batch, train, push (baseline).")
    backend: str = knob("deepspeed", "Training backend: a built-in name (deepspeed; torch, a "
                        "single-process backend for tests) or an import string "
                        "'package.module:Class' of a TrainBackend (trainer.train.backends).")
    num_ranks: int = knob(1, "Training processes; one GPU each on cuda.")
    cpus_per_rank: float = knob(1.0, "Ray CPUs reserved per training rank.")
    zero_stage: int = knob(2, "DeepSpeed ZeRO stage (0-3).")
    num_steps: int = knob(100, "Optimizer steps (policy versions) to train.")
    group_size: int = knob(8, "G: trajectories per task in one GRPO group.")
    groups_per_step: int = knob(8, "Groups consumed by one training step.")
    num_minibatches: int = knob(1, "Optimizer steps per batch (PPO minibatches); proximal "
                                "logprobs stay fixed across them.")
    micro_batch_tokens: int = knob(8192, "Token budget of one packed micro-batch.")
    logprob_chunk_tokens: int = knob(2048, "Positions whose logits exist at once when logprobs "
                                     "and entropy are computed (fp32 [chunk, vocab]); memory "
                                     "for one sequence is then linear in its length. 0: the "
                                     "whole micro-batch's logits at once.")
    lr: float = knob(1e-6, "AdamW learning rate.")
    weight_decay: float = knob(0.0, "AdamW weight decay.")
    max_grad_norm: float = knob(1.0, "Gradient clipping norm.")
    num_warmup_steps: int = knob(0, "Linear learning-rate warm-up steps.")
    gradient_checkpointing: bool = knob(False, "Recompute activations in backward.")
    seed: int = knob(0, "Seed of data order, sampling and initialisation.")


@dataclass(frozen=True, slots=True)
class LossConfig:
    eps_low: float = knob(0.2, "Lower PPO clip: ratio >= 1 - eps_low.")
    eps_high: float = knob(0.28, "Upper PPO clip (clip-higher): ratio <= 1 + eps_high.")
    dual_clip_c: float | None = knob(None, "Dual-clip bound for negative advantages (> 1); None: off.")
    is_mode: Literal["mask", "clamp", "off"] = knob(
        "mask", "Behaviour importance weight outside bounds: mask the token (kept in the "
        "denominator), clamp the weight, or no correction.")
    is_min: float = knob(0.0, "Lower bound of exp(proximal - behaviour).")
    is_max: float = knob(5.0, "Upper bound of exp(proximal - behaviour).")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = knob(
        "token_mean", "How per-token losses become one number.")
    kl_coef: float = knob(0.0, "Weight of the k3 KL to the reference policy (0: no reference).")
    entropy_coef: float = knob(0.0, "Weight of the entropy bonus.")
    adv_std_norm: bool = knob(True, "Divide group-centred rewards by the group std.")
    adv_leave_one_out: bool = knob(False, "Baseline is the mean of the other G-1 rewards.")
    adv_eps: float = knob(1e-6, "Added to the std before dividing.")


@dataclass(frozen=True, slots=True)
class SyncConfig:
    transport: Literal["auto", "nccl", "gloo", "cpu"] = knob(
        "auto", "Weight push transport; auto: nccl on cuda, cpu (safetensors bytes) on cpu; "
        "gloo: the broadcast path of nccl over a gloo group (CPU clusters, tests).")
    bucket_mb: int = knob(512, "Size of one weight bucket.")
    verify_checksum: bool = knob(True, "Engines confirm a checksum of a few tensors; a "
                                 "mismatch stops training.")
    timeout_s: float = knob(300.0, "Limit of one weight push; on the broadcast transports every "
                            "rank bounds each step by it, then leaves the group (a failed "
                            "engine is dropped and the push goes on with the rest).")


class _ModelView(Protocol):
    @property
    def dtype(self) -> str: ...  # auto, float32, bfloat16, float16

    @property
    def rope_scaling(self) -> dict[str, float | str]: ...  # rollout.rope.build_rope_overrides


class _ClusterView(Protocol):
    @property
    def device(self) -> str: ...  # cpu or cuda


class _RolloutView(Protocol):
    @property
    def temperature(self) -> float: ...  # the logprobs the trainer computes are at it

    @property
    def tp_size(self) -> int: ...  # workers per engine in the weight group


class TrainRecipe(Protocol):
    """What the train side reads of a recipe. `trainer.run.config.SluiceConfig` has this
    shape."""

    @property
    def train(self) -> TrainConfig: ...

    @property
    def loss(self) -> LossConfig: ...

    @property
    def sync(self) -> SyncConfig: ...

    @property
    def model(self) -> _ModelView: ...

    @property
    def cluster(self) -> _ClusterView: ...

    @property
    def rollout(self) -> _RolloutView: ...
