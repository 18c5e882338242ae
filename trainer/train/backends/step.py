"""One GRPO training step over packed micro-batches, shared by every backend: proximal
logprobs, then `train.num_minibatches` optimizer steps, each accumulating gradients over
its micro-batches so that the update equals one full-minibatch loss.

The proximal policy is the weights at the start of the step. The first minibatch trains
from exactly those weights, so its proximal logprobs are its training forward's own,
detached: the ratio to the proximal policy is 1 with the policy gradient, as a separate
no-grad pass would give up to summation order, for one forward less. Only the later
minibatches need that pass, before the first optimizer step moves the weights.

Logprobs and entropies are computed at the loss's model tokens only
(`loss_positions_only`): every term of the loss and of its metrics is masked to them, and
the prompt and tool-output positions then never reach the LM head.

Exactness across micro-batches: a micro-batch's loss is aggregated over its own tokens
(or sequences), so it is scaled by its share of the minibatch before backward:
    token_mean:            loss_i * n_i / N   (n_i model tokens of micro-batch i, N of all)
    seq_mean_*:            loss_i * s_i / S   (s_i sequences with a model token, S of all)
Summed over i this is exactly the loss of the whole minibatch. Across data-parallel ranks
N and S are global (all-reduced) and the share is multiplied by the world size, because
the optimizer averages gradients over ranks.

The backend supplies the machinery through `StepOps`; this module holds no backend code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from buffer.batch import TrainBatch
from trainer.train.backends.logprobs import compute_token_logprobs_and_entropy
from trainer.train.backends.packing import (PackedBatch, build_micro_batches, split_minibatches,
                                            unpack_to_rows)
from trainer.train.config import LossConfig, TrainConfig
from trainer.train.loss import LossMetrics, compute_policy_loss

ADAM_BETAS = (0.9, 0.999)  # AdamW moments of every backend, so they train alike
ADAM_EPS = 1e-8
# LossMetrics fields that are aggregated like the loss (combined with the loss weights).
LOSS_LIKE = ("loss", "policy_loss", "kl_ref", "entropy")
TOKEN_FRACTIONS = ("clip_frac", "dual_clip_frac", "is_weight_mean", "is_capped_frac",
                   "mismatch_kl", "approx_kl")


class StepOps(Protocol):
    """What the shared step needs from a backend: a model to call and an optimizer to drive."""

    @property
    def forward_model(self) -> torch.nn.Module: ...  # called as model(input_ids=..., ...)

    @property
    def world_size(self) -> int: ...

    def backward(self, loss: torch.Tensor) -> None: ...  # accumulate gradients, no step

    def optimizer_step(self) -> float: ...  # clip, step, zero grads; grad norm before clipping

    def all_reduce(self, values: list[float], op: str) -> list[float]: ...  # sum or max;
    # over the data-parallel ranks (the values themselves with one rank)


@dataclass(frozen=True, slots=True)
class StepResult:
    """Outcome of one `train_step` (one policy version)."""

    loss: float  # mean over minibatches of each full-minibatch loss, before its own update
    metrics: LossMetrics  # the step: loss-like fields averaged over minibatches, token
    # fractions weighted by model tokens, is_weight_max the max, counts summed
    minibatch_metrics: tuple[LossMetrics, ...]  # one per optimizer step, in order
    grad_norm: float  # mean over the optimizer steps of the pre-clipping gradient norm
    grad_norms: tuple[float, ...]  # per optimizer step
    num_tokens: int  # packed tokens (prompt + response) in the training forward passes
    num_micro_batches: int
    tokens_per_s: float  # num_tokens / wall time of the step, proximal pass included
    step_s: float
    proximal_s: float  # of step_s: packing and the no-grad proximal pass (later minibatches)
    version: int  # policy version after the step


def compute_warmup_factor(step: int, num_warmup_steps: int) -> float:
    """Learning-rate multiplier of optimizer step `step` (0-based): linear warm-up that
    reaches the full rate at step num_warmup_steps - 1 (the first step already moves)."""
    if num_warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / num_warmup_steps)


def pad_to_common_count(ops: StepOps, batches: list[PackedBatch]) -> tuple[list[PackedBatch], int]:
    """Repeat the last batch until every rank holds as many as the busiest one.

    Under ZeRO-2/3 every forward (gather) and backward (reduce) is a collective, so ranks
    must run the same number of micro-batches; the repeats get weight 0. Returns the
    padded list and the number of real batches.
    """
    if not batches:
        raise ValueError("a rank received no trajectories; give every rank at least one")
    target = int(ops.all_reduce([float(len(batches))], "max")[0])
    return batches + [batches[-1]] * (target - len(batches)), len(batches)


@torch.no_grad()
def compute_proximal_logprobs(ops: StepOps, batches: Sequence[PackedBatch],
                              temperature: float = 1.0, chunk_tokens: int = 0,
                              loss_positions_only: bool = False) -> list[torch.Tensor]:
    """logprobs_T of each batch under the current weights, without gradients (CPU tensors);
    `chunk_tokens` and `loss_positions_only` as in `compute_token_logprobs_and_entropy`."""
    model = ops.forward_model
    was_training = model.training
    model.eval()
    try:
        padded, num_real = pad_to_common_count(ops, list(batches))
        out = [compute_token_logprobs_and_entropy(model, b, temperature, chunk_tokens=chunk_tokens,
                                                  loss_positions_only=loss_positions_only)[0].cpu()
               for b in padded]
    finally:
        model.train(was_training)
    return out[:num_real]


def compute_micro_batch_weights(batches: Sequence[PackedBatch], aggregation: str,
                                ops: StepOps) -> list[float]:
    """Each micro-batch's share of the minibatch loss (see the module docstring)."""
    if aggregation == "token_mean":
        counts = [float(b.num_model_tokens) for b in batches]
    else:
        counts = [float(b.num_model_seqs) for b in batches]
    total = ops.all_reduce([sum(counts)], "sum")[0]
    if total == 0:
        return [0.0] * len(batches)  # nothing to learn; backward still runs for the collectives
    return [c / total * ops.world_size for c in counts]


