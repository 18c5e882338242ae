"""Token continuity for multi-turn agent trajectories: the ids to append after each
generation so that the training sequence is exactly what the engine saw and produced,
and the chat families (template conventions plus vLLM's parsers for their output).

The model's generated ids are kept as produced and earlier ids are never decoded and
re-tokenized, because a re-tokenization can differ from what was sampled. Only the new
text (template glue, tool or user messages, the next generation prompt) is tokenized:

    prompt ids   = tokenize(template(messages, add_generation_prompt=True))     # once
    each turn   += generated ids                                                 # mask 1
                += tokenize(close glue + new messages + next generation prompt)  # mask 0

The new text comes from the family's own chat template. A fixed reference conversation
that ends with an assistant turn holding a placeholder is rendered with the new messages
after it; the text after the placeholder is the new text. It never depends on what the
model wrote before, and construction checks that assumption on the real template. Whether
the ids also equal what the template renders for the whole conversation (reasoning,
tool calls and all) is what the start-up self-check proves (rollout.template_check);
docs/parsers.md says, per family, what is kept and dropped across turns.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from envs.types import Image, Message, ToolCall
from rollout.vision import ImageExpander, no_images_error

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rollout.parsers import OutputParser

logger = logging.getLogger(__name__)

Tools = Sequence[Mapping[str, Any]]  # OpenAI function schemas, handed to the template as is


def load_tokenizer(model_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The model folder's tokenizer; ValueError when the folder has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer is None:
        raise ValueError(f"no tokenizer in {model_path}; point the model path at a folder with one")
    return tokenizer


def decode_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], *,
                skip_special_tokens: bool = False) -> str:
    """The text of one id sequence (transformers types `decode` for batches too)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str), "one id sequence decodes to one string"
    return text

# How a family's template treats the reasoning of earlier assistant turns when it renders
# a conversation: never renders reasoning; renders it for every turn; drops it for turns
# before the last user message; drops it for every turn but the latest.
Thinking = Literal["none", "kept", "dropped_before_last_user", "dropped_in_earlier_turns"]

PLACEHOLDER = "SLUICE-ASSISTANT-PLACEHOLDER"
# A second assistant text, different in length and words, to prove the rendering after
# the assistant turn does not depend on what the model wrote.
_OTHER_PLACEHOLDER = "Another reply: 12 * 7 = 84, longer than the first placeholder."
_REFERENCE_HEAD = (Message("system", "You are a helpful assistant."), Message("user", "Hi."))
_SAMPLE_TOOL = (Message("tool", "42", name="python"), Message("tool", "done", name="python"))
_SAMPLE_USER = (Message("user", "Thanks, go on."),)
_EXAMPLE_CALL = ToolCall("tool_name", {"argument": "value"})  # the format shown on a bad call
AUTO = "auto"  # parser knob value: the family's default
NONE = "none"  # parser knob value: no parser


@dataclass(frozen=True, slots=True)
class ChatFamily:
    """What the builder and the parsers must know about a template family beyond the
    template itself; the self-check (rollout.template_check) verifies all of it on the
    model's real template before a run starts."""

    name: str
    stop_tokens: tuple[str, ...]  # tokens ending a generation; the first is the engine's stop
    thinking: Thinking
    tool_parser: str | None  # vLLM tool-parser name; None: the template has no tool calls
    reasoning_parser: str | None  # vLLM reasoning-parser name
    description: str
    detect: tuple[str, ...] = ()  # strings that all occur in the family's templates
    # Template kwargs that make the template render earlier reasoning (used with
    # keep_thinking=True, so that the ids equal the template's rendering).
    keep_thinking_kwargs: Mapping[str, Any] = field(default_factory=dict)
    reasoning_key: str = "reasoning_content"  # the message key the template reads
    arguments_as_json: bool = False  # the template concatenates arguments as a JSON string
    parallel_calls: bool = True  # the template renders several calls in one turn
    content_with_calls: bool = True  # the template renders text next to tool calls
    think_markup: tuple[str, ...] = ("<think>", "</think>")  # around reasoning in the template

    @property
    def end_of_turn(self) -> str:
        return self.stop_tokens[0]

    @property
    def has_tools(self) -> bool:
        return self.tool_parser is not None


