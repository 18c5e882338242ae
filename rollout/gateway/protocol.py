"""OpenAI chat-completions and Anthropic messages wire formats <-> sluice's Message, tools
and one model turn, for the gateway (rollout.gateway.server). Plain functions on JSON-shaped
dicts: no web framework here, so they are unit-tested without a server.

A request becomes a `TurnRequest` (messages, OpenAI-style tool schemas, per-request
options); a `TurnReply` (parsed content and tool calls of one generation) becomes the
protocol's response body or its stream events. Anything the gateway cannot honour
exactly is refused with a `ProtocolError` (the protocol's error shape), never ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from envs.types import Message, ToolCall

Protocol = Literal["openai", "anthropic"]
# The protocol's name for each HTTP status the gateway returns.
_ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 409: "invalid_request_error", 500: "api_error"}
_OPENAI_KINDS = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_denied",
                 404: "not_found_error", 409: "invalid_request_error", 500: "server_error"}


class ProtocolError(Exception):
    """A request the gateway refuses; rendered in the caller's protocol's error shape."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def body(self, protocol: Protocol) -> dict[str, Any]:
        if protocol == "anthropic":
            return {"type": "error", "error": {"type": _ANTHROPIC_KINDS.get(self.status, "api_error"),
                                                "message": self.message}}
        return {"error": {"message": self.message, "type": _OPENAI_KINDS.get(self.status, "server_error"),
                          "param": None, "code": self.code}}


@dataclass(frozen=True, slots=True)
class TurnRequest:
    messages: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...]  # OpenAI function schemas, as the templates take them
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: tuple[str, ...]
    parse_tools: bool  # False for tool_choice "none": the text is returned as content
    stream: bool
    include_usage: bool = False  # OpenAI stream_options.include_usage


@dataclass(frozen=True, slots=True)
class TurnReply:
    content: str
    reasoning: str | None
    calls: tuple[ToolCall, ...]
    finish: Literal["stop", "length", "tool_calls"]
    prompt_tokens: int
    completion_tokens: int
    model: str


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ProtocolError(400, message)


