"""The simulated engine (launch.sim.engine_model): step times by hand, the closed-form
fast-forward against a step-by-step reference, the block pool and its LRU prefix cache."""

from __future__ import annotations

import random

import pytest

from launch.sim.engine_model import EngineModel, EngineSpec, SimRequest

# 1B parameters in bf16 (2 GB), 1,000 bytes of KV per token, 1 TB/s, 1 PFLOP/s at MFU 0.5:
# a decode step is 2 ms + 1 ns per running KV token; prefill is 4 us per token.
SPEC = EngineSpec(params_b=1.0, dtype_bytes=2, kv_bytes_per_token=1000, kv_pool_bytes=1e9,
                  hbm_bytes_per_s=1e12, gpu_flops=1e15, mfu_prefill=0.5, block_tokens=16)


def _req(rid: str, context: int, new: int, session: str | None = None, **kw) -> SimRequest:
    return SimRequest(rid, session or rid, context, new, **kw)


def _run_out(engine: EngineModel) -> list:
    done = []
    while (t := engine.next_event_s()) is not None:
        done += engine.advance(t)
    return done


def test_one_request_by_hand():
    e = EngineModel(SPEC)
    e.submit(0.0, _req("a", 1000, 5))
    (c,) = _run_out(e)
    prefill = 2 * 1e9 * 1000 / (1e15 * 0.5)  # 4 ms; it samples the first token
    decode = 4 * 2e-3 + (1001 + 1002 + 1003 + 1004) * 1e-9  # 4 steps over the growing KV
    assert c.first_token_s == pytest.approx(prefill, rel=1e-12)
    assert c.finished_s == pytest.approx(prefill + decode, rel=1e-12)
    assert (c.cached_tokens, c.prefilled_tokens, c.new_tokens) == (0, 1000, 5)
    s = e.stats()
    assert (s.generated_tokens, s.num_decode_steps, s.prefill_tokens) == (5, 4, 1000)
    assert s.decode_busy_s == pytest.approx(decode, rel=1e-12)


def test_tensor_parallel_splits_both_reads_and_flops():
    tp2 = EngineSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__slots__}, "tp_size": 2})
    assert tp2.decode_step_s(5000) == pytest.approx(SPEC.decode_step_s(5000) / 2)
    assert tp2.prefill_s(800) == pytest.approx(SPEC.prefill_s(800) / 2)


def _reference_finish_times(arrivals: list[tuple[float, int, int]]) -> list[float]:
    """Step by step: prefill first (FIFO, from the first step boundary after arrival),
    then one decode step for every running sequence; an idle engine waits for the next."""
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    queue: list[int] = []
    running: dict[int, list[int]] = {}  # i -> [left, kv]
    finish = [0.0] * len(arrivals)
    clock = 0.0
    while pending or queue or running:
        while pending and arrivals[pending[0]][0] <= clock:
            queue.append(pending.pop(0))
        if queue:
            i = queue.pop(0)
            clock += SPEC.prefill_s(arrivals[i][1])
            if arrivals[i][2] == 1:
                finish[i] = clock
            else:
                running[i] = [arrivals[i][2] - 1, arrivals[i][1] + 1]
        elif running:
            clock += SPEC.decode_step_s(sum(kv for _, kv in running.values()))
            for i in list(running):
                running[i][0] -= 1
                running[i][1] += 1
                if running[i][0] == 0:
                    finish[i] = clock
                    del running[i]
        else:
            clock = arrivals[pending[0]][0]
    return finish


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_forward_matches_stepping_one_step_at_a_time(seed):
    rng = random.Random(seed)
    arrivals = sorted((rng.uniform(0, 0.5), rng.randint(50, 3000), rng.randint(1, 60))
                      for _ in range(40))
    e = EngineModel(SPEC)
    done = []
    probes = sorted(rng.uniform(0, 0.6) for _ in range(30))  # advance at arbitrary times too
    events = sorted([(t, "submit", i) for i, (t, _, _) in enumerate(arrivals)]
                    + [(t, "probe", -1) for t in probes])
    for t, kind, i in events:
        if kind == "submit":
            e.submit(t, _req(f"r{i}", arrivals[i][1], arrivals[i][2]))
        else:
            done += e.advance(t)
    done += _run_out(e)
    got = {c.request_id: c.finished_s for c in done}
    want = _reference_finish_times(arrivals)
    assert sorted(got) == sorted(f"r{i}" for i in range(40))
    for i, t in enumerate(want):
        assert got[f"r{i}"] == pytest.approx(t, rel=1e-9, abs=1e-12), i


