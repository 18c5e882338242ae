"""Loading the trainable policy from a Hugging Face folder, and reading its weights back
under Hugging Face names, for the training backends.

A folder whose config has a `vision_config` is a vision-language model (Idefics3 /
SmolVLM): it loads with AutoModelForImageTextToText, its text model gets the packed
attention and its vision tower plain sdpa. Its weight names are the checkpoint's own
(`model.vision_model.*`, `model.connector.*`, `model.text_model.*`, `lm_head.*`), the names
vLLM's Idefics3 loads, so the push needs no renaming."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from trainer.train.backends.logprobs import MASKED_ATTENTION, PACKED_SDPA, register_packed_sdpa
from trainer.train.backends.vision import is_vision_language

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Config fields some architectures read as dropout probabilities (Qwen2 has the first).
DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
                  "attn_pdrop", "dropout")


def resolve_device(device: str | None) -> torch.device:
    """`cuda` / `cpu`, or None: cuda when available (the rank's LOCAL_RANK GPU), else cpu."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (cluster.device), got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no GPU; set cluster.device=cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """model.dtype: auto is bfloat16 on cuda and float32 on cpu (bf16 matmuls are slow there)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def choose_attention(device: torch.device) -> str:
    """flash_attention_2 (varlen kernel) where it can run, else the per-sequence sdpa
    fallback (see trainer.train.backends.logprobs)."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return PACKED_SDPA


def zero_dropout(config: Any) -> None:  # Any: a transformers PretrainedConfig
    """Set every dropout probability of `config` and of its sub-configs (a vision-language
    model's text and vision configs) to 0."""
    for name in DROPOUT_FIELDS:
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            zero_dropout(sub)


def attention_per_sub_model(config: Any, attn: str) -> str | dict[str, str]:
    """`attn_implementation` for from_pretrained: `attn` for a text model; for a
    vision-language model a dict per sub-config (transformers' form): `attn` for the
    top level and the text model, sdpa for the others. The vision tower attends
    bidirectionally over a batch of tiles under a padding mask; the packed per-sequence
    attention (causal, one row) and flash-attn's varlen kwargs are the text model's only."""
    if not is_vision_language(config):
        return attn
    tower = attn if attn in MASKED_ATTENTION else "sdpa"
    return {"": attn, **{key: attn if key == "text_config" else tower for key in config.sub_configs}}


def build_policy_model(model_path: str | Path, dtype: torch.dtype, device: torch.device,
                       gradient_checkpointing: bool = False,
                       attn_implementation: str | None = None,
                       config_overrides: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """The causal LM (or vision-language model) with dropout off, KV cache off and optional
    activation checkpointing.

    `config_overrides` are set on the model config before the weights load: the recipe's
    RoPE scaling (`rollout.rope.build_rope_overrides`), the same the engines get.

    Dropout is zeroed because the PPO ratio compares two forwards of the same weights (the
    proximal and the current pass); random masks would make it noisy even on-policy.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if not Path(model_path).is_dir():
        raise ValueError(f"model.path {str(model_path)!r} is not a folder; give a Hugging Face "
                         f"model folder or 'tiny'")
    config = AutoConfig.from_pretrained(model_path)
    if config_overrides:
        from rollout.rope import apply_config_overrides

        apply_config_overrides(config, config_overrides)
    zero_dropout(config)
    config.use_cache = False
    config.get_text_config().use_cache = False
    attn = attn_implementation or choose_attention(device)
    if attn == PACKED_SDPA:
        register_packed_sdpa()
    # AutoModelForCausalLM does not map vision-language configs (Idefics3Config).
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    model = auto.from_pretrained(model_path, config=config, dtype=dtype,
                                 attn_implementation=attention_per_sub_model(config, attn))
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if gradient_checkpointing:
        # Non-reentrant checkpointing works with ZeRO-3's parameter hooks and no_grad inputs.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    logger.info("loaded %s: %d parameters, %s, attention %s", model_path,
                sum(p.numel() for p in model.parameters()), dtype, attn)
    return model.to(device)


def iter_persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers that `state_dict()` saves (rotary `inv_freq` and the like are not saved)."""
    for prefix, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def weight_specs(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, full shape, dtype name, element size) of every `iter_weight_names` entry, in
    its order, without copying or gathering (a ZeRO-3 shard knows its full shape)."""
    return [(name, tuple(getattr(t, "ds_shape", t.shape)), str(t.dtype).removeprefix("torch."),
             t.element_size()) for name, t in iter_weight_names(module)]


def iter_weight_names(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every state_dict entry of a Hugging Face model as (name, tensor), tied weights under
    each of their names, parameters first."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from iter_persistent_buffers(module)
