"""Turn.stale_kv_tokens, counted by the recorder (rollout.kv_after_push): the prompt
tokens a generation was served from KV that an older weight version computed, from what
the engine reports as cached and the versions the trajectory's own tokens were computed
under. The engine side (cache salts, no reset): tests/integration/test_engine.py."""

from __future__ import annotations

import numpy as np

from rollout.engine import TokenOutput
from rollout.recorder import Budgets, TrajectoryRecorder


def output(n: int, version: int, prompt: int, cached: int, salted: bool = False) -> TokenOutput:
    return TokenOutput(np.arange(n, dtype=np.int32) + 10, np.full(n, -0.5, np.float32),
                       np.full(n, version, np.int32), "stop", prompt, cached, salted)


def recorder(prompt_len: int = 6) -> TrajectoryRecorder:
    return TrajectoryRecorder("t", "g", 0, list(range(1, prompt_len + 1)), Budgets(4096, 2048, 64))


def test_kv_served_across_a_push_is_counted_once_per_turn_that_uses_it():
    rec = recorder()
    rec.add_generation(output(4, 0, 6, 0), 0.0, 0.0)  # turn 0 at v0: nothing cached
    rec.add_observation([90, 91, 92], 1, 0, 0.0)
    # A push to v1; the engine (reuse) serves the 10 tokens it holds from turn 0.
    rec.add_generation(output(2, 1, 13, 10), 0.0, 0.0)
    rec.add_observation([93], 1, 0, 0.0)
    # Still v1: those 10 are still KV of v0; the 3 observation tokens were prefilled at v1.
    rec.add_generation(output(2, 1, 16, 13), 0.0, 0.0)
    assert [t.stale_kv_tokens for t in rec.turns] == [0, 10, 10]


def test_a_cache_salted_by_version_serves_nothing_stale():
    rec = recorder()
    rec.add_generation(output(4, 0, 6, 0, salted=True), 0.0, 0.0)
    rec.add_observation([90, 91], 1, 0, 0.0)
    # After a push: a sibling already prefilled the shared 6-token prompt under v1 (its
    # salt), so those hit, though this trajectory computed them under v0.
    rec.add_generation(output(2, 1, 12, 6, salted=True), 0.0, 0.0)
    rec.add_observation([92], 1, 0, 0.0)
    rec.add_generation(output(2, 1, 15, 14, salted=True), 0.0, 0.0)
    assert [t.stale_kv_tokens for t in rec.turns] == [0, 0, 0]


def test_a_shared_prompt_cached_by_a_sibling_counts_as_current():
    rec = recorder()
    rec.add_generation(output(3, 2, 6, 6), 0.0, 0.0)  # the group's prompt, cached by another sample
    assert rec.turns[0].stale_kv_tokens == 0
