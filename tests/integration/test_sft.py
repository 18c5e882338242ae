"""Warm-start SFT: demonstrations become ids with the rollout's own layout (mask on
assistant tokens only), and a short supervised pass teaches the tiny model the format."""

from __future__ import annotations

import random

import torch

from envs.tools.calculator import CalculatorTool
from rollout.chat import build_continuity_builder, check_continuity
from envs.types import Message, ToolCall
from trainer.train.sft import Demonstration, build_sft_example, compute_sft_loss, run_sft


def demo(a: int, b: int) -> Demonstration:
    return Demonstration((
        Message("user", f"What is {a} + {b}?"),
        Message("assistant", "", tool_calls=(ToolCall("calculator", {"expression": f"{a} + {b}"}),)),
        Message("tool", str(a + b), name="calculator"),
        Message("assistant", f"The answer is {a + b}."),
    ), tools=(CalculatorTool.schema,))


def test_examples_match_a_full_render_and_mask_only_assistant_tokens(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    chat = build_continuity_builder(tok, "tiny")
    d = demo(12, 30)
    ex = build_sft_example(tok, chat, d)
    assert check_continuity(tok, d.messages, list(d.tools), ex.input_ids) is None
    assistant_text = tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m])
    assert assistant_text == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": '
                              '"12 + 30"}}\n</tool_call><|im_end|>The answer is 42.<|im_end|>')


def test_a_short_supervised_pass_lowers_the_loss(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    chat = build_continuity_builder(tok, "tiny")
    rng = random.Random(0)
    examples = [build_sft_example(tok, chat, demo(rng.randint(0, 99), rng.randint(0, 99)))
                for _ in range(64)]
    # 20 steps of 8 take the loss to about a third of its start (0.33-0.34 over seeds 0-2);
    # the bound is half.
    result = run_sft(tiny_model_path, tmp_path / "warm", examples, steps=20, batch_size=8)
    assert result.last_loss < 0.5 * result.first_loss
    model = AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert compute_sft_loss(model, examples[:8]).item() < 0.5 * result.first_loss
    assert (result.path / "tokenizer.json").is_file() and (result.path / "chat_template.jinja").is_file()


def test_chunked_padding_gives_the_loss_of_one_padded_batch(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    chat = build_continuity_builder(tok, "tiny")
    long_demo = Demonstration((Message("system", "You add numbers. " * 30), *demo(5, 6).messages),
                              tools=(CalculatorTool.schema,))
    examples = [build_sft_example(tok, chat, d) for d in (demo(1, 2), long_demo, demo(40, 2),
                                                          demo(7, 70), demo(3, 3))]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        whole = compute_sft_loss(model, examples, chunk_size=len(examples))
        chunked = compute_sft_loss(model, examples, chunk_size=2)
    assert abs(whole.item() - chunked.item()) < 1e-5
