"""The gateway session journal (rollout.gateway.journal): records round-trip through the
file; a torn or corrupt last record is detected and ignored; a generation dispatched and
never completed fails the sample (`error`, what buffer.failure_policy masks), one that
raised does not; and segments rebuilt from a live gateway's journal equal, token for
token (ids, mask, logprobs, versions) and turn for turn, what that gateway's
close_session returns. A lost gateway process stops its session's harness
(GatewayAgentLoop). Fake engines and a fake host; the real processes, killed, are in
tests/integration/test_gateway_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest

from envs.types import Message, Task, TerminationReason, Trajectory, Turn
from rollout.engine import TokenOutput
from rollout.gate import TurnGate
from rollout.gateway.journal import (CallCompleted, CallDispatched, CallFailed, JournalError, JournalRead,
                                     ObservationAdded, SegmentStarted, SessionJournal, SessionOpened, journal_path,
                                     read_journal, rebuild_session)
from rollout.gateway.loop import GatewayAgentLoop
from rollout.gateway.procs import SessionHandle
from rollout.gateway.protocol import ProtocolError, parse_openai_request
from rollout.gateway.server import Gateway, GatewaySettings, GatewayStats
from rollout.recorder import Budgets
from rollout.router import Router

BUDGETS = Budgets(4096, 2048, 256)
CALL = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "echo", "description": "Echo text.",
                                           "parameters": {"type": "object",
                                                          "properties": {"text": {"type": "string"}}}}}]
HEAD = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Echo hi."}]
LOST = "gateway process 0 died (exit code -9)"


def output(ids, version: int, cached: int = 0) -> TokenOutput:
    n = len(ids)
    return TokenOutput(np.asarray(ids, np.int32), -np.arange(1, n + 1, dtype=np.float32) / (7 + version),
                       np.full(n, version, np.int32), "stop", 10, cached)


def test_records_round_trip_through_the_file(tmp_path):
    journal = SessionJournal(journal_path(str(tmp_path), "s"))
    out = TokenOutput(np.array([5, 6, 7], np.int32), np.array([-0.5, -0.25, -1e-9], np.float32),
                      np.array([3, 3, 4], np.int32), "length", 12, 8, cache_salted=True)
    turn = Turn(0, 12, 0, 3, 0, "length", 3, queue_s=0.125, generate_s=1.5, engine="e1", started_at=1.7e9,
                tool_parse_status="malformed_call")
    journal.opened("task", "g", 2)
    journal.segment_started(np.arange(12))
    journal.dispatched(1, 12)
    journal.completed(1, out, turn)
    journal.observation_added([9, 9], np.int64(1), 0.75)  # a numpy count is stored as Python's
    journal.dispatched(2, 17)
    journal.failed(2)
    read = read_journal(journal.path)
    assert not read.torn
    opened, started, dispatched, completed, observed, _, failed = read.records
    assert opened == SessionOpened("task", "g", 2)
    assert started.segment == 0 and started.prompt_ids.tolist() == list(range(12))
    assert started.prompt_ids.dtype == np.int32
    assert dispatched == CallDispatched(0, 1, 12) and failed == CallFailed(0, 2)
    assert isinstance(completed, CallCompleted)
    back = completed.output
    for name in ("token_ids", "logprobs", "versions"):
        assert np.array_equal(getattr(back, name), getattr(out, name)) and getattr(back, name).dtype == \
            getattr(out, name).dtype
    assert dataclasses.replace(back, token_ids=out.token_ids, logprobs=out.logprobs, versions=out.versions) == out
    assert (completed.queue_s, completed.generate_s, completed.engine, completed.started_at,
            completed.tool_parse_status) == (0.125, 1.5, "e1", 1.7e9, "malformed_call")
    assert isinstance(observed, ObservationAdded) and observed.ids.tolist() == [9, 9]
    assert (observed.num_tool_calls, observed.tool_s) == (1, 0.75) and type(observed.num_tool_calls) is int


def test_a_completed_call_keeps_every_field_of_the_engines_output():
    """A field added to TokenOutput must be journaled too, or a rebuilt turn would lose it."""
    kept = {f.name for f in dataclasses.fields(CallCompleted)}
    assert {f.name for f in dataclasses.fields(TokenOutput)} <= kept


def test_a_torn_or_corrupt_last_record_is_ignored(tmp_path):
    journal = SessionJournal(str(tmp_path / "s.journal"))
    journal.opened("t", "g", 0)
    journal.segment_started(np.arange(40))
    whole = os.path.getsize(journal.path)
    journal.completed(1, output([1, 2, 3], 0), Turn(0, 40, 0, 3, 0, "stop", 0))
    data = (tmp_path / "s.journal").read_bytes()
    for cut in range(whole, len(data)):  # a writer killed anywhere inside the last record
        (tmp_path / "s.journal").write_bytes(data[:cut])
        read = read_journal(journal.path)
        assert [type(r) for r in read.records] == [SessionOpened, SegmentStarted]
        assert read.torn is (cut != whole)
    flipped = bytearray(data)
    flipped[-2] ^= 0xFF  # a corrupt byte in the last payload: its CRC fails
    (tmp_path / "s.journal").write_bytes(bytes(flipped))
    assert len(read_journal(journal.path).records) == 2 and read_journal(journal.path).torn
    (tmp_path / "s.journal").write_bytes(data + bytes(64))  # a zero-filled tail (length 0, CRC 0 would pass)
    read = read_journal(journal.path)
    assert len(read.records) == 3 and read.torn
    missing = read_journal(str(tmp_path / "missing.journal"))
    assert missing.records == () and not missing.torn


def completed(segment: int, call: int, ids, version: int) -> CallCompleted:
    return CallCompleted.of(output(ids, version), 0.0, 0.1, "e0", 0.0, segment=segment, call=call,
                            tool_parse_status="no_call")


def one_turn(prompt=(1, 2, 3)) -> list:
    return [SessionOpened("t", "g", 0), SegmentStarted(0, np.array(prompt, np.int32)),
            CallDispatched(0, 1, len(prompt)), completed(0, 1, [7, 8], 2)]


def test_records_out_of_order_are_an_error_not_a_wrong_trajectory():
    """Checked whatever python's -O says: a bad journal never rebuilds into a sample."""
    observation_first = (SessionOpened("t", "g", 0), ObservationAdded(0, np.array([4], np.int32), 1, 0.1))
    with pytest.raises(JournalError, match="observation before any segment"):
        rebuild_session(JournalRead(observation_first, False), BUDGETS, TerminationReason.FINISHED, "", LOST)
    wrong_prompt = tuple(one_turn()) + (CallDispatched(0, 2, 99),)
    with pytest.raises(JournalError, match="call 2 dispatched with another prompt"):
        rebuild_session(JournalRead(wrong_prompt, False), BUDGETS, TerminationReason.FINISHED, "", LOST)


