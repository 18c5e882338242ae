"""vLLM's own tool-call and reasoning parsers behind one call: the text and ids of one
model turn in, a ParsedTurn (reasoning, content, calls, refused calls, status) out.

The parsers are composed and called exactly as vLLM's chat-completions server does
(`ParserManager.get_parser`, one parser per output, the chat-template kwargs and the
prompt ids handed over), so a policy trained here is read the same way at serving and
evaluation time. A parser name is one of vLLM's registry keys (`agent.tool_parser`,
`agent.reasoning_parser`); each chat family names its defaults (rollout.chat).

vLLM is imported only when a parser is built: unit tests and config checks that never
parse stay fast.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from envs.types import ToolCall
from rollout.tool_parser import (TOOL_FORMATS, ParsedTurn, ToolCallError, arguments_object,
                                 explain_refused_calls, find_call_attempt, too_many_error,
                                 turn_status)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rollout.chat import ContinuityBuilder

log = logging.getLogger(__name__)

Tools = Sequence[Mapping[str, Any]]  # OpenAI function schemas

HARMONY_TOOL_PARSER = "openai"  # gpt-oss: vLLM parses Harmony with its own parser class
HARMONY_REASONING_PARSER = "openai_gptoss"


def tool_parser_names() -> list[str]:
    """Every tool parser the installed vLLM registers."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def reasoning_parser_names() -> list[str]:
    """Every reasoning parser the installed vLLM registers."""
    from vllm.reasoning import ReasoningParserManager

    manager: Any = ReasoningParserManager
    return sorted(set(manager.reasoning_parsers) | set(manager.lazy_parsers))


