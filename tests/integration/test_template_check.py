"""The start-up template self-check (rollout.template_check) on the real chat templates
that trl and vLLM ship: every supported family passes with both keep_thinking settings
(a probe with reasoning, two tool calls and a follow-up user turn), and every template
sluice does not support, or a family that is not the template's, is refused with the
first difference, its context and the knob to change. No engine.
"""

from __future__ import annotations

import pytest

from chat_families import (DEEPSEEK, GEMMA, GEMMA4, HARMONY, LFM, QWEN, SUPPORTED, TemplateCase,
                           tokenizer_for, train_tokenizer, trl_template)
from envs.types import Message
from rollout.chat import FAMILIES, build_continuity_builder, check_continuity, encode
from rollout.template_check import check_template, probe_template

# (template, does the ids' context keep reasoning the template drops, with keep_thinking=True)
DROPS_WITH_KEEP = {"qwen3": True, "qwen3_5_think": True, "qwen3_5_nothink": True, "glm4moe": True,
                   "lfm2_2_5": True, "lfm2_2_5_v2": True}


def test_at_least_ten_families_pass_and_five_of_them_think():
    families = {c.family for c in SUPPORTED}
    thinking = {f for f in families if FAMILIES[f].thinking != "none"}
    assert len(families) >= 10 and len(thinking) >= 5
    assert len({f for f in families if FAMILIES[f].has_tools}) >= 8


@pytest.mark.parametrize("keep_thinking", [True, False], ids=["keep", "drop"])
@pytest.mark.parametrize("case", SUPPORTED, ids=[c.id for c in SUPPORTED])
def test_supported_templates_pass_the_self_check(case: TemplateCase, keep_thinking, tiny_model_path):
    tokenizer = tokenizer_for(case, tiny_model_path)
    report = probe_template(tokenizer, "auto", keep_thinking)  # detection, then verification
    family = FAMILIES[case.family]
    assert report.family == case.family
    assert (report.tool_parser, report.keep_thinking) == (family.tool_parser, keep_thinking)
    thinks = family.thinking != "none"
    # keep_thinking=False: the follow-up user turn starts a new segment without earlier reasoning
    assert report.num_segments == (2 if thinks and not keep_thinking else 1)
    assert report.keeps_dropped_reasoning == (keep_thinking and DROPS_WITH_KEEP.get(case.id, False))
    assert check_template(tokenizer, case.family, keep_thinking) is None


def _message(exc: pytest.ExceptionInfo) -> str:
    return str(exc.value)


# Templates sluice refuses, and what the refusal must say.
REFUSED = [
    ("lfm2", LFM, "does not render the message's tool calls"),  # tools listed, calls dropped
    ("deepseekv3", DEEPSEEK, "generation prompt ends with '<think>\\n'"),  # R1 prefill, history without it
    ("deepseek_r1_distill", DEEPSEEK, "generation prompt ends with '<think>\\n'"),
    ("gptoss", HARMONY, "no previous assistant message with a tool call"),
    ("gemma4", GEMMA4, "not with the turn's closing text"),  # tool results inside the model turn
    ("gemma", GEMMA, "System role not supported"),
    ("cohere2", QWEN, "cannot detect the chat family"),
    ("smolvlm", QWEN, "verbatim exactly once"),
]


