"""The decoupled PPO objective (AReaL-style) over masked multi-turn trajectories, as pure
functions of tensors and `LossConfig`: the clip acts on current vs proximal logprobs and a
behaviour importance weight corrects for the stale engine policy.

Per model token t (mask 1), with A the advantage:
    ratio  = exp(cur - prox)
    pg     = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    pg     = min(pg, -c * A) for A < 0                      (dual clip, when c is set)
    w      = exp(prox - behav), no gradient                 (behaviour importance weight)
    loss_t = w' * pg, w' = w masked / clamped to [is_min, is_max] per `is_mode`
The loss is aggregate(loss_t) + kl_coef * aggregate(k3(ref, cur)) - entropy_coef *
aggregate(entropy), all with the same aggregation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from trainer.train.config import LossConfig

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
IS_MODES = ("mask", "clamp", "off")


@dataclass(frozen=True, slots=True)
class LossMetrics:
    """Diagnostics of one loss call. Fractions and means are over model tokens; `kl_ref`
    and `entropy` are aggregated like the loss, so
    loss = policy_loss + kl_coef * kl_ref - entropy_coef * entropy."""

    loss: float
    policy_loss: float  # aggregated, importance-weighted clipped surrogate
    clip_frac: float  # tokens where the clipped term won (its gradient is zero)
    dual_clip_frac: float  # tokens capped by the dual clip (A < 0, loss held at -c*A)
    is_weight_mean: float  # raw exp(prox - behav), before masking/clamping
    is_weight_max: float
    is_capped_frac: float  # tokens whose weight was masked or clamped (0 with is_mode off)
    mismatch_kl: float  # k3 estimate of KL(behaviour || proximal): engine vs trainer drift
    approx_kl: float  # k3 estimate of KL(proximal || current): how far this step moved
    kl_ref: float  # k3 KL(current || reference); nan without reference logprobs
    entropy: float  # nan without entropy_BT
    num_tokens: int  # model tokens (mask 1)
    num_seqs: int  # sequences with at least one model token

    def to_log(self, prefix: str = "loss/") -> dict[str, float]:
        """Slash-namespaced metric keys for the metrics logger."""
        return {prefix + k: float(v) for k, v in asdict(self).items()}


def compute_k3_kl(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator exp(x) - 1 - x, with x = log p - log q at samples drawn from
    q: an unbiased, per-sample non-negative estimate of KL(q || p)."""
    return torch.expm1(log_ratio_BT) - log_ratio_BT


def compute_token_aggregate(values_BT: torch.Tensor, model_BT: torch.Tensor, aggregation: str,
                            sum_norm_tokens: int | None = None) -> torch.Tensor:
    """One number from per-token values, counting only model tokens (`model_BT` bool).

    token_mean: sum over all model tokens / number of model tokens.
    seq_mean_token_mean: per-sequence mean over its model tokens, then mean over sequences.
    seq_mean_token_sum_norm (Dr. GRPO): per-sequence sum / a constant, then mean over
    sequences. The constant is `sum_norm_tokens`, by default T (the padded length of this
    batch), so long and short answers weigh per token alike; a caller that splits a step
    into micro-batches of different T should pass a fixed value (e.g.
    agent.max_response_tokens) to keep the scale the same across them.
    Sequence means run over sequences with >= 1 model token, so a fully masked
    (failed) trajectory is absent rather than diluting the mean. Empty input gives 0.
    """
    masked_BT = torch.where(model_BT, values_BT, torch.zeros_like(values_BT))
    if aggregation == "token_mean":
        return masked_BT.sum() / model_BT.sum().clamp_min(1)
    count_B = model_BT.sum(dim=1)
    if aggregation == "seq_mean_token_mean":
        per_seq_B = masked_BT.sum(dim=1) / count_B.clamp_min(1)
    elif aggregation == "seq_mean_token_sum_norm":
        norm = model_BT.shape[1] if sum_norm_tokens is None else sum_norm_tokens
        if norm <= 0:
            raise ValueError(f"sum_norm_tokens must be > 0, got {norm}")
        per_seq_B = masked_BT.sum(dim=1) / norm
    else:
        raise ValueError(f"loss.aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    return per_seq_B.sum() / (count_B > 0).sum().clamp_min(1)


def _check_inputs(tensors: dict[str, torch.Tensor | None], cfg: LossConfig) -> None:
    logprobs_BT = tensors["logprobs_BT"]
    assert logprobs_BT is not None, "the current logprobs are always given"
    shape = logprobs_BT.shape
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"logprobs_BT must be 2-D (batch, tokens) and non-empty, got shape "
                         f"{tuple(shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs_BT has "
                             f"{tuple(shape)}; all per-token inputs must share one shape")
    if not logprobs_BT.is_floating_point():
        raise ValueError(f"logprobs_BT must be floating point, got {logprobs_BT.dtype}")
    if cfg.aggregation not in AGGREGATIONS:
        raise ValueError(f"loss.aggregation must be one of {AGGREGATIONS}, got {cfg.aggregation!r}")
    if cfg.is_mode not in IS_MODES:
        raise ValueError(f"loss.is_mode must be one of {IS_MODES}, got {cfg.is_mode!r}")
    if cfg.kl_coef > 0 and tensors["ref_logprobs_BT"] is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs_BT from a reference model; "
                         "pass them or set loss.kl_coef=0")
    if cfg.entropy_coef != 0 and tensors["entropy_BT"] is None:
        raise ValueError("loss.entropy_coef != 0 needs entropy_BT; pass it or set "
                         "loss.entropy_coef=0")


