"""Group deadlines and the straggler policies, piece by piece (the controller's runs under
each policy: test_controller.py): rollout.deadline's cut, the agent-loop worker cutting a
hung sample (its sandbox released, its reward never asked for), the buffer's policies and
counts, the GRPO baseline without the cut samples (hand-computed), and the recipe checks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_agent_loop import ScriptedEngine, call
from test_pool_tool_sessions import FakeProvider
from test_types import make_traj
from test_workspace_handover import SANDBOX_TASK, WRITE, RecordingReward, sandbox_worker

from buffer.replay_buffer import ReplayBuffer
from envs.types import Group, TerminationReason
from rollout.deadline import DeadlineCut, absorb_cut, gather_by_deadline
from trainer.run.recipe import build_config
from trainer.train.advantages import compute_group_advantages
from trainer.train.config import LossConfig

DEADLINE = TerminationReason.DEADLINE


# --- rollout.deadline ---------------------------------------------------------------

async def sample(seconds: float, cut: DeadlineCut) -> str:
    try:
        await asyncio.sleep(seconds)
        return f"done {seconds}"
    except asyncio.CancelledError:
        if not absorb_cut(cut):
            raise
        return "cut"


async def test_samples_past_the_deadline_return_their_cut_result_in_order():
    cut = DeadlineCut()
    out = await gather_by_deadline([sample(0.01, cut), sample(30, cut), sample(0.02, cut)], 0.2, cut)
    assert out == ["done 0.01", "cut", "done 0.02"] and cut.is_set()
    cut = DeadlineCut()
    assert await gather_by_deadline([sample(0.01, cut)], None, cut) == ["done 0.01"]
    assert not cut.is_set()


async def test_cancelling_the_group_cancels_every_sample_and_absorbs_nothing():
    cut = DeadlineCut()
    job = asyncio.ensure_future(gather_by_deadline([sample(30, cut), sample(30, cut)], 60, cut))
    await asyncio.sleep(0.05)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert not cut.is_set()


# --- the agent-loop worker ------------------------------------------------------------

class HangingEngine(ScriptedEngine):
    """The script for every session but those in `hang`, whose second turn never returns
    (a straggler stuck behind its first tool call)."""

    def __init__(self, tokenizer, script: list[str], hang: set[int]) -> None:
        super().__init__(tokenizer, script)
        self.hang = hang

    async def generate(self, request_id, prompt_ids, sampling):
        session = request_id.split("#")[0]
        if int(session.rsplit("/", 1)[1]) in self.hang and len(self.prompts.get(session, [])) == 1:
            self.prompts[session].append(np.array(prompt_ids))
            await asyncio.sleep(3600)
        return await super().generate(request_id, prompt_ids, sampling)


@pytest.fixture(autouse=True)
def fresh_recording():
    RecordingReward.seen, RecordingReward.raise_for = [], set()


async def test_the_worker_cuts_a_hung_sample_releases_its_sandbox_and_does_not_score_it(tokenizer):
    provider = FakeProvider()
    engine = HangingEngine(tokenizer, [WRITE, call("submit")], hang={1})
    worker = sandbox_worker(tokenizer, engine, provider, timeout_s=600.0)
    # 5 s: the finished samples take milliseconds, with room for a loaded machine
    group = await asyncio.wait_for(worker.run_group(SANDBOX_TASK, "g", 3, deadline_s=5.0), 60)
    ends = [t.termination for t in group.trajectories]
    assert ends == [TerminationReason.FINISHED, DEADLINE, TerminationReason.FINISHED]
    straggler = group.trajectories[1]
    assert straggler.reward == 0.0 and "buffer.group_deadline_s" in straggler.termination_detail
    assert len(straggler.turns) == 1 and straggler.num_model_tokens > 0  # what it had produced
    assert group.in_baseline().tolist() == [True, False, True]
    assert len(RecordingReward.seen) == 2  # the cut sample was never graded
    assert (provider.num_acquires, provider.num_releases) == (3, 3)
    stats = worker.stats()
    assert stats.num_running == 0 and stats.end_reasons["deadline"] == 1


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trainer.run.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


# --- the buffer's policies ----------------------------------------------------------

def group_with_cut(rewards: list[float], cut: set[int]) -> Group:
    return Group("t0", "g0", tuple(
        make_traj(i, 0.0 if i in cut else r, termination=DEADLINE if i in cut else "finished")
        for i, r in enumerate(rewards)))


def buffer(policy: str, min_group_size: int = 2, **kw) -> ReplayBuffer:
    buf = ReplayBuffer(max_staleness=1, groups_per_step=1, straggler_policy=policy,  # type: ignore[arg-type]
                       min_group_size=min_group_size, **kw)
    assert buf.try_admit()
    return buf


def test_drop_drops_a_cut_group_and_counts_what_it_cut():
    buf = buffer("drop")
    assert buf.put(group_with_cut([1, 0, 1, 0], {1, 3}), late=True) == "dropped"
    stats = buf.stats()
    assert stats.dropped == {"deadline": 1}
    assert stats.deadline == {"late_groups": 1, "cut_samples": 2}
    assert stats.cut_by_turns == {0: 2} and stats.cut_by_length == {"<256": 2}
    buf.check_accounting()


def test_partial_trains_the_finished_samples_with_the_cut_ones_masked():
    buf = buffer("partial", filter_zero_variance=True)
    assert buf.put(group_with_cut([1, 0, 1, 0], {3})) == "buffered"
    (group,) = buf.get(1, version=1)
    cut = group.trajectories[3]
    assert cut.termination is DEADLINE and cut.response_mask.sum() == 0
    assert cut.oldest_version is None  # nothing of it counts towards staleness either
    assert buf.stats().deadline == {"cut_samples": 1, "partial_groups": 1}
    # Zero variance is judged on the baseline: [1, 1] with the cut 0 left out.
    buf = buffer("partial", filter_zero_variance=True)
    assert buf.put(group_with_cut([1, 1, 0], {2})) == "dropped"
    assert buf.stats().dropped == {"zero_variance": 1}


def test_partial_drops_a_group_with_fewer_finished_samples_than_the_minimum():
    buf = buffer("partial", min_group_size=3)
    assert buf.put(group_with_cut([1, 0, 1, 0], {0, 1})) == "dropped"
    assert buf.stats().dropped == {"deadline": 1}
    with pytest.raises(ValueError, match="min_group_size >= 2"):
        ReplayBuffer(max_staleness=1, groups_per_step=1, min_group_size=1)


def test_deadline_counts_survive_a_checkpoint():
    buf = buffer("partial")
    buf.put(group_with_cut([1, 0, 1], {2}), late=True)
    again = ReplayBuffer(max_staleness=1, groups_per_step=1, straggler_policy="partial")
    again.restore(buf.state())
    assert again.stats().deadline == {"late_groups": 1, "cut_samples": 1, "partial_groups": 1}


# --- the baseline ---------------------------------------------------------------------

def test_cut_samples_are_outside_the_baseline_and_get_no_advantage():
    # rewards 1, 0, (cut), 1: baseline over [1, 0, 1], mean 2/3 -> 1/3, -2/3, 0, 1/3
    group = group_with_cut([1, 0, 0, 1], {2})
    adv = compute_group_advantages(group, LossConfig(adv_std_norm=False))
    np.testing.assert_allclose(adv, [1 / 3, -2 / 3, 0.0, 1 / 3], rtol=1e-6)
    # with std normalisation: std of [1, 0, 1] is sqrt(2)/3
    adv = compute_group_advantages(group, LossConfig(adv_std_norm=True, adv_eps=0.0))
    np.testing.assert_allclose(adv, [1 / 2 ** 0.5, -(2 ** 0.5), 0.0, 1 / 2 ** 0.5], rtol=1e-5)


# --- the recipe -------------------------------------------------------------------------

@pytest.mark.parametrize(("buffer_keys", "message"), [
    ({"straggler_policy": "drop"}, "buffer.straggler_policy"),
    ({"group_deadline_s": -1}, "buffer.group_deadline_s"),
    ({"group_deadline_s": 60, "straggler_policy": "partial", "min_group_size": 9},
     r"buffer.min_group_size: must be in \[2, train.group_size=8\]"),
])
def test_inconsistent_deadline_settings_are_config_errors(buffer_keys, message):
    with pytest.raises(ValueError, match=message):
        build_config({"train": {"group_size": 8}, "buffer": buffer_keys})
    build_config({"train": {"group_size": 8},
                  "buffer": {"group_deadline_s": 60, "straggler_policy": "partial"}})
