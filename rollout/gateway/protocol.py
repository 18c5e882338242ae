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

Images (OpenAI `image_url` parts with a base64 data URL, Anthropic base64 `image` blocks)
become `envs.types.Image` parts of the message content, in order with the text: the bytes
as sent, checked here to decode as an image within MAX_IMAGE_BYTES and MAX_IMAGE_PIXELS.
A message without images keeps its content as one string.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from envs.types import Content, Image, Message, ToolCall
from rollout.gateway.refusals import (DEFAULT_MAX_JSON_DEPTH, Protocol, ProtocolError, check_fields, checked_field,
                                      invalid, load_json, require, unsupported, wrong_type)

__all__ = ["MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "Protocol", "ProtocolError", "TurnReply", "TurnRequest",
           "anthropic_response", "anthropic_stream",
           "extension_suffix", "openai_response", "openai_stream", "parse_anthropic_request",
           "parse_openai_request", "same_reply"]

MAX_STOP_SEQUENCES = 16  # each is encoded on the event loop (a stop must be one token)
# An image's encoded bytes at most: Anthropic's own per-image cap, so whatever a harness
# sends to the real APIs fits (the body cap, GatewaySettings.max_body_bytes, bounds all
# of a request's images together).
MAX_IMAGE_BYTES = 5 * 2**20
# An image's decoded size at most (8K UHD). A few KiB of PNG can declare a huge blank
# canvas that costs gigabytes of RGB once decoded (here, by the processor, by vLLM);
# processors downscale anything this large anyway.
MAX_IMAGE_PIXELS = 7680 * 4320
# Anthropic's image media types; OpenAI data URLs take any image/* type that decodes.
_ANTHROPIC_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


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


# -- images -------------------------------------------------------------------------------------
# SHA-256 digests of images that decoded before (most recent last). A harness re-sends its
# whole history on every request, so without this each screenshot of a session would be
# decoded again every turn (tens of ms each); keyed by content, so sessions share it.
_NUM_DECODED_REMEMBERED = 4096  # x 32-byte digests
_decoded: OrderedDict[bytes, None] = OrderedDict()
_decoded_lock = threading.Lock()  # parsing runs on several worker threads


def _check_decodes(data: bytes, param: str) -> None:
    """Refuse (400, naming `param`) bytes that are not a whole image of at most
    MAX_IMAGE_PIXELS: the size is read from the header before any pixel is decoded."""
    digest = hashlib.sha256(data).digest()
    with _decoded_lock:
        if digest in _decoded:
            _decoded.move_to_end(digest)
            return
    from PIL import Image as PILImage

    try:
        with PILImage.open(io.BytesIO(data)) as opened:
            width, height = opened.size
            if width * height > MAX_IMAGE_PIXELS:
                raise invalid(param, f"{param}: the image is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} "
                                     "pixels (8K UHD) are accepted: send it scaled down")
            opened.load()  # a truncated or corrupt file fails here, not in the processor later
    except ProtocolError:
        raise
    # PIL's decoders report corrupt input as OSError, SyntaxError, ValueError, EOFError,
    # struct.error or DecompressionBombError, by format: any of them is the client's bytes.
    except Exception as exc:  # broad: whatever the decoder raises is a 400, never a 500
        raise invalid(param, f"{param}: the image data cannot be decoded as an image "
                             f"({type(exc).__name__}: {str(exc):.200}); send a PNG, JPEG, GIF or WebP file") from exc
    with _decoded_lock:
        _decoded[digest] = None
        if len(_decoded) > _NUM_DECODED_REMEMBERED:
            _decoded.popitem(last=False)


