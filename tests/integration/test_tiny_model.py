"""The tiny model: deterministic, cached builds (its vision-language sibling's too, whose
other checks are in test_tiny_vl_model.py), a tool-aware chat template, and the same fp32
logprobs in transformers and in the real vLLM engine."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from trainer.run.tiny_model import build_tiny_model, ensure_tiny_model
from trainer.run.tiny_vl_model import build_tiny_vl_model, ensure_tiny_vl_model

TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code and return its output.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You solve arithmetic with tools."},
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": "I will compute it.", "tool_calls": [
        {"type": "function", "function": {"name": "python", "arguments": {"code": "print(12*7)"}}},
        {"type": "function", "function": {"name": "python", "arguments": {"code": "print(84)"}}}]},
    {"role": "tool", "name": "python", "content": "84"},
    {"role": "tool", "name": "python", "content": "84"},
    {"role": "assistant", "content": "The answer is 84."},
]


TEXT_FILES = ("tokenizer.json", "model.safetensors", "config.json", "chat_template.jinja")
BUILDERS = {  # name: (build into a folder, ensure in a cache folder, the files that must not change)
    "text": (build_tiny_model, ensure_tiny_model, TEXT_FILES),
    "vision-language": (build_tiny_vl_model, ensure_tiny_vl_model, (*TEXT_FILES, "processor_config.json")),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_build_is_deterministic_and_cached(tmp_path, name):
    build, ensure, files = BUILDERS[name]
    a, b = build(tmp_path / "a"), build(tmp_path / "b")
    for f in files:
        assert hashlib.sha256((a / f).read_bytes()).digest() == hashlib.sha256((b / f).read_bytes()).digest(), f
    cached = ensure(tmp_path / "cache")
    mtime = (cached / "model.safetensors").stat().st_mtime_ns
    assert ensure(tmp_path / "cache") == cached  # reused, not rebuilt
    assert (cached / "model.safetensors").stat().st_mtime_ns == mtime


def test_architecture_is_an_untied_half_million_parameter_qwen2(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.config.model_type == "qwen2" and not model.config.tie_word_embeddings
    assert 300_000 < sum(p.numel() for p in model.parameters()) < 800_000


def test_chat_template_renders_chatml_tools_and_hermes_blocks(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou solve arithmetic with tools.\n\n# Tools")
    assert '"name": "python"' in text.split("</tools>")[0]
    assert ('<|im_start|>assistant\nI will compute it.\n<tool_call>\n{"name": "python", '
            '"arguments": {"code": "print(12*7)"}}\n</tool_call>\n<tool_call>') in text
    # consecutive tool messages share one user turn
    assert ("<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\n84\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\nThe answer is 84.<|im_end|>\n") in text
    prompt = tok.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n"
    # markup is one token each and survives decoding; ids round-trip exactly
    for marker in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                   "<|im_start|>", "<|im_end|>"):
        assert len(tok(marker, add_special_tokens=False)["input_ids"]) == 1
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>"


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_path):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in-process: starts in seconds
    from vllm import LLM

    llm = LLM(model=str(tiny_model_path), dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_model_len=1024, enforce_eager=True, seed=0)
    yield llm
    del llm


def test_vllm_and_transformers_give_the_same_fp32_logprobs(tiny_model_path, vllm_engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt = tok.apply_chat_template(CONVERSATION[:2], tools=TOOLS, add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    params = SamplingParams(max_tokens=48, temperature=1.0, logprobs=0, prompt_logprobs=0,
                            seed=1, ignore_eos=True)
    outputs = vllm_engine.generate([TokensPrompt(prompt_token_ids=prompt)] * 4, params)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    worst = 0.0
    for out in outputs:
        sample = out.outputs[0]
        assert len(sample.token_ids) == 48
        engine_lp = torch.tensor([step[t].logprob for step, t in zip(sample.logprobs, sample.token_ids)])
        prompt_lp = torch.tensor([next(iter(step.values())).logprob for step in out.prompt_logprobs[1:]])
        ids = torch.tensor([prompt + list(sample.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        ref = logp.gather(-1, ids[0, 1:, None])[:, 0]
        worst = max(worst, (engine_lp - ref[len(prompt) - 1:]).abs().max().item(),
                    (prompt_lp - ref[:len(prompt) - 1]).abs().max().item())
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"
