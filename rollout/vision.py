"""Images in token continuity: a vision-language model's processor turns each image of a
message into the run of ids the model sees (its placeholder tokens) and the arrays its
vision encoder reads; the engine is sent the template's one placeholder per image with the
image itself, and expands it the same way.

    chat template     text with one placeholder token per image (e.g. `<image>`)
    ImageExpander     that token -> the processor's run for the image (tile markup and
                      image tokens) + the image's pixel arrays, kept as a TrajectoryImage
    PromptIds         the ids with their images, what the continuity builder returns
    engine_prompt     a context's ids with each run put back to its placeholder, and the
                      images, as the engine takes them (vLLM expands each placeholder)

Text is never decoded and re-tokenized: the placeholder is found as an id, and each run is
the processor's own tokenization of its expansion (all special tokens and newlines, so it
does not depend on the text around it). The engine checks that what vLLM expanded equals
the trajectory's ids (rollout.engine), so a processor that expands otherwise than vLLM
fails the request instead of training on ids the engine never saw.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from envs.types import Image, Message, TrajectoryImage

log = logging.getLogger(__name__)


class PromptIds(list[int]):
    """Token ids with the images they hold (`images`, starts relative to these ids): what a
    continuity builder returns for messages with images. A list, so loops that pass the ids
    on unchanged (ctx.start, rec.add_observation) carry the images with them."""

    __slots__ = ("images",)

    def __init__(self, ids: Sequence[int] = (), images: Sequence[TrajectoryImage] = ()) -> None:
        super().__init__(ids)
        self.images = tuple(images)


def images_of(ids: object) -> tuple[TrajectoryImage, ...]:
    """The images `ids` carry (a PromptIds), () for plain ids or arrays."""
    return ids.images if isinstance(ids, PromptIds) else ()


def no_images_error(messages: Sequence[Message]) -> ValueError:
    count = sum(len(m.images) for m in messages)
    return ValueError(f"the messages hold {count} image(s) but this model takes no images (its folder has no "
                      "image processor); use a vision-language model (model.path: tiny-vl, or a folder "
                      "whose config has a vision_config) or send text only")


class ImageExpander:
    """A vision-language model's processor, as continuity needs it: the placeholder token
    the chat template renders per image, and the run and arrays each image becomes."""

    def __init__(self, processor: Any) -> None:  # Any: a transformers ProcessorMixin
        self.processor = processor
        token = getattr(processor, "image_token", None)
        if not isinstance(token, str) or not token:
            raise ValueError(f"{type(processor).__name__} names no image token (processor.image_token); "
                             "sluice supports processors that expand one placeholder token per image")
        self.image_token = token
        ids = processor.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the image token {token!r} is {len(ids)} tokens for this tokenizer; it must be one")
        self.image_token_id = int(ids[0])
        # Cumulative, for the worker's stats: images processed and the seconds it took
        # (decode, resize, tiling, normalising: CPU work on the worker, per observation).
        self.num_processed = 0
        self.process_s = 0.0

    def expand(self, ids: Sequence[int], images: Sequence[Image]) -> PromptIds:
        """`ids` (one placeholder per image, in order) with each placeholder replaced by its
        image's run; ValueError when the counts differ (text that holds the placeholder
        token itself, a template that renders no placeholder)."""
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != len(images):
            raise ValueError(f"the rendered text holds {len(positions)} image placeholder(s) {self.image_token!r} "
                             f"for {len(images)} image(s): a message's text may not contain {self.image_token!r}, "
                             "and the chat template must render one per image part")
        out: list[int] = []
        placed: list[TrajectoryImage] = []
        last = 0
        for position, image in zip(positions, images):
            out.extend(ids[last:position])
            run, inputs = self.process(image)
            placed.append(TrajectoryImage(start=len(out), num_tokens=len(run), image=image,
                                          prompt_ids=(self.image_token_id,), inputs=inputs,
                                          num_image_tokens=run.count(self.image_token_id)))
            out.extend(run)
            last = position + 1
        out.extend(ids[last:])
        return PromptIds(out, placed)

    def process(self, image: Image) -> tuple[list[int], dict[str, np.ndarray]]:
        """The run of ids one image becomes and its arrays for the vision encoder (no batch
        dimension; masks as bool)."""
        start = time.monotonic()
        out = self.processor(text=[self.image_token], images=[[image.to_pil()]], add_special_tokens=False,
                             return_tensors="np")
        run = [int(t) for t in out["input_ids"][0]]
        inputs = {k: np.asarray(v[0]) for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        for key, value in inputs.items():
            if key.endswith("attention_mask"):
                inputs[key] = value.astype(bool)
        self.num_processed += 1
        self.process_s += time.monotonic() - start
        return run, inputs


def load_image_expander(model_path: str | os.PathLike[str]) -> ImageExpander | None:
    """The expander of a vision-language model folder (its config has a vision_config);
    None for a text model."""
    import json

    config = Path(model_path) / "config.json"
    try:
        is_vision = "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if not is_vision:
        return None
    from transformers import AutoProcessor

    return ImageExpander(AutoProcessor.from_pretrained(model_path))


def engine_prompt(ids: Sequence[int] | np.ndarray, images: Sequence[TrajectoryImage]
                  ) -> tuple[list[int], list[Image]]:
    """The ids an engine is sent for a context holding `images` (each run put back to the
    placeholder the engine expands) and the images, in order."""
    sent: list[int] = []
    last = 0
    flat = [int(t) for t in ids]
    for image in images:
        if image.start < last or image.end > len(flat):
            raise ValueError(f"image run [{image.start}, {image.end}) is out of order or past the {len(flat)} ids")
        sent.extend(flat[last:image.start])
        sent.extend(image.prompt_ids)
        last = image.end
    sent.extend(flat[last:])
    return sent, [i.image for i in images]


def shift_images(images: Sequence[TrajectoryImage], offset: int) -> tuple[TrajectoryImage, ...]:
    return tuple(i.shifted(offset) for i in images)


# A TrajectoryImage as plain values a journal (marshal) holds: start, num_tokens, media
# type, the encoded image, prompt_ids, num_image_tokens, and each array as (name, dtype,
# shape, bytes).
ImageRecord = tuple[int, int, str, bytes, tuple[int, ...], int, tuple[tuple[str, str, tuple[int, ...], bytes], ...]]


def image_record(image: TrajectoryImage) -> ImageRecord:
    arrays = tuple((k, str(v.dtype), tuple(v.shape), np.ascontiguousarray(v).tobytes())
                   for k, v in image.inputs.items())
    return (image.start, image.num_tokens, image.image.media_type, image.image.data, image.prompt_ids,
            image.num_image_tokens, arrays)


def image_of_record(record: ImageRecord) -> TrajectoryImage:
    start, num_tokens, media_type, data, prompt_ids, num_image_tokens, arrays = record
    inputs = {k: np.frombuffer(raw, dtype).reshape(shape).copy() for k, dtype, shape, raw in arrays}
    return TrajectoryImage(start, num_tokens, Image(data, media_type), prompt_ids, inputs, num_image_tokens)


def for_engine(images: Sequence[TrajectoryImage]) -> tuple[TrajectoryImage, ...]:
    """The images as a request carries them to an engine: without the encoder's arrays
    (the engine's own processor makes them from the image; they stay with the trajectory)."""
    return tuple(replace(i, inputs={}) if i.inputs else i for i in images)
