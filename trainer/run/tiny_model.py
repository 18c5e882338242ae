"""The tiny local test model: a byte-level BPE tokenizer with ChatML + tool-call tokens and
an untied ~0.5M-parameter Qwen2 model, built deterministically in well under a second.

No weights or data can be downloaded on the machines sluice is tested on, so recipes and
tests build this model once and reuse it from the cache folder:

    python -m trainer.tiny_model OUT_DIR      # build into OUT_DIR
    ensure_tiny_model()                      # build into the cache if missing, return path
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from envs.cache import build_lock, default_cache_dir
from envs.progress import FirstUse

# Bump when anything below changes what is built: the cache key includes it.
BUILD_VERSION = 1

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (non-special) tokens: they survive detokenisation so tool calls can be parsed.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                 "<think>", "</think>"]
VOCAB_SIZE = 512

MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)

# ChatML with Hermes-style tools, written for sluice. Tool messages that follow each other
# share one user turn, each wrapped in <tool_response>; assistant tool calls are rendered as
# <tool_call>{json}</tool_call> after the text.
CHAT_TEMPLATE = r"""
{%- set ns = namespace(first=0) -%}
{%- if messages[0].role == 'system' -%}
  {%- set ns.first = 1 -%}
{%- endif -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if ns.first -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
  {{- '# Tools\nCall a tool by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>.\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools><|im_end|>\n' -}}
{%- elif ns.first -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[ns.first:] -%}
  {%- if message.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- elif message.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' + (message.content or '') -}}
    {%- for call in message.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- if (message.content or '') or not loop.first -%}{{- '\n' -}}{%- endif -%}
      {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
      {%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()


def _build_key() -> str:
    spec = json.dumps([BUILD_VERSION, SPECIAL_TOKENS, MARKUP_TOKENS, VOCAB_SIZE, MODEL_SHAPE,
                       CHAT_TEMPLATE], sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def _corpus(seed: int = 0) -> list[str]:
    """Generated text in the shapes the tiny model will meet: chat, arithmetic, code, JSON."""
    rng = random.Random(seed)
    words = ("the a model tool call result answer compute sum of and then python print value "
             "number task test file read write run error output function return def import "
             "is what please use to get final done with for in if else true false").split()
    lines = []
    for _ in range(600):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + ".")
        lines.append(f"What is {a} {op} {b}? The answer is {eval(f'{a}{op}{b}')}.")
        lines.append(json.dumps({"name": "python", "arguments": {"code": f"print({a} {op} {b})"}}))
        lines.append(f"def f(x):\n    return x {op} {b}\n\nprint(f({a}))\n")
        lines.append(f"<|im_start|>user\nCompute {a} {op} {b}.<|im_end|>\n<|im_start|>assistant\n"
                     f"<tool_call>\n{{\"name\": \"python\", \"arguments\": {{\"code\": \"print({a}{op}{b})\"}}}}"
                     f"\n</tool_call><|im_end|>\n")
    return lines


def build_tokenizer(seed: int = 0):
    """Train the byte-level BPE deterministically and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_tokens(MARKUP_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None,
                                   additional_special_tokens=["<|im_start|>"],
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Build tokenizer + model into `out_dir` (written atomically) and return it."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=False,  # vLLM CPU bug with tied
                         bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id, dtype="float32", **MODEL_SHAPE)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        # transformers wraps PreTrainedModel.to with functools.wraps, which pyrefly reads as unbound
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()  # pyrefly: ignore[bad-argument-type]
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)

    def save(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    return write_model_folder(out_dir, save, _build_key(), seed)


def write_model_folder(out_dir: str | Path, save: Callable[[Path], None], key: str, seed: int) -> Path:
    """`save` into a temporary folder beside `out_dir`, mark it built by `key`, then move it
    to `out_dir` in one rename (a reader never sees half a model)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save(tmp)
        (tmp / "sluice_build.json").write_text(json.dumps({"key": key, "seed": seed}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_built(path: Path, what: str, build: Callable[[Path], Path]) -> Path:
    """`path`, built by `build` first if it holds no finished build (its name carries the
    build key, so an outdated build is another folder)."""
    with build_lock(path):  # parallel test workers: one builds, the others wait for it
        if not (path / "sluice_build.json").is_file():
            with FirstUse(what, path):
                build(path)
    return path


def ensure_tiny_model(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached tiny model, building it first if it is missing or outdated."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return ensure_built(root / "models" / f"tiny-qwen2-{_build_key()}",
                        "the tiny test model (tokenizer and random weights)", build_tiny_model)


def run_build_cli(description: str, build: Callable[[Path, int], Path], ensure: Callable[[], Path],
                  argv: list[str] | None) -> None:
    """`python -m ... [OUT_DIR] [--seed N]` of a local test model: build into OUT_DIR, or
    into the cache when it is missing; print where it is."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out_dir", nargs="?", type=Path, help="where to write (default: the cache folder)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build(args.out_dir, args.seed) if args.out_dir else ensure())


def main(argv: list[str] | None = None) -> None:
    run_build_cli(__doc__.split("\n\n")[0], build_tiny_model, ensure_tiny_model, argv)


if __name__ == "__main__":
    main()