@pytest.mark.parametrize("keep_thinking", [True, False], ids=["keep", "drop"])
@pytest.mark.parametrize("name,vocab,why", REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_templates_are_refused_with_the_reason_and_the_knob(name, vocab, why, keep_thinking):
    tokenizer = train_tokenizer(vocab, trl_template(name))
    with pytest.raises(ValueError) as exc:
        check_template(tokenizer, "auto", keep_thinking)
    message = _message(exc)
    assert why in message
    assert "agent.chat_family" in message
    if "cannot detect" not in message:
        assert f"agent.keep_thinking={keep_thinking}" in message and "(detected)" in message


@pytest.mark.parametrize("template,family,first_difference,knob", [
    # Qwen3.5 writes XML calls: the Hermes parser of the qwen3 family cannot read them.
    ("qwen3_5_think", "qwen3", "tool parser reads calls []", "agent.tool_parser"),
    # The Llama 3.1 template renders JSON tool calls: a family without tools cannot read them.
    ("llama3_1", "llama3", "renders tool calls, but family 'llama3' parses none", "agent.chat_family"),
    # LFM2.5 thinks in <think>: the plain ChatML family would train the reasoning as the answer.
    ("lfm2_2_5", "chatml", "family 'chatml' parses none", "agent.chat_family"),
    # A thinking template under a family without a reasoning parser: reasoning lands in the text.
    ("qwen3", "qwen2_5", "the template renders reasoning, but family 'qwen2_5' parses none",
     "agent.reasoning_parser"),
    ("glm4moe", "qwen3", "as one token", "agent.chat_family"),
])
def test_a_family_that_is_not_the_templates_is_refused(template, family, first_difference, knob):
    vocab = next(c.vocab for c in SUPPORTED if c.id == template)
    tokenizer = tokenizer_for(next(c for c in SUPPORTED if c.id == template))
    assert vocab is not None
    with pytest.raises(ValueError) as exc:
        check_template(tokenizer, family, keep_thinking=True)
    message = _message(exc)
    assert first_difference in message and knob in message
    assert message.startswith(f"chat template check failed with agent.chat_family={family!r}, ")


# ChatML with Hermes calls whose earlier turns are re-rendered with the tool name in
# capitals: what a model wrote is not what the template shows it afterwards.
RENAMING_TEMPLATE = (
    "{%- for m in messages -%}{%- set newest = loop.last -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') -}}"
    "{%- for c in m.tool_calls or [] -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + (c.function.name if newest else c.function.name | upper)"
    " + '\", \"arguments\": ' + (c.function.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


@pytest.mark.parametrize("keep_thinking", [True, False])
def test_a_divergence_names_the_first_differing_token_and_its_context(keep_thinking):
    tokenizer = train_tokenizer(QWEN, RENAMING_TEMPLATE)
    with pytest.raises(ValueError) as exc:
        check_template(tokenizer, "auto", keep_thinking)
    message = _message(exc)
    assert message.startswith(f"chat template check failed with agent.chat_family='qwen2_5' (detected), "
                              f"agent.keep_thinking={keep_thinking}: segment 1 of 1: ids diverge at position ")
    # "after '<context>' the template gives '<its tokens>', the trajectory has '<ours>'"
    assert "the template gives 'PY" in message and "the trajectory has 'py" in message
    assert "after '" in message and "renders a generated turn differently" in message
    assert "agent.chat_family" in message


def test_parsers_named_by_the_recipe_are_checked_too():
    tokenizer = tokenizer_for(next(c for c in SUPPORTED if c.id == "qwen3"))
    with pytest.raises(ValueError, match="'qwen3_coder' tool parser reads calls .*agent.tool_parser"):
        check_template(tokenizer, "qwen3", tool_parser="qwen3_coder")
    with pytest.raises(ValueError, match="agent.reasoning_parser"):
        check_template(tokenizer, "qwen3", reasoning_parser="none")
    assert check_template(tokenizer, "qwen3", tool_parser="qwen3_json") is None  # vLLM's alias of hermes


def test_reasoning_kept_as_raw_text_would_have_been_refused():
    """The bug the self-check exists for: a transcript that keeps a thinking turn as raw text
    (no reasoning field) re-renders into a context the template never produces when a user
    turn starts a new segment without earlier thinking."""
    case = next(c for c in SUPPORTED if c.id == "nemotron_3_nano")
    tokenizer = tokenizer_for(case)
    builder = build_continuity_builder(tokenizer, "nemotron_3", keep_thinking=False)
    head = [Message("system", "Be brief."), Message("user", "What is 12 * 7?")]
    raw = Message("assistant", "<think>\nTwelve sevens.\n</think>\n84")
    parsed = Message("assistant", "84", reasoning="Twelve sevens.")
    follow_up = Message("user", "And 12 * 8?")
    with_parsed = tokenizer.decode(builder.reset_context([*head, parsed, follow_up], None))
    assert "Twelve sevens." not in with_parsed  # the earlier reasoning is gone, as the template does
    with_raw = tokenizer.decode(builder.reset_context([*head, raw, follow_up], None))
    assert with_raw != with_parsed


def test_qwen3_drops_an_empty_think_block_of_an_earlier_tool_turn():
    """The real Qwen3 template renders an empty think block only on the newest turn: an
    earlier tool turn whose reasoning was empty loses it on re-render, so the trajectory's
    ids (kept as generated, mask 1) differ from a re-render exactly there."""
    tokenizer = tokenizer_for(next(c for c in SUPPORTED if c.id == "qwen3"))
    builder = build_continuity_builder(tokenizer, "qwen3", keep_thinking=False)
    head = [Message("system", "Use tools."), Message("user", "What is 12 * 7?")]
    tools = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
    ids = builder.initial_prompt_ids(head, tools)
    first = '<think>\n\n</think>\n\n<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n</tool_call>'
    ids += encode(tokenizer, first) + [builder.end_of_turn_id]
    start_of_turn = len(ids) - len(encode(tokenizer, first)) - 1
    parsed = builder.parser.parse(first, encode(tokenizer, first), tools=tools, max_calls=2)
    assert parsed.status == "ok" and parsed.reasoning is None
    ids += builder.observation_ids([Message("tool", "84", name="python")], generation_ended_with_eos=True)
    messages = [*head, Message("assistant", parsed.content, parsed.calls, reasoning=parsed.reasoning),
                Message("tool", "84", name="python")]
    divergence = check_continuity(tokenizer, messages, tools, ids)
    assert divergence is not None and divergence.position == start_of_turn
    assert divergence.incremental_after.startswith("<think>")


def test_a_pass_is_remembered_by_everything_it_depends_on_and_a_failure_never(tmp_path,
                                                                             monkeypatch):
    import rollout.template_check as template_check

    tokenizer = train_tokenizer(QWEN, trl_template("qwen2_5"))
    check_template(tokenizer, "qwen2_5", True, passed_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1

    def probed_again(*args, **kwargs):
        raise AssertionError("probed again")

    monkeypatch.setattr(template_check, "probe_template", probed_again)
    check_template(tokenizer, "qwen2_5", True, passed_dir=tmp_path)  # the same inputs: remembered
    with pytest.raises(AssertionError, match="probed again"):  # another setting
        check_template(tokenizer, "qwen2_5", False, passed_dir=tmp_path)
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_start|>system", "<|im_start|>system ")
    with pytest.raises(AssertionError, match="probed again"):  # another template
        check_template(tokenizer, "qwen2_5", True, passed_dir=tmp_path)
    monkeypatch.undo()

    refused = train_tokenizer(LFM, trl_template("lfm2"))
    for _ in range(2):  # explained every time, never remembered
        with pytest.raises(ValueError, match="does not render the message's tool calls"):
            check_template(refused, "auto", True, passed_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1
