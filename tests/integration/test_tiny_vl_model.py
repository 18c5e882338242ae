"""The tiny vision-language model (trainer.run.tiny_vl_model; its build is checked beside
the text model's in test_tiny_model.py): a chat template that renders an image part as one
placeholder; and the real vLLM engine, handed that placeholder and the image, expanding it exactly as the processor does
and giving the same fp32 logprobs as transformers with the processor's pixel values."""

from __future__ import annotations

import os

import pytest
import torch
from PIL import Image, ImageDraw

from trainer.run.tiny_vl_model import IMAGE_TOKEN, ensure_tiny_vl_model

TOOLS = [{"type": "function", "function": {"name": "click", "description": "Click a cell.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def screenshot(width: int, height: int, label: str) -> Image.Image:
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle([4, 4, width // 3, height // 3], fill="red")
    draw.text((width // 2, height // 2), label, fill="black")
    return image


@pytest.fixture(scope="module")
def vl_model_path():
    return ensure_tiny_vl_model()


def test_an_image_part_renders_as_one_placeholder_where_it_stands(vl_model_path):
    from transformers import AutoConfig, AutoProcessor

    processor = AutoProcessor.from_pretrained(vl_model_path)
    assert AutoConfig.from_pretrained(vl_model_path).model_type == "idefics3"
    messages = [{"role": "system", "content": [{"type": "text", "text": "The board: "}, {"type": "image"}]},
                {"role": "user", "content": [{"type": "text", "text": "Which cell? "}, {"type": "image"}]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "click", "arguments": {}}}]},
                {"role": "tool", "content": [{"type": "text", "text": "after: "}, {"type": "image"}]}]
    text = processor.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                   add_generation_prompt=True)
    assert f"<|im_start|>system\nThe board: {IMAGE_TOKEN}\n\n# Tools" in text
    assert f"<|im_start|>user\nWhich cell? {IMAGE_TOKEN}<|im_end|>" in text
    assert f"<tool_response>\nafter: {IMAGE_TOKEN}\n</tool_response>" in text
    # Text-only messages render as the tiny text model's template does.
    plain = processor.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                    add_generation_prompt=True)
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    for token in (IMAGE_TOKEN, "<|im_start|>", "<|im_end|>"):
        assert len(processor.tokenizer(token, add_special_tokens=False)["input_ids"]) == 1


def test_vllm_expands_the_placeholders_as_the_processor_does_and_scores_like_transformers(vl_model_path):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in-process: starts in seconds
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm import LLM, SamplingParams, TokensPrompt

    processor = AutoProcessor.from_pretrained(vl_model_path)
    images = [screenshot(200, 150, "7"), screenshot(60, 60, "3")]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "then "},
                                             {"type": "image"}, {"type": "text", "text": "Which is larger?"}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    placeholders = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    inputs = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    expanded = inputs["input_ids"][0].tolist()
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    # Each image is resized to 224 pixels on its longest edge: 2 x 2 tiles and the whole, 16 tokens each.
    assert placeholders.count(image_id) == 2 and expanded.count(image_id) == 2 * 5 * 16

    llm = LLM(model=str(vl_model_path), dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024,
              enforce_eager=True, seed=0, limit_mm_per_prompt={"image": 2})
    try:
        params = SamplingParams(max_tokens=16, temperature=1.0, logprobs=0, prompt_logprobs=0, seed=1,
                                ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=placeholders, multi_modal_data={"image": images})],
                           params)[0]
    finally:
        del llm
    assert list(out.prompt_token_ids) == expanded  # vLLM's expansion is the processor's

    sample = out.outputs[0]
    model = AutoModelForImageTextToText.from_pretrained(vl_model_path, dtype=torch.float32).eval()
    ids = torch.tensor([expanded + list(sample.token_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=inputs["pixel_values"],
                       pixel_attention_mask=inputs["pixel_attention_mask"]).logits
    ref = torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    engine = torch.tensor([step[t].logprob for step, t in zip(sample.logprobs, sample.token_ids)])
    prompt = torch.tensor([next(iter(step.values())).logprob for step in out.prompt_logprobs[1:]])
    worst = max((engine - ref[len(expanded) - 1:]).abs().max().item(),
                (prompt - ref[:len(expanded) - 1]).abs().max().item())
    assert worst < 1e-4, f"largest logprob difference {worst:.2e}"