_CHATML = ("<|im_end|>",)
_QWEN3_DETECT = ("<|im_start|>", "<tool_call>", "reasoning_content")
FAMILIES: dict[str, ChatFamily] = {f.name: f for f in (
    ChatFamily("tiny", _CHATML, "none", "hermes", None,
               "the tiny test model (trainer.run.tiny_model): ChatML with Hermes tools",
               ("<|im_start|>", "Call a tool by writing <tool_call>")),
    ChatFamily("chatml", _CHATML, "none", None, None,
               "plain ChatML without tools (vLLM's template_chatml)", ("<|im_start|>",)),
    ChatFamily("qwen2_5", _CHATML, "none", "hermes", None,
               "Qwen2.5 and Qwen3-Instruct-2507 (ChatML, Hermes JSON tool calls)",
               ("<|im_start|>", "<tool_call>")),
    ChatFamily("qwen3", _CHATML, "dropped_before_last_user", "hermes", "qwen3",
               "Qwen3 hybrid thinking (ChatML, <think>, Hermes JSON tool calls)", _QWEN3_DETECT),
    ChatFamily("qwen3_5", _CHATML, "dropped_before_last_user", "qwen3_coder", "qwen3",
               "Qwen3.5 / Qwen3-Coder style XML tool calls (<function=...>) with <think>",
               (*_QWEN3_DETECT, "<function=")),
    ChatFamily("qwen3_6", _CHATML, "dropped_before_last_user", "qwen3_coder", "qwen3",
               "Qwen3.6 / 3.8: XML tool calls, <think>, a preserve_thinking switch",
               (*_QWEN3_DETECT, "<function=", "preserve_thinking"),
               keep_thinking_kwargs={"preserve_thinking": True}),
    ChatFamily("nemotron_3", _CHATML, "dropped_before_last_user", "qwen3_coder", "nemotron_v3",
               "NVIDIA Nemotron 3 (ChatML, <think>, XML tool calls)",
               (*_QWEN3_DETECT, "<function=", "truncate_history_thinking"),
               keep_thinking_kwargs={"truncate_history_thinking": False}),
    ChatFamily("llama3", ("<|eot_id|>",), "none", None, None,
               "Llama 3 without tools (header tokens)", ("<|start_header_id|>",)),
    ChatFamily("llama3_json", ("<|eot_id|>", "<|eom_id|>"), "none", "llama3_json", None,
               "Llama 3.1 / 3.2 (one JSON tool call per turn, ipython role)",
               ("<|start_header_id|>", "ipython"), parallel_calls=False, content_with_calls=False),
    ChatFamily("glm45", ("<|observation|>", "<|user|>", "<|endoftext|>"), "dropped_before_last_user",
               "glm45", "glm45", "GLM-4.5 / 4.6 MoE (<arg_key>/<arg_value> tool calls, <think>)",
               ("<|observation|>", "<arg_key>")),
    # The first LFM2 template lists tools but never renders a call: detected as lfm2, it
    # fails the self-check (the family's templates are the later revisions).
    ChatFamily("lfm2", _CHATML, "none", "lfm2", None,
               "LiquidAI LFM2 (Pythonic calls in <|tool_call_start|>...<|tool_call_end|>)",
               ("<|im_start|>", "<|tool_list_start|>")),
    ChatFamily("lfm2_5", _CHATML, "dropped_before_last_user", "lfm2", "deepseek_r1",
               "LiquidAI LFM2.5 (Pythonic calls, <think> read off message.thinking)",
               ("<|im_start|>", "<|tool_call_start|>", "thinking"), reasoning_key="thinking"),
    ChatFamily("phi3", ("<|end|>",), "none", None, None, "Phi-3 / 3.5 (no tools)",
               ("<|assistant|>", "<|end|>")),
    ChatFamily("gemma3", ("<end_of_turn>",), "none", None, None, "Gemma 2 / 3 (no tools)",
               ("<start_of_turn>",)),
    # Families whose shipped templates the self-check refuses (docs/parsers.md says why);
    # defined so that detection names them and the check reports the first difference.
    ChatFamily("deepseek_v3", ("<｜end▁of▁sentence｜>",), "dropped_in_earlier_turns", "deepseek_v3",
               "deepseek_r1", "DeepSeek-V3 / R1 (<｜tool▁calls▁begin｜> blocks, <think>)",
               ("<｜Assistant｜>",), arguments_as_json=True),
    ChatFamily("gptoss", ("<|call|>", "<|return|>", "<|end|>"), "dropped_in_earlier_turns", "openai",
               "openai_gptoss", "gpt-oss (Harmony channels; one call per turn)", ("<|channel|>",),
               reasoning_key="thinking", parallel_calls=False, content_with_calls=False),
    ChatFamily("gemma4", ("<turn|>",), "dropped_in_earlier_turns", "gemma4", "gemma4",
               "Gemma 4 (<|tool_call> blocks inside the model turn)", ("<|turn>", "<|tool_call>")),
)}


