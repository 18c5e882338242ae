"""The gateway's session logic on a fake engine (no vLLM engine): a request that extends
the previous one appends only the new ids to the same segment; a rewrite, a retry or new
tools start a new segment, counted; tool calls come back in each protocol's format; tokens
are per session; malformed bodies get the protocol's error shape.

Bad input, by class (each refused with a 4xx, counted by reason, never a 500): bodies over
the size cap (413, before they are read), JSON nested too deep (before decoding), invalid
UTF-8 and lone surrogates, NaN/Infinity, every field of the wrong type in both protocols,
text that cannot fit the session's budget (refused before rendering), stop strings longer
than any token; and over HTTP against the real server (uvicorn, a fake engine), including
one session's huge request held mid-render while another session's small one completes.
The real clients against the real engine are in tests/integration/test_gateway_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
import pytest_asyncio

from envs.types import Message, TerminationReason
from rollout.chat import build_continuity_builder, encode
from rollout.engine import TokenOutput
from rollout.gate import TurnGate
from rollout.gateway.server import Gateway, GatewayServer, GatewaySettings, GatewayStats, sum_gateway_stats
from rollout.gateway.protocol import (ProtocolError, anthropic_response, openai_response,
                                      parse_anthropic_request, parse_openai_request)
from rollout.gateway.refusals import ErrorReason, json_depth, load_json
from rollout.recorder import Budgets
from rollout.router import Router

CALL = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "echo", "description": "Echo text.",
                                           "parameters": {"type": "object",
                                                          "properties": {"text": {"type": "string"}}}}}]
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
                         {"role": "user",
                          "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "hi"}]}]
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
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}]}]},
     "openai", "data URL"),  # images come inline (tests/unit/test_gateway_images.py)
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


# -- bad input, by class ---------------------------------------------------------------------

def nested(depth: int, opener: str = "[", closer: str = "]") -> bytes:
    return (opener * depth + closer * depth).encode()


def test_json_depth_counts_structure_only():
    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(nested(100_000)) == 100_000
    # Brackets inside strings, escaped quotes and escaped backslashes do not count.
    assert json_depth(json.dumps({"content": "[" * 500 + '\\"{{{' + "\\\\"}).encode()) == 1
    assert json_depth(b'["\\\\", "[[[", ["\\"]"]]') == 2


@pytest.mark.parametrize("data", [
    nested(100_000),  # the 500 of the report: a RecursionError inside the decoder
    b'{"a":' * 65 + b"1" + b"}" * 65,
    b'{"messages": ' + nested(70) + b"}",
    nested(200_000, "{", "}"),  # invalid JSON too: refused before the decoder sees it
])
def test_json_nested_too_deep_is_refused_before_decoding(data):
    with pytest.raises(ProtocolError) as refused:
        load_json(data, 64)
    assert refused.value.status == 400 and refused.value.reason is ErrorReason.MALFORMED
    assert "deep" in refused.value.message and "max_json_depth" in refused.value.message


def test_json_at_the_depth_limit_is_accepted():
    value = load_json(b'{"a":' * 63 + b"[1]" + b"}" * 63, 64)
    for _ in range(63):
        value = value["a"]
    assert value == [1]


@pytest.mark.parametrize("data, words", [
    (b'{"messages": "\\ud800"}', "surrogate"),  # a lone high surrogate
    (b'{"messages": "ok \\udc00 ok"}', "surrogate"),  # a lone low one
    (b'{"messages": "\\udc00\\ud800"}', "surrogate"),  # a pair in the wrong order
    (b'{"\\ud83d": 1}', "surrogate"),  # in a key
    (b'[1, ["x", "\\uDBFF"]]', "surrogate"),  # upper-case hex, nested
    (b'{"a": "\xff"}', "UTF-8"),  # not UTF-8
    (b'{"a": "\xed\xa0\x80"}', "UTF-8"),  # a surrogate encoded as bytes (CESU-8)
    (b'{"a": "\xc0\xaf"}', "UTF-8"),  # an overlong encoding
    (b'{"a": NaN}', "NaN"),
    (b'{"a": -Infinity}', "Infinity"),
    (b"[" + b"9" * 5000 + b"]", "digits"),  # an int Python will not convert
    (b'{"a": 1', "JSON"),
    (b"", "JSON"),
])
def test_undecodable_bodies_are_refused(data, words):
    with pytest.raises(ProtocolError) as refused:
        load_json(data, 64)
    assert refused.value.status == 400 and refused.value.reason is ErrorReason.MALFORMED
    assert words in refused.value.message
    json.dumps(refused.value.body("openai")).encode("utf-8")  # the error itself is sendable


def test_valid_unicode_passes():
    assert load_json(b'{"a": "\\ud83d\\ude00 \xc3\xa9 \\\\ud800"}', 64) == {"a": "\U0001F600 \u00e9 \\ud800"}


USER = [{"role": "user", "content": "x"}]
ANTHROPIC = {"max_tokens": 8, "messages": USER}
TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "echo", "input": {}}]}


@pytest.mark.parametrize("body, param, reason", [
    ({"messages": USER, "tools": 5}, "tools", "invalid"),  # the 500 of the report
    ({"messages": USER, "tools": [5]}, "tools[0]", "invalid"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function", "invalid"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name",
     "invalid"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", "invalid"),
    ({"messages": USER, "tools": [{"type": "custom", "custom": {}}]}, "tools[0].type", "unsupported"),
    ({"messages": USER, "tool_choice": 5}, "tool_choice", "invalid"),
    ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "unsupported"),
    ({"messages": "hi"}, "messages", "invalid"),
    ({"messages": ["hi"]}, "messages[0]", "invalid"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "invalid"),
    ({"messages": [{"role": 5, "content": "x"}]}, "messages[0].role", "invalid"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text",
     "invalid"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]", "invalid"),
    ({"messages": [{"role": "user", "content": "x", "name": []}]}, "messages[0].name", "invalid"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": ["a"]}]}, "messages[0].tool_call_id",
     "invalid"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls", "invalid"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": {"a": 1}}]}, "messages[0].tool_calls",
     "invalid"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}]}, "messages[0].tool_calls[0].function.arguments", "invalid"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 7}}]}]},
     "messages[0].tool_calls[0].function.arguments", "invalid"),
    ({"messages": [{"role": "assistant", "content": "", "reasoning_content": 1}]},
     "messages[0].reasoning_content", "invalid"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "unsupported"),
    ({"messages": USER, "max_tokens": "5"}, "max_tokens", "invalid"),
    ({"messages": USER, "max_tokens": True}, "max_tokens", "invalid"),
    ({"messages": USER, "max_tokens": 1.5}, "max_tokens", "invalid"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "invalid"),
    ({"messages": USER, "temperature": 1e999}, "temperature", "invalid"),  # decodes to inf
    ({"messages": USER, "temperature": 3}, "temperature", "invalid"),
    ({"messages": USER, "top_p": -0.1}, "top_p", "invalid"),
    ({"messages": USER, "stop": 5}, "stop", "invalid"),
    ({"messages": USER, "stop": ["a", 1]}, "stop[1]", "invalid"),
    ({"messages": USER, "stop": ["x"] * 17}, "stop", "invalid"),
    ({"messages": USER, "stream": "yes"}, "stream", "invalid"),
    ({"messages": USER, "stream": 1}, "stream", "invalid"),
    ({"messages": USER, "stream_options": 5}, "stream_options", "invalid"),
    ({"messages": USER, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "invalid"),
    ({"messages": USER, "n": "2"}, "n", "invalid"),
    ({"messages": USER, "model": 5}, "model", "invalid"),
    ({"messages": USER, "seed": "x"}, "seed", "invalid"),
    ({"messages": USER, "parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid"),
    ({"messages": USER, "logit_bias": [1]}, "logit_bias", "invalid"),
    ({"messages": USER, "presence_penalty": "1"}, "presence_penalty", "invalid"),
    ({"messages": USER, "response_format": 5}, "response_format", "invalid"),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions", "unsupported"),
    ({"messages": USER, "modalities": ["text", "audio"]}, "modalities", "unsupported"),
])
def test_openai_fields_of_the_wrong_type_are_named(body, param, reason):
    with pytest.raises(ProtocolError) as refused:
        parse_openai_request(body)
    err = refused.value
    assert err.status == 400 and err.reason.value == reason, err.message
    assert err.body("openai")["error"]["param"] == param and param.split(".")[0].split("[")[0] in err.message


@pytest.mark.parametrize("patch, where, reason", [
    ({"tools": 5}, "tools", "invalid"),
    ({"tools": [{"name": "f", "input_schema": "x"}]}, "tools.0.input_schema", "invalid"),
    ({"tools": [{"input_schema": {}}]}, "tools.0.name", "invalid"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type", "unsupported"),
    ({"tool_choice": "auto"}, "tool_choice", "invalid"),  # an object in this protocol
    ({"tool_choice": {"type": "any"}}, "tool_choice", "unsupported"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type", "invalid"),
    ({"system": 5}, "system", "invalid"),
    ({"system": [{"type": "text"}]}, "system.0.text", "invalid"),
    ({"system": [{"type": "image"}]}, "system.0.type", "invalid"),  # user content and tool results only
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "invalid"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text", "invalid"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages.0.content.0.type", "invalid"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type",
     "unsupported"),
    ({"messages": [{"role": "user", "content": [TOOL_USE["content"][0]]}]}, "messages.0.content.0.type",
     "invalid"),  # a tool_use block in a user turn
    ({"messages": [USER[0], {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": 5}]},
                   USER[0]]}, "messages.1.content.0.name", "invalid"),
    ({"messages": [USER[0], {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                "input": "x"}]}, USER[0]]},
     "messages.1.content.0.input", "invalid"),
    ({"messages": [USER[0], TOOL_USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "document", "source": {}}]}]}]},
     "messages.2.content.0.content.0.type", "unsupported"),
    ({"messages": [USER[0], TOOL_USE, {"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages.2.content.0.tool_use_id", "invalid"),
    ({"messages": [USER[0], {"role": "assistant", "content": "Sure,"}]}, "messages.1", "unsupported"),  # prefill
    ({"max_tokens": "8"}, "max_tokens", "invalid"),
    ({"max_tokens": 0}, "max_tokens", "invalid"),
    ({"thinking": "on"}, "thinking", "invalid"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "unsupported"),
    ({"stop_sequences": "x"}, "stop_sequences", "invalid"),
    ({"temperature": 1.5}, "temperature", "invalid"),  # 0..1 in this protocol
    ({"top_k": -1}, "top_k", "invalid"),
    ({"stream": "true"}, "stream", "invalid"),
    ({"metadata": "x"}, "metadata", "invalid"),
])
def test_anthropic_fields_of_the_wrong_type_are_named(patch, where, reason):
    with pytest.raises(ProtocolError) as refused:
        parse_anthropic_request({**ANTHROPIC, **patch})
    err = refused.value
    assert err.status == 400 and err.reason.value == reason, err.message
    assert where in err.message and err.body("anthropic")["error"]["type"] == "invalid_request_error"


def test_tool_call_arguments_get_the_same_guards():
    deep = "[" * 100 + "]" * 100
    for arguments, words in ((deep, "deep"), ('{"a": "\\ud800"}', "surrogate"), ('{"a": NaN}', "NaN")):
        body = {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]},
                             USER[0]]}
        with pytest.raises(ProtocolError, match=words) as refused:
            parse_openai_request(body)
        assert refused.value.status == 400
    ok = {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"x": [1]}'}}]},
                       USER[0]]}
    assert parse_openai_request(ok).messages[0].tool_calls[0].arguments == {"x": [1]}


async def chunks_of(data: bytes, size: int = 65536, consumed: list[int] | None = None):
    for start in range(0, len(data), size):
        if consumed is not None:
            consumed.append(start)
        yield data[start:start + size]


SMALL_BUDGETS = Budgets(4096, 2048, 256)


def small_gateway(tokenizer, chat, script=("ok",), budgets=SMALL_BUDGETS, **settings):
    engine = FakeScriptedEngine(tokenizer, list(script), chat.end_of_turn_id)
    return Gateway(Router({"e0": engine}), TurnGate(), chat, tokenizer,
                   GatewaySettings("policy", budgets, **settings)), engine


async def test_bodies_over_the_cap_are_refused_before_they_are_read(tokenizer, chat):
    gateway, _ = small_gateway(tokenizer, chat, max_body_bytes=4096)
    session = gateway.open_session("t", "g", 0)
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    for declared in (str(len(big)), "9" * 40):  # the length it declares, or an absurd one
        consumed: list[int] = []
        with pytest.raises(ProtocolError) as refused:
            await gateway.handle("openai", session.id, session.token, declared, chunks_of(big, consumed=consumed))
        assert refused.value.status == 413 and "4096" in refused.value.message and consumed == []
    consumed = []  # chunked (no length): read only until past the cap
    with pytest.raises(ProtocolError) as refused:
        await gateway.handle("anthropic", session.id, session.token, None, chunks_of(big, 1024, consumed))
    assert refused.value.status == 413 and len(consumed) == 5
    assert refused.value.body("anthropic")["error"]["type"] == "request_too_large"
    small = json.dumps({"messages": HEAD}).encode()
    turn, reply = await gateway.handle("openai", session.id, session.token, str(len(small)), chunks_of(small))
    assert reply.content == "ok" and turn.messages[-1].content == "Echo hi."
    stats = gateway.stats()
    assert stats.num_requests == 4 and stats.errors_by_reason == {"too_large": 3}
    with pytest.raises(ValueError, match="max_body_bytes"):
        GatewaySettings("policy", Budgets(4096, 2048, 256), max_body_bytes=10)


def test_no_token_covers_more_characters_than_the_bound(tokenizer):
    """The length bound is sound: text of C characters is at least C / max_token_chars tokens."""
    gateway, _ = small_gateway(tokenizer, build_continuity_builder(tokenizer, "tiny", reasoning_parser="none"))
    longest = max(tokenizer.get_vocab(), key=len)
    texts = ["a" * 997, " " * 1000, "\n" * 300, longest * 50, "<|im_start|>" * 40, "é漢字😀\u0301" * 100,
             "".join(chr(32 + (i * 7919) % 5000) for i in range(3000)), "the cat sat on the mat. " * 80]
    for text in texts:
        assert len(encode(tokenizer, text)) * gateway.max_token_chars >= len(text), text[:20]


class FakeCountingChat:
    """A fake continuity builder: the real one, counting how much text it was asked to render."""

    def __init__(self, chat) -> None:
        self.chat, self.rendered = chat, []

    def __getattr__(self, name):
        return getattr(self.chat, name)

    def initial_prompt_ids(self, messages, tools):
        self.rendered.append(sum(len(m.content) for m in messages))
        return self.chat.initial_prompt_ids(messages, tools)

    def observation_ids(self, messages, ended):
        self.rendered.append(sum(len(m.content) for m in messages))
        return self.chat.observation_ids(messages, ended)


async def test_text_that_cannot_fit_is_refused_before_it_is_rendered(tokenizer, chat):
    counting = FakeCountingChat(chat)
    gateway, engine = small_gateway(tokenizer, counting, [CALL, "done"], Budgets(2048, 1024, 64))
    session = gateway.open_session("t", "g", 0)
    limit = gateway.max_token_chars * 2048
    for content in ("x" * limit, "y " * (limit // 2), "z" * 10 * limit):
        with pytest.raises(ProtocolError) as refused:
            await ask(gateway, session, {"messages": [HEAD[0], {"role": "user", "content": content}]})
        assert refused.value.reason is ErrorReason.CONTEXT and "characters" in refused.value.message
    assert counting.rendered == [] and engine.prompts == []
    first = (await ask(gateway, session, {"messages": HEAD, "tools": TOOLS}))["choices"][0]["message"]
    (call,) = first["tool_calls"]
    history = HEAD + [first]
    room = 2048 - len(engine.prompts[0]) - len(engine.outputs[0].token_ids)
    huge = {"role": "tool", "tool_call_id": call["id"], "content": "w" * (gateway.max_token_chars * room)}
    with pytest.raises(ProtocolError, match="tokens are left") as refused:
        await ask(gateway, session, {"messages": history + [huge], "tools": TOOLS})
    assert len(counting.rendered) == 1  # the first prompt only: the tool output was never rendered
    # The refusal recorded nothing: a tool result that fits still extends the same segment.
    await ask(gateway, session, {"messages": history + [{**huge, "content": "hi"}], "tools": TOOLS})
    (segment,) = gateway.close_session(session.id, TerminationReason.FINISHED)
    assert len(segment.turns) == 2 and gateway.stats().num_prefix_breaks == 0
    assert gateway.stats().errors_by_reason == {"context": 4}


async def test_a_stop_string_longer_than_any_token_is_refused_without_encoding(tokenizer, chat):
    gateway, engine = small_gateway(tokenizer, chat)
    session = gateway.open_session("t", "g", 0)
    with pytest.raises(ProtocolError, match="single token") as refused:
        await ask(gateway, session, {"messages": HEAD, "stop": ["s" * 3_000_000]})
    assert refused.value.reason is ErrorReason.UNSUPPORTED and len(refused.value.message) < 300
    assert engine.prompts == []


class FakeFailingEngine:
    """A fake engine whose every generation fails."""

    async def generate(self, request_id, prompt_ids, sampling):
        raise RuntimeError("engine died")


async def test_every_refusal_is_counted_by_reason(tokenizer, chat):
    gateway, _ = small_gateway(tokenizer, chat)
    mine, other = gateway.open_session("t", "g", 0), gateway.open_session("t", "g", 1)
    closed = gateway.open_session("t", "g", 2)
    gateway.close_session(closed.id, TerminationReason.FINISHED)
    cases = [(mine.id, "forged", b"{}", 401), (mine.id, other.token, b"{}", 403),
             (closed.id, closed.token, b"{}", 401), (mine.id, mine.token, b'{"messages": "\\ud800"}', 400),
             (mine.id, mine.token, nested(100_000), 400), (mine.id, mine.token, b'{"messages": [], "tools": 5}', 400),
             (mine.id, mine.token, json.dumps({"messages": HEAD, "n": 3}).encode(), 400)]
    for session_id, token, body, status in cases:
        with pytest.raises(ProtocolError) as refused:
            await gateway.handle("openai", session_id, token, None, chunks_of(body))
        assert refused.value.status == status
    with pytest.raises(ProtocolError) as missing:
        await gateway.list_models(None, "forged")
    assert missing.value.status == 401
    failing = Gateway(Router({"e0": FakeFailingEngine()}), TurnGate(), chat, tokenizer, gateway.settings)
    session = failing.open_session("t", "g", 0)
    with pytest.raises(ProtocolError) as failed:
        await failing.handle("openai", session.id, session.token, None,
                             chunks_of(json.dumps({"messages": HEAD}).encode()))
    assert failed.value.status == 500 and "engine died" in failed.value.message
    trusting, engine = small_gateway(tokenizer, chat, trust_request_sampling=True)
    session = trusting.open_session("t", "g", 0)
    with pytest.raises(ProtocolError, match="top_p") as zero:  # the protocol allows it, the engine does not
        await ask(trusting, session, {"messages": HEAD, "top_p": 0})
    assert zero.value.status == 400 and engine.prompts == []
    await ask(trusting, session, {"messages": HEAD, "top_p": 0.5})  # nothing was recorded: the first segment
    assert trusting.stats().num_prefix_breaks == 0
    stats = gateway.stats()
    assert stats.num_requests == 8 and stats.num_errors == 8
    assert stats.errors_by_reason == {"auth": 4, "malformed": 2, "invalid": 1, "unsupported": 1}
    total = sum_gateway_stats([stats, failing.stats(), GatewayStats(1, 0, 1, 0, 0, 2, 0)])
    assert (total.num_requests, total.num_errors) == (11, 9)
    metrics = total.as_metrics()
    assert metrics["gateway/errors"] == 9 and metrics["gateway/errors/auth"] == 4
    assert metrics["gateway/errors/server"] == 1 and "gateway/errors/too_large" not in metrics
    assert sum(v for k, v in metrics.items() if k.startswith("gateway/errors/")) == metrics["gateway/errors"]


# -- over HTTP, against the real server (uvicorn) with a fake engine ---------------------------

class FakeBlockingChat:
    """A fake continuity builder: the real one, except that rendering a conversation over
    `big` characters waits (on its worker thread) until `release` is set, and then renders
    a short stand-in conversation (tokenizing megabytes would only slow the test)."""

    def __init__(self, chat, big: int) -> None:
        self.chat, self.big = chat, big
        self.release, self.started = threading.Event(), threading.Semaphore(0)

    def __getattr__(self, name):
        return getattr(self.chat, name)

    def initial_prompt_ids(self, messages, tools):
        if sum(len(m.content) for m in messages) > self.big:
            self.started.release()
            # Bounded: if rendering ran on the event loop, this wait would stall every
            # session, and the test then fails on the ordering instead of hanging.
            self.release.wait(timeout=20)
            messages = [Message("user", "a stand-in for the huge message")]
        return self.chat.initial_prompt_ids(messages, tools)


@pytest_asyncio.fixture
async def http_gateway(tokenizer, chat):
    import httpx

    blocking = FakeBlockingChat(chat, big=100_000)
    engine = FakeScriptedEngine(tokenizer, ["ok"], chat.end_of_turn_id)
    gateway = Gateway(Router({"e0": engine}), TurnGate(), blocking, tokenizer,
                      GatewaySettings("policy", Budgets(10_000_000, 2048, 16)))
    server = GatewayServer(gateway)
    await server.start()
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        yield server, client, blocking
    blocking.release.set()
    await server.stop()


def post(client, session, protocol="openai", **kwargs):
    path = "chat/completions" if protocol == "openai" else "messages"
    return client.post(f"/sessions/{session.id}/v1/{path}", headers={"authorization": f"Bearer {session.token}"},
                       **kwargs)


async def test_http_bad_input_gets_4xx_in_the_protocols_shape(http_gateway):
    server, client, _ = http_gateway
    mine, other = server.gateway.open_session("t", "h", 0), server.gateway.open_session("t", "h", 1)
    openai_cases = [
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "surrogate"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": 5}', 400, "'tools' must be an array"),
        (nested(100_000), 400, "deep"),
        (b'{"messages": [{"role": "user", "content": "\xff"}]}', 400, "UTF-8"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400, "'stream' must be a boolean"),
        (b"x" * (5 * 2**20), 413, "at most 4194304 bytes"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e999}', 400, "max_tokens"),
    ]
    for body, status, words in openai_cases:
        response = await post(client, mine, content=body)
        assert response.status_code == status and words in response.json()["error"]["message"], response.text
    response = await post(client, mine, content=(c async for c in chunks_of(b"y" * (5 * 2**20))))  # chunked
    assert response.status_code == 413
    anthropic_cases = [(b'{"max_tokens": 4, "messages": [{"role": "user", "content": "\\udfff"}]}', 400),
                       (b'{"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": 5}', 400),
                       (b'{"max_tokens": "4", "messages": []}', 400)]
    for body, status in anthropic_cases:
        response = await post(client, mine, "anthropic", content=body)
        assert response.status_code == status and response.json()["type"] == "error"
    wrong = await client.post(f"/sessions/{mine.id}/v1/messages", headers={"x-api-key": other.token}, content=b"{}")
    assert wrong.status_code == 403 and wrong.json()["error"]["type"] == "permission_error"
    assert (await client.get("/v1/models", headers={"authorization": "Bearer nope"})).status_code == 401
    assert (await client.get(f"/sessions/{mine.id}/v1/models",
                             headers={"authorization": f"Bearer {mine.token}"})).json()["data"][0]["id"] == "policy"
    stats = server.gateway.stats()
    assert stats.errors_by_reason == {"malformed": 4, "invalid": 5, "too_large": 2, "auth": 2}
    ok = await post(client, mine, json={"messages": HEAD})  # the session still works
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"


async def test_one_sessions_huge_request_does_not_hold_up_another_session(http_gateway):
    """Two sessions' huge requests (3 MB each, under the 4 MiB cap) are held mid-render on
    their worker threads; meanwhile a third session's small request and a fourth's
    malformed one are answered. Only then are the huge ones released."""
    server, client, blocking = http_gateway
    sessions = [server.gateway.open_session("t", "iso", i) for i in range(4)]
    huge = {"messages": [{"role": "user", "content": "h" * 3_000_000}], "max_tokens": 4}
    big = [asyncio.create_task(post(client, s, json=huge)) for s in sessions[:2]]
    for _ in big:  # both are rendering (the large lane is full)
        assert await asyncio.to_thread(blocking.started.acquire, timeout=30)
    small = await asyncio.wait_for(post(client, sessions[2], json={"messages": HEAD}), 30)
    bad = await asyncio.wait_for(post(client, sessions[3], content=nested(100_000)), 30)
    assert small.status_code == 200 and bad.status_code == 400
    assert not any(t.done() for t in big)  # answered while the huge ones were still in progress
    blocking.release.set()
    for response in await asyncio.gather(*big):
        assert response.status_code == 200, response.text
