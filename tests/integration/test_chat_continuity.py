"""Token continuity against the families' real chat templates: a simulated three-turn
tool conversation built incrementally must equal a full re-render, keep every turn's
prompt as a prefix, and mask exactly the generated ids.

The original templates come from the installed `trl` package (chat_templates/, byte-
identical to the model repos), paired with small byte-level BPE tokenizers trained here
with each family's special tokens. No Ray, no engine.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest

from chat_families import LLAMA, QWEN, train_tokenizer, trl_template
from envs.types import Message, ToolCall
from rollout.chat import (FAMILIES, build_continuity_builder, check_continuity, detect_family, encode,
                          render_chat)

TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code and return its output.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
HEAD = (Message("system", "You solve arithmetic with tools."), Message("user", "What is 12 * 7?"))


@dataclass(frozen=True)
class ScriptedTurn:
    text: str  # what the model generates, without the stop token
    message: Message  # the same turn as a message, for the full re-render
    observations: tuple[Message, ...]  # what the environment answers (empty: final turn)


def hermes_turn(text: str, *observations: Message, reasoning: str | None = None,
                calls: tuple[ToolCall, ...] = (), content: str = "") -> ScriptedTurn:
    """A turn the model writes as `text`; as a message it is `content`, `calls` and
    `reasoning` apart, as the family's parsers read it."""
    return ScriptedTurn(text, Message("assistant", content, calls, reasoning=reasoning), observations)


def tool(content: str) -> Message:
    return Message("tool", content, name="python")


def call_block(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


def hermes_script(think: bool) -> list[ScriptedTurn]:
    def thought(text: str) -> str:
        return f"<think>\n{text}\n</think>\n\n" if think else ""

    def why(text: str) -> str | None:
        return text if think else None

    first = thought("I should run Python.") + "I will compute it.\n" + call_block("print(12 * 7)")
    second = thought("Both checks.") + call_block("print(84 + 1)") + "\n" + call_block("print(84 - 1)")
    code = lambda c: ToolCall("python", {"code": c})  # noqa: E731
    return [hermes_turn(first, tool("84"), reasoning=why("I should run Python."),
                        calls=(code("print(12 * 7)"),), content="I will compute it."),
            hermes_turn(second, tool("85"), tool("83"), reasoning=why("Both checks."),
                        calls=(code("print(84 + 1)"), code("print(84 - 1)"))),
            hermes_turn(thought("Done.") + "The answer is 84.", reasoning=why("Done."),
                        content="The answer is 84.")]


def llama_script(tool_calls: bool) -> list[ScriptedTurn]:
    """Llama 3.1+ renders a call as bare JSON with "parameters"; Llama 3 has no tool calls,
    so there the same JSON is the message's content."""
    def turn(text: str, call: ToolCall | None, *observations: Message) -> ScriptedTurn:
        calls = (call,) if call and tool_calls else ()
        return ScriptedTurn(text, Message("assistant", "" if calls else text, calls), observations)

    def call_text(code: str) -> str:
        return json.dumps({"name": "python", "parameters": {"code": code}})

    return [turn(call_text("print(12 * 7)"), ToolCall("python", {"code": "print(12 * 7)"}), tool("84")),
            turn(call_text("print(84 + 1)"), ToolCall("python", {"code": "print(84 + 1)"}), tool("85")),
            turn("The answer is 84.", None)]


@dataclass(frozen=True)
class Case:
    template: str  # trl template name, or "tiny"
    family: str
    detected: str  # what family="auto" must find


CASES = {c.template: c for c in (Case("tiny", "tiny", "tiny"), Case("qwen2_5", "qwen2_5", "qwen2_5"),
                                 Case("qwen3", "qwen3", "qwen3"), Case("llama3", "llama3", "llama3"),
                                 Case("llama3_1", "llama3_json", "llama3_json"),
                                 Case("llama3_2", "llama3_json", "llama3_json"))}


def tokenizer_for(case: Case, tiny_model_path: Path):
    if case.template == "tiny":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tiny_model_path)
    vocab = LLAMA if case.family.startswith("llama3") else QWEN
    return train_tokenizer(vocab, trl_template(case.template))


