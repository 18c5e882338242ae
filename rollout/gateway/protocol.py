"""OpenAI chat-completions and Anthropic messages wire formats <-> sluice's Message, tools
and one model turn, for the gateway (rollout.gateway.server). Plain functions on JSON-shaped
dicts: no web framework here, so they are unit-tested without a server.

A request becomes a `TurnRequest` (messages, OpenAI-style tool schemas, per-request
options); a `TurnReply` (parsed content and tool calls of one generation) becomes the
protocol's response body or its stream events. Every field the gateway reads is
type-checked against the protocol (400 naming the field and what it must be), and
anything the gateway cannot honour exactly is refused with a `ProtocolError` (the
protocol's error shape, rollout.gateway.refusals), never ignored. Fields without effect
(seed, user, metadata, ...) are type-checked too; unknown fields are ignored, as
harnesses send vendor extras.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from envs.types import Message, ToolCall
from rollout.gateway.refusals import (DEFAULT_MAX_JSON_DEPTH, Protocol, ProtocolError, check_fields, checked_field,
                                      load_json, require, unsupported, wrong_type)

__all__ = ["Protocol", "ProtocolError", "TurnReply", "TurnRequest", "anthropic_response", "anthropic_stream",
           "extension_suffix", "openai_response", "openai_stream", "parse_anthropic_request",
           "parse_openai_request", "same_reply"]

MAX_STOP_SEQUENCES = 16  # each is encoded on the event loop (a stop must be one token)


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


def _positive(body: Mapping[str, Any], key: str) -> int | None:
    value = checked_field(body, key, key, "an integer")
    require(value is None or value > 0, key, f"'{key}' must be a positive integer, got {value}")
    return value


def _in_range(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = checked_field(body, key, key, "a number")
    if value is None:
        return None
    require(low <= value <= high, key, f"'{key}' must be between {low:g} and {high:g}, got {value!r:.40}")
    return float(value)


def _stops(value: Any, param: str, *, one_string: bool) -> tuple[str, ...]:
    """Stop strings: a list of strings (OpenAI also takes one string), at most
    MAX_STOP_SEQUENCES of them."""
    if value is None:
        return ()
    if one_string and isinstance(value, str):
        return (value,)
    if not isinstance(value, list):
        raise wrong_type(param, "a string or an array of strings" if one_string else "an array of strings", value)
    for k, text in enumerate(value):
        if not isinstance(text, str):
            raise wrong_type(f"{param}[{k}]", "a string", text)
    require(len(value) <= MAX_STOP_SEQUENCES, param,
            f"'{param}' holds {len(value)} stop sequences; at most {MAX_STOP_SEQUENCES} are accepted")
    return tuple(value)


def _nonempty_array(body: Mapping[str, Any], key: str) -> list[Any]:
    value = checked_field(body, key, key, "an array", required=True)
    require(bool(value), key, f"'{key}' must be a non-empty array")
    return value


def _object(value: Any, param: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise wrong_type(param, "an object", value)
    return value


# -- OpenAI chat completions ----------------------------------------------------------------
_OPENAI_ROLES = ("system", "user", "assistant", "tool")
# Accepted without effect (docs/gateway.md), so only their types are checked.
_OPENAI_IGNORED = {"seed": "an integer", "user": "a string", "metadata": "an object", "service_tier": "a string",
                   "parallel_tool_calls": "a boolean", "store": "a boolean", "prediction": "an object",
                   "reasoning_effort": "a string"}


def _openai_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(param, "a string or an array of content parts", content)
    texts = []
    for k, part in enumerate(content):
        where = f"{param}[{k}]"
        kind = checked_field(_object(part, where), "type", f"{where}.type", "a string", required=True)
        if kind != "text":
            raise unsupported(f"{where}.type", f"{where}: only text content parts are supported, got "
                                               f"{kind!r:.40} (images, audio and files are not)")
        texts.append(checked_field(part, "text", f"{where}.text", "a string", required=True))
    return "".join(texts)


def _arguments(raw: Any, param: str, max_depth: int) -> dict[str, Any]:
    """Tool-call arguments: a JSON object in a string (an object is taken too)."""
    if isinstance(raw, Mapping):
        return dict(raw)
    if not isinstance(raw, str):
        raise wrong_type(param, "a string holding a JSON object", raw)
    value = load_json(raw.encode("utf-8"), max_depth, f"'{param}'")
    require(isinstance(value, dict), param, f"'{param}' must hold a JSON object, got {type(value).__name__}")
    return value


def _refuse_sampling_changes(body: Mapping[str, Any]) -> None:
    """OpenAI options that would change what is sampled, or how it must be shaped, and
    that the gateway cannot honour without leaving the recipe's sampling (the trainer's
    behaviour policy) or cutting sampled ids: refused, never silently dropped."""
    fmt = body.get("response_format")
    if fmt is not None and fmt != "text":
        kind = checked_field(_object(fmt, "response_format"), "type", "response_format.type", "a string",
                             required=True)
        if kind != "text":
            raise unsupported("response_format", f"response_format {kind!r:.40} is not supported: structured "
                                                 "output needs constrained decoding")
    if checked_field(body, "logit_bias", "logit_bias", "an object"):
        raise unsupported("logit_bias", "logit_bias is not supported: it changes the sampled distribution")
    for name in ("presence_penalty", "frequency_penalty"):
        if checked_field(body, name, name, "a number"):
            raise unsupported(name, f"{name} is not supported: it changes the sampled distribution")
    if checked_field(body, "logprobs", "logprobs", "a boolean") or \
            checked_field(body, "top_logprobs", "top_logprobs", "an integer"):
        raise unsupported("logprobs", "logprobs are not returned by the gateway (the trainer records them)")


def _refuse_openai_features(body: Mapping[str, Any]) -> None:
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise unsupported(name, f"'{name}' (the deprecated function calling) is not supported: send "
                                    "'tools' and 'tool_choice'")
    modalities = checked_field(body, "modalities", "modalities", "an array")
    if body.get("audio") is not None or (modalities is not None and modalities != ["text"]):
        raise unsupported("modalities", "only text output is supported (no audio)")
    if body.get("web_search_options") is not None:
        raise unsupported("web_search_options", "web search is not supported through the gateway")


def _openai_tool_calls(m: Mapping[str, Any], where: str, names: dict[str, str],
                       max_depth: int) -> tuple[ToolCall, ...]:
    calls = []
    for j, c in enumerate(checked_field(m, "tool_calls", f"{where}.tool_calls", "an array") or ()):
        path = f"{where}.tool_calls[{j}]"
        kind = checked_field(_object(c, path), "type", f"{path}.type", "a string")
        if kind not in (None, "function"):
            raise unsupported(f"{path}.type", f"only function tool calls are supported, got {kind!r:.40}")
        call_id = checked_field(c, "id", f"{path}.id", "a string")
        fn = checked_field(c, "function", f"{path}.function", "an object", required=True)
        name = checked_field(fn, "name", f"{path}.function.name", "a string", required=True)
        calls.append(ToolCall(name, _arguments(fn.get("arguments", "{}"), f"{path}.function.arguments", max_depth)))
        if call_id is not None:
            names[call_id] = name
    return tuple(calls)


def _openai_messages(raw: list[Any], max_depth: int) -> list[Message]:
    messages: list[Message] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for the tool messages
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        role = checked_field(_object(m, where), "role", f"{where}.role", "a string", required=True)
        role = "system" if role == "developer" else role
        if role == "function":
            raise unsupported(f"{where}.role", "role 'function' (the deprecated function calling) is not "
                                               "supported: send tool messages")
        require(role in _OPENAI_ROLES, f"{where}.role",
                f"{where}: unknown role {role!r:.40} (system, developer, user, assistant or tool)")
        name = checked_field(m, "name", f"{where}.name", "a string")
        text = _openai_text(m.get("content"), f"{where}.content")
        if role == "assistant":
            calls = _openai_tool_calls(m, where, names, max_depth)
            checked_field(m, "refusal", f"{where}.refusal", "a string")
            reasoning = checked_field(m, "reasoning_content", f"{where}.reasoning_content", "a string")
            messages.append(Message("assistant", text, calls, reasoning=reasoning))
            continue
        require(m.get("tool_calls") is None, f"{where}.tool_calls",
                f"{where}: only assistant messages carry tool_calls")
        if role == "tool":
            call_id = checked_field(m, "tool_call_id", f"{where}.tool_call_id", "a string")
            messages.append(Message("tool", text, name=names.get(call_id or "") or name))
        else:
            messages.append(Message(role, text))
    return messages


def _openai_tools(raw: list[Any]) -> list[dict[str, Any]]:
    tools = []
    for i, t in enumerate(raw):
        path = f"tools[{i}]"
        kind = checked_field(_object(t, path), "type", f"{path}.type", "a string", required=True)
        if kind != "function":
            raise unsupported(f"{path}.type", f"only function tools are supported, got {kind!r:.40}")
        fn = checked_field(t, "function", f"{path}.function", "an object", required=True)
        name = checked_field(fn, "name", f"{path}.function.name", "a string", required=True)
        require(bool(name), f"{path}.function.name", f"'{path}.function.name' must not be empty")
        check_fields(fn, {"description": "a string", "parameters": "an object", "strict": "a boolean"},
                     f"{path}.function.")
        tools.append({"type": "function", "function": dict(fn)})
    return tools


def _openai_tool_choice(choice: Any) -> bool:
    """Whether tool calls are parsed: 'auto' (the default) or 'none'."""
    if choice is None or choice == "auto":
        return True
    if choice == "none":
        return False
    if choice == "required" or isinstance(choice, Mapping):
        raise unsupported("tool_choice", f"tool_choice {choice!r:.80} is not supported (only 'auto' and 'none'): "
                                         "forcing a call would need constrained decoding, which would change "
                                         "the sampled distribution")
    raise wrong_type("tool_choice", "'auto', 'none', 'required' or an object", choice)


def parse_openai_request(body: Any, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH) -> TurnRequest:
    """An OpenAI chat-completions body (decoded JSON) -> TurnRequest; ProtocolError(400)
    names the field and what it must be. `max_json_depth` bounds tool-call arguments."""
    require(isinstance(body, Mapping), "", "the request body must be a JSON object")
    checked_field(body, "model", "model", "a string")
    raw = _nonempty_array(body, "messages")
    n = checked_field(body, "n", "n", "an integer")
    if n not in (None, 1):
        raise unsupported("n", "only n=1 is supported (a GRPO group is G sessions, not n choices)")
    check_fields(body, _OPENAI_IGNORED)
    _refuse_sampling_changes(body)
    _refuse_openai_features(body)
    messages = _openai_messages(raw, max_json_depth)
    tools = _openai_tools(checked_field(body, "tools", "tools", "an array") or [])
    parse_tools = _openai_tool_choice(body.get("tool_choice"))
    max_completion_tokens, max_tokens = _positive(body, "max_completion_tokens"), _positive(body, "max_tokens")
    options = checked_field(body, "stream_options", "stream_options", "an object") or {}
    stream = checked_field(body, "stream", "stream", "a boolean")
    include_usage = checked_field(options, "include_usage", "stream_options.include_usage", "a boolean")
    return TurnRequest(tuple(messages), tuple(tools), max_completion_tokens or max_tokens,
                       _in_range(body, "temperature", 0.0, 2.0), _in_range(body, "top_p", 0.0, 1.0),
                       _stops(body.get("stop"), "stop", one_string=True), parse_tools, bool(stream),
                       bool(include_usage))


# -- Anthropic messages -----------------------------------------------------------------------
# The content blocks each place takes; other known blocks are misplaced (invalid), unknown
# ones (image, document, server tool results, ...) unsupported.
_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
           "system": ("text",), "tool_result": ("text",)}
_KNOWN_BLOCKS = {kind for kinds in _BLOCKS.values() for kind in kinds}
_BLOCK_FIELDS = {"text": {"text": "a string"}, "tool_use": {"id": "a string", "name": "a string"},
                 "tool_result": {"tool_use_id": "a string"}, "thinking": {"thinking": "a string"},
                 "redacted_thinking": {"data": "a string"}}
_ANTHROPIC_IGNORED = {"metadata": "an object", "service_tier": "a string"}


def _anthropic_blocks(content: Any, param: str, place: str) -> list[Mapping[str, Any]]:
    """The content blocks (a string is one text block), each checked for `place`."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise wrong_type(param, "a string or an array of content blocks", content)
    for k, block in enumerate(content):
        where = f"{param}.{k}"
        kind = checked_field(_object(block, where), "type", f"{where}.type", "a string", required=True)
        if kind not in _KNOWN_BLOCKS:
            raise unsupported(f"{where}.type", f"unsupported content block {kind!r:.40} (text, tool_use, "
                                               "tool_result and thinking only)")
        require(kind in _BLOCKS[place], f"{where}.type", f"a {kind} block is not allowed in {place} content")
        for key, expected in _BLOCK_FIELDS[kind].items():
            checked_field(block, key, f"{where}.{key}", expected, required=True)
        checked_field(block, "cache_control", f"{where}.cache_control", "an object")
        if kind == "tool_use":
            checked_field(block, "input", f"{where}.input", "an object")
        elif kind == "tool_result":
            checked_field(block, "is_error", f"{where}.is_error", "a boolean")
    return content


