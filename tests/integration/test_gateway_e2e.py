"""The gateway served by uvicorn in front of the real vLLM engine (tiny model), driven by
the official `openai` and `anthropic` clients: every prompt the engine saw is a prefix of
its segment, the segment's logprobs and versions are the engine's, streaming and
non-streaming agree in shape, a history rewrite makes a new segment, another session's
token is refused, malformed bodies get the protocol's errors (bad input a 4xx, never a 500),
and GatewayAgentLoop runs a harness through the real agent-loop worker, where a rewritten
session is trained as two exact segments under one reward and advantage. A gateway process
SIGKILLed mid-session, a generation in flight: the session's segments are rebuilt from its
journal exactly as the engine generated them, the sample fails (masked by the buffer), the
counters move, and a replacement process serves the next session.
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest
import pytest_asyncio

from envs.trajectory_env import EnvBuilder
from envs.types import Message, Task, TerminationReason
from reward.loop import RewardLoop
from rollout.agent_loop import LoopSettings
from rollout.gate import TurnGate
from rollout.gateway.server import Gateway, GatewayServer, GatewaySettings
from rollout.gateway.loop import GatewayAgentLoop, HarnessEndpoint
from rollout.recorder import Budgets
from rollout.router import Router
from rollout.worker import AgentLoopWorker

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the shared engine's loop

@pytest.fixture(scope="module")
def engine(shared_engine):
    """This worker's read-only engine (conftest.shared_engine)."""
    return shared_engine

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOOLS = [{"type": "function", "function": {"name": "echo", "description": "Echo text.",
                                           "parameters": {"type": "object",
                                                          "properties": {"text": {"type": "string"}}}}}]