def test_a_call_dispatched_and_never_completed_fails_the_sample():
    tail = [ObservationAdded(0, np.array([4, 5], np.int32), 1, 0.5), CallDispatched(0, 2, 7)]
    rebuilt = rebuild_session(JournalRead(tuple(one_turn() + tail), False), BUDGETS, TerminationReason.FINISHED,
                              "", LOST)
    assert rebuilt.masked
    (segment,) = rebuilt.segments
    # What the engine generated is kept as generated; the turn in flight is not in it.
    assert segment.response_ids.tolist() == [7, 8, 4, 5] and segment.response_mask.tolist() == [1, 1, 0, 0]
    assert segment.versions.tolist()[:2] == [2, 2] and len(segment.turns) == 1
    # ... and the sample fails: `error` is what buffer.failure_policy masks (or drops, resubmits).
    assert segment.termination is TerminationReason.ERROR
    assert LOST in segment.termination_detail and "request #2" in segment.termination_detail
    # A call that raised recorded nothing: it settles, nothing is masked.
    settled = rebuild_session(JournalRead(tuple(one_turn() + tail + [CallFailed(0, 2)]), False), BUDGETS,
                              TerminationReason.FINISHED, "done", LOST)
    assert not settled.masked and settled.segments[0].termination is TerminationReason.FINISHED
    assert settled.segments[0].termination_detail == "done"
    # In flight on a fresh segment (no generation of its own yet): the earlier segment fails.
    fresh = one_turn() + [SegmentStarted(1, np.array([1, 9], np.int32)), CallDispatched(1, 2, 2)]
    rebuilt = rebuild_session(JournalRead(tuple(fresh), False), BUDGETS, TerminationReason.FINISHED, "", LOST)
    assert rebuilt.masked and [s.termination for s in rebuilt.segments] == [TerminationReason.ERROR]
    # In flight before any generation: nothing to rebuild, still counted as masked.
    first = one_turn()[:3]
    rebuilt = rebuild_session(JournalRead(tuple(first), False), BUDGETS, TerminationReason.FINISHED, "", LOST)
    assert rebuilt.masked and rebuilt.segments == ()