def check_parser_name(knob: str, name: str | None, registered: Sequence[str]) -> None:
    """ValueError naming `knob` and the closest registered names when `name` is unknown."""
    if name is None or name in registered:
        return
    close = difflib.get_close_matches(name, registered, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ValueError(f"{knob}={name!r} is not a parser of the installed vLLM; {hint}"
                     f"registered: {', '.join(registered)}; or null for none")


class OutputParser:
    """One model's tool and reasoning parsers; holds no per-turn state (vLLM's parsers are
    stateful, so a fresh one reads each output, as the server does per choice)."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", tool_parser: str | None,
                 reasoning_parser: str | None, *, template_kwargs: Mapping[str, Any] | None = None,
                 expected_format: str = "") -> None:
        from vllm.parser.parser_manager import ParserManager

        check_parser_name("agent.tool_parser", tool_parser, tool_parser_names())
        check_parser_name("agent.reasoning_parser", reasoning_parser, reasoning_parser_names())
        _quiet_vllm_parser_logs()
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.template_kwargs = dict(template_kwargs or {})
        self.expected_format = expected_format  # shown to the model when a call is refused
        self._format = TOOL_FORMATS.get(tool_parser or "")
        # tool-set key -> (the tool set, its ChatCompletionRequest); the last one used
        self._requests: dict[str, tuple[list[Mapping[str, Any]], Any]] = {}
        self._last: tuple[list[Mapping[str, Any]], Any] | None = None
        self._harmony = tool_parser == HARMONY_TOOL_PARSER or reasoning_parser == HARMONY_REASONING_PARSER
        try:
            self._cls = ParserManager.get_parser(
                tool_parser_name=tool_parser, reasoning_parser_name=reasoning_parser,
                enable_auto_tools=tool_parser is not None,
                # vLLM's TokenizerLike protocol is narrower than transformers' own types
                # (vLLM passes these tokenizers itself).
                is_harmony=self._harmony, tokenizer=tokenizer)  # pyrefly: ignore[bad-argument-type]
        except (TypeError, ValueError, RuntimeError, KeyError, ImportError) as exc:
            raise ValueError(f"agent.tool_parser={tool_parser!r} / agent.reasoning_parser="
                             f"{reasoning_parser!r} cannot parse this tokenizer's output ({exc}); "
                             "choose the parsers of the model's family (or null)") from exc

    def parse(self, text: str, token_ids: Sequence[int] = (), *, tools: Tools | None = None,
              max_calls: int, prompt_ids: Sequence[int] | None = None) -> ParsedTurn:
        """Read one turn. Never raises on model output: a call the parser refuses, or a
        parser that fails, becomes a ToolCallError the model reads as an observation.
        Without `tools` no call is parsed, as a server does for a request without tools."""
        if max_calls < 0:
            raise ValueError(f"max_calls must be >= 0, got {max_calls}")
        if self._cls is None:  # neither parser configured: the whole turn is content
            return ParsedTurn(text.strip(), (), ())
        request = self._request(tools)
        if self._harmony:
            # vLLM reads Harmony from o200k ids. They are the model's own ids for gpt-oss;
            # encoding the text gives them for any tokenizer with the same text (tests).
            from vllm.entrypoints.openai.parser.harmony_utils import get_encoding

            token_ids = get_encoding().encode(text, allowed_special="all")
        try:
            # vLLM's TokenizerLike protocol again (see __init__).
            parser = self._cls(self.tokenizer, request.tools,  # pyrefly: ignore[bad-argument-type]
                               chat_template_kwargs=self.template_kwargs,
                               model_config=None)
            if prompt_ids is not None:
                parser.set_prompt_token_ids(list(prompt_ids))
            reasoning, content, found = parser.parse(text, request, enable_auto_tools=self.tool_parser
                                                     is not None, model_output_token_ids=list(token_ids))
        except Exception as exc:  # a parser bug must cost one turn, never the trajectory
            log.debug("the %s parser failed on a model turn: %s", self.tool_parser, exc)
            error = ToolCallError(0, "malformed_call", (
                f"The output could not be parsed ({type(exc).__name__}); no tool call of this turn "
                f"was run. Expected format: {self.expected_format or 'see the system prompt'}"))
            return ParsedTurn(text.strip(), (), (error,), None, "malformed_call")
        calls, errors = self._calls(found or (), max_calls)
        unclosed = False
        # Without tools a server parses no calls (tool_choice "none"): neither is one refused.
        if self._format is not None and self.tool_parser is not None and request.tools:
            # Engine-based parsers drop refused markup from the content they return, so the
            # attempt is looked for in the output after the reasoning.
            rest = _after(text, reasoning)
            attempt = find_call_attempt(rest, self._format)
            unclosed = attempt is not None and not attempt[1]
            if attempt is not None and not calls and not errors:
                errors.append(explain_refused_calls(rest, self._format, self.tool_parser,
                                                    self.expected_format))
        content = (content or "").strip()
        reasoning = (reasoning or "").strip() or None
        schemas = {_schema_name(s): s for s in tools or ()} if tools is not None else None
        # A call the parser still read from an unclosed block runs, as a server would run
        # it; the turn counts as unclosed_block all the same.
        status = "unclosed_block" if unclosed else turn_status(calls, errors, schemas)
        return ParsedTurn(content, tuple(calls), tuple(errors), reasoning, status)

    def _calls(self, found: Sequence[Any], max_calls: int) -> tuple[list[ToolCall], list[ToolCallError]]:
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        for index, fc in enumerate(found):
            name = (getattr(fc, "name", None) or "").strip()
            arguments = arguments_object(getattr(fc, "arguments", None))
            if not name:
                errors.append(ToolCallError(index, "malformed_call", (
                    f"Tool call {index + 1} has no tool name, so it was not run. Expected format: "
                    f"{self.expected_format or 'see the system prompt'}")))
            elif arguments is None:
                errors.append(ToolCallError(index, "malformed_arguments", (
                    f"Tool call {index + 1} ({name!r}): the arguments are not a JSON object, so it "
                    f"was not run. Expected format: {self.expected_format or 'see the system prompt'}")))
            elif len(calls) >= max_calls:
                errors.append(too_many_error(index, name, max_calls))
            else:
                calls.append(ToolCall(name, arguments))
        return calls, errors

    def _request(self, tools: Tools | None) -> Any:
        """The chat-completions request a server would hold: it carries the tools, which
        some parsers read (argument types of XML formats, known tool names)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        given = list(tools or ())
        # The tool set of the last turn again (nearly every turn): a comparison is several
        # times cheaper than the sorted JSON key.
        if self._last is not None and self._last[0] == given:
            return self._last[1]
        key = json.dumps(given, sort_keys=True, default=str)
        entry = self._requests.get(key)
        if entry is None:
            if len(self._requests) > 64:  # tool sets come from recipes: a handful per run
                self._requests.clear()
            request = ChatCompletionRequest(messages=[{"role": "user", "content": ""}],
                                            model="sluice", tools=given or None)
            # A copy to compare with: a caller's schemas changed later must not match it.
            entry = self._requests[key] = (copy.deepcopy(given), request)
        self._last = entry
        return entry[1]


def _after(text: str, reasoning: str | None) -> str:
    """`text` after its reasoning (the parser's reasoning is a verbatim slice of it)."""
    if not reasoning:
        return text
    at = text.find(reasoning)
    return text if at == -1 else text[at + len(reasoning):]


def _schema_name(schema: Mapping[str, Any]) -> str:
    return str(schema.get("function", schema).get("name", ""))


def _quiet_vllm_parser_logs() -> None:
    # vLLM logs a full traceback for every output its parser refuses. Here each refusal
    # is a counted status (rollout/tool_parse/*) and an observation for the model, so the
    # tracebacks would only bury real errors under thousands of lines per step.
    for name in ("vllm.tool_parsers", "vllm.parser", "vllm.reasoning"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


# Parsers of builders that carry none (a user's own ContinuityBuilder): those of the
# tokenizer's detected family, built once per tokenizer.
_FAMILY_PARSERS: "weakref.WeakKeyDictionary[Any, OutputParser]" = weakref.WeakKeyDictionary()


def output_parser_of(chat: ContinuityBuilder, tokenizer: PreTrainedTokenizerBase) -> OutputParser:
    """The builder's parsers, or the detected family's for a builder without any."""
    parser = chat.parser
    if parser is not None:
        return parser
    cached = _FAMILY_PARSERS.get(tokenizer)
    if cached is None:
        from rollout.chat import build_continuity_builder

        cached = build_continuity_builder(tokenizer).parser
        _FAMILY_PARSERS[tokenizer] = cached
    return cached


def parse_generation(chat: ContinuityBuilder, tokenizer: PreTrainedTokenizerBase,
                     token_ids: Sequence[int] | np.ndarray, *, tools: Tools | None, max_calls: int,
                     prompt_ids: Sequence[int] | np.ndarray | None = None) -> ParsedTurn:
    """One generation (ids as the engine returned them, stop token included or not) read
    by the builder's parsers; `prompt_ids` are the ids the engine was sent."""
    ids = _int_list(token_ids)
    stops = chat.stop_token_ids
    if ids and ids[-1] in stops:
        ids = ids[:-1]
    from rollout.chat import decode_text  # deferred: rollout.chat builds on this module

    text = decode_text(tokenizer, ids)
    return output_parser_of(chat, tokenizer).parse(
        text, ids, tools=tools, max_calls=max_calls,
        prompt_ids=None if prompt_ids is None else _int_list(prompt_ids))


def _int_list(ids: Sequence[int] | np.ndarray) -> list[int]:
    # ndarray.tolist gives the same Python ints in one C call; the whole prompt goes through
    # here every turn, and element by element it was a tenth of a worker's CPU per turn.
    return ids.tolist() if isinstance(ids, np.ndarray) else list(map(int, ids))
