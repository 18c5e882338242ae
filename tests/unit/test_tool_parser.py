"""Hermes tool-call parsing: every error kind, limits, lenient arguments, garbage that
must never raise, and argument validation against OpenAI function schemas."""

from __future__ import annotations

import json
import random

import pytest

from rollout.tool_parser import ParsedTurn, parse_tool_calls, validate_arguments
from envs.types import ToolCall


def block(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


def call_json(name: str = "python", **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def kinds(parsed: ParsedTurn) -> list[str]:
    return [e.kind for e in parsed.errors]


def test_single_call_and_content():
    parsed = parse_tool_calls("Let me compute.\n" + block(call_json(code="print(12 * 7)")), max_calls=4)
    assert parsed.content == "Let me compute."
    assert parsed.calls == (ToolCall("python", {"code": "print(12 * 7)"}),)
    assert parsed.errors == ()


def test_several_calls_keep_order_and_content_between_them():
    text = ("First.\n" + block(call_json(code="a")) + "\nthen\n" + block(call_json("search", q="b"))
            + block(call_json(code="c")) + "\nDone.")
    parsed = parse_tool_calls(text, max_calls=8)
    assert [(c.name, dict(c.arguments)) for c in parsed.calls] == [
        ("python", {"code": "a"}), ("search", {"q": "b"}), ("python", {"code": "c"})]
    assert parsed.content == "First.\n\nthen\n\nDone."


def test_no_tool_call_is_all_content():
    assert parse_tool_calls("  The answer is 84.\n", max_calls=2) == ParsedTurn("The answer is 84.", (), ())


def test_max_calls_keeps_the_first_and_reports_the_rest():
    text = "".join(block(call_json(code=str(i))) for i in range(5))
    parsed = parse_tool_calls(text, max_calls=2)
    assert [c.arguments["code"] for c in parsed.calls] == ["0", "1"]
    assert kinds(parsed) == ["too_many"] * 3
    assert [e.index for e in parsed.errors] == [2, 3, 4]
    assert "at most 2 tool calls" in parsed.errors[0].message


def test_max_calls_counts_only_valid_calls():
    text = block("{oops") + block(call_json(code="a")) + block(call_json(code="b"))
    parsed = parse_tool_calls(text, max_calls=1)
    assert [c.arguments["code"] for c in parsed.calls] == ["a"]
    assert kinds(parsed) == ["malformed_json", "too_many"]


def test_zero_max_calls_runs_nothing_and_negative_is_a_config_error():
    assert kinds(parse_tool_calls(block(call_json(code="a")), max_calls=0)) == ["too_many"]
    with pytest.raises(ValueError, match="max_calls"):
        parse_tool_calls("", max_calls=-1)


@pytest.mark.parametrize("payload", ['{"name": "python", "arguments": {"code": "print(1)"', "not json",
                                     "[1, 2]", '"just a string"', "", "   ",
                                     '{"name": "python", "arguments": {}} trailing words'])
def test_malformed_json(payload):
    parsed = parse_tool_calls("x " + block(payload), max_calls=4)
    assert parsed.calls == ()
    assert kinds(parsed) == ["malformed_json"]
    message = parsed.errors[0].message
    assert message.startswith("Tool call 1 is not valid JSON")
    assert '{"name": "<tool name>", "arguments"' in message  # the model is shown the format
    assert parsed.content == "x"


@pytest.mark.parametrize("payload", ['{"arguments": {"code": "1"}}', '{"name": "", "arguments": {}}',
                                     '{"name": 3, "arguments": {}}', '{"name": null}'])
def test_missing_name(payload):
    parsed = parse_tool_calls(block(payload), max_calls=4)
    assert kinds(parsed) == ["missing_name"]
    assert '"name"' in parsed.errors[0].message


@pytest.mark.parametrize("arguments", ["[1]", "3", '"not an object"', '"[1, 2]"', "null", "true"])
def test_bad_arguments(arguments):
    parsed = parse_tool_calls(block('{"name": "python", "arguments": ' + arguments + "}"), max_calls=4)
    assert kinds(parsed) == ["bad_arguments"]
    assert "must be a JSON object" in parsed.errors[0].message
    assert "'python'" in parsed.errors[0].message


def test_arguments_as_json_encoded_string_are_accepted():
    payload = json.dumps({"name": "python", "arguments": json.dumps({"code": "print(2)", "n": 3})})
    parsed = parse_tool_calls(block(payload), max_calls=1)
    assert parsed.calls == (ToolCall("python", {"code": "print(2)", "n": 3}),)


def test_missing_arguments_mean_no_arguments():
    assert parse_tool_calls(block('{"name": "finish"}'), max_calls=1).calls == (ToolCall("finish", {}),)


def test_unclosed_block_at_the_end():
    parsed = parse_tool_calls("I will run it.\n<tool_call>\n" + call_json(code="1"), max_calls=4)
    assert parsed.calls == ()
    assert kinds(parsed) == ["unclosed"]
    assert "</tool_call>" in parsed.errors[0].message
    assert parsed.content == "I will run it."


def test_unclosed_block_followed_by_a_good_one():
    text = "<tool_call>\n{\"name\": \"python\"\n" + block(call_json(code="ok"))
    parsed = parse_tool_calls(text, max_calls=4)
    assert kinds(parsed) == ["unclosed"]
    assert parsed.errors[0].index == 0
    assert parsed.calls == (ToolCall("python", {"code": "ok"}),)


def test_close_tag_and_braces_inside_json_strings():
    code = "print('</tool_call>'); d = {'a': {'b': '}}'}}; s = \"<tool_call>\""
    parsed = parse_tool_calls(block(call_json(code=code)) + " after", max_calls=4)
    assert parsed.errors == ()
    assert parsed.calls == (ToolCall("python", {"code": code}),)
    assert parsed.content == "after"


def test_raw_newlines_inside_strings_are_accepted():
    payload = '{"name": "python", "arguments": {"code": "for i in range(3):\n    print(i)"}}'
    assert parse_tool_calls(block(payload), max_calls=1).calls[0].arguments["code"] == (
        "for i in range(3):\n    print(i)")


def test_unicode_names_arguments_and_content():
    text = "Réponse 🙂 " + block(call_json("recherche", q="日本語 ✓"))
    parsed = parse_tool_calls(text, max_calls=1)
    assert parsed.calls == (ToolCall("recherche", {"q": "日本語 ✓"}),)
    assert parsed.content == "Réponse 🙂"


def test_error_indices_follow_block_order():
    text = block(call_json(code="a")) + block("{bad") + block('{"arguments": {}}') + "<tool_call>{"
    parsed = parse_tool_calls(text, max_calls=4)
    assert [(e.index, e.kind) for e in parsed.errors] == [
        (1, "malformed_json"), (2, "missing_name"), (3, "unclosed")]
    assert parsed.errors[1].message.startswith("Tool call 3 ")


GARBAGE_PIECES = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\", ":", ",", "name",
                  '"name"', '"arguments"', "python", "\n", " ", "null", "1e999", "-", "🙂", "\x00",
                  "<tool_call>{\"name\": \"x\", \"arguments\": {}}</tool_call>", "\ud800"]


def test_garbage_never_raises():
    rng = random.Random(1234)
    for _ in range(3000):
        text = "".join(rng.choice(GARBAGE_PIECES) for _ in range(rng.randint(0, 40)))
        parsed = parse_tool_calls(text, max_calls=rng.randint(0, 3))
        assert len(parsed.calls) <= 3
        assert all(isinstance(c.name, str) and c.name for c in parsed.calls)
        assert all(isinstance(c.arguments, dict) for c in parsed.calls)


def test_pathological_nesting_never_raises():
    parsed = parse_tool_calls(block("[" * 100_000) + block('{"a":' * 50_000), max_calls=2)
    assert kinds(parsed) == ["malformed_json", "malformed_json"]
    deep = json.dumps({"name": "python", "arguments": json.dumps("[" * 100_000)})
    assert kinds(parse_tool_calls(block(deep), max_calls=2)) == ["bad_arguments"]


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