class FakeVersionedEngine:
    """A fake engine: the k-th generation is script[k] + the stop token at weight version k
    (tokens of several versions in one segment), with prefix-cache hits reported; calls
    listed in `fail_at` raise; `hold` (if set) holds the next call until it is set."""

    def __init__(self, tokenizer, script: list[str], stop_id: int, fail_at=()) -> None:
        self.tokenizer, self.script, self.stop_id, self.fail_at = tokenizer, script, stop_id, set(fail_at)
        self.prompts: list[list[int]] = []
        self.outputs: list[TokenOutput] = []
        self.hold: asyncio.Event | None = None
        self.called = asyncio.Event()

    async def generate(self, request_id, prompt_ids, sampling):
        self.prompts.append([int(i) for i in prompt_ids])
        k = len(self.prompts)
        self.called.set()
        if self.hold is not None:
            await self.hold.wait()
        if k in self.fail_at:
            raise RuntimeError("engine died")
        ids = self.tokenizer.encode(self.script[(k - 1) % len(self.script)], add_special_tokens=False)
        out = dataclasses.replace(output(ids + [self.stop_id], version=k, cached=len(prompt_ids) // 2),
                                  num_prompt_tokens=len(prompt_ids))
        self.outputs.append(out)
        await asyncio.sleep(0)
        return out


def journaled_gateway(tokenizer, chat, folder, script, fail_at=()):
    engine = FakeVersionedEngine(tokenizer, script, chat.end_of_turn_id, fail_at)
    gateway = Gateway(Router({"e0": engine}), TurnGate(), chat, tokenizer, GatewaySettings("policy", BUDGETS),
                      journal_dir=str(folder))
    return gateway, engine


async def ask(gateway, session, body) -> dict:
    from rollout.gateway.protocol import openai_response

    return openai_response(await gateway.complete(session, parse_openai_request(body)))


def assert_same(rebuilt: tuple[Trajectory, ...], live: list[Trajectory]) -> None:
    """Token for token and turn for turn (timings aside: a rebuilt recorder starts late)."""
    assert len(rebuilt) == len(live) > 0
    for a, b in zip(rebuilt, live):
        for name in ("prompt_ids", "response_ids", "response_mask", "logprobs", "versions"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
            assert getattr(a, name).dtype == getattr(b, name).dtype
        assert a.turns == b.turns
        assert (a.task_id, a.group_id, a.index, a.termination, a.termination_detail) == (
            b.task_id, b.group_id, b.index, b.termination, b.termination_detail)


async def test_segments_rebuilt_from_the_journal_are_what_the_live_gateway_returns(tokenizer, chat, tmp_path):
    """Tool call and result, a user turn, an engine failure (500), a history rewrite: the
    journal rebuilds the same segments as the live recorder, and goes when the session closes."""
    gateway, engine = journaled_gateway(tokenizer, chat, tmp_path, [CALL, "Done: hi", "more", "x", "again"],
                                        fail_at={4})
    session = gateway.open_session("task", "g", 3)
    first = (await ask(gateway, session, {"messages": HEAD, "tools": TOOLS}))["choices"][0]["message"]
    (call,) = first["tool_calls"]
    history = HEAD + [first, {"role": "tool", "tool_call_id": call["id"], "content": "hi"}]
    second = (await ask(gateway, session, {"messages": history, "tools": TOOLS}))["choices"][0]["message"]
    history += [second, {"role": "user", "content": "More."}]
    third = (await ask(gateway, session, {"messages": history, "tools": TOOLS}))["choices"][0]["message"]
    with pytest.raises(ProtocolError):  # the engine fails the 4th call: a 500, nothing recorded
        await ask(gateway, session, {"messages": history + [third, {"role": "user", "content": "Go."}],
                                     "tools": TOOLS})
    await ask(gateway, session, {"messages": [HEAD[0], {"role": "user", "content": "Summary. Go on."}]})
    # The failed request's user turn stays in the first segment (mask 0), the rewrite starts a second.
    assert gateway.stats().num_segments == 2
    path = journal_path(str(tmp_path), session.id)
    rebuilt = rebuild_session(read_journal(path), BUDGETS, TerminationReason.MAX_TURNS, "turns", LOST)
    live = gateway.close_session(session.id, TerminationReason.MAX_TURNS, "turns")
    assert not rebuilt.masked and not rebuilt.torn
    assert [len(s.turns) for s in live] == [3, 1] and live[0].response_mask[-1] == 0
    assert_same(rebuilt.segments, live)
    assert any(t.stale_kv_tokens for t in live[0].turns)  # the KV tracking was replayed, not defaulted
    assert live[0].turns[0].tool_parse_status == "ok" and live[0].turns[0].num_tool_calls == 1
    assert not os.path.exists(path)  # closed: its journal is gone


async def test_a_call_in_flight_when_the_process_dies_fails_the_sample(tokenizer, chat, tmp_path):
    """The worker reads the journal while a call is held in the engine (as it does when the
    process died then): the completed turns rebuild exactly, the sample ends `error`."""
    gateway, engine = journaled_gateway(tokenizer, chat, tmp_path, ["one", "two"])
    session = gateway.open_session("task", "g", 0)
    reply = (await ask(gateway, session, {"messages": HEAD}))["choices"][0]["message"]
    engine.hold, engine.called = asyncio.Event(), asyncio.Event()
    in_flight = asyncio.create_task(ask(gateway, session, {"messages": HEAD + [reply, {"role": "user",
                                                                                      "content": "More."}]}))
    await engine.called.wait()
    rebuilt = rebuild_session(read_journal(journal_path(str(tmp_path), session.id)), BUDGETS,
                              TerminationReason.FINISHED, "", LOST)
    assert session.recorder is not None
    live = session.recorder.finish(TerminationReason.ERROR, rebuilt.segments[0].termination_detail)
    assert rebuilt.masked
    assert_same(rebuilt.segments, [live])  # the turn that completed, the user turn after it
    assert rebuilt.segments[0].response_mask.tolist()[-1] == 0  # ... ending on that observation
    in_flight.cancel()
    await asyncio.gather(in_flight, return_exceptions=True)
    gateway.close_session(session.id, TerminationReason.FINISHED)


async def test_the_in_process_gateway_keeps_no_journal(tokenizer, chat, tmp_path):
    engine = FakeVersionedEngine(tokenizer, ["x"], chat.end_of_turn_id)
    gateway = Gateway(Router({"e0": engine}), TurnGate(), chat, tokenizer, GatewaySettings("policy", BUDGETS))
    session = gateway.open_session("task", "g", 0)
    await ask(gateway, session, {"messages": HEAD})
    assert session.journal.path is None and gateway.close_session(session.id, TerminationReason.FINISHED)


def test_journal_counters_appear_once_a_process_was_lost():
    assert not any("journal" in k for k in GatewayStats(1, 0, 1, 0, 0, 1, 0).as_metrics())
    metrics = GatewayStats(1, 0, 1, 0, 0, 1, 0, num_journal_recovered=2, num_journal_masked=1).as_metrics()
    assert (metrics["gateway/journal_recovered"], metrics["gateway/journal_masked"]) == (2.0, 1.0)


class FakeLostHost:
    """A fake gateway host whose session's process is lost while the harness runs."""

    def __init__(self, segment: Trajectory) -> None:
        self.segment, self.lost, self.closed = segment, asyncio.Event(), []

    async def open_session(self, task_id, group_id, index):
        return SessionHandle(0, "s", "token", "http://127.0.0.1:1/sessions/s")

    async def close_session(self, handle, reason, detail=""):
        self.closed.append((reason, detail))
        return [dataclasses.replace(self.segment, termination=reason, termination_detail=detail)]

    async def session_lost(self, handle):
        await self.lost.wait()
        return LOST


class StuckHarness(GatewayAgentLoop):
    """Runs a long tool call; records that it was stopped."""

    stopped = False

    async def run_harness(self, task, endpoint, ctx):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            StuckHarness.stopped = True
            raise
        return TerminationReason.FINISHED


async def test_a_lost_gateway_process_stops_the_harness_and_ends_the_session_error():
    segment = Trajectory("t", "g", 0, np.array([1, 2]), np.array([3]), np.array([1]), np.array([-0.5]),
                         np.array([1]), TerminationReason.FINISHED)
    loop = StuckHarness()
    host = loop._host = FakeLostHost(segment)  # type: ignore[assignment]  # a fake host
    ctx = SimpleNamespace(group_id="g", index=0, segments=[], recorder=None)
    run = asyncio.create_task(loop.run(Task("t", (Message("user", "x"),)), ctx))  # type: ignore[arg-type]  # a fake context
    await asyncio.sleep(0.05)
    host.lost.set()
    trajectory = await asyncio.wait_for(run, 5)
    assert StuckHarness.stopped
    ((reason, detail),) = host.closed
    assert reason is TerminationReason.ERROR and LOST in detail and "stopped" in detail
    assert trajectory.termination is TerminationReason.ERROR
