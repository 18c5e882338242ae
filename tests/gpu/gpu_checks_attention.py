"""GPU checks of the trainer's packed attention (trainer.train.backends.logprobs): which
scaled_dot_product_attention kernel its GQA call gets, and packed rows against each
sequence alone (tests/gpu/run_gpu_checks.py runs them)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from gpu_checks_models import (QWEN3_06B, TINY, Settings, Verdict, build_random_model,
                               free_memory, model_config, qwen3_8b_config, random_trajectories,
                               sync, tiny_like)

# aten ops that are one fused kernel each; the math backend is a composite of bmm and
# softmax ops (it never reaches the dispatcher as one op), found by its `_safe_softmax`.
FUSED_SDPA_OPS = {
    "aten._scaled_dot_product_flash_attention.default": "FLASH_ATTENTION",
    "aten._scaled_dot_product_flash_attention_for_cpu.default": "FLASH_ATTENTION",
    "aten._scaled_dot_product_efficient_attention.default": "EFFICIENT_ATTENTION",
    "aten._scaled_dot_product_cudnn_attention.default": "CUDNN_ATTENTION",
    "aten._scaled_dot_product_fused_attention_overrideable.default": "OVERRIDEABLE",
}
MATH_MARKER = "aten._safe_softmax.default"
NON_MATH = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
# Kernel against the math backend on the same inputs, relative to the largest output: bf16
# kernels differ by a few ulps (2^-8 relative each; a first position's output is one value
# row, up to ~4); fp32 ones by summation order. A wrong mask or scale is off by tens of %.
KERNEL_REL_TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-6}
PARITY_MEAN_TOL = {torch.bfloat16: 5e-3, torch.float32: 1e-5}  # logprobs, nats
PARITY_MAX_TOL = {torch.bfloat16: 0.1, torch.float32: 1e-4}


def record_aten_ops(run: Callable[[], Any]) -> tuple[Any, Counter]:
    """`run()` and a count of every aten op it dispatched (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        out = run()
    return out, recorder.ops


def sdpa_backends_seen(ops: Counter) -> dict[str, int]:
    """Forward calls per SDPA backend among `ops` ("MATH" when the composite ran)."""
    seen = {name: ops[op] for op, name in FUSED_SDPA_OPS.items() if ops[op]}
    if ops[MATH_MARKER]:
        seen["MATH"] = ops[MATH_MARKER]
    return seen


def _packed_qkv(heads: int, kv_heads: int, head_dim: int, lengths: list[int], s: Settings
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v laid out as transformers hands them to an attention function: projections
    viewed as (1, T, heads, D) and transposed to (1, heads, T, D), not contiguous."""
    gen = torch.Generator(device=s.device).manual_seed(0)
    num_tokens = sum(lengths)

    def make(n: int) -> torch.Tensor:
        leaf = torch.randn(1, num_tokens, n, head_dim, generator=gen, device=s.device, dtype=s.dtype)
        return leaf.requires_grad_().transpose(1, 2)

    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                              device=s.device)
    return make(heads), make(kv_heads), make(kv_heads), cu_seqlens


def _probe_call(call: Callable[[], torch.Tensor], backends: list[Any]) -> str:
    from torch.nn.attention import sdpa_kernel

    try:
        with sdpa_kernel(backends):
            call()
        return "runs"
    except (RuntimeError, NotImplementedError) as exc:  # torch's "no available kernel"
        return "refused: " + str(exc).strip().splitlines()[0][:160]


def probe_attention_call(heads: int, kv_heads: int, head_dim: int, lengths: list[int],
                         s: Settings) -> dict[str, Any]:
    """The trainer's packed attention call (`compute_packed_sdpa_attention`, GQA) on one
    packed row: the kernel it gets by default (forward and backward), whether it runs with
    the math backend ruled out, which backends can run it alone, and its difference to the
    math backend's output."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.train.backends.logprobs import compute_packed_sdpa_attention

    q, k, v, cu_seqlens = _packed_qkv(heads, kv_heads, head_dim, lengths, s)

    def call() -> torch.Tensor:
        out, _ = compute_packed_sdpa_attention(torch.nn.Module(), q, k, v, None, dropout=0.0,
                                               scaling=head_dim ** -0.5, cu_seq_lens_q=cu_seqlens)
        out.float().square().mean().backward()
        sync(s.device)
        return out.detach()

    out, ops = record_aten_ops(call)
    with sdpa_kernel([SDPBackend.MATH]):
        math_out = call()
    non_math = [getattr(SDPBackend, name) for name in NON_MATH]
    return {
        "attention": f"{heads} query heads over {kv_heads} KV heads x {head_dim}, "
                     f"{len(lengths)} sequences, {sum(lengths)} tokens, {str(s.dtype)[6:]}",
        "default": sdpa_backends_seen(ops),
        "without_math": _probe_call(call, non_math),
        "alone": {name: _probe_call(call, [getattr(SDPBackend, name)]) for name in
                  (*NON_MATH, "MATH")},
        "max_rel_vs_math": ((out.float() - math_out.float()).abs().max()
                            / math_out.float().abs().max()).item(),
    }


def probe_trainer_forward(shape: dict[str, Any], lengths: list[int], s: Settings) -> dict[str, Any]:
    """A one-layer model of `shape` loaded with the trainer's `sluice_packed_sdpa`: the
    kernels its chunked logprob forward and backward dispatch (activation checkpointing
    on, as in training), by default and with math ruled out."""
    from torch.nn.attention import SDPBackend

    from trainer.train.backends.logprobs import PACKED_SDPA, compute_token_logprobs_and_entropy
    from trainer.train.backends.packing import pack_trajectories

    model = build_random_model(model_config(shape, num_layers=1), s.dtype, s.device, PACKED_SDPA,
                               checkpointing=True).train()
    packed = pack_trajectories(random_trajectories(lengths, shape["vocab_size"], seed=5),
                               torch.zeros(len(lengths)))

    def forward() -> torch.Tensor:
        lp, _ = compute_token_logprobs_and_entropy(model, packed, with_entropy=True,
                                                   chunk_tokens=1024)
        return lp

    def step() -> None:
        forward().float().mean().backward()
        sync(s.device)

    _, forward_ops = record_aten_ops(forward)
    _, step_ops = record_aten_ops(step)
    result = {"forward": sdpa_backends_seen(forward_ops),
              "forward_and_backward": sdpa_backends_seen(step_ops),
              "backward_ops": sorted(op for op in step_ops if "attention" in op and "backward" in op),
              "num_sequences": len(lengths),
              "without_math": _probe_call(step, [getattr(SDPBackend, n) for n in NON_MATH])}
    return result  # the model goes with this frame


def check_sdpa_kernel(s: Settings) -> dict[str, Any]:
    """The SDPA kernel of the trainer's GQA attention call, and that it is not math on CUDA."""
    from trainer.train.backends.policy_model import choose_attention

    verdict = Verdict()
    if s.dry:
        shapes = {"tiny": TINY}
        lengths = [40, 70, 50]
    else:
        shapes = {"qwen3-8b": qwen3_8b_config(), "qwen3-0.6b": QWEN3_06B}
        lengths = [3000, 2500, 2692]  # one 8,192-token packed row
    calls = {}
    for name, shape in shapes.items():
        probe = probe_attention_call(shape["num_attention_heads"], shape["num_key_value_heads"],
                                     shape["head_dim"], lengths, s)
        calls[name] = probe
        print(f"  {name}: {probe['attention']}: default {probe['default']}; math ruled out: "
              f"{probe['without_math']}; vs math {probe['max_rel_vs_math']:.2e} of the largest output",
              flush=True)
        for backend, outcome in probe["alone"].items():
            print(f"      {backend:<20} alone: {outcome}", flush=True)
        verdict.expect(probe["max_rel_vs_math"] <= KERNEL_REL_TOL[s.dtype],
                       f"{name}: packed attention differs from the math backend by "
                       f"{probe['max_rel_vs_math']:.2e} of its largest output (> {KERNEL_REL_TOL[s.dtype]})")
        if s.device == "cuda":
            verdict.expect("MATH" not in probe["default"] and bool(probe["default"]),
                           f"{name}: the trainer's GQA call ran {probe['default']} on CUDA, "
                           f"not a fused kernel (flash / efficient / cuDNN)")
            verdict.expect(probe["without_math"] == "runs",
                           f"{name}: with the math backend ruled out the call fails: "
                           f"{probe['without_math']}")
    forward_shape = TINY if s.dry else QWEN3_06B
    model_lengths = [lengths[0] // 2, lengths[1] // 2, lengths[2] // 2]
    model = probe_trainer_forward(forward_shape, model_lengths, s)
    calls_made = sum(model["forward"].values())
    print(f"  trainer forward (1 layer, sluice_packed_sdpa): {model['forward']} over "
          f"{model['num_sequences']} sequences; forward+backward {model['forward_and_backward']}; "
          f"math ruled out: {model['without_math']}", flush=True)
    verdict.expect(calls_made == len(model_lengths),
                   f"the packed forward made {calls_made} attention calls for "
                   f"{len(model_lengths)} sequences in one layer (one per sequence expected)")
    if s.device == "cuda":
        verdict.expect("MATH" not in model["forward_and_backward"],
                       f"the trainer's forward/backward ran the math backend: "
                       f"{model['forward_and_backward']}")
        verdict.expect(model["without_math"] == "runs",
                       f"the trainer's forward/backward fails without math: {model['without_math']}")
    default = sorted({b for probe in calls.values() for b in probe["default"]})
    return verdict.result(trainer_attention=choose_attention(torch.device(s.device)),
                          default_backends=default, calls=calls, trainer_forward=model,
                          asserted_not_math=s.device == "cuda")


@torch.no_grad()
def check_packed_parity(s: Settings) -> dict[str, Any]:
    """Four sequences packed in one row against each alone, with every attention path the
    trainer can load (sluice_packed_sdpa; flash_attention_2 when flash-attn is installed),
    and chunked against unchunked logprobs on the same row."""
    from trainer.train.backends.logprobs import PACKED_SDPA, compute_token_logprobs_and_entropy
    from trainer.train.backends.packing import pack_trajectories

    verdict = Verdict()
    shape = tiny_like(qwen3_8b_config()) if s.dry else qwen3_8b_config()
    attns = [PACKED_SDPA]
    if s.device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        attns.append("flash_attention_2")
    lengths = [70, 150, 30, 210] if s.dry else [700, 1500, 300, 2100]
    chunk = 64 if s.dry else 2048
    trajs = random_trajectories(lengths, shape["vocab_size"], seed=1)
    packed = pack_trajectories(trajs, torch.zeros(len(trajs)))
    mask_T = packed.loss_mask_T
    results = {}
    for attn in attns:
        model = build_random_model(model_config(shape, num_layers=2), s.dtype, s.device, attn).eval()
        row_lp, _ = compute_token_logprobs_and_entropy(model, packed, chunk_tokens=chunk)
        unchunked_lp, _ = compute_token_logprobs_and_entropy(model, packed, chunk_tokens=0)
        diffs = []
        bounds = packed.cu_seqlens.tolist()
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            alone, _ = compute_token_logprobs_and_entropy(
                model, pack_trajectories([trajs[i]], torch.zeros(1)), chunk_tokens=chunk)
            diffs.append((row_lp[a:b] - alone)[mask_T[a:b].to(alone.device)].abs().float())
        d = torch.cat(diffs)
        chunk_d = (row_lp - unchunked_lp)[mask_T.to(row_lp.device)].abs().float()
        results[attn] = {"packed_vs_alone_mean": d.mean().item(), "packed_vs_alone_max": d.max().item(),
                         "chunked_vs_unchunked_max": chunk_d.max().item()}
        print(f"  {attn:<20} packed vs alone: mean {d.mean().item():.2e} max {d.max().item():.2e}; "
              f"chunked vs unchunked max {chunk_d.max().item():.2e}", flush=True)
        verdict.expect(d.mean().item() <= PARITY_MEAN_TOL[s.dtype] and d.max().item() <= PARITY_MAX_TOL[s.dtype],
                       f"{attn}: packed vs alone mean {d.mean().item():.2e} / max {d.max().item():.2e} "
                       f"over {PARITY_MEAN_TOL[s.dtype]} / {PARITY_MAX_TOL[s.dtype]}")
        verdict.expect(chunk_d.max().item() <= PARITY_MAX_TOL[s.dtype],
                       f"{attn}: chunked vs unchunked max {chunk_d.max().item():.2e}")
        del model
        free_memory()
    return verdict.result(attentions=results, tokens=sum(lengths))
