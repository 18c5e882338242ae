"""The gateway's session logic on a fake engine (no server, no vLLM engine): a request
that extends the previous one appends only the new ids to the same segment; a rewrite, a
retry or new tools start a new segment, counted; tool calls come back in each protocol's
format; tokens are per session; malformed bodies get the protocol's error shape.
The real clients against the real engine are in tests/integration/test_gateway_e2e.py.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from envs.types import TerminationReason
from rollout.chat import build_continuity_builder
from rollout.engine import TokenOutput
from rollout.gate import TurnGate
from rollout.gateway.server import Gateway, GatewaySettings
from rollout.gateway.protocol import (ProtocolError, anthropic_response, openai_response,
                                      parse_anthropic_request, parse_openai_request)
from rollout.recorder import Budgets
from rollout.router import Router

CALL = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "echo", "description": "Echo text.",
                                           "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}]
HEAD = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Echo hi."}]


class FakeScriptedEngine:
    """A fake engine: the k-th generation is script[k] + the stop token, logprobs distinct per token."""

    def __init__(self, tokenizer, script: list[str], stop_id: int) -> None:
        self.tokenizer, self.script, self.stop_id = tokenizer, script, stop_id
        self.prompts: list[list[int]] = []
        self.outputs: list[TokenOutput] = []

    async def generate(self, request_id, prompt_ids, sampling):
        self.prompts.append([int(i) for i in prompt_ids])
        text = self.script[min(len(self.prompts), len(self.script)) - 1]
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.stop_id]
        n = len(ids)
        out = TokenOutput(np.array(ids, np.int32), -np.arange(1, n + 1, dtype=np.float32) / 10,
                          np.full(n, 3, np.int32), "stop", len(prompt_ids), 0)
        self.outputs.append(out)
        await asyncio.sleep(0)
        return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def chat(tokenizer):
    return build_continuity_builder(tokenizer, "tiny", reasoning_parser="none")


def make(tokenizer, chat, script):
    engine = FakeScriptedEngine(tokenizer, script, chat.end_of_turn_id)
    gateway = Gateway(Router({"e0": engine}), TurnGate(), chat, tokenizer,
                      GatewaySettings("policy", Budgets(4096, 2048, 256)))
    return gateway, engine, gateway.open_session("task", "g", 0)


async def ask(gateway, session, body, protocol="openai"):
    parse = parse_openai_request if protocol == "openai" else parse_anthropic_request
    reply = await gateway.complete(session, parse(body))
    return (openai_response if protocol == "openai" else anthropic_response)(reply)


def assert_exact(segment, engine_outputs, prompts):
    """Each prompt sent is a prefix of the segment; mask 1 exactly on the sampled ids, with their logprobs."""
    full = np.concatenate([segment.prompt_ids, segment.response_ids]).tolist()
    for p in prompts:
        assert full[:len(p)] == p
    sampled = np.concatenate([o.token_ids for o in engine_outputs])
    assert segment.response_ids[segment.response_mask == 1].tolist() == sampled.tolist()
    assert np.array_equal(segment.logprobs[segment.response_mask == 1],
                          np.concatenate([o.logprobs for o in engine_outputs]))
    assert (segment.logprobs[segment.response_mask == 0] == 0).all()
    assert (segment.versions[segment.response_mask == 1] == 3).all()


async def test_tool_call_round_trip_stays_in_one_segment(tokenizer, chat):
    gateway, engine, session = make(tokenizer, chat, [CALL, "Done: hi"])
    first = await ask(gateway, session, {"model": "policy", "messages": HEAD, "tools": TOOLS})
    message = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "echo" and json.loads(call["function"]["arguments"]) == {"text": "hi"}
    history = HEAD + [message, {"role": "tool", "tool_call_id": call["id"], "content": "hi"}]
    second = await ask(gateway, session, {"model": "policy", "messages": history, "tools": TOOLS})
    assert second["choices"][0]["message"]["content"] == "Done: hi"
    (segment,) = gateway.close_session(session.id, TerminationReason.FINISHED)
    assert segment.termination == TerminationReason.FINISHED and len(segment.turns) == 2
    assert engine.prompts[0] == segment.prompt_ids.tolist()
    assert_exact(segment, engine.outputs, engine.prompts)
    # The tool message was appended as the builder's observation ids, nothing re-encoded.
    obs = chat.observation_ids([m for m in parse_openai_request({"messages": history}).messages[-1:]], True)
    assert engine.prompts[1][-len(obs):] == obs
    stats = gateway.stats()
    assert (stats.num_segments, stats.num_prefix_breaks, stats.num_reencoded_tokens) == (1, 0, 0)


async def test_rewrite_retry_and_new_tools_start_segments(tokenizer, chat):
    gateway, engine, session = make(tokenizer, chat, ["one", "two", "three", "four", "five"])
    r1 = (await ask(gateway, session, {"messages": HEAD}))["choices"][0]["message"]
    turn2 = HEAD + [r1, {"role": "user", "content": "More."}]
    r2 = (await ask(gateway, session, {"messages": turn2}))["choices"][0]["message"]
    assert gateway.stats().num_prefix_breaks == 0
    # The harness compresses its history: the first exchange is dropped.
    await ask(gateway, session, {"messages": [HEAD[0], {"role": "user", "content": "Summary."}, ]})
    assert gateway.stats().num_prefix_breaks == 1
    # A retry of the same request does not extend the reply it got: another segment.
    await ask(gateway, session, {"messages": [HEAD[0], {"role": "user", "content": "Summary."}]})
    # Another tool list: the system prompt the template renders changed.
    await ask(gateway, session, {"messages": turn2 + [r2, {"role": "user", "content": "Go."}], "tools": TOOLS})
    segments = gateway.close_session(session.id, TerminationReason.MAX_TURNS)
    assert [len(s.turns) for s in segments] == [2, 1, 1, 1]
    assert [s.termination for s in segments] == [TerminationReason.FINISHED] * 3 + [TerminationReason.MAX_TURNS]
    assert_exact(segments[0], engine.outputs[:2], engine.prompts[:2])
    for i, s in enumerate(segments[1:], start=2):
        assert_exact(s, engine.outputs[i:i + 1], engine.prompts[i:i + 1])
    stats = gateway.stats()
    assert (stats.num_segments, stats.num_prefix_breaks) == (4, 3)
    assert stats.num_reencoded_tokens == sum(len(s.prompt_ids) for s in segments[1:])
    assert stats.as_metrics()["gateway/segments"] == 4


async def test_an_edited_reply_breaks_the_prefix(tokenizer, chat):
    gateway, _, session = make(tokenizer, chat, ["answer", "again"])
    r1 = (await ask(gateway, session, {"messages": HEAD}))["choices"][0]["message"]
    edited = {**r1, "content": r1["content"] + " (edited)"}
    await ask(gateway, session, {"messages": HEAD + [edited, {"role": "user", "content": "Next."}]})
    assert len(gateway.close_session(session.id, TerminationReason.FINISHED)) == 2


async def test_anthropic_tool_use_and_tool_result(tokenizer, chat):
    gateway, engine, session = make(tokenizer, chat, [CALL, "Done."])
    tools = [{"name": "echo", "description": "Echo text.", "input_schema": TOOLS[0]["function"]["parameters"]}]
    body = {"model": "policy", "max_tokens": 64, "system": "Use tools.", "tools": tools,
            "messages": [{"role": "user", "content": "Echo hi."}]}
    first = await ask(gateway, session, body, "anthropic")
    assert first["stop_reason"] == "tool_use"
    (use,) = [b for b in first["content"] if b["type"] == "tool_use"]
    assert use["name"] == "echo" and use["input"] == {"text": "hi"}
    body["messages"] += [{"role": "assistant", "content": first["content"]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "hi"}]}]
    second = await ask(gateway, session, body, "anthropic")
    assert second["content"] == [{"type": "text", "text": "Done."}] and second["stop_reason"] == "end_turn"
    (segment,) = gateway.close_session(session.id, TerminationReason.FINISHED)
    assert_exact(segment, engine.outputs, engine.prompts)


async def test_tokens_are_per_session(tokenizer, chat):
    gateway, _, mine = make(tokenizer, chat, ["x"])
    other = gateway.open_session("task", "g", 1)
    assert gateway.authorize(mine.id, mine.token) is mine
    with pytest.raises(ProtocolError) as refused:
        gateway.authorize(mine.id, other.token)
    assert refused.value.status == 403
    assert refused.value.body("anthropic")["error"]["type"] == "permission_error"
    for token in (None, "", "not-a-token"):
        with pytest.raises(ProtocolError) as missing:
            gateway.authorize(mine.id, token)
        assert missing.value.status == 401
    gateway.close_session(mine.id, TerminationReason.FINISHED)
    with pytest.raises(ProtocolError) as closed:
        gateway.authorize(mine.id, mine.token)
    assert closed.value.status == 401


@pytest.mark.parametrize("body, protocol, words", [
    ({"messages": []}, "openai", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "openai", "unknown role"),
    ({"messages": HEAD, "n": 2}, "openai", "n=1"),
    ({"messages": HEAD, "tool_choice": "required"}, "openai", "tool_choice"),
    ({"messages": HEAD, "temperature": "hot"}, "openai", "temperature"),
    ({"messages": HEAD, "response_format": {"type": "json_object"}}, "openai", "response_format"),
    ({"messages": HEAD, "logit_bias": {"5": 10}}, "openai", "logit_bias"),
    ({"messages": HEAD, "frequency_penalty": 0.5}, "openai", "frequency_penalty"),
    ({"messages": HEAD, "logprobs": True}, "openai", "logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "openai", "text"),
    ({"messages": [{"role": "user", "content": "x"}]}, "anthropic", "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "anthropic", "role"),
    ("not an object", "anthropic", "JSON object"),
])
def test_malformed_requests_get_the_protocols_error(body, protocol, words):
    parse = parse_openai_request if protocol == "openai" else parse_anthropic_request
    with pytest.raises(ProtocolError) as refused:
        parse(body)
    assert refused.value.status == 400 and words in refused.value.message
    shape = refused.value.body(protocol)
    if protocol == "openai":
        assert shape["error"]["type"] == "invalid_request_error"
    else:
        assert shape["type"] == "error" and shape["error"]["type"] == "invalid_request_error"


async def test_a_multi_token_stop_string_is_refused_and_counted(tokenizer, chat):
    gateway, engine, session = make(tokenizer, chat, ["x"])
    with pytest.raises(ProtocolError, match="stop sequence"):
        await ask(gateway, session, {"messages": HEAD, "stop": ["a long stop string"]})
    assert gateway.stats().num_errors == 1
    # The refused request recorded nothing: the next one is the session's first segment.
    await ask(gateway, session, {"messages": HEAD})
    assert len(engine.prompts) == 1
    (segment,) = gateway.close_session(session.id, TerminationReason.FINISHED)
    assert segment.prompt_ids.tolist() == engine.prompts[0]
    assert gateway.stats().num_prefix_breaks == 0


async def test_rpc_peers_call_each_other_and_fail_pending_calls_on_close():
    """The worker <-> gateway-process link (rollout.gateway.procs): calls both ways, in
    parallel, errors come back as the caller's error, a closed link fails what is pending."""
    import asyncio
    import socket

    from rollout.gateway.procs import RpcPeer

    a_sock, b_sock = socket.socketpair()
    (ra, wa), (rb, wb) = [await asyncio.open_unix_connection(sock=s) for s in (a_sock, b_sock)]
    hold = asyncio.Event()

    async def slow(x):
        await hold.wait()
        return x * 2

    async def boom():
        raise KeyError("nope")

    a = RpcPeer(ra, wa, {"slow": slow})
    b = RpcPeer(rb, wb, {"echo": lambda *args: asyncio.sleep(0, args), "boom": boom})
    serving = [asyncio.create_task(a.serve()), asyncio.create_task(b.serve())]
    pending = asyncio.create_task(b.call("slow", 21))
    assert await a.call("echo", 1, "x") == (1, "x")  # answered while "slow" is still running
    with pytest.raises(RuntimeError, match="KeyError"):
        await a.call("boom")
    hold.set()
    assert await pending == 42
    never = asyncio.create_task(b.call("slow", 1))
    hold.clear()
    await asyncio.sleep(0.01)
    a.close()
    with pytest.raises(ConnectionError):
        await never
    await asyncio.gather(*serving, return_exceptions=True)
    with pytest.raises(ConnectionError, match="not sent"):  # a dead process fails fast, never hangs
        await b.call("slow", 2)


def test_chat_spec_rebuilds_the_same_builder(tokenizer, chat):
    from rollout.gateway.procs import ChatSpec

    spec = ChatSpec.of(chat)
    assert (spec.family, spec.tool_parser, spec.reasoning_parser) == ("tiny", "hermes", "none")
    _, rebuilt = spec.build()
    messages = parse_openai_request({"messages": HEAD}).messages
    assert rebuilt.initial_prompt_ids(messages, None) == chat.initial_prompt_ids(messages, None)
