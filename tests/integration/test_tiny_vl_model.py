"""The tiny vision-language model (trainer.run.tiny_vl_model; its build is checked beside
the text model's in test_tiny_model.py): a chat template that renders an image part as one
placeholder. That the real vLLM engine, handed that placeholder and the image, expands it
exactly as the processor does and scores like transformers is test_engine_vision.py's
(through the engine wrapper, whose engine core is a process of its own: an in-process
vLLM would tear down torch.distributed under a DeepSpeed test sharing the worker)."""

from __future__ import annotations

import pytest

from trainer.run.tiny_vl_model import IMAGE_TOKEN, ensure_tiny_vl_model

TOOLS = [{"type": "function", "function": {"name": "click", "description": "Click a cell.",
                                           "parameters": {"type": "object", "properties": {}}}}]


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