def _tool_result_text(block: Mapping[str, Any], param: str) -> str:
    content = block.get("content")
    if content is None:
        return ""
    return "".join(b["text"] for b in _anthropic_blocks(content, f"{param}.content", "tool_result"))


def _anthropic_messages(raw: list[Any]) -> list[Message]:
    """A user turn holding tool_result blocks becomes tool messages (in order), then a
    user message for any text beside them."""
    messages: list[Message] = []
    names: dict[str, str] = {}
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        role = checked_field(_object(m, where), "role", f"{where}.role", "a string", required=True)
        require(role in ("user", "assistant"), f"{where}.role",
                f"{where}: role must be 'user' or 'assistant', got {role!r:.40}")
        blocks = _anthropic_blocks(m.get("content"), f"{where}.content", role)
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        if role == "assistant":
            calls = []
            for b in blocks:
                if b["type"] == "tool_use":
                    calls.append(ToolCall(b["name"], dict(b.get("input") or {})))
                    names[b["id"]] = b["name"]
            messages.append(Message("assistant", text, tuple(calls)))
            continue
        results = [(k, b) for k, b in enumerate(blocks) if b["type"] == "tool_result"]
        for k, b in results:
            messages.append(Message("tool", _tool_result_text(b, f"{where}.content.{k}"),
                                    name=names.get(b["tool_use_id"])))
        if text or not results:
            messages.append(Message("user", text))
    if raw[-1]["role"] == "assistant":
        raise unsupported(f"messages.{len(raw) - 1}", "a final assistant message (a prefill to continue) is not "
                                                      "supported: the gateway samples a new assistant turn")
    return messages