def _image(data_b64: str, media_type: str, param: str, max_image_bytes: int) -> Image:
    """A base64 image from a request -> Image (the decoded bytes as sent, `media_type` as
    declared); 400 naming `param` for a non-image type, bad base64, too many bytes or
    bytes that do not decode as an image."""
    require(media_type.startswith("image/") and len(media_type) > len("image/"), param,
            f"{param}: media type {media_type!r:.60} is not an image type (image/png, image/jpeg, ...)")
    try:
        # validate=True: characters outside the base64 alphabet are an error, not skipped
        data = base64.b64decode(data_b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise invalid(param, f"{param}: the image data is not valid base64 ({exc}); send standard base64 "
                             "(A-Z a-z 0-9 + /, '=' padding, no line breaks)") from exc
    require(bool(data), param, f"{param}: the image data is empty")
    require(len(data) <= max_image_bytes, param,
            f"{param}: the image is {len(data)} bytes; at most {max_image_bytes} bytes per image are accepted: "
            "send it scaled down or compressed")
    _check_decodes(data, param)
    return Image(data, media_type)


# data:[<media type>][;<parameter>]...[;base64],<data> (RFC 2397)
_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)


def _data_url_image(url: str, param: str, max_image_bytes: int) -> Image:
    """An OpenAI image_url.url: only a base64 data URL. The gateway fetches nothing on a
    harness's behalf (the run has no network, and a URL's content may change between
    requests, which would make a segment's image differ from the one recorded)."""
    head = _DATA_URL.match(url)
    if head is None:
        scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
        if scheme in ("http", "https"):
            raise unsupported(param, f"{param}: image URLs are not fetched by the gateway; send the image inline "
                                     "as a base64 data URL (data:image/png;base64,...)")
        raise invalid(param, f"{param}: must be a base64 data URL (data:image/png;base64,...), got "
                             f"{url[:40]!r}{'...' if len(url) > 40 else ''}")
    media_type, params = head.group(1).strip().lower(), head.group(2).lower().split(";")
    require("base64" in (p.strip() for p in params), param,
            f"{param}: the data URL must be base64-encoded (data:{media_type or 'image/png'};base64,...)")
    return _image(url[head.end():], media_type, param, max_image_bytes)


def _content(parts: Sequence[str | Image]) -> Content:
    """Message content from parts in order: one string when there is no image (as before
    images were taken), else text and images with adjacent texts joined, empty ones left
    out (the templates render parts with nothing between them, so the ids are the same)."""
    if not any(isinstance(p, Image) for p in parts):
        return "".join(p for p in parts if isinstance(p, str))
    out: list[str | Image] = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        elif not isinstance(part, str) or part:
            out.append(part)
    return tuple(out)


# -- OpenAI chat completions ----------------------------------------------------------------
_OPENAI_ROLES = ("system", "user", "assistant", "tool")
# Accepted without effect (docs/gateway.md), so only their types are checked.
_OPENAI_IGNORED = {"seed": "an integer", "user": "a string", "metadata": "an object", "service_tier": "a string",
                   "parallel_tool_calls": "a boolean", "store": "a boolean", "prediction": "an object",
                   "reasoning_effort": "a string"}


# The content part types each role takes (OpenAI: system and assistant text only; tool
# results may hold images, as harnesses return screenshots from tools).
_OPENAI_PARTS = {"system": ("text",), "assistant": ("text",), "user": ("text", "image_url"),
                 "tool": ("text", "image_url")}


