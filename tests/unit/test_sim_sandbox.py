"""The simulated sandboxes (launch.sim.sandbox_model): execution-time samples (body,
hangs, crashes and retries) and the first-come-first-served pool with its statistics."""

from __future__ import annotations

import random

import pytest

from launch.sim.sandbox_model import (SEED_EXEC, ExecTimeModel, SandboxPoolModel,
                                      hang_prob_for)


class FakeRng:
    """Scripted draws: random() and gauss() values in the order the model asks for them."""

    def __init__(self, uniforms: list[float], gausses: list[float]) -> None:
        self.uniforms, self.gausses = list(uniforms), list(gausses)

    def random(self) -> float:
        return self.uniforms.pop(0)

    def gauss(self, mu: float, sigma: float) -> float:
        return self.gausses.pop(0)


def test_without_variance_every_run_takes_the_mean():
    model = ExecTimeModel(mean_s=30.0, sigma=0.0)
    assert {model.sample(random.Random(i)).seconds for i in range(5)} == {30.0}


def test_the_lognormal_body_has_the_requested_mean():
    model, rng = ExecTimeModel(mean_s=30.0, sigma=0.6, timeout_s=1e9), random.Random(0)
    samples = [model.sample(rng).seconds for _ in range(20_000)]
    # std of the mean: 30 x sqrt(e^0.36 - 1) / sqrt(20000) = 0.14 s; the seed is fixed
    assert sum(samples) / len(samples) == pytest.approx(30.0, rel=0.02)
    assert model.median_s == pytest.approx(30.0 / 1.197217, rel=1e-6)


def test_hangs_run_into_the_timeout():
    model, rng = ExecTimeModel(mean_s=1.0, sigma=0.0, hang_prob=0.05, timeout_s=600), random.Random(1)
    samples = [model.sample(rng) for _ in range(20_000)]
    hung = [s for s in samples if s.timed_out]
    assert {s.seconds for s in hung} == {600.0}
    assert len(hung) / len(samples) == pytest.approx(0.05, abs=0.0075)  # 5 sigma
    assert ExecTimeModel(mean_s=700.0, sigma=0.0, timeout_s=600).sample(rng).timed_out


def test_a_crash_costs_the_part_run_and_a_restart_then_retries():
    model = ExecTimeModel(mean_s=10.0, sigma=0.0, crash_prob=0.5, max_retries=1, restart_s=3.0)
    # attempt 1: no hang, crashes half-way; attempt 2: no hang, survives
    s = model.sample(FakeRng([0.9, 0.1, 0.5, 0.9, 0.9], [0.0, 0.0]))
    assert (s.seconds, s.retries, s.failed, s.timed_out) == (10 * 0.5 + 3.0 + 10.0, 1, False, False)
    # both attempts crash: the tool call fails after max_retries
    s = model.sample(FakeRng([0.9, 0.1, 0.5, 0.9, 0.1, 0.2], [0.0, 0.0]))
    assert (s.seconds, s.retries, s.failed) == (10 * 0.5 + 3.0 + 10 * 0.2 + 3.0, 1, True)


def test_the_seed_preset_hangs_in_one_trajectory_of_twenty():
    assert (1 - hang_prob_for(0.05, 20)) ** 20 == pytest.approx(0.95, rel=1e-12)
    rng = random.Random(2)
    hit = sum(any(SEED_EXEC.sample(rng).timed_out for _ in range(20)) for _ in range(4000))
    assert hit / 4000 == pytest.approx(0.05, abs=0.017)  # 5 sigma of 4,000 draws


def test_bad_models_are_rejected():
    with pytest.raises(ValueError, match="hang_prob"):
        ExecTimeModel(hang_prob=1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        ExecTimeModel(timeout_s=0.0)
    assert ExecTimeModel(mean_s=0.0).sample(random.Random(0)).seconds == 0.0  # no tool wait


def test_the_pool_queues_first_come_first_served_and_counts():
    pool = SandboxPoolModel(2)
    assert pool.acquire(0.0, "a") and pool.acquire(0.0, "b")
    assert not pool.acquire(1.0, "c") and not pool.acquire(2.0, "d")
    assert pool.release(5.0, "a") == ["c"]  # waited 4 s
    assert pool.release(6.0, "b") == ["d"]  # waited 4 s
    assert pool.release(8.0, "c") == []
    s = pool.stats(10.0)
    # in use: 2 over [0, 8), then 1 over [8, 10): 16 + 2 = 18 sandbox-seconds
    assert s.mean_in_use == pytest.approx(1.8)
    assert (s.in_use, s.queued, s.peak_in_use, s.peak_queued, s.num_grants) == (1, 0, 2, 2, 4)
    assert (s.mean_wait_s, s.max_wait_s) == (2.0, 4.0)
    assert pool.timeline[2] == (1.0, 2, 1)
    with pytest.raises(ValueError, match="already holds"):
        pool.acquire(10.0, "d")
    with pytest.raises(ValueError, match="holds no sandbox"):
        pool.release(10.0, "a")
    with pytest.raises(ValueError, match="time went back"):
        pool.acquire(9.0, "e")