class RecordingEngine:
    """The real engine, with every prompt it was sent and every output it returned kept."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], object]] = []
        self.calls_with_ids: list[tuple[str, list[int], object]] = []

    async def generate(self, request_id, prompt_ids, sampling):
        out = await self.engine.generate(request_id, prompt_ids, sampling)
        self.calls.append(([int(i) for i in prompt_ids], out))
        self.calls_with_ids.append((request_id, *self.calls[-1]))
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def served(engine, tokenizer, chat):
    recording = RecordingEngine(engine)
    gateway = Gateway(Router({"e0": recording}), TurnGate(), chat, tokenizer,
                      GatewaySettings("tiny", Budgets(1024, 600, 24)))
    server = GatewayServer(gateway)
    await server.start()
    yield server, recording
    await server.stop()


def assert_exact(segment, calls):
    """Each prompt the engine saw is a prefix of the segment; its sampled ids, logprobs and
    versions are exactly the mask-1 tokens of the segment."""
    full = np.concatenate([segment.prompt_ids, segment.response_ids]).tolist()
    assert calls[0][0] == segment.prompt_ids.tolist()
    for prompt, _ in calls:
        assert full[:len(prompt)] == prompt
    model = segment.response_mask == 1
    assert segment.response_ids[model].tolist() == np.concatenate([o.token_ids for _, o in calls]).tolist()
    assert np.array_equal(segment.logprobs[model], np.concatenate([o.logprobs for _, o in calls]))
    assert np.array_equal(segment.versions[model], np.concatenate([o.versions for _, o in calls]))
    assert (segment.logprobs[~model] == 0).all()


def openai_client(server, session, token=None):
    import openai

    return openai.AsyncOpenAI(base_url=server.session_url(session) + "/v1", api_key=token or session.token,
                              max_retries=0)


async def test_openai_client_turns_make_one_exact_segment(served):
    server, engine = served
    session = server.gateway.open_session("t", "openai", 0)
    client = openai_client(server, session)
    messages = [SYSTEM, {"role": "user", "content": "Say hi."}]
    first = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=16)
    reply = first.choices[0].message
    assert first.usage.prompt_tokens == len(engine.calls[-1][0])
    messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=16)
    messages += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Once more."}]
    # The third turn streams; the client assembles the same kind of message.
    stream = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=16,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage.completion_tokens == len(engine.calls[-1][1].token_ids)
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    calls = engine.calls[-3:]
    (segment,) = server.gateway.close_session(session.id, TerminationReason.FINISHED)
    assert len(segment.turns) == 3
    assert_exact(segment, calls)
    assert server.gateway.stats().num_reencoded_tokens == 0


async def test_a_history_rewrite_starts_a_new_exact_segment(served):
    server, engine = served
    before = server.gateway.stats()
    session = server.gateway.open_session("t", "rewrite", 0)
    client = openai_client(server, session)
    messages = [SYSTEM, {"role": "user", "content": "Count."}]
    r1 = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
    messages += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    await client.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
    compressed = [SYSTEM, {"role": "user", "content": "Summary of the count so far. Go on."}]
    await client.chat.completions.create(model="tiny", messages=compressed, max_tokens=12)
    calls = engine.calls[-3:]
    first, second = server.gateway.close_session(session.id, TerminationReason.FINISHED)
    assert_exact(first, calls[:2])
    assert_exact(second, calls[2:])
    after = server.gateway.stats()
    assert after.num_prefix_breaks - before.num_prefix_breaks == 1
    assert after.num_reencoded_tokens - before.num_reencoded_tokens == len(second.prompt_ids)


async def test_anthropic_client_streaming_and_not(served):
    import anthropic

    server, engine = served
    session = server.gateway.open_session("t", "anthropic", 0)
    client = anthropic.AsyncAnthropic(base_url=server.session_url(session), api_key=session.token, max_retries=0)
    tools = [{"name": "echo", "description": "Echo text.", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages = [{"role": "user", "content": "Say hi."}]
    first = await client.messages.create(model="tiny", system="Be brief.", max_tokens=16, tools=tools,
                                         messages=messages)
    assert first.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert first.usage.output_tokens == len(engine.calls[-1][1].token_ids)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": "Again."}]
    async with client.messages.stream(model="tiny", system="Be brief.", max_tokens=16, tools=tools,
                                      messages=messages) as stream:
        final = await stream.get_final_message()
    assert final.usage.output_tokens == len(engine.calls[-1][1].token_ids)
    (segment,) = server.gateway.close_session(session.id, TerminationReason.FINISHED)
    assert_exact(segment, engine.calls[-2:])


async def test_tokens_and_malformed_requests_get_protocol_errors(served):
    import anthropic
    import openai

    server, _ = served
    mine = server.gateway.open_session("t", "auth", 0)
    other = server.gateway.open_session("t", "auth", 1)
    body = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    with pytest.raises(openai.PermissionDeniedError):
        await openai_client(server, mine, token=other.token).chat.completions.create(**body)
    with pytest.raises(openai.AuthenticationError) as bad:
        await openai_client(server, mine, token="forged").chat.completions.create(**body)
    assert "invalid API key" in bad.value.message
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        await anthropic.AsyncAnthropic(base_url=server.session_url(mine), api_key=other.token,
                                       max_retries=0).messages.create(**body)
    assert denied.value.body["error"]["type"] == "permission_error"
    with pytest.raises(openai.BadRequestError) as malformed:
        await openai_client(server, mine).chat.completions.create(model="tiny", messages=[])
    assert "messages" in malformed.value.message
    with pytest.raises(anthropic.BadRequestError):
        await anthropic.AsyncAnthropic(base_url=server.session_url(mine), api_key=mine.token,
                                       max_retries=0).messages.create(model="tiny", max_tokens=4, messages=[])
    listed = await openai_client(server, mine).models.list()
    assert [m.id for m in listed.data] == ["tiny"]
    assert server.gateway.close_session(mine.id, TerminationReason.FINISHED) == []  # nothing was generated
    server.gateway.close_session(other.id, TerminationReason.FINISHED)


async def test_bad_input_gets_4xx_never_a_500(served):
    """What gave a 500 before (a lone surrogate, `"tools": 5`, 100k-deep JSON) and an
    oversized body, from the official clients and as raw bytes: each a 4xx, counted, and
    none reaches the engine."""
    import anthropic
    import httpx
    import openai

    server, engine = served
    session = server.gateway.open_session("t", "bad", 0)
    before, num_calls = server.gateway.stats().errors_by_reason, len(engine.calls)
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="'tools' must be an array"):
        await openai_client(server, session).chat.completions.create(model="tiny", messages=user, tools=5,
                                                                     max_tokens=4)
    with pytest.raises(anthropic.BadRequestError, match="'tools' must be an array"):
        await anthropic.AsyncAnthropic(base_url=server.session_url(session), api_key=session.token,
                                       max_retries=0).messages.create(model="tiny", max_tokens=4, messages=user,
                                                                      tools=5)
    with pytest.raises(openai.APIStatusError) as too_big:
        await openai_client(server, session).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x" * (5 * 2**20)}], max_tokens=4)
    assert too_big.value.status_code == 413
    url = server.session_url(session) + "/v1/chat/completions"
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {session.token}"}, timeout=60) as client:
        for body in (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b"[" * 100_000 + b"]" * 100_000):
            response = await client.post(url, content=body)
            assert response.status_code == 400, response.text
    after = server.gateway.stats().errors_by_reason
    assert {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)} == {
        "invalid": 2, "too_large": 1, "malformed": 2}
    assert len(engine.calls) == num_calls
    # The session is unharmed: the next good request is its first segment.
    await openai_client(server, session).chat.completions.create(model="tiny", messages=user, max_tokens=4)
    (segment,) = server.gateway.close_session(session.id, TerminationReason.FINISHED)
    assert_exact(segment, engine.calls[-1:])


async def two_turns(endpoint: HarnessEndpoint, task: Task):
    """Two turns with the official OpenAI client, as a black box would; the client and the
    conversation so far."""
    import openai

    client = openai.AsyncOpenAI(base_url=endpoint.openai_base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [m.to_template() for m in task.messages]
    for follow_up in ("Go on.", None):
        out = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=12)
        messages.append(out.choices[0].message.model_dump(exclude_none=True))
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return client, messages


class ChattyHarness(GatewayAgentLoop):
    """An in-process harness: two turns."""

    model_name = "tiny"

    async def run_harness(self, task: Task, endpoint: HarnessEndpoint, ctx) -> TerminationReason:
        await two_turns(endpoint, task)
        return TerminationReason.FINISHED


def gateway_worker(engine, tokenizer, chat, loop: str, recording: RecordingEngine | None = None):
    recording = recording or RecordingEngine(engine)
    settings = LoopSettings(budgets=Budgets(1024, 600, 24), max_turns=4, max_tool_calls_per_turn=2,
                            tool_timeout_s=5)
    worker = AgentLoopWorker(
        default_loop=loop, settings=settings, chat=chat, tokenizer=tokenizer,
        router=Router({"e0": recording}), envs=EnvBuilder({}),
        rewards=RewardLoop("exact_match", lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                           timeout_s=30.0, max_concurrency=4), trajectory_timeout_s=120)
    return worker, recording


async def test_gateway_agent_loop_runs_a_harness_in_the_worker(engine, tokenizer, chat):
    worker, recording = gateway_worker(engine, tokenizer, chat, f"{__name__}:ChattyHarness")
    task = Task("hi", (Message("system", "Be brief."), Message("user", "Say hi.")), answer="hi")
    group = await worker.run_group(task, "gw", 3)
    loop = worker.loop_for(task)
    assert group.size == 3  # no rewrite: one segment per sample
    for t in group.trajectories:
        assert t.termination == TerminationReason.FINISHED, t.termination_detail
        assert len(t.turns) == 2 and t.reward is not None and t.segment == 0
        full = np.concatenate([t.prompt_ids, t.response_ids]).tolist()
        sent = [c for c in recording.calls if c[0] == full[:len(c[0])]]
        assert {len(c[0]) for c in sent} >= {len(t.prompt_ids), t.turns[1].prompt_tokens}
    assert loop.host.stats().num_prefix_breaks == 0
    metrics = worker.stats().gateway.as_metrics()
    assert metrics["gateway/sessions"] == 3 and metrics["gateway/reencoded_tokens"] == 0
    await loop.close()


class RewritingHarness(GatewayAgentLoop):
    """Two turns, then the history compressed into one user message (a context-managing
    harness), then one more turn: two segments for the sample."""

    model_name = "tiny"

    async def run_harness(self, task: Task, endpoint: HarnessEndpoint, ctx) -> TerminationReason:
        client, messages = await two_turns(endpoint, task)
        compressed = [messages[0], {"role": "user", "content": "Summary so far: you counted. Say hi."}]
        await client.chat.completions.create(model=endpoint.model, messages=compressed, max_tokens=12)
        return TerminationReason.FINISHED


class RewritingHarnessInProcesses(RewritingHarness):
    num_gateway_processes = 2


@pytest.mark.parametrize("loop", ["RewritingHarness", "RewritingHarnessInProcesses"])
async def test_a_rewritten_session_trains_two_exact_segments_under_one_reward(engine, tokenizer, chat, loop):
    """In-process and with 2 gateway processes behind the worker's router: the same."""
    from trainer.train.advantages import compute_group_advantages
    from trainer.train.config import LossConfig

    worker, recording = gateway_worker(engine, tokenizer, chat, f"{__name__}:{loop}")
    task = Task("hi", (Message("system", "Be brief."), Message("user", "Say hi.")), answer="hi")
    group = await worker.run_group(task, "rw", 2)
    assert [(t.index, t.segment) for t in group.trajectories] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for index in (0, 1):
        first, second = [t for t in group.trajectories if t.index == index]
        calls = [(p, o) for rid, p, o in recording.calls_with_ids if rid.startswith(f"rw/{index}#")]
        assert len(calls) == 3 and len(first.turns) == 2 and len(second.turns) == 1
        assert_exact(first, calls[:2])
        assert_exact(second, calls[2:])
        assert first.reward == second.reward is not None  # scored once, on the last segment
        assert first.termination is second.termination is TerminationReason.FINISHED
    adv = compute_group_advantages(group, LossConfig())
    assert adv[0] == adv[1] and adv[2] == adv[3]  # each segment carries its sample's advantage
    stats = worker.stats()
    assert stats.num_finished == 2 and stats.num_segments == 4
    metrics = stats.gateway.as_metrics()
    assert metrics["gateway/prefix_breaks"] == 2 and metrics["gateway/segments_per_session"] == 2.0
    assert metrics["gateway/requests"] == 6 and metrics["gateway/open_sessions"] == 0
    if loop.endswith("InProcesses"):  # one session on each process (fewest open sessions first)
        assert [p.stats.num_sessions for p in worker.loop_for(task).host._procs] == [1, 1]
    assert metrics["gateway/reencoded_tokens"] == sum(len(t.prompt_ids) for t in group.trajectories if t.segment)
    await worker.loop_for(task).close()