def script_for(case: Case) -> list[ScriptedTurn]:
    if case.family.startswith("llama3"):
        return llama_script(tool_calls=case.template != "llama3")
    return hermes_script(think=case.family == "qwen3")


@dataclass
class Transcript:
    ids: list[int]
    mask: list[int]  # 1 = generated by the model
    prompts: list[list[int]]  # what the engine saw before each turn
    spans: list[tuple[int, int]]  # [start, end) of each generation in ids
    messages: list[Message]


def simulate(tokenizer, builder, script: list[ScriptedTurn], length_stopped: tuple[int, ...] = (),
             head: tuple[Message, ...] = HEAD, start: Transcript | None = None) -> Transcript:
    """Run the turns as an agent loop would: generated ids are kept as produced, only
    observations go through the builder. Turns in `length_stopped` end without the stop token."""
    if start is None:
        ids = builder.initial_prompt_ids(head, TOOLS)
        start = Transcript(ids, [0] * len(ids), [], [], list(head))
    out = Transcript(list(start.ids), list(start.mask), list(start.prompts), list(start.spans),
                     list(start.messages))
    for k, turn in enumerate(script):
        out.prompts.append(list(out.ids))
        ended_with_eos = k not in length_stopped
        generated = encode(tokenizer, turn.text) + ([builder.end_of_turn_id] if ended_with_eos else [])
        out.spans.append((len(out.ids), len(out.ids) + len(generated)))
        out.ids += generated
        out.mask += [1] * len(generated)
        out.messages.append(turn.message)
        if turn.observations:
            observation = builder.observation_ids(turn.observations, ended_with_eos)
            out.ids += observation
            out.mask += [0] * len(observation)
            out.messages.extend(turn.observations)
    return out


@pytest.mark.parametrize("length_stopped", [(), (1,), (2,)], ids=["eos", "mid-turn-length", "final-length"])
@pytest.mark.parametrize("name", list(CASES))
def test_incremental_ids_equal_a_full_rerender(name, length_stopped, tiny_model_path):
    case = CASES[name]
    tokenizer = tokenizer_for(case, tiny_model_path)
    assert detect_family(tokenizer) == case.detected
    builder = build_continuity_builder(tokenizer, case.family)
    script = script_for(case)
    run = simulate(tokenizer, builder, script, length_stopped)

    divergence = check_continuity(tokenizer, run.messages, TOOLS, run.ids)
    assert divergence is None, str(divergence)
    for prompt in run.prompts:
        assert run.ids[:len(prompt)] == prompt
    generated_positions = [i for start, end in run.spans for i in range(start, end)]
    assert [i for i, m in enumerate(run.mask) if m] == generated_positions
    eos_text = FAMILIES[case.family].end_of_turn
    for k, (turn, (start, end)) in enumerate(zip(script, run.spans)):
        expected = turn.text + ("" if k in length_stopped else eos_text)
        assert tokenizer.decode(run.ids[start:end]) == expected


@pytest.mark.parametrize("name", list(CASES))
def test_stop_token_is_appended_only_when_the_model_did_not_emit_it(name, tiny_model_path):
    case = CASES[name]
    tokenizer = tokenizer_for(case, tiny_model_path)
    builder = build_continuity_builder(tokenizer, case.family)
    observations = (tool("84"),)
    after_eos = builder.observation_ids(observations, generation_ended_with_eos=True)
    after_length = builder.observation_ids(observations, generation_ended_with_eos=False)
    assert after_length == [builder.end_of_turn_id] + after_eos
    assert builder.end_of_turn_id not in after_eos[:1]
    assert "84" in tokenizer.decode(after_eos)


def test_qwen3_keep_thinking_keeps_generated_thinking_across_a_user_turn():
    tokenizer = train_tokenizer(QWEN, trl_template("qwen3"))
    builder = build_continuity_builder(tokenizer, "qwen3", keep_thinking=True)
    run = simulate(tokenizer, builder, hermes_script(think=True))
    follow_up = Message("user", "Now add 1.")
    run.ids += builder.user_message_ids([follow_up], generation_ended_with_eos=True)
    run.mask += [0] * (len(run.ids) - len(run.mask))
    run.messages.append(follow_up)
    run = simulate(tokenizer, builder, [hermes_turn("<think>\nAdd one.\n</think>\n\n85.", reasoning="Add one.",
                                                   content="85.")], start=run)

    # The template re-renders earlier turns without thinking; the trajectory keeps what the
    # model conditioned on, so the first difference is the first generated <think>.
    divergence = check_continuity(tokenizer, run.messages, TOOLS, run.ids)
    assert divergence is not None
    assert divergence.position == run.spans[0][0]
    assert divergence.incremental_after.startswith("<think>")
    assert "<think>" not in divergence.reference_after
    assert "I should run Python." in tokenizer.decode(run.ids)


