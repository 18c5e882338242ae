"""The model halves of launch.calibrate by hand: the cache experiment's hits on an engine
model whose pool holds everything, and the sandbox queue waits of the pool model."""

from __future__ import annotations

import pytest

from launch.calibrate import (CacheExperiment, SandboxCosts, SandboxExperiment, SandboxResult,
                              build_tiny_engine_spec, run_model_cache_experiment,
                              run_model_sandboxes, waits_agree)
from trainer.run.model_check import DecoderShape

TINY = DecoderShape(num_layers=2, hidden=128, intermediate=384, num_heads=2, num_kv_heads=1,
                    head_dim=64, vocab=518, tied_embeddings=False, positions=4096)


def test_cache_hits_by_hand_when_the_pool_holds_everything():
    exp = CacheExperiment(num_in_flight=1, turns=6, prompt_tokens=256, gen_tokens=16,
                          obs_tokens=112, group_size=1)
    r = run_model_cache_experiment(build_tiny_engine_spec(TINY, 31, 0.01), exp)
    # Turn t sends 256 + 128t tokens; it hits every full block of the last turn's context
    # and output: 256 + 128(t - 1) tokens for t >= 1.
    assert r.queries == sum(256 + 128 * t for t in range(6)) == 3456
    assert r.hits == r.cached_tokens == sum(256 + 128 * (t - 1) for t in range(1, 6)) == 2560
    # 15 decode steps (prefill samples the first token) of the weights' 10 ms plus KV reads.
    assert 15 * 0.01 < r.mean_turn_s < 15 * 0.01 * 1.5


def test_a_group_sibling_hits_the_shared_prompt_and_a_small_pool_evicts():
    exp = CacheExperiment(num_in_flight=2, turns=1, prompt_tokens=256, gen_tokens=16,
                          obs_tokens=112, tool_s=0.5, group_size=2)
    r = run_model_cache_experiment(build_tiny_engine_spec(TINY, 31, 0.01), exp)
    assert r.hits == 255 // 128 * 128  # the second sibling: the prompt less its last token
    crowded = CacheExperiment(num_in_flight=8, turns=6, group_size=1)
    roomy, small = (run_model_cache_experiment(build_tiny_engine_spec(TINY, n, 0.01), crowded)
                    for n in (200, 15))
    assert roomy.hit_rate == pytest.approx(2560 / 3456)
    assert small.hit_rate < roomy.hit_rate / 2


def test_sandbox_waits_by_hand():
    exp = SandboxExperiment(num_sandboxes=2, num_callers=6, commands_per_caller=2, exec_s=0.4)
    costs = SandboxCosts(create_s=0.01, exec_s=0.4, teardown_s=0.02)
    r = run_model_sandboxes(exp, costs)
    # Two warm grants hold 2 x 0.4 + 0.02; the next two wait for them and create (0.01).
    assert r.waits_s == pytest.approx((0, 0, 0.83, 0.83, 1.66, 1.66))
    assert r.wall_s == pytest.approx(1.66 + 0.82)
    off = SandboxResult((0.0, 3.0), 1.5, 3.0, 4.0)  # waits 80% longer than the model's
    assert waits_agree(r, r) and not waits_agree(off, r)


def test_measured_holds_are_replayed_caller_by_caller():
    """Uneven holds (a loaded machine's slow commands) move the waits as they moved the
    real pool's: each slot passes to the next caller in asking order when it frees."""
    exp = SandboxExperiment(num_sandboxes=2, num_callers=4)
    costs = SandboxCosts(create_s=0.0, exec_s=9.9, teardown_s=0.0, holds_s=(1.0, 3.0, 2.0, 2.0))
    r = run_model_sandboxes(exp, costs)
    # caller 2 takes caller 0's slot at 1 s, caller 3 the first freed after: caller 1's, at 3 s
    assert r.waits_s == pytest.approx((0, 0, 1.0, 3.0))
    assert r.wall_s == pytest.approx(5.0)
