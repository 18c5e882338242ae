"""The simulator's KV events (launch.sim.engine_client.SimKvEvents): a simulated engine
publishes the block keys a residency router computes from the prompt ids, removes them as
the engine model evicts, forgets them at a new salt; and over an oversubscribed pool,
routing by residency hits the prefix cache more than sticky routing, in the simulator too."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from launch.plan import load_recipe_and_profile
from launch.sim.engine_client import SimEngine, SimWorld, content_ids
from launch.sim.engine_model import EngineModel, EngineSpec, SimRequest
from launch.simulate import SimOptions, run_simulation
from rollout.engine import Sampling
from rollout.kv_residency import ResidencyView, block_keys

pytest.importorskip("looptime")

# 16-token blocks, 1,000 bytes of KV per token: a 64-block pool (1,024 tokens).
SPEC = EngineSpec(params_b=1.0, dtype_bytes=2, kv_bytes_per_token=1000, kv_pool_bytes=64 * 16 * 1000,
                  hbm_bytes_per_s=1e12, gpu_flops=1e15, mfu_prefill=0.5, block_tokens=16)


def _engine(token_unit: int = 1) -> tuple[SimEngine, SimWorld]:
    world = SimWorld(token_unit)
    return SimEngine(EngineModel(SPEC, record_blocks=True), world, kv_events=True), world


async def _call(engine: SimEngine, world: SimWorld, rid: str, session: str, prompt: np.ndarray,
                new_tokens: int, task: str | None = None, shared_tokens: int = 0) -> np.ndarray:
    unit = world.token_unit
    world.register(SimRequest(rid, session, len(prompt) * unit, new_tokens, shared_key=task,
                              shared_tokens=shared_tokens))
    out = await engine.generate(f"{rid}.0", prompt, Sampling(max_new_tokens=new_tokens))
    return np.concatenate([prompt, out.token_ids])


def _held(view: ResidencyView, ids: np.ndarray, size: int, salt: str) -> int:
    return view.held_blocks("e", block_keys(ids, size, salt))


def test_a_finished_request_publishes_the_keys_a_router_computes_from_its_ids():
    async def main() -> None:
        engine, world = _engine()
        prompt = content_ids("task-a", 100)
        context = await _call(engine, world, "t0", "s0", prompt, 40)
        view = ResidencyView()
        delta = await engine.kv_residency(0)
        view.apply("e", delta)
        assert delta.block_size == 16 and delta.salt == "sim-v0" and not delta.lost
        # prompt + output: 140 tokens, 8 full blocks, all held, in the router's key space
        assert _held(view, context, 16, delta.salt) == 140 // 16 == len(delta.stored)
        assert _held(view, content_ids("task-b", 100), 16, delta.salt) == 0
        again = await engine.kv_residency(delta.seq)
        assert again.stored == again.removed == () and again.seq == delta.seq

    asyncio.run(main())


def test_eviction_removes_the_tail_first_and_a_new_salt_forgets_the_rest():
    async def main() -> None:
        engine, world = _engine()
        first = await _call(engine, world, "a0", "a", content_ids("a", 480), 32)  # 32 blocks
        view = ResidencyView()
        view.apply("e", await engine.kv_residency(0))
        assert _held(view, first, 16, "sim-v0") == 32
        # 48 blocks more: 16 of a's must go, its tail first
        await _call(engine, world, "b0", "b", content_ids("b", 752), 16)
        delta = await engine.kv_residency(view.seq("e"))
        view.apply("e", delta)
        assert len(delta.removed) == 16
        assert _held(view, first, 16, "sim-v0") == 16  # the head of a's prefix is still there
        await engine.update_weights(1)  # recompute: a new cache salt
        delta = await engine.kv_residency(view.seq("e"))
        view.apply("e", delta)
        assert delta.salt == "sim-v1" and view.num_blocks() == 0
        # the next turn of a misses (new salt) and is cached under the new salt
        second = await _call(engine, world, "a1", "a", first, 16)
        view.apply("e", await engine.kv_residency(view.seq("e")))
        assert _held(view, second, 16, "sim-v1") == len(second) // 16

    asyncio.run(main())


def test_blocks_the_pool_evicted_stay_held_where_the_tier_has_them():
    """With an offload tier the engine publishes the tier's blocks too: what the pool
    evicts is still held (the tier serves it), until the tier evicts it as well."""
    async def main() -> None:
        tiered = EngineSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__slots__},
                               "tier_bytes": 80 * 16 * 1000})  # 80 blocks
        world = SimWorld(1)
        engine = SimEngine(EngineModel(tiered, record_blocks=True), world, kv_events=True)
        first = await _call(engine, world, "a0", "a", content_ids("a", 480), 32)  # 32 blocks
        await _call(engine, world, "b0", "b", content_ids("b", 752), 16)  # evicts 16 of a's
        view = ResidencyView()
        view.apply("e", await engine.kv_residency(0))
        assert _held(view, first, 16, "sim-v0") == 32  # the tier has all of a
        await _call(engine, world, "c0", "c", content_ids("c", 752), 16)  # the tier evicts a
        view.apply("e", await engine.kv_residency(view.seq("e")))
        assert _held(view, first, 16, "sim-v0") == 0

    asyncio.run(main())


def test_with_ids_of_many_tokens_a_key_covers_several_blocks():
    async def main() -> None:
        engine, world = _engine(token_unit=100)  # one id stands for 100 tokens: 6.25 blocks
        context = await _call(engine, world, "t0", "s0", content_ids("t", 5), 100)
        delta = await engine.kv_residency(0)
        assert delta.block_size == 1
        view = ResidencyView()
        view.apply("e", delta)
        # 600 tokens: 37 full blocks, which cover 5 ids (500 tokens) whole
        assert _held(view, context, 1, delta.salt) == 5

    asyncio.run(main())


def test_a_group_shares_its_task_prompt_keys():
    async def main() -> None:
        engine, world = _engine()
        prompt = content_ids("task", 64)
        await _call(engine, world, "g/0#0", "g/0", prompt, 16, task="task", shared_tokens=64)
        view = ResidencyView()
        view.apply("e", await engine.kv_residency(0))
        sibling = np.concatenate([prompt, content_ids("g/1#0 output", 40)])
        assert _held(view, sibling, 16, "sim-v0") == 4  # the shared prompt's 4 blocks

    asyncio.run(main())


# A small oversubscribed SWE-like workload: 2 engines whose pools hold a fraction of the
# trajectories in flight.
SMALL = ["plan.model_params_b=8", "plan.kv_bytes_per_token=131072", "plan.prompt_tokens=2000",
         "rollout.num_engines=2", "rollout.tp_size=1", "plan.train_gpus=4",
         "train.groups_per_step=8", "train.group_size=4", "envs.num_sandbox_workers=1",
         "envs.sandboxes_per_worker=128", "plan.turns=5", "rollout.num_agent_workers=1",
         "eval.tasks=null", "plan.kv_pool_gb_per_gpu=12", "train.num_steps=1"]


def test_residency_routing_over_simulated_engines_hits_more_than_sticky():
    rates = {}
    for routing in ("sticky", "residency"):
        cfg, profile = load_recipe_and_profile("swe_grpo.yaml", [*SMALL, f"rollout.routing={routing}"], None)
        report, trace = run_simulation(cfg, profile, SimOptions(tail="none", seed=1))
        assert report.turns == len(trace) > 0
        rates[routing] = (sum(e["cached_tokens"] for e in trace)
                          / sum(e["context_tokens"] for e in trace))
    assert rates["residency"] > 1.2 * rates["sticky"] > 0, rates
