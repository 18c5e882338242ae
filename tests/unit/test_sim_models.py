"""The simulated trainer (launch.sim.trainer_model), and the simulated parts built from a
plan agreeing with the planner where its assumptions hold (steady decode, no cache)."""

from __future__ import annotations

import pytest

from launch.plan import compute_account, compute_decode_bound_tokens_per_s
from launch.sim.engine_model import EngineModel, SimRequest, build_engine_spec
from launch.sim.trainer_model import TrainerModel

from tests.unit.test_plan import SEED, plan_of


@pytest.fixture(scope="module")
def seed_plan():
    return plan_of("swe_grpo.yaml", SEED)


def test_trainer_step_and_push_by_hand(seed_plan):
    trainer = TrainerModel.from_plan(seed_plan, push_bytes_per_s=50e9, push_latency_s=1.0)
    assert trainer.step_s(160_000_000) == pytest.approx(12 * 8e9 * 160e6 / (32 * 989e12 * 0.4))
    assert trainer.step_s(160_000_000) == pytest.approx(compute_account(seed_plan.inputs).train_s)
    assert trainer.push_s() == pytest.approx(1.0 + 16e9 / 50e9)  # 8B bf16 over 50 GB/s


def test_the_engine_is_the_plans_engine(seed_plan):
    spec = build_engine_spec(seed_plan)
    assert spec.num_blocks == int(56e9 // (131_072 * 16))  # TP1: one GPU's pool
    # one trajectory's 40K tokens on one of the 32 GPUs, as the planner spreads them
    assert spec.prefill_s(40_000) / 32 == pytest.approx(
        compute_account(seed_plan.inputs).prefill_cached_s / 4000, rel=1e-12)


def test_steady_decode_runs_at_the_planners_bandwidth_bound(seed_plan):
    spec = build_engine_spec(seed_plan, max_num_seqs=64)
    # The seed's 31 running requests x 20K context need 81 GB of KV: more than the 56 GB
    # pool of one card (26,702 blocks hold 21 of them). 20 fit, and all run together.
    assert 21 * 1257 <= spec.num_blocks < 22 * 1257
    e = EngineModel(spec)
    for i in range(20):
        e.submit(0.0, SimRequest(f"r{i}", f"r{i}", 20_000, 101))
    while (t := e.next_event_s()) is not None:
        e.advance(t)
    s = e.stats()
    assert s.num_decode_steps == 100
    tokens_per_s = 20 * 100 / s.decode_busy_s
    bound = compute_decode_bound_tokens_per_s(seed_plan.weight_bytes_per_gpu, 20, 20_050.5,
                                              131_072, 2e12)  # the mean KV over the run
    assert tokens_per_s == pytest.approx(bound, rel=1e-9)
    assert s.prefill_busy_s == pytest.approx(20 * spec.prefill_s(20_000), rel=1e-12)