def test_the_next_turn_hits_its_own_full_blocks():
    e = EngineModel(SPEC)
    e.submit(0.0, _req("t1", 100, 20, session="s"))
    _run_out(e)
    e.submit(1.0, _req("t2", 150, 10, session="s"))  # 120 tokens so far + 30 of tool output
    (c,) = _run_out(e)
    assert c.cached_tokens == 7 * 16  # (100 + 20) // 16 full blocks
    assert c.prefilled_tokens == 150 - 112
    s = e.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (250, 112)
    e.submit(2.0, _req("t3", 160, 1, session="s"))  # 160 = 10 whole blocks: one is recomputed
    (c,) = _run_out(e)
    assert c.cached_tokens == 9 * 16


def test_a_group_shares_the_task_prompt():
    e = EngineModel(SPEC)
    kw = dict(shared_key="task", shared_tokens=64)
    e.submit(0.0, _req("g0", 100, 50, **kw))
    e.submit(0.0, _req("g1", 100, 50, **kw))  # while g0 holds the prompt's 4 blocks
    first = {c.request_id: c.cached_tokens for c in _run_out(e)}
    assert first == {"g0": 0, "g1": 64}
    e.submit(1.0, _req("g2", 100, 5, **kw))  # from the cache, after both ended
    assert _run_out(e)[0].cached_tokens == 64
    # The group shares 4 blocks once: 2 x (ceil(150/16) - 4) + 4 = 16 blocks were in use.
    assert e.stats().kv_used_blocks == 0


def test_lru_evicts_the_oldest_trajectory_tail_first():
    small = EngineSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__slots__},
                          "kv_pool_bytes": 20 * 16 * 1000})  # 20 blocks
    e = EngineModel(small)
    e.submit(0.0, _req("a1", 160, 16, session="a"))  # 11 blocks, 11 cached after
    _run_out(e)
    e.submit(1.0, _req("b1", 96, 16, session="b"))  # 7 blocks: 11 + 7 cached, 2 free
    _run_out(e)
    e.submit(2.0, _req("c1", 64, 16, session="c"))  # 5 blocks: evict 3 of a's tail
    _run_out(e)
    assert e.stats().evicted_blocks == 3
    e.submit(3.0, _req("a2", 200, 1, session="a"))  # a's first 8 blocks are still there
    (c,) = _run_out(e)
    assert c.cached_tokens == 8 * 16
    # a2 took 13 blocks with 12 free of others: b, now the oldest, lost 5 of its 7
    assert e.stats().evicted_blocks == 3 + 5
    e.submit(4.0, _req("b2", 120, 1, session="b"))
    (c,) = _run_out(e)
    assert c.cached_tokens == 2 * 16
    assert e.stats().evicted_blocks == 8 + 5  # b2's 8 blocks: 3 free, then all of c


def test_a_full_pool_makes_requests_wait_for_blocks():
    small = EngineSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__slots__},
                          "kv_pool_bytes": 10 * 16 * 1000})  # 10 blocks
    e = EngineModel(small)
    e.submit(0.0, _req("big", 140, 10))  # 10 blocks: the whole pool
    e.submit(0.0, _req("next", 30, 2))
    assert e.stats().num_waiting == 1
    done = {c.request_id: c for c in _run_out(e)}
    assert done["next"].admitted_s == done["big"].finished_s
    with pytest.raises(ValueError, match="raise the KV pool"):
        e.submit(9.0, _req("huge", 170, 1))


def test_max_num_seqs_queues_the_rest():
    two = EngineSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__slots__}, "max_num_seqs": 2})
    e = EngineModel(two)
    for i in range(3):
        e.submit(0.0, _req(f"r{i}", 100, 10 * (i + 1)))
    done = {c.request_id: c for c in _run_out(e)}
    assert done["r2"].admitted_s == done["r0"].finished_s


def test_reset_prefix_cache_waits_for_an_idle_engine_then_forgets():
    e = EngineModel(SPEC)
    e.submit(0.0, _req("t1", 100, 20, session="s"))
    assert e.reset_prefix_cache() is False  # vLLM refuses while blocks are in use
    _run_out(e)
    assert e.reset_prefix_cache() is True
    e.submit(1.0, _req("t2", 150, 1, session="s"))
    assert _run_out(e)[0].cached_tokens == 0


def _hit_rate(num_sessions: int, pool_blocks: int, turns: int = 6, wait_s: float = 0.05,
              seed: int = 0) -> float:
    """Sessions alternate a turn on the engine and a tool wait; each turn adds 64 tokens."""
    spec = EngineSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__slots__},
                         "kv_pool_bytes": pool_blocks * 16 * 1000})
    e, rng = EngineModel(spec), random.Random(seed)
    context = {f"s{i}": 256 for i in range(num_sessions)}
    left = dict.fromkeys(context, turns)
    for s in context:
        e.submit(rng.uniform(0, 0.01), _req(f"{s}/0", 256, 16, session=s))
    ready: list[tuple[float, str]] = []
    while (t := e.next_event_s()) is not None or ready:
        if ready and (t is None or ready[0][0] <= t):
            at, s = ready.pop(0)
            e.submit(at, _req(f"{s}/{left[s]}", context[s], 16, session=s))
            continue
        for c in e.advance(t):
            s = c.request_id.split("/")[0]
            left[s] -= 1
            context[s] += 64
            if left[s]:
                ready.append((c.finished_s + wait_s * rng.uniform(0.5, 1.5), s))
                ready.sort()
    stats = e.stats()
    return stats.prefix_cache_hits / stats.prefix_cache_queries


