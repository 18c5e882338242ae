"""RoPE scaling of the recipe (`model.rope_scaling`) as model-config overrides: one
definition for the vLLM engines (their `hf_overrides`) and the trainer's Hugging Face model
config, so that both compute the same positions.

    model:
      max_context_tokens: 65536
      rope_scaling: {rope_type: yarn, factor: 2.0, original_max_position_embeddings: 32768}

becomes `{"rope_parameters": {<the model's rope_theta...>, "rope_type": "yarn", "factor":
2.0, "original_max_position_embeddings": 32768}, "max_position_embeddings": 65536}`. The
model's own RoPE keys (rope_theta, partial_rotary_factor) are kept: overrides replace the
whole `rope_parameters` entry. For YaRN, transformers and vLLM read
`max_position_embeddings` as the extended length and `original_max_position_embeddings` as
the pre-training one; for linear and dynamic NTK scaling, positions are
`max_position_embeddings x factor` and `max_position_embeddings` is left alone.
Imports nothing heavy: config.json is read as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# RoPE types whose `max_position_embeddings` holds the extended length (factor already
# applied) versus those where the factor multiplies it (both libraries agree on these).
EXTENDED_LENGTH_TYPES = ("yarn",)
SCALED_LENGTH_TYPES = ("linear", "dynamic")
SUPPORTED_TYPES = EXTENDED_LENGTH_TYPES + SCALED_LENGTH_TYPES
KEPT_MODEL_KEYS = ("rope_theta", "partial_rotary_factor")
NUMERIC_KEYS = ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim")


def read_config_json(model_path: str | Path) -> dict[str, Any]:
    """A model folder's config.json as data; ValueError naming model.path if absent."""
    path = Path(model_path).expanduser() / "config.json"
    if not path.is_file():
        raise ValueError(f"model.path: {str(model_path)!r} has no config.json; give a Hugging "
                         f"Face model folder")
    return json.loads(path.read_text())


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (multimodal configs nest it)."""
    return config.get("text_config") or config


def model_rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The model's RoPE parameters in transformers 5 form, from either config.json layout
    (`rope_parameters`, or the older top-level `rope_theta` + `rope_scaling`)."""
    text = text_config(config)
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    for key in KEPT_MODEL_KEYS:
        if key in text and key not in params:
            params[key] = text[key]
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    return params


def build_rope_overrides(config: Mapping[str, Any], rope_scaling: Mapping[str, float | str],
                         key: str = "model.rope_scaling") -> dict[str, Any]:
    """Config overrides that apply `rope_scaling` (the recipe's `key`: model.rope_scaling,
    or reward.judge.rope_scaling for the judge) to the model described by `config` (its
    config.json); {} when rope_scaling is empty."""
    if not rope_scaling:
        return {}
    scaling = dict(rope_scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    if rope_type not in SUPPORTED_TYPES:
        raise ValueError(f"{key}.rope_type must be one of {SUPPORTED_TYPES}, got "
                         f"{rope_type!r}")
    for name, value in scaling.items():
        if name in NUMERIC_KEYS and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{key}.{name} must be a number, got {value!r}")
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 1:
        raise ValueError(f"{key}.factor must be a number > 1 (how many times the "
                         f"model's positions are stretched), got {factor!r}")
    text = text_config(config)
    if "max_position_embeddings" not in text:
        raise ValueError(f"{key}: the model's config.json has no "
                         "max_position_embeddings to scale")
    base = {k: v for k, v in model_rope_parameters(config).items() if k in KEPT_MODEL_KEYS}
    params: dict[str, Any] = {**base, "rope_type": rope_type, **scaling}
    overrides: dict[str, Any] = {"rope_parameters": params}
    if rope_type in EXTENDED_LENGTH_TYPES:
        original = int(params.setdefault("original_max_position_embeddings",
                                         text["max_position_embeddings"]))
        overrides["max_position_embeddings"] = int(original * factor)
    return overrides


def count_positions(config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> int:
    """Longest sequence the model supports: its max_position_embeddings, scaled by the RoPE
    factor where the type multiplies it, after `overrides` (build_rope_overrides)."""
    text = {**text_config(config), **(overrides or {})}
    if "max_position_embeddings" not in text:
        raise ValueError("model.path: the model's config.json has no max_position_embeddings")
    positions = int(text["max_position_embeddings"])
    params = (dict(overrides["rope_parameters"]) if overrides and "rope_parameters" in overrides
              else model_rope_parameters(config))
    if params.get("rope_type") in SCALED_LENGTH_TYPES and params.get("factor"):
        positions = int(positions * float(params["factor"]))
    return positions


def apply_config_overrides(hf_config: Any, overrides: Mapping[str, Any]) -> None:
    """Set `overrides` on a transformers config object (as vLLM's hf_overrides does)."""
    for key, value in overrides.items():
        setattr(hf_config, key, dict(value) if isinstance(value, Mapping) else value)