class ContinuityBuilder(Protocol):
    """Turns messages into the ids appended to a trajectory and reads the model's turns;
    holds no per-trajectory state. A builder of one's own subclasses it to inherit the
    defaults of `stop_token_ids`, `parser` and `continuation_ids`."""

    __slots__ = ()

    @property
    def end_of_turn_id(self) -> int: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids a turn of this chat family ends with (some families have several)."""
        return (self.end_of_turn_id,)

    @property
    def parser(self) -> OutputParser | None:
        """The parsers of the model's turns; None: those of the tokenizer's detected family."""
        return None

    @property
    def starts_segment_on_user_turn(self) -> bool: ...

    def initial_prompt_ids(self, messages: Sequence[Message], tools: Tools | None) -> list[int]: ...

    def observation_ids(self, tool_messages: Sequence[Message],
                        generation_ended_with_eos: bool) -> list[int]: ...

    def user_message_ids(self, user_messages: Sequence[Message],
                         generation_ended_with_eos: bool) -> list[int]: ...

    def reset_context(self, messages: Sequence[Message], tools: Tools | None) -> list[int]: ...

    def continuation_ids(self, new_messages: Sequence[Message],
                         generation_ended_with_eos: bool) -> list[int] | None:
        """Ids after a generation for new messages of mixed roles (tool results, then a user
        message); None where the builder cannot append them (a new segment starts)."""
        return None


def template_messages(messages: Sequence[Message], family: ChatFamily | None = None) -> list[dict[str, Any]]:
    """The messages as the family's template reads them."""
    out = [m.to_template() for m in messages]
    if family is None:
        return out
    for m in out:
        if family.reasoning_key != "reasoning_content" and "reasoning_content" in m:
            m[family.reasoning_key] = m.pop("reasoning_content")
        if family.arguments_as_json:
            for call in m.get("tool_calls", ()):
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return out


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], tools: Tools | None,
                *, add_generation_prompt: bool, template_kwargs: Mapping[str, Any] | None = None,
                family: ChatFamily | None = None) -> str:
    """The tokenizer's chat template applied to `messages`, as text."""
    try:
        text = tokenizer.apply_chat_template(
            template_messages(messages, family), tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt, tokenize=False, **dict(template_kwargs or {}))
    except Exception as exc:  # jinja's TemplateError, or a TypeError inside the template
        roles = "/".join(m.role for m in messages)
        raise ValueError(f"the chat template cannot render a {roles} conversation "
                         f"({type(exc).__name__}: {exc}); set agent.chat_family to a family whose "
                         "template renders system, user, assistant, tool-call and tool turns") from exc
    if not isinstance(text, str):
        raise ValueError(f"apply_chat_template returned {type(text).__name__}, expected text")
    return text


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # The template already holds every special token (BOS included): add none.
    return list(tokenizer.encode(text, add_special_tokens=False))