def _anthropic_system(system: Any) -> list[Message]:
    if system is None:
        return []
    text = "".join(b["text"] for b in _anthropic_blocks(system, "system", "system"))
    return [Message("system", text)] if text else []


def _anthropic_tools(raw: list[Any]) -> list[dict[str, Any]]:
    tools = []
    for i, t in enumerate(raw):
        path = f"tools.{i}"
        kind = checked_field(_object(t, path), "type", f"{path}.type", "a string")
        if kind not in (None, "custom"):
            raise unsupported(f"{path}.type", f"server tool {kind!r:.40} is not supported: only custom tools "
                                              "(name, description, input_schema)")
        name = checked_field(t, "name", f"{path}.name", "a string", required=True)
        require(bool(name), f"{path}.name", f"'{path}.name' must not be empty")
        description = checked_field(t, "description", f"{path}.description", "a string") or ""
        schema = checked_field(t, "input_schema", f"{path}.input_schema", "an object") or {"type": "object"}
        checked_field(t, "cache_control", f"{path}.cache_control", "an object")
        tools.append({"type": "function", "function": {"name": name, "description": description,
                                                         "parameters": dict(schema)}})
    return tools


def _anthropic_tool_choice(choice: Any) -> bool:
    """Whether tool calls are parsed: auto (the default) or none."""
    if choice is None:
        return True
    kind = checked_field(_object(choice, "tool_choice"), "type", "tool_choice.type", "a string", required=True)
    checked_field(choice, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use", "a boolean")
    if kind in ("any", "tool"):
        raise unsupported("tool_choice", f"tool_choice {kind!r} is not supported (only auto and none): forcing "
                                         "a call would need constrained decoding")
    require(kind in ("auto", "none"), "tool_choice.type",
            f"'tool_choice.type' must be auto, any, tool or none, got {kind!r:.40}")
    return kind == "auto"


def _refuse_anthropic_features(body: Mapping[str, Any]) -> None:
    thinking = checked_field(body, "thinking", "thinking", "an object")
    if thinking is not None and checked_field(thinking, "type", "thinking.type", "a string",
                                              required=True) != "disabled":
        raise unsupported("thinking", "extended thinking is not supported through the gateway")
    for name in ("mcp_servers", "container"):
        if body.get(name):
            raise unsupported(name, f"'{name}' is not supported through the gateway")


def parse_anthropic_request(body: Any, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH) -> TurnRequest:
    """An Anthropic messages body (decoded JSON) -> TurnRequest; ProtocolError(400) names
    the field and what it must be. (`max_json_depth`: tool inputs arrive decoded; kept for
    the same signature as parse_openai_request.)"""
    require(isinstance(body, Mapping), "", "the request body must be a JSON object")
    checked_field(body, "model", "model", "a string")
    raw = _nonempty_array(body, "messages")
    max_tokens = checked_field(body, "max_tokens", "max_tokens", "an integer", required=True)
    require(max_tokens > 0, "max_tokens", f"'max_tokens' must be a positive integer, got {max_tokens}")
    check_fields(body, _ANTHROPIC_IGNORED)
    _refuse_anthropic_features(body)
    messages = _anthropic_system(body.get("system")) + _anthropic_messages(raw)
    tools = _anthropic_tools(checked_field(body, "tools", "tools", "an array") or [])
    parse_tools = _anthropic_tool_choice(body.get("tool_choice"))
    top_k = checked_field(body, "top_k", "top_k", "an integer")
    require(top_k is None or top_k >= 0, "top_k", f"'top_k' must be a non-negative integer, got {top_k}")
    stream = checked_field(body, "stream", "stream", "a boolean")
    return TurnRequest(tuple(messages), tuple(tools), max_tokens, _in_range(body, "temperature", 0.0, 1.0),
                       _in_range(body, "top_p", 0.0, 1.0),
                       _stops(body.get("stop_sequences"), "stop_sequences", one_string=False), parse_tools,
                       bool(stream))


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
