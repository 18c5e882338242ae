"""Token continuity for multi-turn agent trajectories: the ids to append after each
generation so that the training sequence is exactly what the engine saw and produced.

The model's generated ids are kept as produced and earlier ids are never decoded and
re-tokenized, because a re-tokenization can differ from what was sampled. Only the new
text (template glue, tool or user messages, the next generation prompt) is tokenized:

    prompt ids   = tokenize(template(messages, add_generation_prompt=True))     # once
    each turn   += generated ids                                                 # mask 1
                += tokenize(close glue + new messages + next generation prompt)  # mask 0

The new text comes from the family's own chat template. A fixed reference conversation
that ends with an assistant turn holding a placeholder is rendered with the new messages
after it; the text after the placeholder is the new text. It never depends on what the
model wrote before, and construction checks that assumption on the real template.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from envs.types import Message

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Tools = Sequence[Mapping[str, Any]]  # OpenAI function schemas, handed to the template as is

PLACEHOLDER = "SLUICE-ASSISTANT-PLACEHOLDER"
# A second assistant text, different in length and words, to prove the rendering after
# the assistant turn does not depend on what the model wrote.
_OTHER_PLACEHOLDER = "Another reply: 12 * 7 = 84, longer than the first placeholder."
_REFERENCE_HEAD = (Message("system", "You are a helpful assistant."), Message("user", "Hi."))
_SAMPLE_TOOL = (Message("tool", "42", name="python"), Message("tool", "done", name="python"))
_SAMPLE_USER = (Message("user", "Thanks, go on."),)


@dataclass(frozen=True, slots=True)
class ChatFamily:
    """What the builder must know about a template family beyond the template itself."""

    name: str
    end_of_turn: str  # token closing an assistant turn; the engine's stop token
    strips_thinking: bool  # a full re-render drops <think> of turns before the last user query
    description: str


FAMILIES: dict[str, ChatFamily] = {
    "tiny": ChatFamily("tiny", "<|im_end|>", False,
                       "the tiny test model (trainer.tiny_model): ChatML with Hermes tools"),
    "chatml": ChatFamily("chatml", "<|im_end|>", False, "any ChatML template"),
    "qwen2_5": ChatFamily("qwen2_5", "<|im_end|>", False, "Qwen2.5 instruct (ChatML, Hermes tools)"),
    "qwen3": ChatFamily("qwen3", "<|im_end|>", True,
                        "Qwen3 with <think> blocks (ChatML, Hermes tools)"),
    "llama3": ChatFamily("llama3", "<|eot_id|>", False,
                         "Llama 3 / 3.1 / 3.2 (header tokens; tool or ipython role per template)"),
}


class ContinuityBuilder(Protocol):
    """Turns messages into the ids appended to a trajectory; holds no per-trajectory state."""

    @property
    def end_of_turn_id(self) -> int: ...

    @property
    def starts_segment_on_user_turn(self) -> bool: ...

    def initial_prompt_ids(self, messages: Sequence[Message], tools: Tools | None) -> list[int]: ...

    def observation_ids(self, tool_messages: Sequence[Message],
                        generation_ended_with_eos: bool) -> list[int]: ...

    def user_message_ids(self, user_messages: Sequence[Message],
                         generation_ended_with_eos: bool) -> list[int]: ...

    def reset_context(self, messages: Sequence[Message], tools: Tools | None) -> list[int]: ...


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], tools: Tools | None,
                *, add_generation_prompt: bool, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The tokenizer's chat template applied to `messages`, as text."""
    text = tokenizer.apply_chat_template(
        [m.to_template() for m in messages], tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt, tokenize=False, **dict(template_kwargs or {}))
    if not isinstance(text, str):
        raise ValueError(f"apply_chat_template returned {type(text).__name__}, expected text")
    return text


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # The template already holds every special token (BOS included): add none.
    return list(tokenizer.encode(text, add_special_tokens=False))


