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

Vision-language models (config.json with a `vision_config`: a SigLIP-style ViT, Idefics3's
connector) add, to the dry-run's notes, what one image costs at the processor's largest
size: the ids of its run and its image tokens (measured with the model's own processor),
KV per image token (the text model's: an image token is a context token like any other),
and, for training, the vision encoder's activations per tile and per image token on top
of the text model's per-token activations. Per patch and layer the encoder keeps about
8 x hidden + 2 x intermediate values (two norm inputs and outputs, q/k/v, attention output,
fc1 output and its activation); each image token stands for merge^2 patches (Idefics3's
`scale_factor`). The encoder and connector weights join the train rank's and the engine's
weights (trained, and sharded, like the rest).
"""

from __future__ import annotations

import math
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
class VisionShape:
    """A ViT-style vision encoder (SigLIP, as in Idefics3 and SmolVLM) and the connector that
    maps its merged patch features into the text model's embeddings: what sizes one image's
    compute and memory."""

    num_layers: int
    hidden: int
    intermediate: int
    patch_size: int
    tile_pixels: int  # image_size: the square the encoder reads at once (one tile)
    num_channels: int
    merge: int  # patches per side merged into one image token (Idefics3's scale_factor)
    text_hidden: int  # the connector's output: one text-model embedding per image token

    @classmethod
    def from_config(cls, config: Mapping[str, Any], key: str = "model.path") -> VisionShape | None:
        """None for a text-only config; ValueError naming `key` for a vision_config whose
        layout is not a SigLIP-style ViT (Qwen2-VL's `depth`/`embed_dim`, for one)."""
        vision = config.get("vision_config")
        if not vision:
            return None
        try:
            return cls(num_layers=int(vision["num_hidden_layers"]), hidden=int(vision["hidden_size"]),
                       intermediate=int(vision["intermediate_size"]), patch_size=int(vision["patch_size"]),
                       tile_pixels=int(vision["image_size"]), num_channels=int(vision.get("num_channels", 3)),
                       merge=int(config.get("scale_factor", 1)),
                       text_hidden=int(text_config(config)["hidden_size"]))
        except KeyError as exc:
            raise ValueError(f"{key}: config.json's vision_config lacks {exc.args[0]!r}; image accounts "
                             "read a SigLIP-style encoder (hidden_size, intermediate_size, num_hidden_layers, "
                             "patch_size, image_size)") from None

    @property
    def patches_per_tile(self) -> int:
        return (self.tile_pixels // self.patch_size) ** 2

    @property
    def patches_per_image_token(self) -> int:
        return self.merge ** 2

    @property
    def layer_params(self) -> int:
        """q/k/v/o and the two MLP projections with their biases, two LayerNorms."""
        h, i = self.hidden, self.intermediate
        return 4 * (h * h + h) + 2 * h * i + i + h + 4 * h

    @property
    def patch_embedding_params(self) -> int:
        return self.num_channels * self.patch_size ** 2 * self.hidden + self.hidden

    @property
    def connector_params(self) -> int:
        """Idefics3's connector: one projection of merge^2 patch features to a text embedding."""
        return self.patches_per_image_token * self.hidden * self.text_hidden

    @property
    def num_params(self) -> int:
        """Encoder (patch and position embeddings, layers, final norm) plus connector."""
        return (self.num_layers * self.layer_params + self.patch_embedding_params
                + self.patches_per_tile * self.hidden + 2 * self.hidden + self.connector_params)

    @property
    def flops_per_image_token(self) -> int:
        """2 FLOPs per weight per patch through the patch embedding and the layers (attention
        scores left out, as on the text side), merge^2 patches per image token, then the
        connector once per image token."""
        per_patch = self.num_layers * self.layer_params + self.patch_embedding_params
        return 2 * (self.patches_per_image_token * per_patch + self.connector_params)

    @property
    def activation_values_per_patch_layer(self) -> int:
        return 8 * self.hidden + 2 * self.intermediate


@dataclass(frozen=True, slots=True)
class ImageRun:
    """What the model's processor makes of one image of `edge_pixels` x `edge_pixels`: the
    ids of its run in the context (image tokens and the markup around them), of which
    `num_image_tokens` are filled by the encoder's features, and the tiles it is cut into
    (0 for processors that do not tile)."""

    edge_pixels: int
    num_tokens: int
    num_image_tokens: int
    num_tiles: int


def largest_image_edge(image_processor: Any) -> int:  # Any: a transformers image processor
    """The side of the largest square image the processor keeps at full size (larger ones
    are resized down to it): Idefics3's longest_edge, a max_pixels budget, a fixed size."""
    size = image_processor.size
    size = size if isinstance(size, Mapping) else {k: getattr(size, k, None) for k in
                                                   ("longest_edge", "max_pixels", "height", "width",
                                                    "shortest_edge")}
    if size.get("longest_edge"):
        return int(size["longest_edge"])
    if size.get("max_pixels"):
        return math.isqrt(int(size["max_pixels"]))
    edges = [int(size[k]) for k in ("height", "width", "shortest_edge") if size.get(k)]
    if not edges:
        raise ValueError(f"the image processor's size {dict(size)} names no largest image")
    return max(edges)


def measure_image_run(folder: Path, image_token_id: int) -> ImageRun:
    """Run the model's own processor on one blank square image of the largest size it keeps
    and count the ids it expands the image's placeholder into (loads transformers)."""
    from PIL import Image as PILImage
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    edge = largest_image_edge(processor.image_processor)
    placeholder = getattr(processor, "image_token", None) or "<image>"
    out = processor(text=[placeholder], images=[[PILImage.new("RGB", (edge, edge))]], return_tensors="np")
    ids = out["input_ids"][0].tolist()
    base = len(processor.tokenizer("")["input_ids"])  # special tokens the tokenizer adds to any text
    pixels = out.get("pixel_values")
    tiles = int(pixels.shape[1]) if pixels is not None and pixels.ndim == 5 else 0
    return ImageRun(edge_pixels=edge, num_tokens=len(ids) - base, num_image_tokens=ids.count(image_token_id),
                    num_tiles=tiles)


@dataclass(frozen=True, slots=True)
class ImageMemory:
    """Bytes one image token and one image of the processor's largest size cost: on an
    engine GPU (KV, the text model's per token) and on a train rank (activations)."""

    kv_bytes_per_token: int  # engine GPU, any context token, image or text
    kv_bytes_per_image: int  # the image's whole run
    encoder_output_bytes_per_image: int  # the features vLLM keeps until the run is prefilled
    text_activation_bytes_per_token: int  # train rank: an image token passes the text model too
    vision_activation_bytes_per_tile: int
    vision_activation_bytes_per_image_token: int

    @property
    def train_bytes_per_image_token(self) -> int:
        return self.text_activation_bytes_per_token + self.vision_activation_bytes_per_image_token


def estimate_image_memory(cfg: SluiceConfig, shape: DecoderShape, vision: VisionShape, run: ImageRun,
                          dtype_bytes: int) -> ImageMemory:
    """Per image token and per image (see the module docstring for the per-value counts).
    With activation checkpointing each layer keeps only its input, plus one layer's working
    set during its recompute, on both the text and the vision side."""
    if cfg.train.gradient_checkpointing:
        text = shape.num_layers * shape.hidden + shape.activation_values_per_token_layer
        patch = vision.num_layers * vision.hidden + vision.activation_values_per_patch_layer
    else:
        text = shape.num_layers * shape.activation_values_per_token_layer
        patch = vision.num_layers * vision.activation_values_per_patch_layer
    kv = shape.kv_bytes_per_token(dtype_bytes, cfg.rollout.tp_size)
    return ImageMemory(kv_bytes_per_token=kv, kv_bytes_per_image=run.num_tokens * kv,
                       encoder_output_bytes_per_image=run.num_image_tokens * vision.text_hidden * dtype_bytes,
                       text_activation_bytes_per_token=text * dtype_bytes,
                       vision_activation_bytes_per_tile=vision.patches_per_tile * patch * dtype_bytes,
                       vision_activation_bytes_per_image_token=vision.patches_per_image_token * patch * dtype_bytes)


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
    """The folder a model path names (a local test model is built into the cache once);
    None if absent."""
    from trainer.run.local_models import local_model_folder

    if (local := local_model_folder(path)) is not None:
        return local
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
            try:
                vision = VisionShape.from_config(config)
            except ValueError as exc:  # a layout the accounts do not read: no account, no problem
                vision = None
                report.notes.append(f"image accounts skipped: {exc}")
            _check_policy(cfg, shape, config, report, vision)
            if vision is not None:
                report.notes += image_notes(cfg, shape, vision, config, folder)
    if cfg.reward.judge.enabled:
        _check_judge(cfg, report)
    return report


def _check_policy(cfg: SluiceConfig, shape: DecoderShape, config: Mapping[str, Any],
                  report: ModelReport, vision: VisionShape | None = None) -> None:
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
    report.memory.append(estimate_train_rank(cfg, shape, dtype_bytes, vision))
    engine, kv_tokens = estimate_engine_gpu(cfg, shape, dtype_bytes, cfg.rollout.tp_size,
                                            cfg.rollout.kv_cache_memory_bytes, vision=vision)
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


def compute_param_state_bytes(params: int, dtype_bytes: int, ranks: int, stage: int
                              ) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes of `params` trained parameters on one ZeRO rank:
    fp32 AdamW moments, plus an fp32 master copy when the weights are not fp32."""
    weights = params * dtype_bytes / (ranks if stage >= 3 else 1)
    grads = params * dtype_bytes / (ranks if stage >= 2 else 1)
    optimizer = params * 4 * (2 if dtype_bytes == 4 else 3) / (ranks if stage >= 1 else 1)
    return weights, grads, optimizer


def estimate_train_rank(cfg: SluiceConfig, shape: DecoderShape, dtype_bytes: int,
                        vision: VisionShape | None = None) -> MemoryLine:
    """Peak memory of one train rank on the longest micro-batch (see the module docstring);
    a vision encoder and its connector are trained and sharded like the text model."""
    t = cfg.train
    ranks, stage = t.num_ranks, t.zero_stage
    weights, grads, optimizer = compute_param_state_bytes(shape.num_params, dtype_bytes, ranks, stage)
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
    if vision is not None:
        parts.append(("vision encoder (weights, grads, optimizer)",
                      sum(compute_param_state_bytes(vision.num_params, dtype_bytes, ranks, stage))))
    if stage >= 3:
        # ZeRO-3 gathers a layer's full weights for its forward and prefetches the next.
        parts.append(("ZeRO-3 gathered layers", 2 * shape.layer_params * dtype_bytes))
    return MemoryLine(f"train rank (ZeRO-{stage}, {ranks} rank{'s' if ranks > 1 else ''})",
                      tuple(parts))


def estimate_engine_gpu(cfg: SluiceConfig, shape: DecoderShape, dtype_bytes: int, tp_size: int,
                        kv_cache_memory_bytes: int | None, what: str = "rollout engine",
                        vision: VisionShape | None = None) -> tuple[MemoryLine, int]:
    """(memory of one engine GPU, tokens its KV cache holds). vLLM's kv_cache_memory_bytes is
    per GPU; without it the cache takes gpu_memory_utilization of the GPU minus the weights
    (a vision encoder's included: vLLM shards it over the TP ranks too)."""
    weights = shape.num_params * dtype_bytes / tp_size
    vision_weights = vision.num_params * dtype_bytes / tp_size if vision is not None else 0.0
    per_token = shape.kv_bytes_per_token(dtype_bytes, tp_size)
    if kv_cache_memory_bytes is not None:
        kv = float(kv_cache_memory_bytes)
    else:
        kv = max(0.0, cfg.cluster.gpu_memory_gb * 1e9 * cfg.rollout.gpu_memory_utilization
                 - weights - vision_weights)
    device = "GPU" if cfg.cluster.device == "cuda" else "process"
    parts: list[tuple[str, float]] = [("weights shard", weights)]
    if vision is not None:
        parts.append(("vision encoder shard", vision_weights))
    parts.append((f"KV cache ({per_token / 1024:.0f} KiB/token)", kv))
    return MemoryLine(f"{what} {device} (tp={tp_size})", tuple(parts)), int(kv // per_token)


def image_notes(cfg: SluiceConfig, shape: DecoderShape, vision: VisionShape, config: Mapping[str, Any],
                folder: Path) -> list[str]:
    """The dry-run's lines on what images cost: the vision encoder, one image of the
    processor's largest size, per image token; and the planner's keys that match."""
    dtype_bytes = compute_dtype_bytes(cfg)
    flops = vision.flops_per_image_token
    lines = [f"vision encoder + connector: {vision.num_params:,} parameters, {_flops(flops)} per "
             f"image token ({flops / (2 * shape.num_params):.2f} x a text token's prefill, "
             f"{vision.patches_per_image_token} patches per image token)"]
    token_id = config.get("image_token_id")
    if token_id is None:
        return [*lines, "tokens per image unknown: config.json has no image_token_id"]
    try:
        run = measure_image_run(folder, int(token_id))
    except (OSError, ValueError, ImportError) as exc:  # no processor files, or one this install cannot load
        return [*lines, f"tokens per image unknown: the processor of model.path could not be run ({exc})"]
    m = estimate_image_memory(cfg, shape, vision, run, dtype_bytes)
    tiles = f", {run.num_tiles} tiles of {vision.tile_pixels} px" if run.num_tiles else ""
    factor = flops * run.num_image_tokens / (2 * shape.num_params * run.num_tokens)
    return [*lines,
            f"an image of {run.edge_pixels} x {run.edge_pixels} px (the processor's largest): {run.num_tokens} "
            f"ids in the context, {run.num_image_tokens} of them image tokens{tiles}",
            f"per image token: KV {_bytes(m.kv_bytes_per_token)} on an engine GPU (the text model's, as any "
            f"token); training activations {_bytes(m.train_bytes_per_image_token)} "
            f"({_bytes(m.text_activation_bytes_per_token)} text model + "
            f"{_bytes(m.vision_activation_bytes_per_image_token)} vision encoder)",
            f"per image: KV {_bytes(m.kv_bytes_per_image)} and encoder output "
            f"{_bytes(m.encoder_output_bytes_per_image)} on an engine GPU; vision encoder activations "
            f"{_bytes(m.vision_activation_bytes_per_tile)} per tile, "
            f"{_bytes(m.vision_activation_bytes_per_image_token * run.num_image_tokens)} per image",
            f"launch.plan for such images: plan.tokens_per_image={run.num_tokens} "
            f"plan.vision_prefill_factor={factor:.3g}"]


def _flops(n: float) -> str:
    for unit, scale in (("TFLOPs", 1e12), ("GFLOPs", 1e9), ("MFLOPs", 1e6), ("kFLOPs", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} FLOPs"


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def format_model_report(report: ModelReport) -> str:
    """Estimates, notes and warnings; problems are listed with the other start-up problems."""
    lines = ["model checks:"]
    for m in report.memory:
        parts = ", ".join(f"{name} {value / GIB:.1f}" for name, value in m.parts)
        lines.append(f"  {m.what}: {m.total / GIB:.1f} GiB  ({parts})")
    lines += [f"  {n}" for n in report.notes]
    lines += [f"  warning: {w}" for w in report.warnings]
    return "\n".join(lines)