def test_qwen3_without_kept_thinking_starts_a_new_segment_on_a_user_turn():
    tokenizer = train_tokenizer(QWEN, trl_template("qwen3"))
    builder = build_continuity_builder(tokenizer, "qwen3", keep_thinking=False)
    assert builder.starts_segment_on_user_turn
    run = simulate(tokenizer, builder, hermes_script(think=True))
    assert check_continuity(tokenizer, run.messages, TOOLS, run.ids) is None  # tool turns keep thinking
    follow_up = Message("user", "Now add 1.")
    with pytest.raises(ValueError, match="reset_context"):
        builder.user_message_ids([follow_up], generation_ended_with_eos=True)

    messages = [*run.messages, follow_up]
    segment = builder.reset_context(messages, TOOLS)
    assert "I should run Python." not in tokenizer.decode(segment)
    assert segment[:len(run.ids)] != run.ids  # a new training segment, not a continuation
    second = simulate(tokenizer, builder, [hermes_turn("<think>\nAdd one.\n</think>\n\n85.", reasoning="Add one.",
                                                   content="85.")],
                      start=Transcript(segment, [0] * len(segment), [], [], messages))
    assert check_continuity(tokenizer, second.messages, TOOLS, second.ids) is None


def test_qwen3_generation_prompt_follows_template_kwargs():
    tokenizer = train_tokenizer(QWEN, trl_template("qwen3"))
    kwargs = {"enable_thinking": False}
    builder = build_continuity_builder(tokenizer, "qwen3", template_kwargs=kwargs)
    observation = tokenizer.decode(builder.observation_ids([tool("84")], generation_ended_with_eos=True))
    assert observation.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode(builder.initial_prompt_ids(HEAD, TOOLS)).endswith("<think>\n\n</think>\n\n")

    # The engine saw an empty think block before each turn; a re-render leaves it out of
    # earlier turns, so the first difference is the first such block, outside the mask.
    run = simulate(tokenizer, builder, hermes_script(think=False))
    divergence = check_continuity(tokenizer, run.messages, TOOLS, run.ids, template_kwargs=kwargs)
    assert divergence is not None and divergence.incremental_after.startswith("<think>")
    assert divergence.position < run.spans[0][0] and run.mask[divergence.position] == 0


def test_tiny_and_qwen2_5_names_build_the_same_continuation(tiny_model_path):
    tokenizer = tokenizer_for(CASES["tiny"], tiny_model_path)
    messages = [tool("84"), tool("85")]
    ids = {name: build_continuity_builder(tokenizer, name).observation_ids(messages, True)
           for name in ("tiny", "qwen2_5", "auto")}
    assert ids["tiny"] == ids["qwen2_5"] == ids["auto"]
    assert tokenizer.decode(ids["tiny"]) == ("\n<|im_start|>user\n<tool_response>\n84\n</tool_response>"
                                             "\n<tool_response>\n85\n</tool_response><|im_end|>\n"
                                             "<|im_start|>assistant\n")


def test_builder_rejects_wrong_roles_and_unknown_families(tiny_model_path):
    tokenizer = tokenizer_for(CASES["tiny"], tiny_model_path)
    builder = build_continuity_builder(tokenizer)
    with pytest.raises(ValueError, match="only 'tool' messages"):
        builder.observation_ids([Message("user", "hi")], True)
    with pytest.raises(ValueError, match="at least one message"):
        builder.observation_ids([], True)
    with pytest.raises(ValueError, match="only 'user' messages"):
        builder.user_message_ids([tool("1")], True)
    with pytest.raises(ValueError, match="supported: auto, tiny, chatml, qwen2_5, qwen3, "):
        build_continuity_builder(tokenizer, "mistral")
    with pytest.raises(ValueError, match="'<\\|eot_id\\|>' as one token"):
        build_continuity_builder(tokenizer, "llama3")  # a ChatML vocabulary has no <|eot_id|>


