"""Test fixtures for chat families: the real chat templates that the installed `trl` and
`vllm` packages ship (byte-identical to the model repositories; read at test time, never
copied here), paired with small byte-level BPE tokenizers trained in milliseconds with
each family's special tokens, so continuity builders, parsers and the template self-check
meet the real boundary glue and markup of each family without a model hub.
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

from envs.tools.base import ToolResult, function_schema

# The pre-tokenization of the Qwen2 and Llama 3 vocabularies: a run of newlines is one piece
# even when a word follows, so the ids at turn boundaries behave as with the real tokenizers.
FAMILY_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Vocabulary:
    special: tuple[str, ...]  # never split, hidden by skip_special_tokens
    markup: tuple[str, ...]  # added, not special: they survive decoding, as in the real vocabularies
    bos: str | None
    eos: str


_THINK = ("<think>", "</think>")
QWEN = Vocabulary(("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                  ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", *_THINK),
                  None, "<|im_end|>")
LLAMA = Vocabulary(("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"), (), "<|begin_of_text|>", "<|eot_id|>")
GLM = Vocabulary(("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|observation|>"),
                 (*_THINK, "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                  "</arg_value>", "<tool_response>", "</tool_response>"), None, "<|user|>")
DEEPSEEK = Vocabulary(("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                       "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                       "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                       "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
                      _THINK, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
LFM = Vocabulary(("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_list_start|>",
                  "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
                  "<|tool_response_start|>", "<|tool_response_end|>"), _THINK, "<|startoftext|>",
                 "<|im_end|>")
PHI = Vocabulary(("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), (), None,
                 "<|endoftext|>")
KIMI = Vocabulary(("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                   "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                   "<|tool_call_argument_begin|>", "<|tool_call_end|>"), _THINK, None, "<|im_end|>")
MISTRAL = Vocabulary(("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                      "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]",
                      "[THINK]", "[/THINK]"), (), "<s>", "</s>")
GEMMA = Vocabulary(("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), (), "<bos>", "<end_of_turn>")
HARMONY = Vocabulary(("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
                      "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"), (), None, "<|return|>")
GEMMA4 = Vocabulary(("<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>",
                     "<tool_call|>", "<|tool_response>", "<tool_response|>", "<|channel>", "<channel|>",
                     '<|"|>', "<|think|>"), (), "<bos>", "<turn|>")


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = ("the a model tool call result answer compute python print value I will it is done "
             "should run both checks add one what you solve arithmetic with tools twice sure agree "
             "adding more twelve sevens are function parameter name arguments").split()
    lines = []
    for _ in range(400):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize() + "."
        call = json.dumps({"name": "python", "arguments": {"code": f"print({a} * {b})"}})
        lines.append(f"{sentence}\n\n{call}\n\nThe answer is {a * b}.\n\n")
    return lines


def train_tokenizer(vocab: Vocabulary, template: str, family_split: bool = True):
    """A byte-level BPE with the family's tokens, trained in milliseconds."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not family_split)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(FAMILY_SPLIT), "isolated"),
                                                  byte_level]) if family_split else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=list(vocab.special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens(list(vocab.markup))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=vocab.bos, eos_token=vocab.eos,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = template
    return fast


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed (test extra); it ships the original templates")
    return Path(next(iter(spec.submodule_search_locations)))


def trl_template(name: str) -> str:
    """An original template shipped by trl, read without importing trl (it is heavy)."""
    path = _package_dir("trl") / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"the installed trl has no chat_templates/{name}.jinja")
    return path.read_text()


def vllm_template(name: str) -> str:
    """A generic template shipped by vLLM (transformers_utils/chat_templates)."""
    path = _package_dir("vllm") / "transformers_utils" / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"the installed vllm has no chat_templates/{name}.jinja")
    return path.read_text()


@dataclass(frozen=True)
class TemplateCase:
    """One real template: where it comes from, the vocabulary of its family, the sluice
    family it belongs to (None: sluice refuses it) and what detection finds."""

    template: str  # "trl:<name>", "vllm:<name>" or "tiny"
    vocab: Vocabulary | None  # None: the tiny model's own tokenizer
    family: str | None
    template_kwargs: tuple[tuple[str, object], ...] = ()

    @property
    def id(self) -> str:
        return self.template.split(":")[-1]


def template_text(case: TemplateCase) -> str:
    source, _, name = case.template.partition(":")
    return trl_template(name) if source == "trl" else vllm_template(name)


@lru_cache(maxsize=None)
def _tokenizer(template: str, vocab: Vocabulary | None, tiny_path: str | None):
    if vocab is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tiny_path)
    return train_tokenizer(vocab, template)


def tokenizer_for(case: TemplateCase, tiny_model_path: Path | None = None):
    """The case's tokenizer (cached: tests must not change it)."""
    if case.vocab is None:
        return _tokenizer("", None, str(tiny_model_path))
    return _tokenizer(template_text(case), case.vocab, None)


# Templates sluice supports: each passes the self-check with both keep_thinking settings.
SUPPORTED = (
    TemplateCase("tiny", None, "tiny"),
    TemplateCase("trl:qwen2_5", QWEN, "qwen2_5"),
    TemplateCase("trl:qwen3_instruct_2507", QWEN, "qwen2_5"),
    TemplateCase("trl:qwen3_vl", QWEN, "qwen2_5"),
    TemplateCase("trl:qwen3", QWEN, "qwen3"),
    TemplateCase("trl:qwen3_5_think", QWEN, "qwen3_5"),
    TemplateCase("trl:qwen3_5_nothink", QWEN, "qwen3_5"),
    TemplateCase("trl:qwen3_6", QWEN, "qwen3_6"),
    TemplateCase("trl:qwen3_8", QWEN, "qwen3_6"),
    TemplateCase("trl:nemotron_3_nano", QWEN, "nemotron_3"),
    TemplateCase("trl:nemotron_3_super", QWEN, "nemotron_3"),
    TemplateCase("trl:llama3", LLAMA, "llama3"),
    TemplateCase("trl:llama3_1", LLAMA, "llama3_json"),
    TemplateCase("trl:llama3_2", LLAMA, "llama3_json"),
    TemplateCase("trl:glm4moe", GLM, "glm45"),
    TemplateCase("trl:lfm2_v2", LFM, "lfm2"),
    TemplateCase("trl:lfm2_2_5", LFM, "lfm2_5"),
    TemplateCase("trl:lfm2_2_5_v2", LFM, "lfm2_5"),
    TemplateCase("trl:phi3", PHI, "phi3"),
    TemplateCase("trl:phi3_5", PHI, "phi3"),
    TemplateCase("trl:gemma3", GEMMA, "gemma3"),
    TemplateCase("vllm:template_chatml", QWEN, "chatml"),
)


class EchoTool:
    """The one tool of the agent-loop parser tests: echoes its text argument."""

    name = "echo"
    schema = function_schema("echo", "Repeat text.", {"text": {"type": "string"}}, ("text",))

    def __init__(self, env=None) -> None:
        pass

    async def execute(self, arguments) -> ToolResult:
        return ToolResult(f"echoed {arguments.get('text')}")
