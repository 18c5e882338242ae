"""vLLM's tool and reasoning parsers through rollout.parsers, on model output written from
each format's documentation: good calls, several calls, reasoning, and the failures the
trackers are full of (broken JSON, unknown tools, blocks cut by the length limit,
unparseable markup). Every failure is a status and an observation, never an exception.

Tokenizers are trained here with each family's special tokens (tests/chat_families.py);
gpt-oss output is given as the o200k Harmony ids vLLM reads. No engine.
"""

from __future__ import annotations

import json
import logging
import random

import pytest

from chat_families import (DEEPSEEK, GLM, HARMONY, KIMI, LFM, LLAMA, MISTRAL, QWEN, Vocabulary,
                           train_tokenizer)
from envs.types import ToolCall
from rollout.parsers import OutputParser, check_parser_name, tool_parser_names
from rollout.tool_parser import PARSE_STATUSES

TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"},
                                                    "timeout_s": {"type": "integer"}},
                   "required": ["code"]}}}]
PY = lambda code, **kw: ToolCall("python", {"code": code, **kw})  # noqa: E731

_TOKENIZERS: dict[Vocabulary, object] = {}
_PARSERS: dict[tuple, OutputParser] = {}


def parser(tool: str | None, reasoning: str | None, vocab: Vocabulary) -> OutputParser:
    key = (tool, reasoning, vocab)
    if key not in _PARSERS:
        if vocab not in _TOKENIZERS:
            _TOKENIZERS[vocab] = train_tokenizer(vocab, "{{ messages[0]['content'] }}")
        _PARSERS[key] = OutputParser(_TOKENIZERS[vocab], tool, reasoning,
                                     expected_format="<format of the family>")
    return _PARSERS[key]


def parse(p: OutputParser, text: str, max_calls: int = 4):
    ids = p.tokenizer.encode(text, add_special_tokens=False)
    return p.parse(text, ids, tools=TOOLS, max_calls=max_calls)