def test_more_trajectories_in_flight_lower_the_hit_rate():
    # The seed's experiment in miniature: the same pool, twice the trajectories.
    roomy = _hit_rate(num_sessions=8, pool_blocks=4000)
    fewer = _hit_rate(num_sessions=16, pool_blocks=300)
    more = _hit_rate(num_sessions=32, pool_blocks=300)
    assert roomy > 0.6  # everything stays resident: all but the new tokens hit
    assert more < fewer < roomy
    assert _hit_rate(16, 300) == fewer  # deterministic under a seed


def test_a_new_salt_hides_older_blocks_and_reuse_keeps_them():
    """A push under rollout.kv_after_push=recompute: blocks of the older salt are never hit
    (vLLM's cache_salt); without a new salt (reuse) they keep hitting."""
    for salted, hit in ((True, 0), (False, 112)):  # 7 full blocks of 100 + 20 tokens
        e = EngineModel(SPEC)
        e.submit(0.0, _req("t1", 100, 20, session="s"))
        _run_out(e)
        if salted:
            e.new_salt()
        e.submit(1.0, _req("t2", 150, 1, session="s"))
        assert _run_out(e)[0].cached_tokens == hit


def test_the_tier_serves_what_the_pool_evicted_at_its_bandwidth():
    """A prefix the pool evicted is loaded from the offload tier (hits, counted as tier
    hits) for its bytes over the tier's bandwidth, instead of being prefilled."""
    small = dict(kv_pool_bytes=16 * 1000 * 20)  # 20 blocks of 16 tokens
    plain = EngineModel(EngineSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__slots__}, **small}))
    tiered = EngineModel(EngineSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__slots__}, **small,
                                       "tier_bytes": 16 * 1000 * 100, "tier_bytes_per_s": 1e10}))
    for e in (plain, tiered):
        e.submit(0.0, _req("a1", 256, 1, session="a"))  # 16 blocks, cached when done
        _run_out(e)
        e.submit(1.0, _req("b1", 318, 1, session="b"))  # all 20 blocks: evicts a's from the pool
        _run_out(e)
        e.submit(2.0, _req("a2", 300, 1, session="a"))
    (lost,), (loaded,) = _run_out(plain), _run_out(tiered)
    assert lost.cached_tokens == 0 and plain.stats().tier_hits == 0
    assert loaded.cached_tokens == 256 and tiered.stats().tier_hits == 256
    load_s = 256 * 1000 / 1e10
    assert tiered.stats().tier_load_s == pytest.approx(load_s)
    assert loaded.first_token_s - loaded.admitted_s == pytest.approx(SPEC.prefill_s(300 - 256) + load_s)


def test_a_tier_load_waits_on_the_transfer_channel_while_the_engine_runs_others():
    """As vLLM's connectors load (asynchronously): a loading request waits for its load,
    a request behind it that loads nothing is prefilled meanwhile, two loads queue on the
    one channel, and the engine's busy time has no load in it."""
    spec = EngineSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__slots__}, "kv_pool_bytes": 16 * 1000 * 48,
                         "tier_bytes": 16 * 1000 * 200, "tier_bytes_per_s": 1e6})  # 256 tokens: 0.256 s
    e = EngineModel(spec)
    for i, sid in enumerate(("a", "b", "c")):  # a and b leave 16 blocks each; c evicts both
        e.submit(float(i), _req(f"{sid}1", 256 if sid != "c" else 767, 1, session=sid))
        _run_out(e)
    e.submit(3.0, _req("a2", 300, 1, session="a"))
    e.submit(3.0, _req("b2", 300, 1, session="b"))
    e.submit(3.0, _req("fresh", 50, 1))
    done = {c.request_id: c for c in _run_out(e)}
    load_s = 256 * 1000 / 1e6
    assert done["fresh"].first_token_s == pytest.approx(3.0 + SPEC.prefill_s(50))
    assert done["a2"].first_token_s == pytest.approx(3.0 + load_s + SPEC.prefill_s(44))
    assert done["b2"].first_token_s == pytest.approx(3.0 + 2 * load_s + SPEC.prefill_s(44))
    s = e.stats()
    assert s.tier_hits == 512 and s.tier_load_s == pytest.approx(2 * load_s)
    assert s.prefill_busy_s == pytest.approx(SPEC.prefill_s(256 * 2 + 767 + 50 + 2 * 44))
