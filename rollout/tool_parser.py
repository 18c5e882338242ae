"""What a model turn held: its reasoning, its content and its tool calls, each parse with a
status; the messages a model reads when a call could not be read; argument checks against
the tool's schema; and the per-status counts the trainer logs (`rollout/tool_parse/*`).

The parsing itself is vLLM's (rollout.parsers), so a policy is trained on exactly what a
vLLM server would extract from the same output. This module holds what surrounds it and
imports no framework: model output is untrusted input and nothing here raises on it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from envs.types import ToolCall, Trajectory

ParseStatus = Literal["ok", "no_call", "malformed_call", "malformed_arguments", "unknown_tool",
                      "unclosed_block", "too_many"]
# Every status, most severe first: a turn with several problems is counted under the first.
PARSE_STATUSES: tuple[ParseStatus, ...] = ("unclosed_block", "malformed_call", "malformed_arguments",
                                           "unknown_tool", "too_many", "ok", "no_call")
ErrorKind = Literal["malformed_call", "malformed_arguments", "unclosed_block", "too_many"]

# strict=False accepts raw newlines and tabs inside strings, for diagnosis only: vLLM's
# parsers decide what is a call; this decoder only explains why a body was refused.
_DECODER = json.JSONDecoder(strict=False)
_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                                dict: "object", list: "array", type(None): "null"}


@dataclass(frozen=True, slots=True)
class ToolCallError:
    """A call that will not run. `index` counts calls in the turn from 0; the message
    (shown to the model as a tool observation) numbers them from 1."""

    index: int
    kind: ErrorKind
    message: str


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    """One model turn, parsed. `calls` are run (an unknown tool or arguments that do not fit
    the schema still run and get an error observation from the agent context); `errors` are
    calls that could not be read and only get their message back."""

    content: str  # text outside reasoning and tool-call markup, stripped
    calls: tuple[ToolCall, ...]  # in order, at most max_calls
    errors: tuple[ToolCallError, ...]
    reasoning: str | None = None  # None: no reasoning parser, or the turn had none
    status: ParseStatus | Literal[""] = ""  # "" on construction: derived from calls and errors

    def __post_init__(self) -> None:
        if not self.status:
            derived = self.errors[0].kind if self.errors else "ok" if self.calls else "no_call"
            object.__setattr__(self, "status", derived)


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a vLLM tool parser's calls look in text, for telling "no call" from "a call the
    parser refused" and for the model-facing error message. `start` strings open a call;
    `end` closes one (None: the format has no closing marker)."""

    start: tuple[str, ...]
    end: str | None
    json_body: bool = False  # the text between start and end is one JSON object {name, arguments}


_TAGGED = ToolFormat(("<tool_call>",), "</tool_call>")
# vLLM tool-parser name -> format. Parsers not listed still parse; their refused calls count
# as no_call, since nothing here can see that a call was attempted.
TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(("<tool_call>",), "</tool_call>", json_body=True),
    "qwen3_json": ToolFormat(("<tool_call>",), "</tool_call>", json_body=True),
    "qwen3_coder": ToolFormat(("<tool_call>", "<function="), "</tool_call>"),
    "qwen3_xml": ToolFormat(("<tool_call>", "<function="), "</tool_call>"),
    "glm45": _TAGGED,
    "glm47": _TAGGED,
    "minimax_m2": ToolFormat(("<minimax:tool_call>",), "</minimax:tool_call>"),
    "llama3_json": ToolFormat(("<|python_tag|>", '{"name"', '{"type"'), None),
    "llama4_json": ToolFormat(("<|python_tag|>", '{"name"', '{"type"'), None),
    "mistral": ToolFormat(("[TOOL_CALLS]",), None),
    "deepseek_v3": ToolFormat(("<｜tool▁calls▁begin｜>",), "<｜tool▁calls▁end｜>"),
    "deepseek_v31": ToolFormat(("<｜tool▁calls▁begin｜>",), "<｜tool▁calls▁end｜>"),
    "kimi_k2": ToolFormat(("<|tool_calls_section_begin|>",), "<|tool_calls_section_end|>"),
    "lfm2": ToolFormat(("<|tool_call_start|>",), "<|tool_call_end|>"),
    "openai": ToolFormat(("to=functions.",), "<|call|>"),
}