def hermes_block(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


def hermes_call(name: str = "python", **arguments) -> str:
    return hermes_block(json.dumps({"name": name, "arguments": arguments}))


# (id, tool parser, reasoning parser, vocabulary, model output, status, calls, reasoning, content)
CASES = [
    # Hermes (Qwen2.5, Qwen3, the tiny model): JSON in <tool_call> blocks.
    ("hermes-one", "hermes", None, QWEN, "Let me compute.\n" + hermes_call(code="print(12 * 7)"),
     "ok", [PY("print(12 * 7)")], None, "Let me compute."),
    ("hermes-two", "hermes", None, QWEN, hermes_call(code="a") + "\n" + hermes_call(code="b", timeout_s=3),
     "ok", [PY("a"), PY("b", timeout_s=3)], None, ""),
    ("hermes-bad-json", "hermes", None, QWEN, "Run it.\n" + hermes_block('{"name": "python", "arguments": {"code": "a"'),
     "malformed_call", [], None, None),
    # One broken block fails the whole turn, exactly as vLLM's server reads it.
    ("hermes-one-bad-of-two", "hermes", None, QWEN, hermes_call(code="a") + hermes_block("{oops}"),
     "malformed_call", [], None, None),
    ("hermes-raw-newline", "hermes", None, QWEN,
     hermes_block('{"name": "python", "arguments": {"code": "for i in x:\n    print(i)"}}'),
     "malformed_call", [], None, None),
    ("hermes-unknown-tool", "hermes", None, QWEN, hermes_call("browser", url="x"), "unknown_tool",
     [ToolCall("browser", {"url": "x"})], None, ""),
    ("hermes-schema-mismatch", "hermes", None, QWEN, hermes_call(code=3), "malformed_arguments",
     [ToolCall("python", {"code": 3})], None, ""),
    # Cut by the length limit: vLLM still reads a complete JSON body, the turn is unclosed.
    ("hermes-unclosed-complete", "hermes", None, QWEN, '<tool_call>\n{"name": "python", "arguments": {"code": "a"}}',
     "unclosed_block", [PY("a")], None, ""),
    ("hermes-unclosed-partial", "hermes", None, QWEN, 'I will run.\n<tool_call>\n{"name": "python", "argu',
     "unclosed_block", [], None, None),
    ("hermes-too-many", "hermes", None, QWEN, "".join(hermes_call(code=str(i)) for i in range(6)),
     "too_many", [PY("0"), PY("1"), PY("2"), PY("3")], None, ""),
    ("hermes-no-call", "hermes", None, QWEN, "The answer is 84.", "no_call", [], None, "The answer is 84."),
    # Qwen3: <think> reasoning, then Hermes calls.
    ("qwen3-think-call", "hermes", "qwen3", QWEN,
     "<think>\nI should run Python.\n</think>\n\nI will compute it.\n" + hermes_call(code="print(1)"),
     "ok", [PY("print(1)")], "I should run Python.", "I will compute it."),
    ("qwen3-think-answer", "hermes", "qwen3", QWEN, "<think>\nEasy.\n</think>\n\nThe answer is 84.",
     "no_call", [], "Easy.", "The answer is 84."),
    # Qwen3.5 / Qwen3-Coder: XML calls, the generation prompt opened <think>.
    ("qwen3xml-two", "qwen3_coder", "qwen3", QWEN,
     "Two runs.\n</think>\n\nChecking.\n\n<tool_call>\n<function=python>\n<parameter=code>\nprint(12 * 7)\n"
     "</parameter>\n<parameter=timeout_s>\n5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
     "<function=python>\n<parameter=code>\nprint(7 * 12)\n</parameter>\n</function>\n</tool_call>",
     "ok", [PY("print(12 * 7)", timeout_s=5), PY("print(7 * 12)")], "Two runs.", "Checking."),
    ("qwen3xml-multiline", "qwen3_coder", None, QWEN,
     "<tool_call>\n<function=python>\n<parameter=code>\nfor i in range(3):\n    print(i)\n</parameter>\n"
     "</function>\n</tool_call>", "ok", [PY("for i in range(3):\n    print(i)")], None, ""),
    # A JSON body inside Qwen3.5's tags is not its format: the call is refused.
    ("qwen3xml-json-body", "qwen3_coder", None, QWEN, hermes_call(code="a"), "malformed_call", [], None, None),
    ("qwen3xml-unclosed", "qwen3_coder", None, QWEN,
     "<tool_call>\n<function=python>\n<parameter=code>\nprint(", "unclosed_block", None, None, None),
    ("qwen3xml-unknown", "qwen3_coder", None, QWEN,
     "<tool_call>\n<function=shell>\n<parameter=cmd>\nls\n</parameter>\n</function>\n</tool_call>",
     "unknown_tool", [ToolCall("shell", {"cmd": "ls"})], None, ""),
    # GLM-4.5: <arg_key>/<arg_value> pairs, reasoning in <think>.
    ("glm-call", "glm45", "glm45", GLM,
     "\n<think>Run it.</think>\nComputing.\n<tool_call>python\n<arg_key>code</arg_key>\n"
     "<arg_value>print(1)</arg_value>\n<arg_key>timeout_s</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
     "ok", [PY("print(1)", timeout_s=3)], "Run it.", "Computing."),
    ("glm-unclosed", "glm45", "glm45", GLM,
     "\n<think>Run it.</think>\n<tool_call>python\n<arg_key>code</arg_key>\n<arg_value>print(",
     "unclosed_block", None, "Run it.", None),
    ("glm-answer", "glm45", "glm45", GLM, "\n<think>Easy.</think>\nThe answer is 84.", "no_call", [],
     "Easy.", "The answer is 84."),
    # Llama 3.1 / 3.2: one bare JSON object with "parameters", <|python_tag|> optional.
    ("llama-json", "llama3_json", None, LLAMA, '{"name": "python", "parameters": {"code": "print(1)"}}',
     "ok", [PY("print(1)")], None, ""),
    ("llama-python-tag", "llama3_json", None, LLAMA,
     '<|python_tag|>{"name": "python", "parameters": {"code": "print(2)"}}', "ok", [PY("print(2)")], None, ""),
    ("llama-cut", "llama3_json", None, LLAMA, '{"name": "python", "parameters": {"code": "pri',
     "malformed_call", [], None, None),
    ("llama-answer", "llama3_json", None, LLAMA, "The answer is 84.", "no_call", [], None, "The answer is 84."),
    # Mistral (tokenizer v11+): [TOOL_CALLS]name[ARGS]{...}, reasoning in [THINK].
    ("mistral-two", "mistral", "mistral", MISTRAL,
     '[THINK]Two runs.[/THINK]Checking.[TOOL_CALLS]python[ARGS]{"code": "a"}[TOOL_CALLS]python[ARGS]{"code": "b"}',
     "ok", [PY("a"), PY("b")], "Two runs.", "Checking."),
    ("mistral-cut-args", "mistral", None, MISTRAL, '[TOOL_CALLS]python[ARGS]{"code": "a"',
     "malformed_arguments", [], None, ""),
    ("mistral-answer", "mistral", None, MISTRAL, "The answer is 84.", "no_call", [], None, "The answer is 84."),
    # DeepSeek-V3: fenced JSON in <｜tool▁call▁begin｜> blocks; R1-style reasoning.
    ("deepseek-two", "deepseek_v3", "deepseek_r1", DEEPSEEK,
     "Two runs.\n</think>\n\nChecking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>python\n"
     '```json\n{"code": "a"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>python\n'
     '```json\n{"code": "b"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "ok", [PY("a"), PY("b")], "Two runs.", "Checking."),
    ("deepseek-unclosed", "deepseek_v3", None, DEEPSEEK,
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>python\n```json\n{\"code\": \"a\"",
     "unclosed_block", [], None, None),
    ("deepseek-bad-json", "deepseek_v3", None, DEEPSEEK,
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>python\n```json\n{code: a}\n```"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "malformed_arguments", [], None, None),
    ("deepseek-v31", "deepseek_v31", None, DEEPSEEK,
     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>python<｜tool▁sep｜>{"code": "a"}<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>", "ok", [PY("a")], None, ""),
    # Kimi K2: functions.NAME:IDX ids in a tool-calls section.
    ("kimi-two", "kimi_k2", "kimi_k2", KIMI,
     "<think>Two runs.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.python:0"
     '<|tool_call_argument_begin|>{"code": "a"}<|tool_call_end|><|tool_call_begin|>functions.python:1'
     '<|tool_call_argument_begin|>{"code": "b"}<|tool_call_end|><|tool_calls_section_end|>',
     "ok", [PY("a"), PY("b")], "Two runs.", "Checking."),
    ("kimi-cut", "kimi_k2", None, KIMI,
     '<|tool_calls_section_begin|><|tool_call_begin|>functions.python:0<|tool_call_argument_begin|>{"code": "a"',
     "unclosed_block", [], None, None),
    ("kimi-bad-args", "kimi_k2", None, KIMI,
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.python:0<|tool_call_argument_begin|>{code: a}"
     "<|tool_call_end|><|tool_calls_section_end|>", "malformed_arguments", [], None, None),
    # LFM2: Pythonic calls between <|tool_call_start|> and <|tool_call_end|>.
    ("lfm2-two", "lfm2", None, LFM,
     "Checking.<|tool_call_start|>[python(code='a'), python(code='b', timeout_s=3)]<|tool_call_end|>",
     "ok", [PY("a"), PY("b", timeout_s=3)], None, "Checking."),
    ("lfm2-cut", "lfm2", None, LFM, "<|tool_call_start|>[python(code='a'", "unclosed_block", [], None, None),
    ("lfm2-not-python", "lfm2", None, LFM, "<|tool_call_start|>[python(code=a b)]<|tool_call_end|>",
     "malformed_call", [], None, None),
    ("lfm2.5-think", "lfm2", "deepseek_r1", LFM,
     "<think>Run it.</think>Checking.<|tool_call_start|>[python(code='a')]<|tool_call_end|>",
     "ok", [PY("a")], "Run it.", "Checking."),
    # gpt-oss (Harmony): channels after the prompt's <|start|>assistant.
    ("harmony-call", "openai", "openai_gptoss", HARMONY,
     "<|channel|>analysis<|message|>Run it.<|end|><|start|>assistant to=functions.python<|channel|>commentary "
     'json<|message|>{"code": "print(1)"}<|call|>', "ok", [PY("print(1)")], "Run it.", ""),
    ("harmony-final", "openai", "openai_gptoss", HARMONY,
     "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>The answer is 84.",
     "no_call", [], "Easy.", "The answer is 84."),
    ("harmony-cut", "openai", "openai_gptoss", HARMONY,
     "<|channel|>analysis<|message|>Run.<|end|><|start|>assistant to=functions.python<|channel|>commentary "
     'json<|message|>{"code": "pri', "unclosed_block", [], "Run.", None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_model_output_formats(case):
    _, tool, reasoning_parser, vocab, text, status, calls, reasoning, content = case
    p = parser(tool, reasoning_parser, vocab)
    parsed = parse(p, text)
    assert parsed.status == status, parsed
    if calls is not None:
        assert list(parsed.calls) == calls
    assert parsed.reasoning == reasoning
    if content is not None:
        assert parsed.content == content
    if status in ("malformed_call", "malformed_arguments", "unclosed_block", "too_many") and not parsed.calls:
        # what could not run is explained to the model, with the format it should use
        assert parsed.errors and parsed.errors[0].message.startswith("Tool call ")
        assert "<format of the family>" in parsed.errors[0].message or status == "too_many"


def test_a_broken_json_body_is_explained_precisely():
    p = parser("hermes", None, QWEN)
    parsed = parse(p, hermes_call(code="a") + "\n" + hermes_block('{"name": "python", "arguments": {"code": 1,}}'))
    assert parsed.status == "malformed_call" and parsed.calls == ()
    message = parsed.errors[0].message
    assert message.startswith("Tool call 2 is not valid JSON") and "no tool call of this turn was run" in message
    raw = parse(p, hermes_block('{"name": "python", "arguments": {"code": "a\n b"}}')).errors[0].message
    assert "raw newlines" in raw  # the one thing that made the body invalid is named


def test_too_many_calls_run_the_first_and_say_so():
    parsed = parse(parser("hermes", None, QWEN), "".join(hermes_call(code=str(i)) for i in range(3)), max_calls=1)
    assert [c.arguments["code"] for c in parsed.calls] == ["0"]
    assert [e.kind for e in parsed.errors] == ["too_many", "too_many"]
    assert "at most 1 tool call run per turn" in parsed.errors[0].message


def test_without_tools_nothing_is_a_call_as_on_a_server():
    p = parser("hermes", None, QWEN)
    text = "Running.\n" + hermes_call(code="a")
    for tools in ([], None):
        parsed = p.parse(text, (), tools=tools, max_calls=2)
        assert (parsed.status, parsed.calls, parsed.errors) == ("no_call", (), ())
        assert parsed.content == text


def test_thinking_switched_off_reads_everything_as_content():
    tokenizer = train_tokenizer(QWEN, "{{ 'x' }}")
    p = OutputParser(tokenizer, "hermes", "qwen3", template_kwargs={"enable_thinking": False})
    parsed = p.parse("The answer is 84.", (), tools=TOOLS, max_calls=2)
    assert (parsed.reasoning, parsed.content) == (None, "The answer is 84.")
    thinking = parser("hermes", "qwen3", QWEN).parse("The answer is 84.", (), tools=TOOLS, max_calls=2)
    assert thinking.reasoning == "The answer is 84."  # an open think block, as vLLM assumes


GARBAGE = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\", ":", ",", "name", '"name"',
           '"arguments"', "python", "\n", " ", "null", "1e999", "<function=", "</function>",
           "<parameter=", "</parameter>", "<think>", "</think>", "🙂", "\x00", "(", ")", "=", "'"]


@pytest.mark.parametrize("tool,reasoning_parser,vocab", [
    ("hermes", "qwen3", QWEN), ("qwen3_coder", "qwen3", QWEN), ("glm45", "glm45", GLM),
    ("llama3_json", None, LLAMA), ("mistral", "mistral", MISTRAL), ("deepseek_v3", "deepseek_r1", DEEPSEEK),
    ("kimi_k2", "kimi_k2", KIMI), ("lfm2", None, LFM), ("openai", "openai_gptoss", HARMONY)])
def test_garbage_never_raises(tool, reasoning_parser, vocab, caplog):
    p = parser(tool, reasoning_parser, vocab)
    pieces = GARBAGE + list(vocab.special) + list(vocab.markup)
    rng = random.Random(1234)
    statuses = set()
    with caplog.at_level(logging.ERROR):
        for _ in range(300):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
            parsed = p.parse(text, p.tokenizer.encode(text, add_special_tokens=False), tools=TOOLS,
                             max_calls=rng.randint(0, 3))
            statuses.add(parsed.status)
            assert parsed.status in PARSE_STATUSES
            assert all(isinstance(c.name, str) and c.name for c in parsed.calls)
    assert not [r for r in caplog.records if r.name.startswith("vllm")]  # no traceback per bad call
    assert "no_call" in statuses


def test_unknown_parser_names_are_config_errors_with_close_matches():
    with pytest.raises(ValueError, match="agent.tool_parser='hermess'.*did you mean hermes"):
        check_parser_name("agent.tool_parser", "hermess", tool_parser_names())
    with pytest.raises(ValueError, match="agent.reasoning_parser='qwen4'"):
        parser("hermes", "qwen4", QWEN)


def test_a_parser_whose_tokens_the_tokenizer_lacks_is_refused_at_start():
    with pytest.raises(ValueError, match="agent.tool_parser='lfm2'.*cannot parse this tokenizer"):
        parser("lfm2", None, QWEN)
