"""Hermes-style tool-call parsing: turns a model's text into tool calls plus errors the
model can read as observations, and checks call arguments against the tool's schema.

Model output is untrusted input: nothing here raises on it. Every problem becomes a
`ToolCallError` whose message says what was wrong and what the expected format is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from envs.types import ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

ErrorKind = Literal["malformed_json", "missing_name", "bad_arguments", "unclosed", "too_many"]

_EXPECTED = '<tool_call>\n{"name": "<tool name>", "arguments": {"<argument>": <value>}}\n</tool_call>'
# strict=False accepts raw newlines and tabs inside strings: models write code that way.
_DECODER = json.JSONDecoder(strict=False)
_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                                dict: "object", list: "array", type(None): "null"}


@dataclass(frozen=True, slots=True)
class ToolCallError:
    """One rejected `<tool_call>` block. `index` counts blocks in the turn from 0; the
    message (shown to the model) numbers them from 1."""

    index: int
    kind: ErrorKind
    message: str


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    content: str  # text outside tool-call blocks, stripped
    calls: tuple[ToolCall, ...]  # valid calls in order, at most max_calls
    errors: tuple[ToolCallError, ...]  # in block order


@dataclass(frozen=True, slots=True)
class _Block:
    """The span of one `<tool_call>` block; `body` is None when it was never closed."""

    start: int  # position of the opening tag
    end: int  # position just after the closing tag (or the end of the text)
    body: str | None
    decoded: Any = None  # the JSON value when the body decoded cleanly
    json_error: str = ""


def parse_tool_calls(text: str, max_calls: int) -> ParsedTurn:
    """Split `text` into content and tool calls; never raises on any model output."""
    if max_calls < 0:
        raise ValueError(f"max_calls must be >= 0, got {max_calls}")
    blocks = _find_blocks(text)
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    for index, block in enumerate(blocks):
        call_or_error = _to_call(index, block)
        if isinstance(call_or_error, ToolCallError):
            errors.append(call_or_error)
        elif len(calls) >= max_calls:
            errors.append(ToolCallError(index, "too_many", (
                f"Tool call {index + 1} ({call_or_error.name!r}) was not run: at most {max_calls} "
                f"tool call{'s' if max_calls != 1 else ''} run per turn. Send the rest next turn.")))
        else:
            calls.append(call_or_error)
    return ParsedTurn(content=_outside(text, blocks).strip(), calls=tuple(calls), errors=tuple(errors))


def _find_blocks(text: str) -> list[_Block]:
    blocks: list[_Block] = []
    pos = text.find(OPEN_TAG)
    while pos != -1:
        block = _read_block(text, pos)
        blocks.append(block)
        pos = text.find(OPEN_TAG, block.end)
    return blocks


def _read_block(text: str, start: int) -> _Block:
    body_start = start + len(OPEN_TAG)
    # Decode JSON first so that a "</tool_call>" inside a JSON string does not end the block.
    decoded, json_end, json_error = _decode_object_at(text, body_start)
    if json_end is not None:
        after = len(text) - len(text[json_end:].lstrip())
        if text.startswith(CLOSE_TAG, after):
            return _Block(start, after + len(CLOSE_TAG), text[body_start:after], decoded)
    search_from = body_start if json_end is None else json_end  # skip tags inside JSON strings
    close = text.find(CLOSE_TAG, search_from)
    reopen = text.find(OPEN_TAG, search_from)
    if close == -1 or reopen != -1 and reopen < close:
        # A second opening before any closing: this block is the unclosed one.
        return _Block(start, len(text) if reopen == -1 else reopen, None)
    body = text[body_start:close]
    if json_end is not None:
        json_error = "unexpected text after the JSON object"
    return _Block(start, close + len(CLOSE_TAG), body, None, json_error or "not a JSON object")


def _decode_object_at(text: str, pos: int) -> tuple[Any, int | None, str]:
    """(value, end, error) for the JSON value starting at the first non-space after `pos`."""
    stripped = len(text) - len(text[pos:].lstrip())
    if stripped >= len(text) or text.startswith(CLOSE_TAG, stripped):
        return None, None, "the block is empty"
    try:
        value, end = _DECODER.raw_decode(text, stripped)
    except json.JSONDecodeError as exc:
        return None, None, f"{exc.msg} at character {exc.pos - stripped}"
    except (ValueError, RecursionError):  # absurd nesting or numbers: still just bad JSON
        return None, None, "the JSON could not be decoded"
    return value, end, ""


def _to_call(index: int, block: _Block) -> ToolCall | ToolCallError:
    n = index + 1
    if block.body is None:
        return ToolCallError(index, "unclosed", (
            f"Tool call {n} was opened with {OPEN_TAG} but never closed with {CLOSE_TAG}. "
            f"Expected format: {_EXPECTED}"))
    if not isinstance(block.decoded, dict):
        why = block.json_error or f"got a JSON {_type_name(block.decoded)}, not an object"
        return ToolCallError(index, "malformed_json", (
            f"Tool call {n} is not valid JSON ({why}). Expected format: {_EXPECTED}"))
    name = block.decoded.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError(index, "missing_name", (
            f'Tool call {n} has no "name" string. Expected format: {_EXPECTED}'))
    arguments = _arguments_object(block.decoded.get("arguments", {}))
    if arguments is None:
        got = _type_name(block.decoded.get("arguments"))
        return ToolCallError(index, "bad_arguments", (
            f'Tool call {n} ({name!r}): "arguments" must be a JSON object, got {got}. '
            f"Expected format: {_EXPECTED}"))
    return ToolCall(name=name.strip(), arguments=arguments)


def _arguments_object(value: Any) -> dict[str, Any] | None:
    """The arguments as a dict; a JSON-encoded string holding an object is accepted too,
    since several model families were trained to emit arguments that way."""
    if isinstance(value, str):
        try:
            value = _DECODER.decode(value)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, dict) else None


def _outside(text: str, blocks: list[_Block]) -> str:
    pieces, pos = [], 0
    for block in blocks:
        pieces.append(text[pos:block.start])
        pos = block.end
    pieces.append(text[pos:])
    return "".join(pieces)


def _type_name(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def validate_arguments(call: ToolCall, schema: Mapping[str, Any]) -> str | None:
    """Check `call.arguments` against an OpenAI function schema (`{"type": "function",
    "function": {...}}` or the inner function dict). Returns a message for the model, or
    None when the arguments fit. Only top-level arguments are checked."""
    function = schema.get("function", schema)
    parameters = function.get("parameters") or {}
    properties: Mapping[str, Any] = parameters.get("properties") or {}
    problems = [f"missing required argument {key!r}" for key in parameters.get("required") or ()
                if key not in call.arguments]
    if parameters.get("additionalProperties") is False:
        problems += [f"unknown argument {key!r}" for key in call.arguments if key not in properties]
    for key, value in call.arguments.items():
        spec = properties.get(key)
        if isinstance(spec, Mapping):
            problems += _value_problems(key, value, spec)
    if not problems:
        return None
    expected = ", ".join(f'"{key}": <{_spec_type(spec)}>' for key, spec in properties.items())
    name = function.get("name", call.name)
    return (f"Invalid arguments for tool {name!r}: {'; '.join(problems)}. "
            f"Expected arguments: {{{expected}}}.")


def _value_problems(key: str, value: Any, spec: Mapping[str, Any]) -> list[str]:
    types = spec.get("type")
    allowed = [types] if isinstance(types, str) else list(types or [])
    if allowed and not any(_has_type(value, t) for t in allowed):
        return [f"argument {key!r} must be {' or '.join(allowed)}, got {_type_name(value)}"]
    if "enum" in spec and value not in spec["enum"]:
        return [f"argument {key!r} must be one of {json.dumps(spec['enum'])}"]
    return []


def _has_type(value: Any, json_type: str) -> bool:
    if isinstance(value, bool):  # bool is an int subclass in Python, never in JSON Schema
        return json_type == "boolean"
    if json_type == "integer":
        return isinstance(value, int) or isinstance(value, float) and value.is_integer()
    if json_type == "number":
        return isinstance(value, (int, float))
    python_type = {"string": str, "boolean": bool, "object": dict, "array": list,
                   "null": type(None)}.get(json_type)
    return python_type is None or isinstance(value, python_type)  # unknown types are not checked


def _spec_type(spec: Any) -> str:
    types = spec.get("type", "any") if isinstance(spec, Mapping) else "any"
    return types if isinstance(types, str) else "|".join(types)