def find_call_attempt(text: str, fmt: ToolFormat) -> tuple[int, bool] | None:
    """(position of the first call marker, whether the last call is closed), or None when
    `text` holds no call marker at all."""
    first = [p for marker in fmt.start if (p := text.find(marker)) != -1]
    if not first:
        return None
    last = max(text.rfind(marker) for marker in fmt.start)
    return min(first), fmt.end is None or text.find(fmt.end, last) != -1


def explain_refused_calls(text: str, fmt: ToolFormat, parser_name: str,
                          expected_format: str) -> ToolCallError:
    """The observation for output whose call markup the parser did not accept."""
    attempt = find_call_attempt(text, fmt)
    expected = f" Expected format: {expected_format}" if expected_format else ""
    if attempt is not None and not attempt[1]:
        assert fmt.end is not None  # a format without an end marker is never unclosed
        return ToolCallError(0, "unclosed_block", (
            f"Tool call 1 was opened but never closed with {fmt.end}, so it was not run.{expected}"))
    if fmt.json_body and fmt.end is not None:
        problem = _first_bad_json_block(text, fmt.start[0], fmt.end)
        if problem is not None:
            index, why = problem
            return ToolCallError(index, "malformed_call", (
                f"Tool call {index + 1} is not valid JSON ({why}); no tool call of this turn "
                f"was run.{expected}"))
    return ToolCallError(0, "malformed_call", (
        f"Tool call 1 could not be read (the {parser_name} format), so no tool call of this "
        f"turn was run.{expected}"))


def _first_bad_json_block(text: str, open_tag: str, close_tag: str) -> tuple[int, str] | None:
    """(index, reason) of the first block whose body is not a JSON object with a "name"."""
    pos, index = text.find(open_tag), 0
    while pos != -1:
        body_start = pos + len(open_tag)
        close = text.find(close_tag, body_start)
        body = text[body_start:] if close == -1 else text[body_start:close]
        why = _json_problem(body)
        if why:
            return index, why
        pos = -1 if close == -1 else text.find(open_tag, close + len(close_tag))
        index += 1
    return None


def _json_problem(body: str) -> str:
    stripped = body.strip()
    if not stripped:
        return "the block is empty"
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError as exc:
        try:  # tell the model when only the raw control characters in its strings broke it
            _DECODER.decode(stripped)
            return "strings must not hold raw newlines or tabs; write them as \\n and \\t"
        except (ValueError, RecursionError):
            return f"{exc.msg} at character {exc.pos}"
    except (ValueError, RecursionError):  # absurd nesting or numbers: still just bad JSON
        return "the JSON could not be decoded"
    if not isinstance(value, dict):
        return f"got a JSON {type_name(value)}, not an object"
    if not isinstance(value.get("name"), str) or not value["name"].strip():
        return 'it has no "name" string'
    return ""


def arguments_object(raw: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A parser's arguments (a JSON string in vLLM's results) as a dict, or None when they
    are not a JSON object."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def type_name(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def too_many_error(index: int, name: str, max_calls: int) -> ToolCallError:
    return ToolCallError(index, "too_many", (
        f"Tool call {index + 1} ({name!r}) was not run: at most {max_calls} tool "
        f"call{'s' if max_calls != 1 else ''} run per turn. Send the rest next turn."))


def turn_status(calls: Sequence[ToolCall], errors: Sequence[ToolCallError],
                schemas: Mapping[str, Mapping[str, Any]] | None) -> ParseStatus:
    """The most severe status of a turn. With `schemas` (tool name -> schema), a call to a
    tool not among them is unknown_tool and arguments that do not fit are
    malformed_arguments, although those calls still run and get an error observation."""
    seen: set[str] = {e.kind for e in errors}
    if schemas is not None:
        for call in calls:
            schema = schemas.get(call.name)
            if schema is None:
                seen.add("unknown_tool")
            elif validate_arguments(call, schema) is not None:
                seen.add("malformed_arguments")
    if calls:
        seen.add("ok")
    return next((s for s in PARSE_STATUSES if s in seen), "no_call")


def tool_parse_counts(trajectories: Iterable[Trajectory]) -> dict[str, float]:
    """Turns per parse status over `trajectories`, as metrics `rollout/tool_parse/<status>`
    (every status present, zeros included, so the charts keep their series)."""
    counts: Counter[str] = Counter(turn.tool_parse_status for t in trajectories for turn in t.turns)
    return {f"rollout/tool_parse/{status}": float(counts.get(status, 0)) for status in PARSE_STATUSES}


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
        return [f"argument {key!r} must be {' or '.join(allowed)}, got {type_name(value)}"]
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
