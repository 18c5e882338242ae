"""GPU checks of the training backends' real step (tests/gpu/run_gpu_checks.py runs them):
TorchBackend on random Qwen3-shaped models with the swe recipe's YaRN and behaviour
logprobs from an unpacked Hugging Face forward of the same weights, and one DeepSpeed
ZeRO-3 step where deepspeed is installed."""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_checks_models import (QWEN3_06B, TINY, Settings, Verdict, compute_reference_logprobs,
                               free_memory, load_reference_model, random_trajectories,
                               recipe_rope_scaling, save_random_model, skipped, with_behaviour)

from buffer.batch import TrainBatch
from envs.types import Trajectory

# The trainer's proximal logprobs against the reference forward, per model token (nats).
# fp32: the same math in another order (packed per-sequence sdpa and a chunked head against
# one unpacked forward): ~1e-6. bf16: every linear output is rounded to 8 significant bits
# (2^-9 relative), and a packed row's matmuls have other shapes than one sequence's, so
# roundings differ in the last bit and add up over the layers: about sqrt(28) * 2^-9 ~ 1%
# of a random model's logits (std ~0.6 at hidden 1024), a few 1e-3 nats on average; the
# largest of ~40k tokens is ~4 sigma. A bug (a sequence seeing its neighbour, wrong
# positions, no YaRN, zeros for behaviour) moves them by 0.05 nats or more on average.
PROXIMAL_MEAN_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
PROXIMAL_MAX_TOL = {torch.bfloat16: 0.15, torch.float32: 1e-4}
# E[exp(prox - behav)] - 1 ~ mean + var / 2 of those differences.
IS_WEIGHT_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
YARN_MARGIN = 3.0  # the trainer must be this much closer to YaRN's logprobs than to plain RoPE's
# AdamW moves each weight by ~lr on its first step. The TorchBackend keeps bf16 weights
# without an fp32 master copy, where a change below half a bf16 ulp (2^-9 relative, 6e-5
# at |w| = 0.02) is rounded away: lr 1e-3 is visible on every weight, the recipe's 1e-6
# would not be (DeepSpeed keeps fp32 master weights for that).
STEP_LR = 1e-3
MOVED_MIN_FRACTION = 0.5