def _openai_content(content: Any, param: str, role: str, max_image_bytes: int) -> Content:
    """A message's content: a string, or text and image_url parts (as `_content` joins them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(param, "a string or an array of content parts", content)
    parts: list[str | Image] = []
    for k, part in enumerate(content):
        where = f"{param}[{k}]"
        kind = checked_field(_object(part, where), "type", f"{where}.type", "a string", required=True)
        if kind not in ("text", "image_url"):
            raise unsupported(f"{where}.type", f"{where}: only text and image_url content parts are supported, "
                                               f"got {kind!r:.40} (audio, files and refusals are not)")
        require(kind in _OPENAI_PARTS[role], f"{where}.type", f"{where}: {role} messages take text parts only")
        if kind == "text":
            parts.append(checked_field(part, "text", f"{where}.text", "a string", required=True))
            continue
        image_url = checked_field(part, "image_url", f"{where}.image_url", "an object", required=True)
        checked_field(image_url, "detail", f"{where}.image_url.detail", "a string")  # no effect: the processor sizes
        url = checked_field(image_url, "url", f"{where}.image_url.url", "a string", required=True)
        parts.append(_data_url_image(url, f"{where}.image_url.url", max_image_bytes))
    return _content(parts)


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


def _openai_messages(raw: list[Any], max_depth: int, max_image_bytes: int) -> list[Message]:
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
        content = _openai_content(m.get("content"), f"{where}.content", role, max_image_bytes)
        if role == "assistant":
            calls = _openai_tool_calls(m, where, names, max_depth)
            checked_field(m, "refusal", f"{where}.refusal", "a string")
            reasoning = checked_field(m, "reasoning_content", f"{where}.reasoning_content", "a string")
            messages.append(Message("assistant", content, calls, reasoning=reasoning))
            continue
        require(m.get("tool_calls") is None, f"{where}.tool_calls",
                f"{where}: only assistant messages carry tool_calls")
        if role == "tool":
            call_id = checked_field(m, "tool_call_id", f"{where}.tool_call_id", "a string")
            messages.append(Message("tool", content, name=names.get(call_id or "") or name))
        else:
            messages.append(Message(role, content))
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


def parse_openai_request(body: Any, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
                         max_image_bytes: int = MAX_IMAGE_BYTES) -> TurnRequest:
    """An OpenAI chat-completions body (decoded JSON) -> TurnRequest; ProtocolError(400)
    names the field and what it must be. `max_json_depth` bounds tool-call arguments,
    `max_image_bytes` each image's decoded bytes."""
    require(isinstance(body, Mapping), "", "the request body must be a JSON object")
    checked_field(body, "model", "model", "a string")
    raw = _nonempty_array(body, "messages")
    n = checked_field(body, "n", "n", "an integer")
    if n not in (None, 1):
        raise unsupported("n", "only n=1 is supported (a GRPO group is G sessions, not n choices)")
    check_fields(body, _OPENAI_IGNORED)
    _refuse_sampling_changes(body)
    _refuse_openai_features(body)
    messages = _openai_messages(raw, max_json_depth, max_image_bytes)
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
# ones (document, server tool results, ...) unsupported.
_BLOCKS = {"user": ("text", "image", "tool_result"),
           "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
           "system": ("text",), "tool_result": ("text", "image")}
_KNOWN_BLOCKS = {kind for kinds in _BLOCKS.values() for kind in kinds}
_BLOCK_FIELDS = {"text": {"text": "a string"}, "image": {"source": "an object"},
                 "tool_use": {"id": "a string", "name": "a string"}, "tool_result": {"tool_use_id": "a string"},
                 "thinking": {"thinking": "a string"}, "redacted_thinking": {"data": "a string"}}
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
            raise unsupported(f"{where}.type", f"unsupported content block {kind!r:.40} (text, image, tool_use, "
                                               "tool_result and thinking only)")
        require(kind in _BLOCKS[place], f"{where}.type", f"{kind} blocks are not allowed in {place} content")
        for key, expected in _BLOCK_FIELDS[kind].items():
            checked_field(block, key, f"{where}.{key}", expected, required=True)
        checked_field(block, "cache_control", f"{where}.cache_control", "an object")
        if kind == "tool_use":
            checked_field(block, "input", f"{where}.input", "an object")
        elif kind == "tool_result":
            checked_field(block, "is_error", f"{where}.is_error", "a boolean")
    return content