def compute_clipped_surrogate(ratio_BT: torch.Tensor, adv_BT: torch.Tensor, cfg: LossConfig
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss with optional dual clip; also which tokens each clip hit."""
    clipped_ratio_BT = ratio_BT.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    unclipped_BT = -ratio_BT * adv_BT
    clipped_BT = -clipped_ratio_BT * adv_BT
    pg_BT = torch.maximum(unclipped_BT, clipped_BT)  # the pessimistic of the two objectives
    clip_hit_BT = clipped_BT > unclipped_BT
    dual_hit_BT = torch.zeros_like(clip_hit_BT)
    if cfg.dual_clip_c is not None:
        # For A < 0 a huge ratio makes the loss unbounded; dual clip holds it at -c*A.
        cap_BT = -cfg.dual_clip_c * adv_BT
        dual_hit_BT = (adv_BT < 0) & (pg_BT > cap_BT)
        pg_BT = torch.where(dual_hit_BT, cap_BT, pg_BT)
    return pg_BT, clip_hit_BT, dual_hit_BT


def compute_behaviour_weight(log_w_BT: torch.Tensor, model_BT: torch.Tensor, cfg: LossConfig
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weight exp(prox - behav) per token after `is_mode`: (weight, kept, capped).

    mask: tokens with the weight outside [is_min, is_max] are not kept: they leave the
    numerator but stay in the denominator, so stale tokens shrink the update instead of
    reweighting the survivors. clamp: every token kept, weight clamped. off: weight 1.
    `capped` marks the model tokens that were masked or clamped.
    """
    w_BT = torch.exp(log_w_BT)
    out_BT = model_BT & ((w_BT < cfg.is_min) | (w_BT > cfg.is_max))
    if cfg.is_mode == "mask":
        return w_BT, model_BT & ~out_BT, out_BT
    if cfg.is_mode == "clamp":
        return w_BT.clamp(cfg.is_min, cfg.is_max), model_BT, out_BT
    return torch.ones_like(w_BT), model_BT, torch.zeros_like(out_BT)


def compute_policy_loss(logprobs_BT: torch.Tensor, proximal_logprobs_BT: torch.Tensor,
                        behaviour_logprobs_BT: torch.Tensor, advantages_BT: torch.Tensor,
                        mask_BT: torch.Tensor, cfg: LossConfig,
                        ref_logprobs_BT: torch.Tensor | None = None,
                        entropy_BT: torch.Tensor | None = None, *,
                        sum_norm_tokens: int | None = None) -> tuple[torch.Tensor, LossMetrics]:
    """Decoupled PPO loss of one batch and its metrics.

    Only `logprobs_BT` and `entropy_BT` carry gradients; proximal, behaviour and reference
    logprobs and advantages are detached. Every input is replaced by 0 where mask is 0
    before any arithmetic, so NaN/inf in padding or tool tokens can reach neither the loss
    nor the gradient (which is exactly 0 there). `sum_norm_tokens`: see
    `compute_token_aggregate`.
    """
    _check_inputs(dict(logprobs_BT=logprobs_BT, proximal_logprobs_BT=proximal_logprobs_BT,
                       behaviour_logprobs_BT=behaviour_logprobs_BT, advantages_BT=advantages_BT,
                       mask_BT=mask_BT, ref_logprobs_BT=ref_logprobs_BT,
                       entropy_BT=entropy_BT), cfg)
    model_BT = mask_BT != 0
    dtype = torch.promote_types(logprobs_BT.dtype, torch.float32)  # ratios in bf16 are too coarse

    def model_only(x_BT: torch.Tensor) -> torch.Tensor:
        x_BT = x_BT.to(dtype)
        return torch.where(model_BT, x_BT, torch.zeros_like(x_BT))

    cur_BT = model_only(logprobs_BT)
    prox_BT = model_only(proximal_logprobs_BT.detach())
    behav_BT = model_only(behaviour_logprobs_BT.detach())
    adv_BT = model_only(advantages_BT.detach())

    log_ratio_BT = cur_BT - prox_BT
    ratio_BT = torch.exp(log_ratio_BT)
    pg_BT, clip_hit_BT, dual_hit_BT = compute_clipped_surrogate(ratio_BT, adv_BT, cfg)
    log_w_BT = prox_BT - behav_BT
    weight_BT, kept_BT, capped_BT = compute_behaviour_weight(log_w_BT, model_BT, cfg)
    # where, not multiply: a dropped token may hold w = inf or pg = inf, and 0 * inf = nan.
    loss_BT = torch.where(kept_BT, weight_BT * pg_BT, torch.zeros_like(pg_BT))

    def aggregate(values_BT: torch.Tensor) -> torch.Tensor:
        return compute_token_aggregate(values_BT, model_BT, cfg.aggregation, sum_norm_tokens)

    policy_loss = aggregate(loss_BT)
    loss = policy_loss
    kl_ref = entropy = torch.full((), float("nan"), dtype=dtype, device=loss.device)
    if ref_logprobs_BT is not None:
        kl_ref = aggregate(compute_k3_kl(model_only(ref_logprobs_BT.detach()) - cur_BT))
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_ref
    if entropy_BT is not None:
        entropy = aggregate(model_only(entropy_BT))
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * entropy

    metrics = _compute_metrics(model_BT, loss, policy_loss, kl_ref, entropy, clip_hit_BT,
                               dual_hit_BT, capped_BT, log_w_BT, log_ratio_BT.detach())
    return loss, metrics


@torch.no_grad()
def _compute_metrics(model_BT: torch.Tensor, loss: torch.Tensor, policy_loss: torch.Tensor,
                     kl_ref: torch.Tensor, entropy: torch.Tensor, clip_hit_BT: torch.Tensor,
                     dual_hit_BT: torch.Tensor, capped_BT: torch.Tensor, log_w_BT: torch.Tensor,
                     log_ratio_BT: torch.Tensor) -> LossMetrics:
    num_tokens = model_BT.sum()
    raw_w_BT = torch.exp(log_w_BT)  # before masking/clamping: shows the drift itself

    def token_mean(x_BT: torch.Tensor) -> torch.Tensor:
        x_BT = x_BT.to(loss.dtype)
        return torch.where(model_BT, x_BT, torch.zeros_like(x_BT)).sum() / num_tokens.clamp_min(1)

    # w >= 0, so 0 outside the mask never exceeds a real maximum.
    w_max = torch.where(model_BT, raw_w_BT, torch.zeros_like(raw_w_BT)).max()
    values = torch.stack([
        loss.detach(), policy_loss.detach(), token_mean(clip_hit_BT), token_mean(dual_hit_BT),
        token_mean(raw_w_BT), w_max, token_mean(capped_BT),
        # KL(behaviour || proximal): samples come from the engine, log ratio = prox - behav.
        token_mean(compute_k3_kl(log_w_BT)),
        # KL(proximal || current): log ratio = cur - prox, as in PPO's approx_kl.
        token_mean(compute_k3_kl(log_ratio_BT)),
        kl_ref.detach(), entropy.detach(),
        num_tokens.to(loss.dtype), (model_BT.sum(dim=1) > 0).sum().to(loss.dtype),
    ]).tolist()  # one device sync for all metrics
    *floats, n_tok, n_seq = values
    return LossMetrics(*floats, num_tokens=int(n_tok), num_seqs=int(n_seq))