def _number(body: Mapping[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if value is None:
        return None
    _require(isinstance(value, (int, float)) and not isinstance(value, bool)
             and (kind is float or isinstance(value, int)), f"'{key}' must be a {kind.__name__}")
    return kind(value)


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    _require(isinstance(values, list) and all(isinstance(s, str) for s in values),
             "'stop' must be a string or a list of strings")
    return tuple(values)


def _openai_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    _require(isinstance(content, list), f"{where}: content must be a string or a list of parts")
    texts = []
    for part in content:
        _require(isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str),
                 f"{where}: only text content parts are supported (got {part!r:.60})")
        texts.append(part["text"])
    return "".join(texts)


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        value = None
    _require(isinstance(value, dict), f"{where}: arguments must be a JSON object")
    return value  # type: ignore[return-value]  # checked just above


def _refuse_sampling_changes(body: Mapping[str, Any]) -> None:
    """OpenAI options that would change what is sampled, or how it must be shaped, and
    that the gateway cannot honour without leaving the recipe's sampling (the trainer's
    behaviour policy) or cutting sampled ids: refused, never silently dropped."""
    fmt = body.get("response_format")
    _require(fmt in (None, "text") or (isinstance(fmt, Mapping) and fmt.get("type") == "text"),
             f"response_format {fmt!r:.80} is not supported: structured output needs constrained decoding")
    _require(not body.get("logit_bias"), "logit_bias is not supported: it changes the sampled distribution")
    for name in ("presence_penalty", "frequency_penalty"):
        _require(not body.get(name), f"{name} is not supported: it changes the sampled distribution")
    _require(not body.get("logprobs") and not body.get("top_logprobs"),
             "logprobs are not returned by the gateway (the trainer records them)")


def parse_openai_request(body: Any) -> TurnRequest:
    """An OpenAI chat-completions body -> TurnRequest; ProtocolError(400) names the field."""
    _require(isinstance(body, Mapping), "the request body must be a JSON object")
    raw = body.get("messages")
    _require(isinstance(raw, list) and bool(raw), "'messages' must be a non-empty list")
    _require(body.get("n", 1) == 1, "only n=1 is supported")
    _refuse_sampling_changes(body)
    messages: list[Message] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for the tool messages
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        _require(isinstance(m, Mapping), f"{where} must be an object")
        role = m.get("role")
        role = "system" if role == "developer" else role
        _require(role in ("system", "user", "assistant", "tool"), f"{where}: unknown role {role!r}")
        text = _openai_text(m.get("content"), where)
        if role == "assistant":
            calls = []
            for j, c in enumerate(m.get("tool_calls") or ()):
                fn = c.get("function") if isinstance(c, Mapping) else None
                _require(isinstance(fn, Mapping) and isinstance(fn.get("name"), str),
                         f"{where}.tool_calls[{j}] must have function.name")
                calls.append(ToolCall(fn["name"], _arguments(fn.get("arguments", "{}"), f"{where}.tool_calls[{j}]")))
                if isinstance(c.get("id"), str):
                    names[c["id"]] = fn["name"]
            reasoning = m.get("reasoning_content")
            messages.append(Message("assistant", text, tuple(calls),
                                    reasoning=reasoning if isinstance(reasoning, str) else None))
        elif role == "tool":
            messages.append(Message("tool", text, name=names.get(m.get("tool_call_id", "")) or m.get("name")))
        else:
            messages.append(Message(role, text))
    tools = []
    for i, t in enumerate(body.get("tools") or ()):
        _require(isinstance(t, Mapping) and t.get("type") == "function" and isinstance(t.get("function"), Mapping)
                 and isinstance(t["function"].get("name"), str), f"tools[{i}] must be a function tool with a name")
        tools.append({"type": "function", "function": dict(t["function"])})
    choice = body.get("tool_choice", "auto")
    _require(choice in ("auto", "none", None),
             f"tool_choice {choice!r} is not supported (only 'auto' and 'none'): forcing a call would "
             "need constrained decoding, which would change the sampled distribution")
    max_tokens = _number(body, "max_completion_tokens", int) or _number(body, "max_tokens", int)
    _require(max_tokens is None or max_tokens > 0, "'max_tokens' must be positive")
    options = body.get("stream_options") or {}
    return TurnRequest(tuple(messages), tuple(tools), max_tokens, _number(body, "temperature", float),
                       _number(body, "top_p", float), _stops(body.get("stop")), choice != "none",
                       bool(body.get("stream", False)),
                       bool(isinstance(options, Mapping) and options.get("include_usage")))


def _anthropic_blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    _require(isinstance(content, list), f"{where}: content must be a string or a list of blocks")
    for block in content:
        _require(isinstance(block, Mapping) and block.get("type") in ("text", "tool_use", "tool_result", "thinking"),
                 f"{where}: unsupported content block {block!r:.60} (text, tool_use, tool_result only)")
    return content


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.get("text", "") for b in _anthropic_blocks(content, where) if b.get("type") == "text")


def parse_anthropic_request(body: Any) -> TurnRequest:
    """An Anthropic messages body -> TurnRequest. A user turn holding tool_result blocks
    becomes tool messages (in order), then a user message for any text beside them."""
    _require(isinstance(body, Mapping), "the request body must be a JSON object")
    raw = body.get("messages")
    _require(isinstance(raw, list) and bool(raw), "messages: must be a non-empty list")
    max_tokens = _number(body, "max_tokens", int)
    _require(max_tokens is not None and max_tokens > 0, "max_tokens: field required (a positive integer)")
    messages: list[Message] = []
    system = body.get("system")
    if system:
        messages.append(Message("system", system if isinstance(system, str) else
                                "".join(b.get("text", "") for b in _anthropic_blocks(system, "system"))))
    names: dict[str, str] = {}
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        _require(isinstance(m, Mapping) and m.get("role") in ("user", "assistant"),
                 f"{where}: role must be 'user' or 'assistant'")
        blocks = _anthropic_blocks(m.get("content"), where)
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        if m["role"] == "assistant":
            calls = []
            for b in blocks:
                if b["type"] == "tool_use":
                    _require(isinstance(b.get("name"), str) and isinstance(b.get("input", {}), Mapping),
                             f"{where}: tool_use needs a name and an object input")
                    calls.append(ToolCall(b["name"], dict(b.get("input") or {})))
                    names[str(b.get("id"))] = b["name"]
            messages.append(Message("assistant", text, tuple(calls)))
            continue
        results = [b for b in blocks if b["type"] == "tool_result"]
        for b in results:
            messages.append(Message("tool", _tool_result_text(b.get("content"), where),
                                    name=names.get(str(b.get("tool_use_id")))))
        if text or not results:
            messages.append(Message("user", text))
    tools = []
    for i, t in enumerate(body.get("tools") or ()):
        _require(isinstance(t, Mapping) and isinstance(t.get("name"), str),
                 f"tools.{i}: a custom tool with a name and an input_schema is required")
        tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                         "parameters": t.get("input_schema") or {"type": "object"}}})
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    _require(kind in ("auto", "none"), f"tool_choice {choice!r} is not supported (only auto and none)")
    _require(not body.get("thinking") or body["thinking"].get("type") == "disabled",
             "extended thinking is not supported through the gateway")
    return TurnRequest(tuple(messages), tuple(tools), max_tokens, _number(body, "temperature", float),
                       _number(body, "top_p", float), _stops(body.get("stop_sequences")), kind != "none",
                       bool(body.get("stream", False)))


