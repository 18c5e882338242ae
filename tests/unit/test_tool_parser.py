"""What surrounds vLLM's tool parsing, without vLLM: turn statuses and their precedence,
the explanations a model reads when its call markup was refused, the per-status metric
counts, and argument validation against OpenAI function schemas. The parsers themselves
run in tests/integration/test_output_parsers.py."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from envs.types import TerminationReason, ToolCall, Trajectory, Turn
from rollout.tool_parser import (PARSE_STATUSES, TOOL_FORMATS, ParsedTurn, ToolCallError,
                                 arguments_object, explain_refused_calls, find_call_attempt,
                                 too_many_error, tool_parse_counts, turn_status, validate_arguments)

HERMES = TOOL_FORMATS["hermes"]
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


def block(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


def test_a_parsed_turn_derives_its_status_when_none_is_given():
    call = ToolCall("echo", {"text": "a"})
    assert ParsedTurn("hi", (), ()).status == "no_call"
    assert ParsedTurn("", (call,), ()).status == "ok"
    error = ToolCallError(0, "unclosed_block", "Tool call 1 was opened but never closed")
    assert ParsedTurn("", (call,), (error,)).status == "unclosed_block"
    assert ParsedTurn("", (), (), status="malformed_call").status == "malformed_call"


def test_turn_status_takes_the_most_severe_problem():
    ok, unknown, bad_args = ToolCall("echo", {"text": "a"}), ToolCall("shell", {}), ToolCall("echo", {"text": 3})
    schemas = {"echo": ECHO}
    assert turn_status([ok], [], schemas) == "ok"
    assert turn_status([], [], schemas) == "no_call"
    assert turn_status([ok, unknown], [], schemas) == "unknown_tool"
    assert turn_status([unknown, bad_args], [], schemas) == "malformed_arguments"
    assert turn_status([ok], [too_many_error(1, "echo", 1)], schemas) == "too_many"
    refused = ToolCallError(0, "malformed_call", "x")
    assert turn_status([unknown], [refused], schemas) == "malformed_call"
    assert turn_status([unknown], [], None) == "ok"  # no schemas: names and arguments not judged
    assert PARSE_STATUSES[0] == "unclosed_block" and set(PARSE_STATUSES) >= {
        "ok", "no_call", "malformed_call", "malformed_arguments", "unknown_tool", "too_many"}


def test_call_attempts_and_whether_the_last_one_closed():
    assert find_call_attempt("The answer is 84.", HERMES) is None
    assert find_call_attempt("x " + block("{}"), HERMES) == (2, True)
    assert find_call_attempt(block("{}") + "<tool_call>\n{", HERMES) == (0, False)
    assert find_call_attempt('[TOOL_CALLS]python[ARGS]{"a', TOOL_FORMATS["mistral"]) == (0, True)  # no end marker


@pytest.mark.parametrize("payload,why", [
    ('{"name": "python", "arguments": {"code": "a"', "Expecting"),
    ("[1, 2]", "got a JSON array, not an object"),
    ('{"arguments": {}}', 'no "name" string'),
    ("", "the block is empty"),
    ('{"name": "python", "arguments": {"code": "a\n b"}}', "raw newlines"),
])
def test_a_refused_json_block_is_explained(payload, why):
    text = block(json.dumps({"name": "echo", "arguments": {"text": "ok"}})) + block(payload)
    error = explain_refused_calls(text, HERMES, "hermes", "<tool_call>{...}</tool_call>")
    assert error.kind == "malformed_call" and error.index == 1
    assert error.message.startswith("Tool call 2 is not valid JSON") and why in error.message
    assert error.message.endswith("Expected format: <tool_call>{...}</tool_call>")


def test_an_unclosed_or_unreadable_block_is_explained():
    unclosed = explain_refused_calls('<tool_call>\n{"name": "echo"', HERMES, "hermes", "")
    assert unclosed.kind == "unclosed_block" and "never closed with </tool_call>" in unclosed.message
    xml = explain_refused_calls("<tool_call>\n<function=echo>\n</tool_call>", TOOL_FORMATS["qwen3_coder"],
                                "qwen3_coder", "<tool_call>\n<function=NAME>...")
    assert xml.kind == "malformed_call" and "the qwen3_coder format" in xml.message
    assert "Expected format: <tool_call>\n<function=NAME>" in xml.message


def test_explanations_never_raise_on_garbage():
    pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", "[", "\n", "\\", "🙂", "\x00", "\ud800"]
    rng = random.Random(7)
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        if find_call_attempt(text, HERMES) is not None:
            assert explain_refused_calls(text, HERMES, "hermes", "").message.startswith("Tool call ")
    deep = block("[" * 100_000)
    assert "not valid JSON" in explain_refused_calls(deep, HERMES, "hermes", "").message


@pytest.mark.parametrize("raw,expected", [
    ('{"code": "a"}', {"code": "a"}), ("", {}), (None, {}), ({"a": 1}, {"a": 1}),
    ('{"code": "a"', None), ("[1]", None), ('"{}"', None), ("[" * 100_000, None)])
def test_arguments_must_be_a_json_object(raw, expected):
    assert arguments_object(raw) == expected


def _trajectory(*statuses: str) -> Trajectory:
    turns = tuple(Turn(index=i, prompt_tokens=1, response_start=i, num_generated=1, num_observation=0,
                       finish_reason="stop", version=0, tool_parse_status=s) for i, s in enumerate(statuses))
    n = len(statuses)
    return Trajectory("t", "g", 0, [1], np.ones(n), np.ones(n), np.full(n, -0.5), np.zeros(n),
                      TerminationReason.FINISHED, turns)


def test_tool_parse_counts_every_status_as_a_metric():
    counts = tool_parse_counts([_trajectory("ok", "ok", "malformed_call"), _trajectory("no_call"), _trajectory()])
    assert counts == {f"rollout/tool_parse/{s}": v for s, v in {
        "unclosed_block": 0.0, "malformed_call": 1.0, "malformed_arguments": 0.0, "unknown_tool": 0.0,
        "too_many": 0.0, "ok": 2.0, "no_call": 1.0}.items()}
    assert all(isinstance(v, float) for v in counts.values())
    assert set(tool_parse_counts([])) == set(counts) and not any(tool_parse_counts([]).values())


PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python code.",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"code": {"type": "string"}, "timeout_s": {"type": "number"},
                                  "retries": {"type": "integer"}, "verbose": {"type": "boolean"},
                                  "env": {"type": "object"}, "args": {"type": "array"},
                                  "mode": {"type": "string", "enum": ["fast", "safe"]},
                                  "note": {"type": ["string", "null"]}},
                   "required": ["code"]}}}


def test_valid_arguments_pass():
    call = ToolCall("python", {"code": "1", "timeout_s": 2.5, "retries": 3, "verbose": True,
                               "env": {}, "args": [1], "mode": "safe", "note": None})
    assert validate_arguments(call, PYTHON_TOOL) is None
    assert validate_arguments(ToolCall("python", {"code": "1", "timeout_s": 2}), PYTHON_TOOL) is None
    assert validate_arguments(ToolCall("python", {"code": "1", "retries": 2.0}), PYTHON_TOOL) is None


def test_missing_required_argument():
    message = validate_arguments(ToolCall("python", {}), PYTHON_TOOL)
    assert "missing required argument 'code'" in message
    assert '"code": <string>' in message  # the expected format is shown


def test_unknown_argument_only_when_additional_properties_false():
    assert "unknown argument 'cmd'" in validate_arguments(ToolCall("python", {"code": "1", "cmd": "ls"}),
                                                          PYTHON_TOOL)
    open_schema = {"name": "python",
                   "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}
    assert validate_arguments(ToolCall("python", {"code": "1", "cmd": "ls"}), open_schema) is None


@pytest.mark.parametrize("key,value,expected", [
    ("code", 3, "must be string, got integer"),
    ("retries", True, "must be integer, got boolean"),
    ("retries", 1.5, "must be integer, got number"),
    ("timeout_s", "10", "must be number, got string"),
    ("verbose", 1, "must be boolean, got integer"),
    ("env", [], "must be object, got array"),
    ("args", {}, "must be array, got object"),
    ("note", 1, "must be string or null, got integer"),
    ("mode", "slow", 'must be one of ["fast", "safe"]'),
])
def test_type_mismatches(key, value, expected):
    arguments = {"code": "1", key: value}
    message = validate_arguments(ToolCall("python", arguments), PYTHON_TOOL)
    assert message is not None and expected in message
    assert message.startswith("Invalid arguments for tool 'python'")


def test_all_problems_are_reported_together():
    message = validate_arguments(ToolCall("python", {"timeout_s": "x", "cmd": 1}), PYTHON_TOOL)
    assert "missing required argument 'code'" in message
    assert "unknown argument 'cmd'" in message
    assert "'timeout_s' must be number" in message


def test_schema_without_parameters_accepts_anything():
    schema = {"type": "function", "function": {"name": "ping"}}
    assert validate_arguments(ToolCall("ping", {"x": 1}), schema) is None