def _anthropic_image(source: Mapping[str, Any], param: str, max_image_bytes: int) -> Image:
    """An image block's source: base64 only (url and file sources would need the gateway to
    fetch or look up content on the harness's behalf)."""
    kind = checked_field(source, "type", f"{param}.type", "a string", required=True)
    if kind in ("url", "file"):
        raise unsupported(f"{param}.type", f"{param}: {kind} image sources are not supported (the gateway fetches "
                                           'nothing); send the image inline: {"type": "base64", '
                                           '"media_type": "image/png", "data": ...}')
    require(kind == "base64", f"{param}.type", f"'{param}.type' must be base64, url or file, got {kind!r:.40}")
    media_type = checked_field(source, "media_type", f"{param}.media_type", "a string", required=True)
    require(media_type in _ANTHROPIC_MEDIA_TYPES, f"{param}.media_type",
            f"'{param}.media_type' must be one of {', '.join(_ANTHROPIC_MEDIA_TYPES)}, got {media_type!r:.60}")
    data = checked_field(source, "data", f"{param}.data", "a string", required=True)
    return _image(data, media_type, f"{param}.data", max_image_bytes)


def _blocks_content(blocks: Sequence[Mapping[str, Any]], param: str, max_image_bytes: int) -> Content:
    """The text and image blocks of checked `blocks`, in order, as message content."""
    parts: list[str | Image] = []
    for k, b in enumerate(blocks):
        if b["type"] == "text":
            parts.append(b["text"])
        elif b["type"] == "image":
            parts.append(_anthropic_image(b["source"], f"{param}.{k}.source", max_image_bytes))
    return _content(parts)


def _tool_result_content(block: Mapping[str, Any], param: str, max_image_bytes: int) -> Content:
    content = block.get("content")
    if content is None:
        return ""
    param = f"{param}.content"
    return _blocks_content(_anthropic_blocks(content, param, "tool_result"), param, max_image_bytes)


def _anthropic_messages(raw: list[Any], max_image_bytes: int) -> list[Message]:
    """A user turn holding tool_result blocks becomes tool messages (in order), then a
    user message for any text and images beside them."""
    messages: list[Message] = []
    names: dict[str, str] = {}
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        role = checked_field(_object(m, where), "role", f"{where}.role", "a string", required=True)
        require(role in ("user", "assistant"), f"{where}.role",
                f"{where}: role must be 'user' or 'assistant', got {role!r:.40}")
        blocks = _anthropic_blocks(m.get("content"), f"{where}.content", role)
        if role == "assistant":
            calls = []
            for b in blocks:
                if b["type"] == "tool_use":
                    calls.append(ToolCall(b["name"], dict(b.get("input") or {})))
                    names[b["id"]] = b["name"]
            text = "".join(b["text"] for b in blocks if b["type"] == "text")
            messages.append(Message("assistant", text, tuple(calls)))
            continue
        results = [(k, b) for k, b in enumerate(blocks) if b["type"] == "tool_result"]
        for k, b in results:
            messages.append(Message("tool", _tool_result_content(b, f"{where}.content.{k}", max_image_bytes),
                                    name=names.get(b["tool_use_id"])))
        content = _blocks_content(blocks, f"{where}.content", max_image_bytes)
        if content or not results:
            messages.append(Message("user", content))
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


def parse_anthropic_request(body: Any, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
                            max_image_bytes: int = MAX_IMAGE_BYTES) -> TurnRequest:
    """An Anthropic messages body (decoded JSON) -> TurnRequest; ProtocolError(400) names
    the field and what it must be; `max_image_bytes` bounds each image's decoded bytes.
    (`max_json_depth`: tool inputs arrive decoded; kept for the same signature as
    parse_openai_request.)"""
    require(isinstance(body, Mapping), "", "the request body must be a JSON object")
    checked_field(body, "model", "model", "a string")
    raw = _nonempty_array(body, "messages")
    max_tokens = checked_field(body, "max_tokens", "max_tokens", "an integer", required=True)
    require(max_tokens > 0, "max_tokens", f"'max_tokens' must be a positive integer, got {max_tokens}")
    check_fields(body, _ANTHROPIC_IGNORED)
    _refuse_anthropic_features(body)
    messages = _anthropic_system(body.get("system")) + _anthropic_messages(raw, max_image_bytes)
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
    return echoed.role == "assistant" and echoed.text.strip() == sent.text.strip() and \
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
