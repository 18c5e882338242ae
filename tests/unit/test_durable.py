"""Durable trajectories (rollout.durable) on the agent-loop worker with a scripted engine: a
trajectory stopped mid-run continues, in a new worker, from its journal (its first turns
byte-identical, none of them sent to the engine again, their versions kept), and what
cannot be continued starts over: a journal of another run, a sandbox task, a loop that
replays differently, generations of weights the resumed run no longer has; a sandboxed
trajectory continues from its newest saved workspace."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import numpy as np
from test_agent_loop import TASK, call, make_worker

from rollout.durable import (CODEC, DurableSetup, ToolsRan, TrajectoryBegun, TurnGenerated, journal_file,
                             open_replay)
from rollout.journal_file import append_frame
from envs.types import Task, TerminationReason
from rollout.engine import TokenOutput

LOOP = "rollout.agent_loop:ToolAgentLoop"


def one_generation(token: int, version: int, context: int) -> TurnGenerated:
    out = TokenOutput(np.array([token], np.int32), np.array([-0.1], np.float32), np.array([version], np.int32),
                      "stop", context, 0)
    return TurnGenerated.of(out, 0.0, 0.0, "e0", 0.0, num_context_ids=context)
SCRIPT = [call("calculator", expression=f"{k}+1") for k in range(5)] + ["The answer is 5."]


def durable_worker(tokenizer, folder, *, run_id="run-a", resumed_version=0, version=0, delay_s=0.0,
                   script=SCRIPT):
    """A worker journaling into `folder`; its engine answers a session's n-th call with
    script[n] (a continued trajectory's first call is its turn k + 1: script=SCRIPT[k:])."""
    worker, engine = make_worker(tokenizer, script, max_turns=8, traj_timeout_s=60.0, engine_delay_s=delay_s)
    worker.durable = DurableSetup(str(folder), run_id, resumed_version)
    engine.version = version
    return worker, engine


async def stopped_after(worker, engine, generations: int, group_id: str = "g7") -> None:
    """Run one sample of TASK until the engine has answered `generations` calls, then stop
    it as a Ctrl-C would (cancelled in the middle of the next generation)."""
    run = asyncio.create_task(worker.run_group(TASK, group_id, 1))
    while engine.n <= generations:
        await asyncio.sleep(0.01)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)


async def test_a_stopped_trajectory_continues_from_its_last_turn_in_a_new_worker(tokenizer, tmp_path):
    first, engine = durable_worker(tokenizer, tmp_path, delay_s=0.05)
    await stopped_after(first, engine, 3)
    path = journal_file(str(tmp_path), "g7", 0)
    journaled = CODEC.read(path).records
    generated = [r for r in journaled if isinstance(r, TurnGenerated)]
    assert isinstance(journaled[0], TrajectoryBegun) and len(generated) >= 3
    assert first.stats().durable.num_records == len(journaled)

    # The resumed run: new weights (version 1), a new worker and engine, the same folder.
    k = len(generated)
    second, engine2 = durable_worker(tokenizer, tmp_path, resumed_version=1, version=1, script=SCRIPT[k:])
    group = await second.run_group(TASK, "g7", 1)
    (traj,) = group.trajectories
    assert traj.termination is TerminationReason.FINISHED and len(traj.turns) == 6
    # Its first k turns are the journal's, byte for byte, with the versions they had.
    model = np.flatnonzero(traj.response_mask == 1)
    at = 0
    for record, turn in zip(generated, traj.turns[:k], strict=True):
        assert turn.num_generated == len(record.token_ids) and turn.engine == record.engine
        ids = model[at:at + turn.num_generated]
        assert traj.response_ids[ids].tolist() == record.token_ids.tolist()
        assert traj.logprobs[ids].tolist() == record.logprobs.tolist()
        assert traj.versions[ids].tolist() == record.versions.tolist() == [0] * len(ids)
        at += turn.num_generated
    assert set(traj.versions[model[at:]].tolist()) == {1}  # the rest, live under the new weights
    # None of them went to the engine again: its first prompt already holds them.
    (sent,) = engine2.prompts.values()
    end_of_replayed = len(traj.prompt_ids) + int(model[at - 1]) + 1
    assert len(sent) == 6 - k and len(sent[0]) > end_of_replayed
    assert np.array_equal(traj.input_ids()[:len(sent[0])], sent[0])
    stats = second.stats().durable
    assert stats.num_continued == 1 and stats.num_turns_replayed == k and stats.num_restarted == 0
    assert not os.path.exists(os.path.dirname(path))  # the group returned: its journals are gone


