"""Residency routing's parts (rollout.kv_residency, rollout.router with a view): block
keys of a prompt equal the keys its engine's stored-block events translate to, the event
log and the view follow stores, removals, clears, salts and lost batches, and the router
sends a turn where its prefix is held unless the load there outweighs it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rollout.engine import EngineSpec, EngineStats, Sampling, TokenOutput
from rollout.kv_residency import KvEventLog, KvResidencyDelta, ResidencyView, block_keys
from rollout.router import Router

BS = 4


def stored(parent, hashes, tokens, salt=None):
    extra = [(salt,) if salt and parent is None and i == 0 else None for i in range(len(hashes))]
    return ("stored", parent, hashes, tokens, BS, extra)


def test_block_keys_chain_full_blocks_and_extend_from_known_ones():
    ids = list(range(10))
    keys = block_keys(ids, BS, None)
    assert len(keys) == 2 and len(set(keys)) == 2  # the last 2 tokens are no block
    assert block_keys(ids[:8], BS, None) == keys
    assert block_keys(ids + [1, 2], BS, None, known=keys)[:2] == keys
    assert block_keys(np.asarray(ids + [1, 2]), BS, None) == block_keys(ids + [1, 2], BS, None)
    # a block's key depends on every block before it, and the salt on the first
    assert block_keys([9, 9, 9, 9] + ids[4:8], BS, None)[1] != keys[1]
    salted = block_keys(ids, BS, "sluice-v1")
    assert salted[0] != keys[0] and salted[1] != keys[1]
    with pytest.raises(ValueError):
        block_keys(ids, 0, None)


def test_the_log_keys_stored_blocks_as_a_router_keys_the_prompt():
    log = KvEventLog()
    ids = list(range(100, 112))
    # vLLM's own hashes are opaque: two events, the second chained to the first's last block
    log.add_batch([stored(None, [11, 12], ids[:8], "sluice-v0")])
    log.add_batch([stored(12, [13], ids[8:12])])
    delta = log.since(0, None)
    assert delta.stored == tuple(block_keys(ids, BS, "sluice-v0"))
    assert delta.seq == 2 and delta.block_size == BS and not delta.lost and not delta.cleared
    assert log.since(1, None).stored == delta.stored[2:]  # only what came after batch 1

    log.add_batch([("removed", [13, 99])])  # 99: never stored (or forgotten): ignored
    assert log.since(2, None).removed == delta.stored[2:]
    log.add_batch([stored(77, [14], ids[:4])])  # its parent was never seen: cannot be keyed
    assert log.since(3, None).stored == () and log.num_unchained == 1
    log.add_batch([stored(None, [21], ids[:4]), ("cleared",), stored(None, [22], ids[4:8])])
    after_clear = log.since(2, None)
    assert after_clear.cleared and after_clear.stored == tuple(block_keys(ids[4:8], BS, None))
    assert after_clear.removed == ()  # what came before the clear no longer matters


def test_a_delta_is_the_net_effect_of_its_batches_in_order():
    """A block stored and then evicted between two reads is gone, one evicted and stored
    again is held: a reader that applied stores and removals as two lists would keep the
    first (a view that grows past the pool) or drop the second."""
    log = KvEventLog()
    ids = list(range(200, 208))
    log.add_batch([stored(None, [1, 2], ids, "s")])
    a, b = block_keys(ids, BS, "s")
    log.add_batch([("removed", [2])])
    log.add_batch([("removed", [1]), stored(None, [3], ids[:4], "s")])  # a again, as block 3
    delta = log.since(0, None)
    assert delta.stored == (a,) and delta.removed == (b,)
    log.add_keys(stored=[], removed=[a])  # keys straight from an engine that is not vLLM
    assert log.since(0, None).stored == () and set(log.since(0, None).removed) == {a, b}
    assert log.since(3, None).removed == (a,)


def test_a_key_is_held_while_the_pool_or_the_tier_holds_it():
    """An engine with an offload tier publishes the tier's stores and removals under their
    medium, with the pool's block hashes (vLLM's self_describing_kv_events) but no cache
    salt; a block evicted from the pool is still held where the tier has it, a tier
    announces a block once per chunk (so removals count), a pool reset leaves the tier's
    blocks, and a tier event without token ids (no self-describing events) is skipped."""
    log = KvEventLog()
    ids = list(range(300, 312))
    a, b, c = block_keys(ids, BS, "v3")
    log.add_batch([stored(None, [1, 2, 3], ids, "v3")])
    # the tier's copy of blocks 1-2, twice (two chunks overlapping), and of block 3
    tier = ("stored", None, [1, 2], ids[:8], BS, None, "CPU")
    log.add_batch([tier, tier, ("stored", 2, [3], ids[8:], BS, None, "CPU")])
    assert log.since(1, None).stored == ()  # held already, and keyed with the pool's salt
    log.add_batch([("removed", [1, 2, 3], "GPU")])  # the pool evicts them all
    assert log.since(1, None).removed == ()
    log.add_batch([("removed", [3], "CPU")])
    assert log.since(1, None).removed == (c,)
    log.add_batch([("removed", [1, 2], "CPU")])  # one of the two chunks' copies
    assert log.since(1, None).removed == (c,)
    log.add_batch([("stored", None, [9], [], 0, None, "CPU")])  # a placeholder: no token ids
    assert log.num_undescribed == 1 and log.since(1, None).stored == ()
    log.add_batch([stored(None, [5], [7] * BS)])  # in the pool only
    log.add_batch([("cleared",)])  # a pool reset: the tier still has a and b
    delta = log.since(5, None)
    assert not delta.cleared and delta.removed == tuple(block_keys([7] * BS, BS, None))
    log.add_batch([("removed", [1, 2], "CPU")])
    assert set(log.since(1, None).removed) == {a, b, c, *delta.removed}
    log.add_batch([("cleared",)])  # nothing of a tier left: a plain clear
    assert log.since(8, None).cleared


def test_the_log_says_when_a_reader_missed_batches():
    log = KvEventLog(max_batches=2)
    for i in range(4):
        log.add_batch([stored(None, [i], [i] * BS)])
    assert log.since(0, None).lost and not log.since(2, None).lost and log.since(4, None).stored == ()
    log.add_batch([], gap=True)  # vLLM's publisher dropped a batch before this one
    assert log.since(4, None).lost


def test_the_view_follows_deltas_and_forgets_blocks_of_an_older_salt():
    view = ResidencyView(max_blocks=3)
    keys = block_keys(list(range(16)), BS, "v0")
    assert not view.knows("e") and view.held_blocks("e", keys) == 0
    view.apply("e", KvResidencyDelta(1, BS, "v0", tuple(keys[:3]), (), False, False))
    assert view.knows("e") and view.seq("e") == 1 and view.held_blocks("e", keys) == 3
    view.apply("e", KvResidencyDelta(2, BS, "v0", (), (keys[1],), False, True))
    assert view.held_blocks("e", keys) == 1 and view.num_lost == 1  # a prefix: stops at the gap
    view.add("e", keys)  # bounded: the oldest are forgotten
    assert view.num_blocks() == 3 and view.held_blocks("e", keys) == 0
    view.apply("e", KvResidencyDelta(3, BS, "v1", (), (), False, False))  # a push (recompute)
    assert view.num_blocks() == 0 and view.salt("e") == "v1"
    view.drop("e")
    assert not view.knows("e")


class FakeEngine:
    """Records the prompts it is sent; reports a fixed load and a KV delta it is given."""

    def __init__(self, load: int = 0) -> None:
        self.load = load
        self.prompts: list[list[int]] = []
        self.delta = KvResidencyDelta(1, BS, None, (), (), False, False)

    async def generate(self, request_id, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        await asyncio.sleep(0)
        return TokenOutput(np.asarray([7] * 4, np.int32), np.zeros(4, np.float32),
                           np.zeros(4, np.int32), "stop", len(prompt_ids), 0)

    async def get_stats(self):
        return EngineStats(0, 0, self.load, 0, 0.0, 0, 0, False)

    async def kv_residency(self, since):
        return self.delta


async def routed(router: Router, session: str, ids: list[int]) -> str:
    return (await router.generate(session, "r", ids, Sampling(max_new_tokens=4))).engine


async def test_a_turn_goes_where_its_prefix_is_held_unless_the_load_there_outweighs_it():
    a, b = FakeEngine(), FakeEngine()
    view = ResidencyView()
    router = Router({"a": a, "b": b}, load_poll_s=60, residency=view, load_penalty_tokens=2)
    prompt = list(range(100, 116))  # 4 blocks
    b.delta = KvResidencyDelta(1, BS, None, tuple(block_keys(prompt, BS, None)), (), False, False)
    await router.refresh_load()
    assert await routed(router, "s1", prompt + [1, 2]) == "b"  # 16 tokens held there
    b.load = 20  # 20 requests more: 40 tokens of penalty > 16 held
    await router.refresh_load()
    assert await routed(router, "s1", prompt + [1, 2, 3]) == "a"
    stats = router.stats()
    assert stats.num_routed == 2 and stats.view_held_tokens == 16 and stats.num_residency_moves == 1


async def test_no_cache_outweighs_the_imbalance_bound():
    """Without a load penalty a turn follows its prefix, but never onto an engine running
    max_imbalance requests more than the least loaded one (the bound sticky routing keeps)."""
    a, b = FakeEngine(), FakeEngine()
    router = Router({"a": a, "b": b}, load_poll_s=60, max_imbalance=8, residency=ResidencyView(),
                    load_penalty_tokens=0)
    prompt = list(range(100, 116))
    b.delta = KvResidencyDelta(1, BS, None, tuple(block_keys(prompt, BS, None)), (), False, False)
    b.load = 8
    await router.refresh_load()
    assert await routed(router, "s1", prompt + [1]) == "b"  # at the bound: still the cache
    b.load = 9
    await router.refresh_load()
    assert await routed(router, "s1", prompt + [1, 2]) == "a"  # past it


async def test_a_groups_samples_follow_their_shared_prompt_before_any_event():
    a, b = FakeEngine(), FakeEngine()
    router = Router({"a": a, "b": b}, load_poll_s=60, residency=ResidencyView(), load_penalty_tokens=2)
    await router.refresh_load()  # block sizes known, nothing held
    prompt = list(range(200, 220))  # 5 blocks
    first = await routed(router, "g0/0", prompt)  # no block anywhere: the sticky rule
    assert [await routed(router, f"g0/{i}", prompt) for i in range(1, 4)] == [first] * 3
    # its own next turn extends prompt + output: held there too
    assert await routed(router, "g0/0", prompt + [7] * 4 + [5, 6]) == first
    short = [1, 2, 3]  # under one block: nothing to be held, sticky as before
    assert await routed(router, "x", short) in ("a", "b")
    router.release("g0/0")
    assert "g0/0" not in router._keys


async def test_a_failed_engine_leaves_the_view():
    a, b = FakeEngine(), FakeEngine()
    view = ResidencyView()
    router = Router({"a": a, "b": b}, load_poll_s=60, residency=view)
    await router.refresh_load()
    router.remove("b", RuntimeError("gone"))
    assert not view.knows("b") and view.knows("a")


def test_the_recipe_key_turns_on_the_policy_engines_events_and_is_checked_before_start(tiny_model_path):
    from rollout.engine import build_engine_args
    from trainer.run.recipe import build_config

    cfg = build_config({"rollout": {"routing": "residency"}})
    assert EngineSpec.from_config(cfg, "/m").kv_events
    assert not EngineSpec.from_config(cfg, "/judge", policy=False).kv_events
    assert not EngineSpec.from_config(build_config({}), "/m").kv_events  # sticky by default
    spec = EngineSpec(model_path=str(tiny_model_path), kv_cache_memory_bytes=64 << 20,
                      enforce_eager=True, kv_events=True)
    events = build_engine_args(spec, "ipc:///tmp/x/kv-events").create_engine_config().kv_events_config
    assert events.enable_kv_cache_events and events.publisher == "zmq"
    assert events.endpoint == "ipc:///tmp/x/kv-events"
    with pytest.raises(ValueError, match="rollout.routing: residency reads the engines' KV cache events"):
        build_config({"rollout": {"routing": "residency", "load_poll_s": 0}})
    with pytest.raises(ValueError, match="rollout.routing"):
        build_config({"rollout": {"routing": "kv"}})