class TemplateContinuity:
    """The continuity builder for every built-in family: the template itself supplies the
    glue, `family` supplies the end-of-turn token and how the template treats thinking.

    Thinking (`qwen3`): the original Qwen3 template drops the `<think>` blocks of assistant
    turns that come before the last user message when it re-renders a conversation. Tool
    turns after that message keep them, so a tool loop stays continuous either way.
    - keep_thinking=True: `user_message_ids` appends as usual and the earlier `<think>` ids
      stay in the sequence as generated. The training sequence is then NOT what a full
      re-render would give, and that is intended: it is what the model conditioned on.
    - keep_thinking=False: `starts_segment_on_user_turn` is True and `user_message_ids`
      refuses; the trajectory layer calls `reset_context(messages, tools)` instead, which
      re-renders the whole conversation as the template does (earlier thinking dropped) and
      starts a new training segment from those prompt ids.
    With template_kwargs={"enable_thinking": False} every generation prompt holds an empty
    `<think></think>` block that a re-render leaves out of earlier turns; the sequence keeps
    it (mask 0), for the same reason.
    """

    __slots__ = ("tokenizer", "family", "keep_thinking", "template_kwargs", "end_of_turn_id",
                 "_close_glue")

    def __init__(self, tokenizer: PreTrainedTokenizerBase, family: ChatFamily,
                 keep_thinking: bool = True, template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.keep_thinking = keep_thinking
        self.template_kwargs = dict(template_kwargs or {})  # e.g. enable_thinking for qwen3
        self.end_of_turn_id = _single_token_id(tokenizer, family)
        self._close_glue = self._check_template()

    @property
    def starts_segment_on_user_turn(self) -> bool:
        return self.family.strips_thinking and not self.keep_thinking

    def initial_prompt_ids(self, messages: Sequence[Message], tools: Tools | None) -> list[int]:
        """The first prompt: the conversation rendered once, with the generation prompt."""
        if not messages:
            raise ValueError("initial_prompt_ids needs at least one message")
        return encode(self.tokenizer, self._render(messages, tools, add_generation_prompt=True))

    def observation_ids(self, tool_messages: Sequence[Message],
                        generation_ended_with_eos: bool) -> list[int]:
        """Ids after a generation: close the assistant turn (only the part the model did not
        emit), all tool results of this turn, then the next generation prompt."""
        _require_roles(tool_messages, "tool", "observation_ids")
        return encode(self.tokenizer, self._continuation(tool_messages, generation_ended_with_eos))

    def user_message_ids(self, user_messages: Sequence[Message],
                         generation_ended_with_eos: bool) -> list[int]:
        """Like `observation_ids`, for user messages (a follow-up question, a nudge)."""
        _require_roles(user_messages, "user", "user_message_ids")
        if self.starts_segment_on_user_turn:
            raise ValueError(f"family {self.family.name!r} with keep_thinking=False drops earlier "
                             "thinking on a user turn: call reset_context(messages, tools) and start "
                             "a new segment, or build with keep_thinking=True")
        return encode(self.tokenizer, self._continuation(user_messages, generation_ended_with_eos))

    def reset_context(self, messages: Sequence[Message], tools: Tools | None) -> list[int]:
        """Prompt ids of a new segment: the whole conversation re-rendered by the template
        (for qwen3 without the thinking of turns before the last user message). The ids
        differ from the running sequence, so they start a new training segment."""
        return self.initial_prompt_ids(messages, tools)

    def _render(self, messages: Sequence[Message], tools: Tools | None,
                add_generation_prompt: bool) -> str:
        return render_chat(self.tokenizer, messages, tools, add_generation_prompt=add_generation_prompt,
                           template_kwargs=self.template_kwargs)

    def _suffix_after(self, placeholder: str, new_messages: Sequence[Message],
                      add_generation_prompt: bool = True) -> str:
        """The template's text after an assistant turn holding `placeholder`."""
        conversation = (*_REFERENCE_HEAD, Message("assistant", placeholder), *new_messages)
        # No tools: the built-in templates render them in the system block, before the split.
        text = self._render(conversation, None, add_generation_prompt)
        if text.count(placeholder) != 1:
            raise ValueError(f"family {self.family.name!r}: the chat template does not render an "
                             f"assistant's content verbatim exactly once (found {text.count(placeholder)} "
                             "times), so the text after a generation cannot be derived from it")
        return text[text.index(placeholder) + len(placeholder):]

    def _continuation(self, new_messages: Sequence[Message], ended_with_eos: bool) -> str:
        suffix = self._suffix_after(PLACEHOLDER, new_messages)
        if not suffix.startswith(self._close_glue):
            raise ValueError(f"family {self.family.name!r}: for these messages the template does "
                             f"not close the assistant turn with {self._close_glue!r}: {suffix[:80]!r}")
        # The engine output already holds the stop token when the model emitted it.
        return suffix[len(self.family.end_of_turn):] if ended_with_eos else suffix

    def _check_template(self) -> str:
        """Check that what follows an assistant turn is prefix-preserving in the way this
        builder needs; return the close glue (the text right after an assistant's output)."""
        name, eot = self.family.name, self.family.end_of_turn
        close_glue = self._suffix_after(PLACEHOLDER, (), add_generation_prompt=False)
        if not close_glue.startswith(eot):
            raise ValueError(f"family {name!r}: the template closes an assistant turn with "
                             f"{close_glue[:40]!r}, not with the end-of-turn token {eot!r}; "
                             f"choose the family whose template this is ({', '.join(FAMILIES)})")
        generation_prompt = self._generation_prompt()
        for sample in (_SAMPLE_TOOL, _SAMPLE_USER):
            suffix = self._suffix_after(PLACEHOLDER, sample)
            if suffix != self._suffix_after(_OTHER_PLACEHOLDER, sample):
                raise ValueError(f"family {name!r}: the template renders the messages after an "
                                 "assistant turn differently depending on that turn's text, so they "
                                 "cannot be appended to the generated ids")
            if not suffix.startswith(close_glue) or not suffix.endswith(generation_prompt):
                raise ValueError(f"family {name!r}: after an assistant turn and {sample[0].role} "
                                 f"messages the template renders {suffix!r}; expected it to start "
                                 f"with {close_glue!r} and end with {generation_prompt!r}")
        self._check_token_boundaries()
        return close_glue

    def _generation_prompt(self) -> str:
        with_prompt = self._render(_REFERENCE_HEAD, None, add_generation_prompt=True)
        without = self._render(_REFERENCE_HEAD, None, add_generation_prompt=False)
        if not with_prompt.startswith(without):
            raise ValueError(f"family {self.family.name!r}: add_generation_prompt changes the "
                             "earlier text of the prompt, so turns cannot be appended")
        return with_prompt[len(without):]

    def _check_token_boundaries(self) -> None:
        """Tokenizing prompt, generation and observation apart must give the same text as
        tokenizing the whole; the same ids too, or `check_continuity` reports artifacts."""
        conversation = (*_REFERENCE_HEAD, Message("assistant", PLACEHOLDER), *_SAMPLE_TOOL)
        text = self._render(conversation, None, add_generation_prompt=True)
        start = text.index(PLACEHOLDER)
        end = start + len(PLACEHOLDER) + len(self.family.end_of_turn)
        pieces = (encode(self.tokenizer, text[:start]) + encode(self.tokenizer, PLACEHOLDER)
                  + [self.end_of_turn_id] + encode(self.tokenizer, text[end:]))
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


def _single_token_id(tokenizer: PreTrainedTokenizerBase, family: ChatFamily) -> int:
    ids = encode(tokenizer, family.end_of_turn)
    if len(ids) != 1:
        raise ValueError(f"family {family.name!r} needs {family.end_of_turn!r} as one token, but "
                         f"this tokenizer splits it into {len(ids)}; is the family right?")
    return ids[0]


def _require_roles(messages: Sequence[Message], role: str, caller: str) -> None:
    if not messages:
        raise ValueError(f"{caller} needs at least one message")
    wrong = sorted({m.role for m in messages if m.role != role})
    if wrong:
        raise ValueError(f"{caller} takes only {role!r} messages, got {wrong}")


def detect_family(tokenizer: PreTrainedTokenizerBase) -> str:
    """The family name for this tokenizer's chat template, from the tokens it renders."""
    template = tokenizer.chat_template
    if isinstance(template, Mapping):  # tokenizers with several named templates
        template = template.get("default") or next(iter(template.values()), None)
    if not isinstance(template, str) or not template:
        raise ValueError("the tokenizer has no chat template; set one or pass family=...")
    if "<|start_header_id|>" in template:
        return "llama3"
    if "<|im_start|>" in template:
        if "<think>" in template or "reasoning_content" in template:
            return "qwen3"
        return "qwen2_5" if "You are Qwen" in template else "chatml"
    raise ValueError(f"cannot detect the chat family of this template; pass family= one of "
                     f"{', '.join(FAMILIES)}")


def build_continuity_builder(tokenizer: PreTrainedTokenizerBase, family: str = "auto",
                             keep_thinking: bool = True,
                             template_kwargs: Mapping[str, Any] | None = None) -> TemplateContinuity:
    """The builder for `family` ("auto" detects it from the tokenizer's chat template).
    `keep_thinking` matters only for families whose template drops earlier thinking."""
    name = detect_family(tokenizer) if family == "auto" else family
    if name not in FAMILIES:
        raise ValueError(f"unknown chat family {family!r}; supported: auto, {', '.join(FAMILIES)}")
    return TemplateContinuity(tokenizer, FAMILIES[name], keep_thinking, template_kwargs)


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


def check_continuity(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message],
                     tools: Tools | None, incremental_ids: Sequence[int], *,
                     template_kwargs: Mapping[str, Any] | None = None,
                     context_tokens: int = 4) -> Divergence | None:
    """Debug check: compare incremental ids with the conversation fully re-rendered.

    When `messages` ends with an assistant message the trajectory may stop before the
    glue that closes it (a final turn cut by length, or ChatML's newline after the stop
    token): the re-render may run on past the ids only by special tokens and whitespace.
    Otherwise the re-render includes the generation prompt and must match exactly.
    """
    final_is_assistant = bool(messages) and messages[-1].role == "assistant"
    reference = encode(tokenizer, render_chat(tokenizer, messages, tools,
                                              add_generation_prompt=not final_is_assistant,
                                              template_kwargs=template_kwargs))
    incremental = list(incremental_ids)
    n = 0
    for ref_id, inc_id in zip(reference, incremental):
        if ref_id != inc_id:
            break
        n += 1
    if n == len(incremental) and (n == len(reference) or final_is_assistant and
                                  not tokenizer.decode(reference[n:], skip_special_tokens=True).strip()):
        return None

    def decoded(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    return Divergence(
        position=n,
        reference_id=reference[n] if n < len(reference) else None,
        incremental_id=incremental[n] if n < len(incremental) else None,
        context_before=decoded(reference[max(0, n - context_tokens):n]),
        reference_after=decoded(reference[n:n + context_tokens]),
        incremental_after=decoded(incremental[n:n + context_tokens]))