@contextlib.contextmanager
def record_loss_inputs() -> Iterator[list[dict[str, torch.Tensor]]]:
    """What the step hands its loss per micro-batch (proximal and behaviour logprobs, the
    mask), recorded on the way through; the loss itself runs unchanged."""
    from trainer.train.backends import step

    calls: list[dict[str, torch.Tensor]] = []
    loss_fn = step.compute_policy_loss

    def recording(logprobs_BT: torch.Tensor, proximal_logprobs_BT: torch.Tensor,
                  behaviour_logprobs_BT: torch.Tensor, advantages_BT: torch.Tensor,
                  mask_BT: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append({"proximal": proximal_logprobs_BT.detach().float().cpu(),
                      "behaviour": behaviour_logprobs_BT.detach().float().cpu(),
                      "mask": mask_BT.detach().bool().cpu()})
        return loss_fn(logprobs_BT, proximal_logprobs_BT, behaviour_logprobs_BT, advantages_BT,
                       mask_BT, *args, **kwargs)

    step.compute_policy_loss = recording
    try:
        yield calls
    finally:
        step.compute_policy_loss = loss_fn


def train_cases(s: Settings) -> dict[str, dict[str, Any]]:
    """Models and sequence lengths of the train-step check. Every case runs with the swe
    recipe's YaRN; the long case holds one sequence past its original positions."""
    if s.dry:
        return {"tiny": {"shape": TINY, "cases": {"short": [60, 50, 40, 30], "long": [300, 40]},
                         "micro_batch_tokens": 128, "chunk_tokens": 64}}
    gpu_tiny = {**TINY, "max_position_embeddings": QWEN3_06B["max_position_embeddings"]}
    cases = {"8k": [3000, 2500, 1500, 1192], "32k": [33000, 1500]}  # 33,000 > 32,768
    return {name: {"shape": shape, "cases": cases, "micro_batch_tokens": 8192,
                   "chunk_tokens": 2048} for name, shape in (("tiny", gpu_tiny),
                                                              ("qwen3-0.6b", QWEN3_06B))}


def _sample_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the first layer's query and the last layer's down projection."""
    params = dict(model.named_parameters())
    last = model.config.num_hidden_layers - 1
    names = ["model.layers.0.self_attn.q_proj.weight", f"model.layers.{last}.mlp.down_proj.weight"]
    return {n: params[n].detach().clone() for n in names}


def run_train_case(backend: Any, reference: torch.nn.Module, plain: torch.nn.Module,
                   lengths: list[int], vocab: int, original_positions: int, seed: int
                   ) -> dict[str, Any]:
    """One TorchBackend step on trajectories whose behaviour logprobs are the reference
    forward's at the backend's current weights; what the step used and reported."""
    from trainer.train.config import LossConfig

    model = backend.forward_model
    reference.load_state_dict(model.state_dict())  # the same weights (after earlier steps)
    plain.load_state_dict(model.state_dict())
    trajs: list[Trajectory] = []
    behaviour, plain_diffs = [], []
    for t in random_trajectories(lengths, vocab, seed=seed):
        lp = compute_reference_logprobs(reference, t)
        trajs.append(with_behaviour(t, lp))
        behaviour.append(lp[t.response_mask == 1])
        if len(t.input_ids()) == max(lengths):  # YaRN's effect, on the longest sequence
            plain_lp = compute_reference_logprobs(plain, t)
            plain_diffs.append((plain_lp, lp, t.response_mask == 1))
    behaviour_all = np.concatenate(behaviour)
    before = _sample_weights(model)
    advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(trajs))]
    with record_loss_inputs() as calls:
        result = backend.train_step(TrainBatch(trajs, advantages, backend.version), LossConfig())
    after = _sample_weights(model)
    diffs = torch.cat([(c["proximal"] - c["behaviour"])[c["mask"]].abs() for c in calls])
    moved = {n: (after[n] != before[n]).float().mean().item() for n in before}
    plain_lp, yarn_lp, mask = plain_diffs[0]  # the longest sequence under both RoPEs
    out = {
        "tokens": sum(lengths), "sequences": len(lengths), "longest": max(lengths),
        "past_original_positions": max(lengths) > original_positions,
        "micro_batches": result.num_micro_batches, "loss_calls": len(calls),
        "behaviour_mean": float(behaviour_all.mean()), "behaviour_std": float(behaviour_all.std()),
        "proximal_vs_hf_mean": diffs.mean().item(), "proximal_vs_hf_max": diffs.max().item(),
        "is_weight_mean": result.metrics.is_weight_mean, "is_weight_max": result.metrics.is_weight_max,
        "is_capped_frac": result.metrics.is_capped_frac, "mismatch_kl": result.metrics.mismatch_kl,
        "loss": result.loss, "grad_norm": result.grad_norm, "moved_fraction": moved,
        "plain_rope_vs_yarn_mean": float(np.abs(plain_lp - yarn_lp)[mask].mean()),
        "step_s": result.step_s, "tokens_per_s": result.tokens_per_s,
    }
    return out


def _expect_case(verdict: Verdict, label: str, case: dict[str, Any], s: Settings) -> None:
    tol_mean, tol_max = PROXIMAL_MEAN_TOL[s.dtype], PROXIMAL_MAX_TOL[s.dtype]
    verdict.expect(case["behaviour_std"] > 0 and case["behaviour_mean"] < -1.0,
                   f"{label}: behaviour logprobs look unreal (mean {case['behaviour_mean']:.3f}, "
                   f"std {case['behaviour_std']:.3f})")
    verdict.expect(case["proximal_vs_hf_mean"] <= tol_mean and case["proximal_vs_hf_max"] <= tol_max,
                   f"{label}: the step's proximal logprobs differ from the unpacked HF forward by "
                   f"mean {case['proximal_vs_hf_mean']:.2e} / max {case['proximal_vs_hf_max']:.2e} "
                   f"(tolerance {tol_mean} / {tol_max})")
    verdict.expect(abs(case["is_weight_mean"] - 1.0) <= IS_WEIGHT_TOL[s.dtype] and case["is_capped_frac"] == 0,
                   f"{label}: importance weight mean {case['is_weight_mean']:.5f} (capped "
                   f"{case['is_capped_frac']:.3f}); on-policy behaviour should give 1 +- "
                   f"{IS_WEIGHT_TOL[s.dtype]}")
    verdict.expect(all(f >= MOVED_MIN_FRACTION for f in case["moved_fraction"].values()),
                   f"{label}: the step left weights in place: changed fractions {case['moved_fraction']}")
    verdict.expect(bool(np.isfinite([case["loss"], case["grad_norm"]]).all()) and case["grad_norm"] > 0,
                   f"{label}: loss {case['loss']} / grad norm {case['grad_norm']}")
    if not case["past_original_positions"]:
        return
    floor = max(case["proximal_vs_hf_mean"], PROXIMAL_MEAN_TOL[s.dtype] / 10)
    verdict.expect(case["plain_rope_vs_yarn_mean"] >= YARN_MARGIN * floor,
                   f"{label}: plain RoPE differs from YaRN by only {case['plain_rope_vs_yarn_mean']:.2e} "
                   f"(the trainer's own error is {case['proximal_vs_hf_mean']:.2e}): is YaRN in effect?")


def check_train_step(s: Settings) -> dict[str, Any]:
    """TorchBackend.train_step on real behaviour logprobs: proximal == HF, IS weight ~ 1,
    weights move; with YaRN past the original positions."""
    from rollout.rope import build_rope_overrides, read_config_json
    from trainer.train.backends.torch_backend import TorchBackend
    from trainer.train.config import TrainConfig

    verdict = Verdict()
    models: dict[str, Any] = {}
    for name, spec in train_cases(s).items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = save_random_model(Path(tmp), spec["shape"], s.dtype, s.device)
            overrides = build_rope_overrides(read_config_json(folder), recipe_rope_scaling(s.dry))
            cfg = TrainConfig(backend="torch", lr=STEP_LR, num_minibatches=2,
                              micro_batch_tokens=spec["micro_batch_tokens"],
                              logprob_chunk_tokens=spec["chunk_tokens"], gradient_checkpointing=True)
            backend = TorchBackend(cfg, folder, device=s.device, config_overrides=overrides)
            reference = load_reference_model(folder, s.dtype, s.device, overrides)
            plain = load_reference_model(folder, s.dtype, s.device)
        cases = {}
        for i, (label, lengths) in enumerate(spec["cases"].items()):
            original = overrides["rope_parameters"]["original_max_position_embeddings"]
            case = run_train_case(backend, reference, plain, lengths, spec["shape"]["vocab_size"],
                                  original, seed=10 + i)
            cases[label] = case
            print(f"  {name} {label}: {case['tokens']} tokens (longest {case['longest']}), "
                  f"{case['micro_batches']} micro-batches; behaviour mean {case['behaviour_mean']:.3f}; "
                  f"proximal vs HF mean {case['proximal_vs_hf_mean']:.2e} max "
                  f"{case['proximal_vs_hf_max']:.2e}; IS weight mean {case['is_weight_mean']:.5f}; "
                  f"plain RoPE vs YaRN {case['plain_rope_vs_yarn_mean']:.2e}; weights changed "
                  f"{min(case['moved_fraction'].values()):.0%}; step {case['step_s']:.2f} s", flush=True)
            _expect_case(verdict, f"{name} {label}", case, s)
        models[name] = {"rope_overrides": overrides, "cases": cases}
        del backend, reference, plain
        free_memory()
    return verdict.result(models=models, lr=STEP_LR)


def check_deepspeed(s: Settings) -> dict[str, Any]:
    """One ZeRO-3 step (one process) of the chunked path, behaviour logprobs from the HF
    forward: finite loss, a gradient, IS weight ~ 1."""
    if s.device != "cuda":
        return skipped("needs CUDA: the dry mode never imports deepspeed")
    if importlib.util.find_spec("deepspeed") is None:
        return skipped("deepspeed not installed")
    from trainer.train.backends.deepspeed_backend import DeepSpeedBackend
    from trainer.train.config import LossConfig, TrainConfig

    verdict = Verdict()
    shape = {**TINY, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 8192}
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_random_model(Path(tmp), shape, s.dtype, s.device)
        reference = load_reference_model(folder, s.dtype, s.device)
        trajs = [with_behaviour(t, compute_reference_logprobs(reference, t))
                 for t in random_trajectories([1500, 900, 2000], shape["vocab_size"], seed=3)]
        del reference
        free_memory()
        backend = DeepSpeedBackend(TrainConfig(zero_stage=3, lr=1e-5, micro_batch_tokens=4096,
                                               logprob_chunk_tokens=512, gradient_checkpointing=True),
                                   folder, dtype="bfloat16", device="cuda")
        result = backend.train_step(TrainBatch(trajs, [1.0, -0.5, -0.5], backend.version), LossConfig())
    m = result.metrics
    print(f"  ZeRO-3 step: loss {result.loss:.4f}, grad norm {result.grad_norm:.3f}, IS weight mean "
          f"{m.is_weight_mean:.5f}, {result.num_micro_batches} micro-batches", flush=True)
    verdict.expect(bool(np.isfinite([result.loss, result.grad_norm]).all()) and result.grad_norm > 0,
                   f"loss {result.loss} / grad norm {result.grad_norm}")
    verdict.expect(abs(m.is_weight_mean - 1) <= IS_WEIGHT_TOL[s.dtype],
                   f"IS weight mean {m.is_weight_mean:.5f} under ZeRO-3")
    return verdict.result(loss=result.loss, grad_norm=result.grad_norm,
                          is_weight_mean=m.is_weight_mean, version=backend.version)