class TemplateContinuity(ContinuityBuilder):
    """The continuity builder for every built-in family: the template itself supplies the
    glue, `family` supplies the stop tokens and how the template treats reasoning, and
    `parser` reads the model's turns with the family's (or the recipe's) vLLM parsers.

    Reasoning across a user turn (families whose template renders reasoning at all):
    - keep_thinking=True: `user_message_ids` appends as usual and the earlier reasoning
      stays in the sequence as generated. Where the template drops it (qwen3, glm45, ...),
      the training sequence is then NOT what a full re-render gives, and that is intended:
      it is what the model conditioned on. Families with a switch that makes the template
      keep it (qwen3_6 `preserve_thinking`) get that switch, and then ids and template agree.
    - keep_thinking=False: `starts_segment_on_user_turn` is True and `user_message_ids`
      refuses; the trajectory layer calls `reset_context(messages, tools)` instead, which
      re-renders the conversation without the reasoning of turns before the last user
      message and starts a new training segment from those prompt ids.
    Tool turns never re-render anything: within a tool loop the ids stay as generated.
    That includes what a template would change there: Qwen3's drops the empty think block
    of an earlier tool turn (it renders one only on the newest turn), so such a turn's ids
    differ from a re-render exactly there, as generated (docs/parsers.md).
    """

    __slots__ = ("tokenizer", "family", "keep_thinking", "template_kwargs", "end_of_turn_id",
                 "stop_token_ids", "close_glue", "images", "_tool_parser", "_reasoning_parser", "_parser")
    end_of_turn_id: int
    stop_token_ids: tuple[int, ...]

    def __init__(self, tokenizer: PreTrainedTokenizerBase, family: ChatFamily,
                 keep_thinking: bool = True, template_kwargs: Mapping[str, Any] | None = None, *,
                 tool_parser: str | None = AUTO, reasoning_parser: str | None = AUTO,
                 images: ImageExpander | None = None) -> None:
        self.tokenizer = tokenizer
        # A vision-language model's processor: image parts become their runs of ids; None:
        # the model takes no images, and messages with images are refused.
        self.images = images
        self.family = family
        self.keep_thinking = keep_thinking
        kwargs = dict(family.keep_thinking_kwargs) if keep_thinking else {}
        self.template_kwargs = {**kwargs, **dict(template_kwargs or {})}  # e.g. enable_thinking
        self.stop_token_ids = tuple(_single_token_id(tokenizer, family, t) for t in family.stop_tokens)
        self.end_of_turn_id = self.stop_token_ids[0]
        self._tool_parser = _parser_name(tool_parser, family.tool_parser)
        self._reasoning_parser = _parser_name(reasoning_parser, family.reasoning_parser)
        self._parser: OutputParser | None = None
        self.close_glue = self._check_template()
        if images is not None:
            self._check_image_parts(images)
        if reasoning_parser == AUTO and self.prompt_closes_thinking():
            # The model starts after a closed think block (Qwen3.5 "nothink",
            # enable_thinking=False): all it writes is content, whatever a reasoning
            # parser would assume about an open one.
            self._reasoning_parser = None

    @property
    def starts_segment_on_user_turn(self) -> bool:
        return not self.keep_thinking and self.family.thinking != "none"

    @property
    def tool_parser_name(self) -> str | None:
        return self._tool_parser

    @property
    def reasoning_parser_name(self) -> str | None:
        return self._reasoning_parser

    @property
    def parser(self) -> OutputParser:
        """vLLM's parsers for this model's turns (built on first use: it imports vLLM)."""
        if self._parser is None:
            from rollout.parsers import OutputParser

            self._parser = OutputParser(self.tokenizer, self._tool_parser, self._reasoning_parser,
                                        template_kwargs=self.template_kwargs,
                                        expected_format=self.expected_call_format())
        return self._parser

    def initial_prompt_ids(self, messages: Sequence[Message], tools: Tools | None) -> list[int]:
        """The first prompt: the conversation rendered once, with the generation prompt."""
        if not messages:
            raise ValueError("initial_prompt_ids needs at least one message")
        self._check_takes_images(messages)
        return self._with_images(encode(self.tokenizer, self.render(messages, tools, add_generation_prompt=True)),
                                 messages)

    def _with_images(self, ids: list[int], messages: Sequence[Message]) -> list[int]:
        """`ids` with each image placeholder expanded into its image's run (a PromptIds) for
        a vision-language model."""
        if self.images is None:
            return ids
        return self.images.expand(ids, [image for m in messages for image in m.images])

    def _check_takes_images(self, messages: Sequence[Message]) -> None:
        """ValueError, before rendering, for images a text model cannot take."""
        if self.images is None and any(m.images for m in messages):
            raise no_images_error(messages)

    def observation_ids(self, tool_messages: Sequence[Message],
                        generation_ended_with_eos: bool) -> list[int]:
        """Ids after a generation: close the assistant turn (only the part the model did not
        emit), all tool results of this turn, then the next generation prompt."""
        _require_roles(tool_messages, "tool", "observation_ids")
        return self.continuation_ids(tool_messages, generation_ended_with_eos)

    def user_message_ids(self, user_messages: Sequence[Message],
                         generation_ended_with_eos: bool) -> list[int]:
        """Like `observation_ids`, for user messages (a follow-up question, a nudge)."""
        _require_roles(user_messages, "user", "user_message_ids")
        if self.starts_segment_on_user_turn:
            raise ValueError(f"family {self.family.name!r} with keep_thinking=False drops earlier "
                             "thinking on a user turn: call reset_context(messages, tools) and start "
                             "a new segment, or build with keep_thinking=True")
        return self.continuation_ids(user_messages, generation_ended_with_eos)

    def continuation_ids(self, new_messages: Sequence[Message],
                         generation_ended_with_eos: bool) -> list[int]:
        """Ids after a generation for any new messages: the template's own continuation
        after the assistant turn, as for tool results or user messages alone."""
        self._check_takes_images(new_messages)
        return self._with_images(encode(self.tokenizer, self._continuation(new_messages, generation_ended_with_eos)),
                                 new_messages)

    def reset_context(self, messages: Sequence[Message], tools: Tools | None) -> list[int]:
        """Prompt ids of a new segment: the whole conversation re-rendered by the template,
        without the reasoning of turns before the last user message when keep_thinking is
        False. The ids differ from the running sequence, so they start a new segment."""
        if not self.keep_thinking:
            messages = drop_reasoning_before_last_user(messages)
        return self.initial_prompt_ids(messages, tools)

    def render(self, messages: Sequence[Message], tools: Tools | None,
               add_generation_prompt: bool) -> str:
        """The template's text for `messages`, with this builder's template kwargs."""
        return render_chat(self.tokenizer, messages, tools, add_generation_prompt=add_generation_prompt,
                           template_kwargs=self.template_kwargs, family=self.family)

    def expected_call_format(self) -> str:
        """A tool call as this template renders it, shown to the model when a call is refused."""
        if not self.family.has_tools:
            return ""
        try:
            text = self.render((*_REFERENCE_HEAD, Message("assistant", "", (_EXAMPLE_CALL,))), None, False)
            prompt = self.render(_REFERENCE_HEAD, None, True)
        except ValueError:  # render_chat's error: the template cannot render it, the message says less
            return ""
        if not text.startswith(prompt):
            return ""
        body = text[len(prompt):]
        return (body[:-len(self.close_glue)] if self.close_glue and body.endswith(self.close_glue)
                else body).strip()

    def prompt_closes_thinking(self) -> bool:
        """Whether the generation prompt already ends with a closed think block."""
        if self.family.thinking == "none":
            return False
        prompt = self.render(_REFERENCE_HEAD, None, add_generation_prompt=True)
        return prompt.rstrip().endswith(self.family.think_markup[-1])

    def stop_token_before(self, next_messages: Sequence[Message]) -> str | None:
        """The stop token that the template's text after an assistant turn starts with, when
        `next_messages` follow (the model emits it as its last token); None if none does."""
        suffix = (self._suffix_after(PLACEHOLDER, next_messages) if next_messages else self.close_glue)
        return next((t for t in self.family.stop_tokens if suffix.startswith(t)), None)

    def _suffix_after(self, placeholder: str, new_messages: Sequence[Message],
                      add_generation_prompt: bool = True) -> str:
        """The template's text after an assistant turn holding `placeholder`."""
        conversation = (*_REFERENCE_HEAD, Message("assistant", placeholder), *new_messages)
        # No tools: the built-in templates render them in the system block, before the split.
        text = self.render(conversation, None, add_generation_prompt and bool(new_messages))
        if text.count(placeholder) != 1:
            raise ValueError(f"family {self.family.name!r}: the chat template does not render an "
                             f"assistant's content verbatim exactly once (found {text.count(placeholder)} "
                             "times), so the text after a generation cannot be derived from it")
        return text[text.index(placeholder) + len(placeholder):]

    def _continuation(self, new_messages: Sequence[Message], ended_with_eos: bool) -> str:
        suffix = self._suffix_after(PLACEHOLDER, new_messages)
        stop = next((t for t in self.family.stop_tokens if suffix.startswith(t)), None)
        if stop is None:
            raise ValueError(f"family {self.family.name!r}: for these messages the template does "
                             f"not close the assistant turn with a stop token: {suffix[:80]!r}")
        # The engine output already holds the stop token when the model emitted it.
        return suffix[len(stop):] if ended_with_eos else suffix

    def _check_template(self) -> str:
        """Check that what follows an assistant turn is prefix-preserving in the way this
        builder needs; return the close glue (the text right after an assistant's output
        when nothing follows it)."""
        name, stops = self.family.name, self.family.stop_tokens
        close_glue = self._suffix_after(PLACEHOLDER, (), add_generation_prompt=False)
        samples = (_SAMPLE_TOOL, _SAMPLE_USER) if self.family.has_tools else (_SAMPLE_USER,)
        for sample in samples:
            suffix = self._suffix_after(PLACEHOLDER, sample)
            if suffix != self._suffix_after(_OTHER_PLACEHOLDER, sample):
                raise ValueError(f"family {name!r}: the template renders the messages after an "
                                 "assistant turn differently depending on that turn's text, so they "
                                 "cannot be appended to the generated ids")
            if not any(suffix.startswith(t) for t in stops):
                raise ValueError(f"family {name!r}: the template closes an assistant turn with "
                                 f"{suffix[:40]!r}, not with a stop token of the family "
                                 f"({', '.join(stops)}); set agent.chat_family to the family whose "
                                 f"template this is ({', '.join(FAMILIES)})")
            if close_glue.strip() and not any(suffix.startswith(t) and close_glue.startswith(t)
                                              for t in stops):
                raise ValueError(f"family {name!r}: after an assistant turn and {sample[0].role} "
                                 f"messages the template renders {suffix[:80]!r}, which does not "
                                 f"start with the stop token that closes a final turn "
                                 f"({close_glue!r})")
            without_prompt = self._suffix_after(PLACEHOLDER, sample, add_generation_prompt=False)
            eos = self.tokenizer.eos_token
            if eos and without_prompt.endswith(eos):  # Phi-3 ends a conversation with eos
                without_prompt = without_prompt[:-len(eos)]
            if not suffix.startswith(without_prompt):
                raise ValueError(f"family {name!r}: add_generation_prompt changes the earlier text "
                                 "of the prompt, so turns cannot be appended")
        self._check_token_boundaries(samples[0])
        return close_glue

    def _check_image_parts(self, images: ImageExpander) -> None:
        """The template renders one placeholder per image part, where the part stands, in
        the first prompt and in the text after a generation (user and tool messages)."""
        picture = Image(b"sluice-template-check")  # rendering never reads the bytes
        user = Message("user", ("Look: ", picture, " and ", picture, "."))
        tool = Message("tool", ("Screenshot:", picture), name="python")
        for text, expected, where in (
                (self.render((_REFERENCE_HEAD[0], user), None, True), 2, "a user message"),
                (self._suffix_after(PLACEHOLDER, (tool,)), 1, "a tool message")):
            found = text.count(images.image_token)
            if found != expected:
                raise ValueError(f"family {self.family.name!r}: the chat template renders {found} image "
                                 f"placeholder(s) {images.image_token!r} for {expected} image part(s) in {where}; "
                                 "a vision-language template renders one per {'type': 'image'} part")

    def _check_token_boundaries(self, sample: Sequence[Message]) -> None:
        """Tokenizing prompt, generation and observation apart must give the same text as
        tokenizing the whole; the same ids too, or `check_continuity` reports artifacts."""
        conversation = (*_REFERENCE_HEAD, Message("assistant", PLACEHOLDER), *sample)
        text = self.render(conversation, None, add_generation_prompt=True)
        start = text.index(PLACEHOLDER)
        end = start + len(PLACEHOLDER)
        stop = next(t for t in self.family.stop_tokens if text.startswith(t, end))
        end += len(stop)
        pieces = (encode(self.tokenizer, text[:start]) + encode(self.tokenizer, PLACEHOLDER)
                  + encode(self.tokenizer, stop) + encode(self.tokenizer, text[end:]))
        whole = encode(self.tokenizer, text)
        if pieces == whole:
            return
        if self.tokenizer.decode(pieces) != self.tokenizer.decode(whole):
            raise ValueError(f"family {self.family.name!r}: tokenizing the template's pieces apart "
                             "changes the text (a tokenizer that adds prefix spaces?); this "
                             "tokenizer cannot be used for incremental token continuity")
        logger.warning("family %r: tokenizing at turn boundaries gives other ids than tokenizing "
                       "the whole text; training is unaffected but check_continuity will report "
                       "these boundaries", self.family.name)