async def test_generations_of_weights_the_resume_does_not_have_are_generated_again(tokenizer, tmp_path):
    """Killed after a push the checkpoint never saw: the run resumes at version 0, so the
    journal's generations of version 1 are cut off (from the file too)."""
    first, engine = durable_worker(tokenizer, tmp_path, delay_s=0.05)
    await stopped_after(first, engine, 2)
    path = journal_file(str(tmp_path), "g7", 0)
    late = one_generation(token=5, version=1, context=0)
    records = CODEC.read(path).records
    first_gen = next(r for r in records if isinstance(r, TurnGenerated))
    append_frame(path, CODEC.encode(late))
    size = os.path.getsize(path)
    found = open_replay(path, "run-a", TASK.id, "g7", 0, LOOP, max_version=0)
    assert found.replay is not None
    replayed = [r for r in found.replay.records if isinstance(r, TurnGenerated)]
    assert replayed[0].token_ids.tolist() == first_gen.token_ids.tolist()
    assert all(int(r.versions.max()) == 0 for r in replayed)  # the version-1 one is not replayed
    assert os.path.getsize(path) < size and len(CODEC.read(path).records) == len(records)


async def test_what_cannot_be_continued_starts_over_and_is_counted(tokenizer, tmp_path):
    first, engine = durable_worker(tokenizer, tmp_path, delay_s=0.05)
    await stopped_after(first, engine, 2)
    path = journal_file(str(tmp_path), "g7", 0)
    kept = open(path, "rb").read()

    other_run, engine2 = durable_worker(tokenizer, tmp_path, run_id="run-b")
    (traj,) = (await other_run.run_group(TASK, "g7", 1)).trajectories
    assert traj.termination is TerminationReason.FINISHED and len(engine2.prompts["g7/0"]) == 6
    assert other_run.stats().durable.num_restarted == 1 and other_run.stats().durable.num_continued == 0

    # A journal the loop does not replay (the worker now offers other tools, so its prompt
    # differs): the trajectory starts over, with a fresh journal.
    os.makedirs(os.path.dirname(path))
    open(path, "wb").write(kept)
    fewer_tools, engine3 = durable_worker(tokenizer, tmp_path)
    task = Task(TASK.id, TASK.messages, tools=("calculator",), answer=TASK.answer)
    (traj,) = (await fewer_tools.run_group(task, "g7", 1)).trajectories
    assert traj.termination is TerminationReason.FINISHED and len(engine3.prompts["g7/0"]) == 6
    assert fewer_tools.stats().durable.num_restarted == 1



def test_a_sandboxed_journal_continues_from_its_newest_saved_state(tmp_path):
    """Its workspace after each turn's tools is saved beside the journal, only the newest
    kept: the replay restores that one and goes up to the next tools, which run again."""
    path = journal_file(str(tmp_path), "g8", 0)
    os.makedirs(os.path.dirname(path))
    gen = one_generation(token=5, version=0, context=2)
    ran = ToolsRan(("bash {}",), ("ok",), ("bash",), 1, 0, 0, False, 0.1, ("bash",), ())
    records = [TrajectoryBegun("run-a", TASK.id, "g8", 0, LOOP, np.array([1, 2], np.int32), True),
               gen, dataclasses.replace(ran, state="0.journal.state1"),  # deleted once state2 was saved
               gen, dataclasses.replace(ran, state="0.journal.state2"),
               gen, dataclasses.replace(ran, state=""), gen]  # saving failed, then killed
    for r in records:
        append_frame(path, CODEC.encode(r))
    open(path + ".state2", "wb").close()
    found = open_replay(path, "run-a", TASK.id, "g8", 0, LOOP, max_version=0)
    assert found.replay is not None and found.replay.state == "0.journal.state2"
    assert len(found.replay.records) == 5  # up to the third generation; its tools run again
    assert len(CODEC.read(path).records) == 6