def compute_combined_metrics(parts: Sequence[LossMetrics], loss_weights: Sequence[float]
                             ) -> LossMetrics:
    """Metrics of several loss calls as one: loss-like fields as sum(w_i * x_i), token
    fractions weighted by model tokens, is_weight_max as the max, counts summed."""
    if not parts:
        raise ValueError("no metrics to combine")
    num_tokens = sum(m.num_tokens for m in parts)
    values: dict[str, float] = {}  # the float fields; the counts are passed as ints
    for name in LOSS_LIKE:
        values[name] = float(sum(w * getattr(m, name) for m, w in zip(parts, loss_weights)))
    for name in TOKEN_FRACTIONS:
        values[name] = (sum(getattr(m, name) * m.num_tokens for m in parts) / num_tokens
                        if num_tokens else 0.0)
    values["is_weight_max"] = max(m.is_weight_max for m in parts)
    return LossMetrics(**values, num_tokens=num_tokens, num_seqs=sum(m.num_seqs for m in parts))


def compute_micro_batch_loss(model: torch.nn.Module, batch: PackedBatch,
                             proximal_logprobs_T: torch.Tensor | None, cfg: LossConfig,
                             temperature: float, sum_norm_tokens: int, chunk_tokens: int = 0
                             ) -> tuple[torch.Tensor, LossMetrics]:
    """The decoupled PPO loss of one packed micro-batch, aggregated over its own tokens.
    `proximal_logprobs_T` None: the model's weights are the proximal policy's (the first
    minibatch of a step), whose logprobs are this forward's own, detached.

    Per-token values are laid out as (sequence, position) rows so that sequence-mean
    aggregations see each trajectory as one row.
    """
    # Entropy is always reported (collapse shows there first); it carries gradients only
    # when it is part of the loss.
    logprobs_T, entropy_T = compute_token_logprobs_and_entropy(
        model, batch, temperature, with_entropy=True, entropy_grad=cfg.entropy_coef != 0,
        chunk_tokens=chunk_tokens, loss_positions_only=True)
    device = logprobs_T.device

    def rows(values_T: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        return unpack_to_rows(batch, values_T.to(device), fill)

    if proximal_logprobs_T is None:
        proximal_logprobs_T = logprobs_T.detach()
    return compute_policy_loss(
        rows(logprobs_T), rows(proximal_logprobs_T), rows(batch.behaviour_logprobs_T),
        rows(batch.advantages_T), rows(batch.loss_mask_T, False), cfg,
        entropy_BT=None if entropy_T is None else rows(entropy_T),
        sum_norm_tokens=sum_norm_tokens)


def _check_step_inputs(cfg_loss: LossConfig) -> None:
    if cfg_loss.kl_coef > 0:
        raise ValueError("loss.kl_coef > 0 needs a reference model, which the training "
                         "backends do not host yet; set loss.kl_coef=0")


def _train_minibatch(ops: StepOps, batches: list[PackedBatch], proximal: list[torch.Tensor | None],
                     cfg_loss: LossConfig, temperature: float, sum_norm_tokens: int,
                     chunk_tokens: int) -> tuple[LossMetrics, float]:
    padded, num_real = pad_to_common_count(ops, batches)
    proximal = proximal + [proximal[-1]] * (len(padded) - num_real)
    weights = compute_micro_batch_weights(batches, cfg_loss.aggregation, ops)
    weights += [0.0] * (len(padded) - num_real)
    model = ops.forward_model
    model.train()  # activation checkpointing only acts in training mode; dropout is off
    parts = []
    for batch, prox_T, weight in zip(padded, proximal, weights):
        loss, metrics = compute_micro_batch_loss(model, batch, prox_T, cfg_loss, temperature,
                                                 sum_norm_tokens, chunk_tokens)
        ops.backward(loss * weight)
        parts.append(metrics)
    grad_norm = ops.optimizer_step()
    # Metrics are this rank's: the weights without the world-size factor, renormalised.
    total = sum(weights[:num_real])
    local = ([w / total for w in weights[:num_real]] if total > 0
             else [1.0 / num_real] * num_real)
    return compute_combined_metrics(parts[:num_real], local), grad_norm


def run_train_step(ops: StepOps, batch: TrainBatch, cfg_train: TrainConfig,
                   cfg_loss: LossConfig, temperature: float, version_after: int) -> StepResult:
    """Pack `batch` (this rank's shard: one advantage per trajectory, checked by
    TrainBatch), compute the later minibatches' proximal logprobs, then one optimizer step
    per minibatch."""
    start = time.perf_counter()
    trajectories = batch.trajectories
    advantages_B = torch.tensor(batch.advantages, dtype=torch.float32)  # a copy: batches are read-only
    _check_step_inputs(cfg_loss)
    minibatches = []
    for idx in split_minibatches(len(trajectories), cfg_train.num_minibatches):
        minibatches.append(build_micro_batches([trajectories[i] for i in idx], advantages_B[idx],
                                               cfg_train.micro_batch_tokens))
    # seq_mean_token_sum_norm divides by a constant that must not depend on how the step was
    # cut into micro-batches: the longest response of the step, over all ranks.
    longest = float(max(1, *(len(t.response_ids) for t in trajectories)))
    sum_norm_tokens = int(ops.all_reduce([longest], "max")[0])

    flat = [b for mb in minibatches for b in mb]
    proximal: list[torch.Tensor | None] = [None] * len(minibatches[0])
    if len(minibatches) > 1:  # on every rank alike (each minibatch holds a trajectory)
        proximal += compute_proximal_logprobs(ops, flat[len(minibatches[0]):], temperature,
                                              cfg_train.logprob_chunk_tokens,
                                              loss_positions_only=True)
    proximal_s = time.perf_counter() - start
    results, offset = [], 0
    for mb in minibatches:
        results.append(_train_minibatch(ops, mb, proximal[offset:offset + len(mb)], cfg_loss,
                                        temperature, sum_norm_tokens,
                                        cfg_train.logprob_chunk_tokens))
        offset += len(mb)
    step_s = time.perf_counter() - start
    mb_metrics = tuple(m for m, _ in results)
    grad_norms = tuple(g for _, g in results)
    step_metrics = compute_combined_metrics(mb_metrics, [1.0 / len(mb_metrics)] * len(mb_metrics))
    num_tokens = sum(b.num_tokens for b in flat)
    return StepResult(loss=step_metrics.loss, metrics=step_metrics, minibatch_metrics=mb_metrics,
                      grad_norm=float(sum(grad_norms) / len(grad_norms)), grad_norms=grad_norms,
                      num_tokens=num_tokens, num_micro_batches=len(flat),
                      tokens_per_s=num_tokens / step_s if step_s > 0 else math.inf,
                      step_s=step_s, proximal_s=proximal_s, version=version_after)