def drop_reasoning_before_last_user(messages: Sequence[Message]) -> list[Message]:
    """`messages` without the reasoning of assistant turns before the last user message."""
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    return [replace(m, reasoning=None) if i < last_user and m.reasoning is not None else m
            for i, m in enumerate(messages)]


def _parser_name(knob: str | None, default: str | None) -> str | None:
    if knob is None or knob == NONE:
        return None
    return default if knob == AUTO else knob


def _single_token_id(tokenizer: PreTrainedTokenizerBase, family: ChatFamily, token: str) -> int:
    ids = encode(tokenizer, token)
    if len(ids) != 1:
        raise ValueError(f"family {family.name!r} needs {token!r} as one token, but this "
                         f"tokenizer splits it into {len(ids)}; is agent.chat_family right?")
    return ids[0]


def _require_roles(messages: Sequence[Message], role: str, caller: str) -> None:
    if not messages:
        raise ValueError(f"{caller} needs at least one message")
    wrong = sorted({m.role for m in messages if m.role != role})
    if wrong:
        raise ValueError(f"{caller} takes only {role!r} messages, got {wrong}")


def chat_template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    template = tokenizer.chat_template
    if isinstance(template, Mapping):  # tokenizers with several named templates
        template = template.get("default") or next(iter(template.values()), None)
    if not isinstance(template, str) or not template:
        raise ValueError("the tokenizer has no chat template; give the model one or set "
                         "agent.chat_family explicitly")
    return template


