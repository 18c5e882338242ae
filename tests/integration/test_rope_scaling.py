"""model.rope_scaling against the real libraries: vLLM's own config validation agrees with
trainer.run.model_check on a Qwen3-8B-shaped config.json (65,536 tokens refused as the model
ships, accepted with YaRN x2, 65,537 refused again), and a vLLM engine and the trainer's
transformers model, both given the overrides of rollout.rope, compute the same logprobs on
the tiny model, which differ from the unscaled model's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from model_configs import QWEN3_8B
from test_engine import PROMPT, _hf_logprobs

from rollout.engine import EngineSpec, Sampling, VLLMEngine
from rollout.rope import build_rope_overrides, read_config_json
from trainer.train.backends.policy_model import build_policy_model

YARN_2X = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}


def test_vllm_validation_agrees_with_the_model_check(tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    overrides = build_rope_overrides(QWEN3_8B, YARN_2X)

    def vllm_accepts(max_len: int, hf_overrides: dict) -> bool:
        args = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=max_len,
                          hf_overrides=hf_overrides)
        try:
            args.create_model_config()
            return True
        except Exception as exc:  # pydantic's ValidationError wraps vLLM's ValueError
            assert "max_model_len" in str(exc)
            return False

    assert not vllm_accepts(65536, {})
    assert vllm_accepts(65536, overrides)
    assert not vllm_accepts(65537, overrides)


@pytest.mark.asyncio
async def test_engine_and_trainer_share_the_scaled_positions(tiny_model_path):
    scaling = {"rope_type": "yarn", "factor": 2.0}  # the tiny model's 4,096 positions x 2
    overrides = build_rope_overrides(read_config_json(tiny_model_path), scaling)
    assert overrides["max_position_embeddings"] == 8192
    engine = VLLMEngine(EngineSpec(model_path=str(tiny_model_path), max_model_len=8192,
                                   kv_cache_memory_bytes=64 << 20, enforce_eager=True,
                                   hf_overrides=overrides))
    await engine.start()
    try:
        out = await engine.generate("rope-1", PROMPT, Sampling(max_new_tokens=32, seed=4))
    finally:
        engine.shutdown()
    scaled = build_policy_model(tiny_model_path, torch.float32, torch.device("cpu"),
                                config_overrides=overrides).eval()
    plain = build_policy_model(tiny_model_path, torch.float32, torch.device("cpu")).eval()
    same = np.abs(out.logprobs - _hf_logprobs(scaled, PROMPT, out.token_ids)).mean()
    other = np.abs(out.logprobs - _hf_logprobs(plain, PROMPT, out.token_ids)).mean()
    assert same < 1e-3, same
    assert other > 10 * same, (other, same)  # the scaling is in effect on both sides
