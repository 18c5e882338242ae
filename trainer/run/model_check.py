"""Checks of a recipe against its models' own config.json, made before any cluster resource
is touched (`trainer.main` runs them for `--dry-run` and before a run starts):

- context: model.max_context_tokens fits the policy's positions after model.rope_scaling,
  and the judge's context (reward.judge.max_model_len, else the policy's) fits the judge's
  positions after reward.judge.rope_scaling;
- tensor parallelism: rollout.tp_size (reward.judge.tp_size) divides the attention heads,
  and divides or is a multiple of the KV heads (vLLM replicates KV heads past their count);
- memory, per train rank and per engine GPU, printed: weights, gradients and optimizer
  state under the ZeRO stage; activations of the longest micro-batch; the logits of one
  logprob chunk; an engine's weight shard and how many tokens its KV cache holds. A KV
  cache that cannot hold one sequence of model.max_context_tokens is a problem (vLLM
  refuses to start); a train estimate above the GPU's memory is a warning (estimates).

The estimates are for dense decoders (Llama/Qwen-style gated MLP), bf16 or fp32 weights with
fp32 AdamW state; they leave out allocator fragmentation, CUDA context (~0.5-1 GiB) and
communication buffers. Per token and layer a training forward keeps about
9 x hidden + 4 x intermediate + 3 x kv_heads x head_dim values (norm inputs, q/k/v, rotary
outputs, attention output, gate/up/activation/product); with activation checkpointing only
each layer's input is kept, plus one layer's working set during its recompute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.engine import model_runner_note
from rollout.rope import build_rope_overrides, count_positions, read_config_json, text_config
from trainer.run.config import SluiceConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# fp32 [chunk, vocab] tensors alive at once while a chunk's logprobs, entropy and their
# gradients are computed (logits, softmax, products and gradients; measured on CPU with
# tests/bench/bench_logprob_memory.py: 5.2 copies in training, 3.0 without gradients).
LOGIT_COPIES_TRAIN = 5
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """What sizes a dense decoder's memory and what tensor parallelism must divide; also
    the planner's parameter count and KV bytes per token (launch.plan)."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    positions: int  # after RoPE scaling overrides
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2, attention_bias)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], overrides: Mapping[str, Any],
                    key: str) -> DecoderShape:
        text = text_config(config)
        try:
            hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
            return cls(num_layers=int(text["num_hidden_layers"]), hidden=hidden,
                       intermediate=int(text["intermediate_size"]), num_heads=heads,
                       num_kv_heads=int(text.get("num_key_value_heads") or heads),
                       head_dim=int(text.get("head_dim") or hidden // heads),
                       vocab=int(text["vocab_size"]),
                       tied_embeddings=bool(text.get("tie_word_embeddings", False)),
                       positions=count_positions(config, overrides),
                       # Qwen2 has q/k/v biases without saying so in its config.
                       qkv_bias=bool(text.get("attention_bias", text.get("model_type") == "qwen2")))
        except KeyError as exc:
            raise ValueError(f"{key}: config.json lacks {exc.args[0]!r}; it does not describe "
                             "a decoder-only language model") from None

    @property
    def layer_params(self) -> int:
        """Attention and gated-MLP weights of one layer (per-head q/k norms, Qwen3's
        2 x head_dim, are left out: under 1e-5 of the total)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        biases = q + 2 * kv if self.qkv_bias else 0
        return 2 * self.hidden * q + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate + biases

    @property
    def num_params(self) -> int:
        """A dense Llama/Qwen-style decoder: layers with their two RMSNorms, embeddings (and
        an untied head), the final norm."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.num_layers * (self.layer_params + 2 * self.hidden) + embeddings + self.hidden

    @property
    def activation_values_per_token_layer(self) -> int:
        return 9 * self.hidden + 4 * self.intermediate + 3 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int, tp_size: int) -> int:
        """K and V of every layer for one token, on one of `tp_size` GPUs."""
        kv_heads_per_gpu = max(1, self.num_kv_heads // tp_size)
        return 2 * self.num_layers * kv_heads_per_gpu * self.head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class MemoryLine:
    """One estimate, in bytes, with its parts for the printout."""

    what: str
    parts: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        return sum(v for _, v in self.parts)


@dataclass(slots=True)
class ModelReport:
    """What `check_models` found: problems stop the run (exit 2), the rest is printed."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    memory: list[MemoryLine] = field(default_factory=list)


def resolve_model_folder(path: str) -> Path | None:
    """The folder a model path names ('tiny' is built into the cache once); None if absent."""
    if path == "tiny":
        from trainer.run.tiny_model import ensure_tiny_model

        return ensure_tiny_model()
    folder = Path(path).expanduser()
    return folder if (folder / "config.json").is_file() else None


def compute_dtype_bytes(cfg: SluiceConfig) -> int:
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if cfg.cluster.device == "cuda" else "float32"
    return DTYPE_BYTES[dtype]


def check_models(cfg: SluiceConfig) -> ModelReport:
    """Every check above for the policy (and the judge when enabled)."""
    report = ModelReport()
    folder = resolve_model_folder(cfg.model.path)
    if folder is None:
        report.notes.append(f"model checks skipped: no config.json in model.path "
                            f"{cfg.model.path!r} on this machine")
    else:
        config = read_config_json(folder)
        try:
            overrides = build_rope_overrides(config, cfg.model.rope_scaling)
            shape = DecoderShape.from_config(config, overrides, "model.path")
        except ValueError as exc:
            report.problems.append(str(exc))
        else:
            _check_policy(cfg, shape, config, report)
    if cfg.reward.judge.enabled:
        _check_judge(cfg, report)
    return report


def _check_policy(cfg: SluiceConfig, shape: DecoderShape, config: Mapping[str, Any],
                  report: ModelReport) -> None:
    ctx = cfg.model.max_context_tokens
    if any(text_config(config).get(k) for k in MOE_KEYS):
        report.notes.append("model.path is a mixture-of-experts model: memory estimates below "
                            "count every expert as dense")
    if ctx > shape.positions:
        hint = ("raise model.rope_scaling.factor" if cfg.model.rope_scaling else
                f"set model.rope_scaling (YaRN: {{rope_type: yarn, factor: "
                f"{_factor_hint(ctx, shape.positions)}, original_max_position_embeddings: "
                f"{shape.positions}}} gives {_factor_hint(ctx, shape.positions) * shape.positions:,} "
                f"positions)")
        report.problems.append(
            f"model.max_context_tokens: {ctx:,} exceeds the {shape.positions:,} positions of "
            f"{cfg.model.path} (max_position_embeddings"
            f"{' with model.rope_scaling' if cfg.model.rope_scaling else ''}); {hint}, or lower "
            f"model.max_context_tokens")
    report.problems += _tp_problems("rollout.tp_size", cfg.rollout.tp_size, shape, cfg.model.path)
    dtype_bytes = compute_dtype_bytes(cfg)
    report.memory.append(estimate_train_rank(cfg, shape, dtype_bytes))
    engine, kv_tokens = estimate_engine_gpu(cfg, shape, dtype_bytes, cfg.rollout.tp_size,
                                            cfg.rollout.kv_cache_memory_bytes)
    report.memory.append(engine)
    report.notes.append(f"rollout engine KV cache: {kv_tokens:,} tokens "
                        f"({kv_tokens / ctx:.1f} sequences of model.max_context_tokens at once; "
                        f"rollout.max_num_seqs={cfg.rollout.max_num_seqs})")
    report.notes.append(model_runner_note())
    if kv_tokens < ctx:
        report.problems.append(
            f"rollout.kv_cache_memory_bytes: an engine's KV cache holds {kv_tokens:,} tokens, "
            f"less than one sequence of model.max_context_tokens={ctx:,} (vLLM refuses to "
            f"start); raise rollout.kv_cache_memory_bytes or rollout.gpu_memory_utilization, "
            f"raise rollout.tp_size, or lower model.max_context_tokens")
    gpu_bytes = cfg.cluster.gpu_memory_gb * 1e9
    train = report.memory[0]
    if cfg.cluster.device == "cuda" and train.total > gpu_bytes:
        report.warnings.append(
            f"a train rank is estimated at {train.total / GIB:.1f} GiB, over the "
            f"{cfg.cluster.gpu_memory_gb:g} GB of cluster.gpu_memory_gb: raise train.num_ranks or "
            f"train.zero_stage, turn on train.gradient_checkpointing, or lower "
            f"train.micro_batch_tokens / train.logprob_chunk_tokens")


def _check_judge(cfg: SluiceConfig, report: ModelReport) -> None:
    j = cfg.reward.judge
    folder = resolve_model_folder(j.model_path)
    if folder is None:
        report.notes.append(f"judge checks skipped: no config.json in reward.judge.model_path "
                            f"{j.model_path!r} on this machine")
        return
    try:
        config = read_config_json(folder)
        overrides = build_rope_overrides(config, j.rope_scaling, "reward.judge.rope_scaling")
        shape = DecoderShape.from_config(config, overrides, "reward.judge.model_path")
    except ValueError as exc:
        report.problems.append(str(exc))
        return
    ctx = j.max_model_len or cfg.model.max_context_tokens
    if ctx > shape.positions:
        source = ("reward.judge.max_model_len" if j.max_model_len
                  else "model.max_context_tokens (reward.judge.max_model_len is null)")
        report.problems.append(
            f"reward.judge.max_model_len: judge engines would start with a context of {ctx:,} "
            f"tokens from {source}, over the {shape.positions:,} positions of "
            f"reward.judge.model_path{' with reward.judge.rope_scaling' if j.rope_scaling else ''}"
            f"; set reward.judge.max_model_len <= {shape.positions:,} (judge prompts past it "
            f"fail as reward errors), or reward.judge.rope_scaling (e.g. {{rope_type: yarn, factor: "
            f"{_factor_hint(ctx, shape.positions)}}}), or choose a judge with a longer context")
    report.problems += _tp_problems("reward.judge.tp_size", j.tp_size, shape, j.model_path)
    line, kv_tokens = estimate_engine_gpu(cfg, shape, compute_dtype_bytes(cfg), j.tp_size,
                                          j.kv_cache_memory_bytes if j.kv_cache_memory_bytes
                                          is not None else cfg.rollout.kv_cache_memory_bytes,
                                          what="judge engine")
    report.memory.append(line)
    report.notes.append(f"judge engine KV cache: {kv_tokens:,} tokens")


def _factor_hint(ctx: int, positions: int) -> int:
    factor = 2
    while factor * positions < ctx:
        factor *= 2
    return factor


def _tp_problems(key: str, tp_size: int, shape: DecoderShape, model: str) -> list[str]:
    out = []
    if shape.num_heads % tp_size:
        out.append(f"{key}: {tp_size} does not divide the {shape.num_heads} attention heads "
                   f"of {model}; choose a divisor of {shape.num_heads}")
    kv = shape.num_kv_heads
    if kv % tp_size and tp_size % kv:
        out.append(f"{key}: {tp_size} neither divides nor is a multiple of the {kv} KV heads "
                   f"of {model} (vLLM shards or replicates KV heads); choose a divisor or "
                   f"multiple of {kv}")
    return out


def estimate_train_rank(cfg: SluiceConfig, shape: DecoderShape, dtype_bytes: int) -> MemoryLine:
    """Peak memory of one train rank on the longest micro-batch (see the module docstring)."""
    t = cfg.train
    ranks, stage, params = t.num_ranks, t.zero_stage, shape.num_params
    weights = params * dtype_bytes / (ranks if stage >= 3 else 1)
    grads = params * dtype_bytes / (ranks if stage >= 2 else 1)
    # fp32 AdamW moments, plus an fp32 master copy when the weights are not fp32.
    optimizer = params * 4 * (2 if dtype_bytes == 4 else 3) / (ranks if stage >= 1 else 1)
    # A trajectory longer than the micro-batch budget gets a micro-batch of its own.
    tokens = max(t.micro_batch_tokens, cfg.model.max_context_tokens)
    layer_working = tokens * shape.activation_values_per_token_layer * dtype_bytes
    if t.gradient_checkpointing:
        activations = shape.num_layers * tokens * shape.hidden * dtype_bytes + layer_working
    else:
        activations = shape.num_layers * layer_working
    chunk = t.logprob_chunk_tokens or tokens
    chunk = min(chunk, tokens)
    logits = chunk * shape.vocab * (4 * LOGIT_COPIES_TRAIN + dtype_bytes)
    parts = [("weights", weights), ("grads", grads), ("optimizer", optimizer),
             (f"activations ({tokens:,} tokens{', checkpointed' if t.gradient_checkpointing else ''})",
              activations),
             (f"logits ({chunk:,}-token chunk)" if t.logprob_chunk_tokens else
              f"logits (all {tokens:,} tokens)", logits)]
    if stage >= 3:
        # ZeRO-3 gathers a layer's full weights for its forward and prefetches the next.
        parts.append(("ZeRO-3 gathered layers", 2 * shape.layer_params * dtype_bytes))
    return MemoryLine(f"train rank (ZeRO-{stage}, {ranks} rank{'s' if ranks > 1 else ''})",
                      tuple(parts))


def estimate_engine_gpu(cfg: SluiceConfig, shape: DecoderShape, dtype_bytes: int, tp_size: int,
                        kv_cache_memory_bytes: int | None, what: str = "rollout engine"
                        ) -> tuple[MemoryLine, int]:
    """(memory of one engine GPU, tokens its KV cache holds). vLLM's kv_cache_memory_bytes is
    per GPU; without it the cache takes gpu_memory_utilization of the GPU minus the weights."""
    weights = shape.num_params * dtype_bytes / tp_size
    per_token = shape.kv_bytes_per_token(dtype_bytes, tp_size)
    if kv_cache_memory_bytes is not None:
        kv = float(kv_cache_memory_bytes)
    else:
        kv = max(0.0, cfg.cluster.gpu_memory_gb * 1e9 * cfg.rollout.gpu_memory_utilization - weights)
    device = "GPU" if cfg.cluster.device == "cuda" else "process"
    line = MemoryLine(f"{what} {device} (tp={tp_size})",
                      (("weights shard", weights), (f"KV cache ({per_token / 1024:.0f} KiB/token)", kv)))
    return line, int(kv // per_token)


def format_model_report(report: ModelReport) -> str:
    """Estimates, notes and warnings; problems are listed with the other start-up problems."""
    lines = ["model checks:"]
    for m in report.memory:
        parts = ", ".join(f"{name} {value / GIB:.1f}" for name, value in m.parts)
        lines.append(f"  {m.what}: {m.total / GIB:.1f} GiB  ({parts})")
    lines += [f"  {n}" for n in report.notes]
    lines += [f"  warning: {w}" for w in report.warnings]
    return "\n".join(lines)