def detect_family(tokenizer: PreTrainedTokenizerBase) -> str:
    """The family whose markers this tokenizer's chat template holds: the most specific
    one (most markers, then the longest) wins. A guess until the self-check
    (rollout.template_check) verifies it on the template."""
    template = chat_template_text(tokenizer)
    matches = [f for f in FAMILIES.values() if f.detect and all(m in template for m in f.detect)]
    if not matches:
        raise ValueError(f"cannot detect the chat family of this template; set agent.chat_family "
                         f"to one of {', '.join(FAMILIES)} (pass family= one of them)")
    return max(matches, key=lambda f: (len(f.detect), sum(map(len, f.detect)))).name


def build_continuity_builder(tokenizer: PreTrainedTokenizerBase, family: str = "auto",
                             keep_thinking: bool = True,
                             template_kwargs: Mapping[str, Any] | None = None, *,
                             tool_parser: str | None = AUTO,
                             reasoning_parser: str | None = AUTO,
                             images: ImageExpander | None = None) -> TemplateContinuity:
    """The builder for `family` ("auto" detects it from the tokenizer's chat template).
    `keep_thinking` matters only for families whose template renders reasoning. The
    parsers are vLLM names, "auto" for the family's default, or "none"; they are built
    here (the first build imports vLLM, seconds), so that no trajectory waits for them.
    `images` (rollout.vision.load_image_expander) lets messages hold images."""
    name = detect_family(tokenizer) if family == AUTO else family
    if name not in FAMILIES:
        raise ValueError(f"unknown chat family {family!r}; supported: auto, {', '.join(FAMILIES)}")
    builder = TemplateContinuity(tokenizer, FAMILIES[name], keep_thinking, template_kwargs,
                                 tool_parser=tool_parser, reasoning_parser=reasoning_parser, images=images)
    builder.parser  # noqa: B018 - built now, not inside the first trajectory's event loop turn
    return builder