class HoldingEngine(RecordingEngine):
    """The recording engine, except that calls whose request id starts with `hold_prefix`
    are held, never answered (until their caller gives up on them)."""

    def __init__(self, engine, hold_prefix: str) -> None:
        super().__init__(engine)
        self.hold_prefix = hold_prefix
        self.held = asyncio.Event()

    async def generate(self, request_id, prompt_ids, sampling):
        if request_id.startswith(self.hold_prefix):
            self.held.set()
            await asyncio.Event().wait()  # cancelled by the worker once the process's connection is gone
        return await super().generate(request_id, prompt_ids, sampling)


class FourTurnsInOneProcess(GatewayAgentLoop):
    """Four turns with the official OpenAI client, from one gateway process; what each
    reply said is kept by (group, sample)."""

    model_name = "tiny"
    num_gateway_processes = 1
    received: dict[tuple[str, int], list] = {}

    async def run_harness(self, task: Task, endpoint: HarnessEndpoint, ctx) -> TerminationReason:
        import openai

        client = openai.AsyncOpenAI(base_url=endpoint.openai_base_url, api_key=endpoint.api_key, max_retries=0)
        messages = [m.to_template() for m in task.messages]
        replies = self.received.setdefault((ctx.group_id, ctx.index), [])
        for turn in range(4):
            out = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=12)
            replies.append(out)
            messages += [out.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"Go on ({turn})."}]
        return TerminationReason.FINISHED