def test_unknown_template_cannot_be_detected():
    tokenizer = train_tokenizer(QWEN, "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    with pytest.raises(ValueError, match="pass family= one of"):
        detect_family(tokenizer)


CHATML_TURN = "{{- '<|im_start|>' + m.role + '\\n' + m.content }}"


@pytest.mark.parametrize("template,match", [
    # The newline after <|im_end|> depends on the length of the assistant's text.
    ("{%- for m in messages -%}" + CHATML_TURN + "{{- '<|im_end|>\\n' if m.content|length > 30 "
     "else '<|im_end|>\\n\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}"
     "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}", "depending on that turn's text"),
    # Earlier assistant turns are rendered without their content.
    ("{%- for m in messages -%}{%- if m.role == 'assistant' and not loop.last -%}"
     "{{- '<|im_start|>assistant\\n<|im_end|>\\n' -}}{%- else -%}" + CHATML_TURN + "{{- '<|im_end|>\\n' -}}"
     "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
     "{%- endif -%}", "verbatim exactly once"),
    # The assistant turn is closed by something other than the stop token.
    ("{%- for m in messages -%}" + CHATML_TURN + "{{- '\\n<|endoftext|>' -}}{%- endfor -%}"
     "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
     "not with a stop token of the family"),
])
def test_templates_the_builder_cannot_follow_are_refused(template, match):
    tokenizer = train_tokenizer(QWEN, template)
    with pytest.raises(ValueError, match=match):
        build_continuity_builder(tokenizer, "chatml")


def test_check_continuity_reports_the_first_divergence_with_context():
    tokenizer = train_tokenizer(QWEN, trl_template("qwen2_5"))
    builder = build_continuity_builder(tokenizer, "qwen2_5")
    run = simulate(tokenizer, builder, hermes_script(think=False))
    position = run.spans[1][0] + 2
    corrupted = list(run.ids)
    corrupted[position] = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    divergence = check_continuity(tokenizer, run.messages, TOOLS, corrupted, context_tokens=3)
    assert divergence is not None
    assert (divergence.position, divergence.incremental_id) == (position, corrupted[position])
    assert divergence.reference_id == run.ids[position]
    assert divergence.incremental_after.startswith("<|endoftext|>")
    assert divergence.context_before == tokenizer.decode(run.ids[position - 3:position])
    assert f"position {position}" in str(divergence)

    cut = run.spans[2][0] - 3  # an observation that lost its last ids
    short = check_continuity(tokenizer, run.messages[:-1], TOOLS, run.ids[:cut])
    assert short is not None and short.position == cut and short.incremental_id is None
    extra = check_continuity(tokenizer, run.messages, TOOLS, run.ids + [run.ids[-2]])
    assert extra is not None and (extra.position, extra.incremental_id) == (len(run.ids), run.ids[-2])


def test_check_continuity_rejects_a_final_turn_cut_inside_its_text():
    tokenizer = train_tokenizer(QWEN, trl_template("qwen2_5"))
    builder = build_continuity_builder(tokenizer, "qwen2_5")
    run = simulate(tokenizer, builder, hermes_script(think=False))
    assert check_continuity(tokenizer, run.messages, TOOLS, run.ids) is None
    divergence = check_continuity(tokenizer, run.messages, TOOLS, run.ids[:-3])
    assert divergence is not None and divergence.position == len(run.ids) - 3


def test_tokenizer_merging_across_turn_boundaries_is_reported(caplog):
    # GPT-2 pre-tokenization splits "\n\n" before a word but not at the end of a text, so
    # the generation prompt tokenized alone ends in a merged "\n\n" the full text lacks.
    tokenizer = train_tokenizer(LLAMA, trl_template("llama3_1"), family_split=False)
    assert len(encode(tokenizer, "\n\n")) == 1
    with caplog.at_level(logging.WARNING, logger="rollout.chat"):
        build_continuity_builder(tokenizer, "llama3")
    assert "check_continuity will report" in caplog.text
    text = render_chat(tokenizer, HEAD, None, add_generation_prompt=True)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