@dataclass(frozen=True, slots=True)
class Divergence:
    """First position where incremental ids differ from a full re-render."""

    position: int
    reference_id: int | None  # None: the re-render ends here
    incremental_id: int | None  # None: the incremental ids end here
    context_before: str  # decoded ids shared by both, just before `position`
    reference_after: str  # decoded re-render from `position` on (a few ids)
    incremental_after: str

    def __str__(self) -> str:
        return (f"ids diverge at position {self.position}: after {self.context_before!r} the "
                f"template gives {self.reference_after!r}, the trajectory has "
                f"{self.incremental_after!r}")


def first_divergence(tokenizer: PreTrainedTokenizerBase, reference: Sequence[int],
                     incremental: Sequence[int], *, trailing_glue_ok: bool = False,
                     context_tokens: int = 4) -> Divergence | None:
    """Where `incremental` first differs from `reference`; None when they agree. With
    `trailing_glue_ok`, either may run past the other by special tokens and whitespace
    only (a final turn whose closing glue or stop token is not in both)."""
    reference, incremental = list(reference), list(incremental)
    n = 0
    for ref_id, inc_id in zip(reference, incremental):
        if ref_id != inc_id:
            break
        n += 1
    if n == len(incremental) == len(reference):
        return None
    if trailing_glue_ok and (n == len(incremental) or n == len(reference)):
        rest = reference[n:] or incremental[n:]
        if not decode_text(tokenizer, rest, skip_special_tokens=True).strip():
            return None

    def decoded(ids: list[int]) -> str:
        return decode_text(tokenizer, ids)

    return Divergence(
        position=n,
        reference_id=reference[n] if n < len(reference) else None,
        incremental_id=incremental[n] if n < len(incremental) else None,
        context_before=decoded(reference[max(0, n - context_tokens):n]),
        reference_after=decoded(reference[n:n + context_tokens]),
        incremental_after=decoded(incremental[n:n + context_tokens]))


def check_continuity(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message],
                     tools: Tools | None, incremental_ids: Sequence[int], *,
                     template_kwargs: Mapping[str, Any] | None = None,
                     context_tokens: int = 4, family: ChatFamily | None = None,
                     images: ImageExpander | None = None) -> Divergence | None:
    """Debug check: compare incremental ids with the conversation fully re-rendered.

    When `messages` ends with an assistant message the trajectory may stop before the
    glue that closes it (a final turn cut by length, or ChatML's newline after the stop
    token), or hold a stop token the template leaves to the next message (GLM): the two
    may differ at the end by special tokens and whitespace only. Otherwise the re-render
    includes the generation prompt and must match exactly. With `images` (a vision-language
    model's expander) the re-render's image placeholders are expanded as the builder does.
    """
    final_is_assistant = bool(messages) and messages[-1].role == "assistant"
    reference = encode(tokenizer, render_chat(tokenizer, messages, tools,
                                              add_generation_prompt=not final_is_assistant,
                                              template_kwargs=template_kwargs, family=family))
    if images is not None:
        reference = images.expand(reference, [i for m in messages for i in m.images])
    return first_divergence(tokenizer, reference, incremental_ids, trailing_glue_ok=final_is_assistant,
                            context_tokens=context_tokens)