async def test_a_killed_gateway_process_loses_nothing_the_engine_completed(engine, tokenizer, chat):
    """Two samples on one gateway process; sample 1 finishes, sample 0's third generation
    is held in the engine and the process is SIGKILLed. Sample 0 keeps exactly the two
    generations the engine completed (ids, logprobs, versions), ends `error` (its third
    turn is unknown) and the buffer masks it; the journal counters move; a replacement
    process serves the next session; no journal is left behind."""
    from buffer.replay_buffer import ReplayBuffer

    recording = HoldingEngine(engine, "kill/0#3")
    worker, _ = gateway_worker(engine, tokenizer, chat, f"{__name__}:FourTurnsInOneProcess", recording)
    task = Task("hi", (Message("system", "Be brief."), Message("user", "Say hi.")), answer="hi")
    loop = worker.loop_for(task)
    running = asyncio.create_task(worker.run_group(task, "kill", 2))
    await asyncio.wait_for(recording.held.wait(), 600)  # the process starts first
    async with asyncio.timeout(300):
        while worker.stats().num_running > 1:  # sample 1's four turns, on the same process
            await asyncio.sleep(0.05)
    (process,) = loop.host._procs
    os.kill(process.proc.pid, signal.SIGKILL)
    group = await asyncio.wait_for(running, 120)

    (killed,) = [t for t in group.trajectories if t.index == 0]
    calls = [(p, o) for rid, p, o in recording.calls_with_ids if rid.startswith("kill/0#")]
    assert len(calls) == 2 and len(killed.turns) == 2  # what the engine completed; nothing of the third
    assert_exact(killed, calls)
    replies = FourTurnsInOneProcess.received[("kill", 0)]
    assert [r.usage.completion_tokens for r in replies] == [t.num_generated for t in killed.turns]
    assert [r.usage.prompt_tokens for r in replies] == [len(p) for p, _ in calls]
    assert killed.response_mask[-1] == 0  # ends on the third request's user turn, sent, never answered
    assert killed.termination is TerminationReason.ERROR
    assert "exit code -9" in killed.termination_detail and "never completed" in killed.termination_detail
    (finished,) = [t for t in group.trajectories if t.index == 1]
    assert finished.termination is TerminationReason.FINISHED and len(finished.turns) == 4
    assert_exact(finished, [(p, o) for rid, p, o in recording.calls_with_ids if rid.startswith("kill/1#")])

    buffer = ReplayBuffer(max_staleness=1, groups_per_step=1, failure_policy="mask")
    assert buffer.try_admit() and buffer.put(group) == "buffered"
    (trained,) = buffer.get(1, version=0)
    assert [t.num_model_tokens for t in trained.trajectories] == [0, finished.num_model_tokens]
    metrics = worker.stats().gateway.as_metrics()
    assert metrics["gateway/journal_recovered"] == 1 and metrics["gateway/journal_masked"] == 1
    assert metrics["gateway/open_sessions"] == 0 and metrics["gateway/sessions"] == 2

    fresh = await asyncio.wait_for(worker.run_group(task, "fresh", 1), 600)
    (t,) = fresh.trajectories
    assert t.termination is TerminationReason.FINISHED and len(t.turns) == 4
    assert [p.lost.is_set() for p in loop.host._procs] == [True, False]  # served by the replacement
    assert os.listdir(loop.host.journal_dir) == []
    assert worker.stats().gateway.as_metrics()["gateway/journal_recovered"] == 1
    await loop.close()