def test_a_journal_another_version_wrote_starts_over(tmp_path):
    """Whole, CRC-checked frames of a record layout this version does not know."""
    import marshal
    import struct
    import zlib

    path = str(tmp_path / "0.journal")
    payload = marshal.dumps((2, ("echo {}",), ("hi",)))  # a ToolsRan of fewer fields
    append_frame(path, struct.pack("<HII", 0x534A, len(payload), zlib.crc32(payload)) + payload)
    found = open_replay(path, "r", "t", "g", 0, LOOP, max_version=0)
    assert found.replay is None and "cannot be read" in found.reason and not os.path.exists(path)


def test_a_torn_last_record_is_cut_off_and_the_journal_goes_on(tmp_path):
    path = str(tmp_path / "0.journal")
    begun = TrajectoryBegun("r", "t", "g", 0, LOOP, np.array([1, 2, 3], np.int32), False)
    ran = ToolsRan(("echo {}",), ("hi",), ("echo",), 1, 0, 0, False, 0.1, ("echo",), ())
    append_frame(path, CODEC.encode(begun))
    append_frame(path, CODEC.encode(ran))
    whole = os.path.getsize(path)
    append_frame(path, CODEC.encode(ran)[:-3])  # killed mid-write
    found = open_replay(path, "r", "t", "g", 0, LOOP, max_version=0)
    assert found.replay is not None and found.replay.records == [ran]
    assert os.path.getsize(path) == whole and not CODEC.read(path).torn
    assert ran.messages[0].content == "hi" and ran.messages[0].name == "echo"


async def test_a_sandbox_state_is_saved_behind_the_next_generation_and_recorded_first(tmp_path):
    """The save runs in the background (record_tools returns at once); the next generation's
    record waits for it, so the journal keeps tools before generation; a stop drops a save
    in progress and its record (the replay then runs those tools again)."""
    class SlowEnv:
        def __init__(self) -> None:
            self.release = asyncio.Event()

        async def save_state(self, path: str) -> int:
            await self.release.wait()
            open(path, "wb").write(b"tar")
            return 3

        async def restore_state(self, path: str) -> None:
            return None

    from rollout.durable import DurableTrajectory

    path = str(tmp_path / "g" / "0.journal")
    durable = DurableTrajectory(path, "r", LOOP, has_sandbox=True)
    durable.begin("t", "g", 0, np.array([1, 2], np.int32))
    env = SlowEnv()
    ran = ToolsRan(("python {}",), ("ok",), ("python",), 1, 0, 0, False, 0.1, ("python",), ())
    gen = one_generation(token=7, version=0, context=5)
    await asyncio.wait_for(durable.record_tools(ran, env), 1)  # does not wait for the save
    recording = asyncio.create_task(durable.record_generation(gen))
    await asyncio.sleep(0.05)
    assert not recording.done() and len(CODEC.read(path).records) == 1
    env.release.set()
    await recording
    kinds = [type(r).__name__ for r in CODEC.read(path).records]
    assert kinds == ["TrajectoryBegun", "ToolsRan", "TurnGenerated"]
    assert CODEC.read(path).records[1].state == "0.journal.state1"

    env.release.clear()
    await durable.record_tools(ran, env)
    durable.abandon()  # stopped while saving
    await asyncio.sleep(0.05)
    assert len(CODEC.read(path).records) == 3 and durable.last_state == "0.journal.state1"