def _call_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def openai_response(reply: TurnReply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.calls else "")}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = [{"id": _call_id("call_"), "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))}}
                                 for c in reply.calls]
    return {"id": _call_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()),
            "model": reply.model, "choices": [{"index": 0, "message": message, "finish_reason": reply.finish,
                                               "logprobs": None}],
            "usage": _openai_usage(reply)}


def _openai_usage(reply: TurnReply) -> dict[str, int]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def openai_stream(reply: TurnReply, include_usage: bool) -> Iterator[str]:
    """The reply as server-sent chat.completion.chunk events. The engine returns a turn
    whole, so the stream carries it in a few chunks; clients assemble it as usual."""
    head = {"id": _call_id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()),
            "model": reply.model}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                                      **extra}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if reply.reasoning:
        yield chunk({"reasoning_content": reply.reasoning})
    if reply.content:
        yield chunk({"content": reply.content})
    for i, c in enumerate(reply.calls):
        yield chunk({"tool_calls": [{"index": i, "id": _call_id("call_"), "type": "function",
                                     "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))}}]})
    yield chunk({}, reply.finish)
    if include_usage:
        yield "data: " + json.dumps({**head, "choices": [], "usage": _openai_usage(reply)}) + "\n\n"
    yield "data: [DONE]\n\n"


_ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _anthropic_content(reply: TurnReply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": reply.content}] if reply.content else []
    blocks += [{"type": "tool_use", "id": _call_id("toolu_"), "name": c.name, "input": dict(c.arguments)}
               for c in reply.calls]
    return blocks


def anthropic_response(reply: TurnReply) -> dict[str, Any]:
    return {"id": _call_id("msg_"), "type": "message", "role": "assistant", "model": reply.model,
            "content": _anthropic_content(reply), "stop_reason": _ANTHROPIC_STOP[reply.finish],
            "stop_sequence": None,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens}}


def anthropic_stream(reply: TurnReply) -> Iterator[str]:
    """The reply as Anthropic's message stream events (one delta per block)."""
    def event(name: str, data: Mapping[str, Any]) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

    message = {**anthropic_response(reply), "content": [], "stop_reason": None,
               "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0}}
    yield event("message_start", {"message": message})
    for i, block in enumerate(_anthropic_content(reply)):
        if block["type"] == "text":
            yield event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}})
            yield event("content_block_delta", {"index": i, "delta": {"type": "text_delta", "text": block["text"]}})
        else:
            yield event("content_block_start", {"index": i, "content_block": {**block, "input": {}}})
            yield event("content_block_delta", {"index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
        yield event("content_block_stop", {"index": i})
    yield event("message_delta", {"delta": {"stop_reason": _ANTHROPIC_STOP[reply.finish], "stop_sequence": None},
                                  "usage": {"output_tokens": reply.completion_tokens}})
    yield event("message_stop", {})


def same_reply(sent: Message, echoed: Message) -> bool:
    """Whether the harness sent back the assistant turn the gateway returned. Reasoning is
    not compared (harnesses drop or keep it as they like; the ids keep what was sampled)."""
    return echoed.role == "assistant" and echoed.content.strip() == sent.content.strip() and \
        tuple(echoed.tool_calls) == tuple(sent.tool_calls)


def extension_suffix(previous: Sequence[Message], reply: Message, tools_before: Sequence[Mapping[str, Any]],
                     messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]) -> tuple[Message, ...] | None:
    """The new tool/user messages when `messages` extend the previous request's messages
    plus the reply given to it (same tools); None when the history was rewritten, edited,
    retried, or new system/assistant turns were inserted."""
    n = len(previous)
    if list(tools) != list(tools_before) or len(messages) <= n + 1:
        return None
    if tuple(messages[:n]) != tuple(previous) or not same_reply(reply, messages[n]):
        return None
    suffix = tuple(messages[n + 1:])
    return suffix if all(m.role in ("tool", "user") for m in suffix) else None
