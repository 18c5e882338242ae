"""Model-family glue for vision-language policies: which module computes the hidden states
the LM head reads, and the keyword arguments that carry a packed row's images into the
model's forward, built from the arrays the rollout side's processor produced
(`TrajectoryImage.inputs`), never from the images re-processed here.

Supported: Idefics3 and SmolVLM (`config.model_type` "idefics3" / "smolvlm"). Each image
is a stack of tiles; the model encodes every tile into `image_seq_len` features and writes
them, in order, over the row's image-token ids. So the tiles of all images of a row are
concatenated in row order into one batch of tiles:

    pixel_values          (1, total_tiles, 3, H, W)   the processor's normalised tiles
    pixel_attention_mask  (1, total_tiles, H, W)      True on real pixels

Tiles of different sizes are padded to the largest with zeros and mask False, as the
processor pads a batch. Quirk of transformers' Idefics3 (and SmolVLM): a tile whose pixel
values are all exactly 0.0 is taken for batch padding and dropped before the encoder, so
the features would no longer line up with the image tokens. A real tile never is (0.0 is
a pixel of value 127.5 after the processor's 0.5 / 0.5 normalisation); one is rejected here.

Qwen2-VL-style models (flat patches with `image_grid_thw`, M-RoPE positions) are not
supported: their processors need torchvision, which the CPU install cannot hold, so that
path could not be tested and is refused with a ValueError rather than guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from envs.types import TrajectoryImage

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

TILED_FAMILIES = ("idefics3", "smolvlm")  # model_type values of the Idefics3 layout


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether a model config describes a vision-language model (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def hidden_state_module(model: PreTrainedModel) -> torch.nn.Module:
    """The module whose `last_hidden_state` the LM head reads. For a text causal LM the
    decoder. For a vision-language model the multimodal base model (Idefics3Model): its
    `get_decoder()` is the text model alone, which would skip the merge of image features
    into the embeddings; the base model merges them and passes attention kwargs such as
    `cu_seq_lens_*` on to the text model."""
    if is_vision_language(model.config):
        return model.base_model
    return model.get_decoder()


def _require_family(config: PretrainedConfig) -> str:
    if not is_vision_language(config):
        raise ValueError(f"the batch holds images but the policy ({config.model_type!r}) is a text model; "
                         "train image trajectories with a vision-language model (model.path: tiny-vl, or "
                         "a folder whose config has a vision_config)")
    if config.model_type not in TILED_FAMILIES:
        raise ValueError(f"vision-language model type {config.model_type!r} is not supported by the trainer; "
                         f"supported: {', '.join(TILED_FAMILIES)} (Idefics3-style tiles). Qwen2-VL-style "
                         "flat patches with image_grid_thw are not supported")
    return config.model_type


def tokens_per_tile(config: PretrainedConfig) -> int:
    """Image-token positions one tile's features fill (Idefics3's `image_seq_len`)."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 // config.scale_factor ** 2


def _tiles(image: TrajectoryImage) -> tuple[np.ndarray, np.ndarray]:
    """An image's (pixel_values (tiles, C, H, W), pixel_attention_mask (tiles, H, W) bool)."""
    pixels = image.inputs.get("pixel_values")
    if pixels is None or pixels.ndim != 4:
        got = None if pixels is None else pixels.shape
        raise ValueError(f"image at {image.start}: inputs need the processor's 'pixel_values' of shape "
                         f"(tiles, channels, height, width) without a batch dim, got {got}")
    mask = image.inputs.get("pixel_attention_mask")
    if mask is None:  # the processor without padding: every pixel is real
        mask = np.ones((pixels.shape[0], *pixels.shape[2:]), dtype=bool)
    if mask.shape != (pixels.shape[0], *pixels.shape[2:]):
        raise ValueError(f"image at {image.start}: pixel_attention_mask {mask.shape} does not match "
                         f"pixel_values {pixels.shape}")
    return pixels, mask.astype(bool)


def check_image_runs(config: PretrainedConfig, input_ids_T: torch.Tensor,
                     images: Sequence[TrajectoryImage]) -> None:
    """ValueError unless the features of `images` land exactly on their own runs of the
    1-D ids `input_ids_T` (`start`s in its coordinates): each run holds `num_image_tokens`
    image-token ids, one tile's features per `tokens_per_tile` of them, and no image-token
    id lies outside a run (it would take the next image's features)."""
    _require_family(config)
    image_id = config.image_token_id
    is_image_T = (input_ids_T == image_id).cpu()
    per_tile = tokens_per_tile(config)
    for image in images:
        in_run = int(is_image_T[image.start:image.end].sum())
        tiles = _tiles(image)[0].shape[0]
        if in_run != image.num_image_tokens or tiles * per_tile != in_run:
            raise ValueError(f"image run [{image.start}, {image.end}) holds {in_run} image-token ids (id "
                             f"{image_id}), num_image_tokens={image.num_image_tokens}, and {tiles} tiles of "
                             f"{per_tile} features: they must agree; build TrajectoryImage from the model's "
                             "own processor (rollout.vision.ImageExpander)")
    total = int(is_image_T.sum())
    expected = sum(i.num_image_tokens for i in images)
    if total != expected:
        raise ValueError(f"the ids hold {total} image-token ids (id {image_id}) but their images fill {expected}: "
                         "an image-token id outside any image run (text that contains the image token?)")


def _tiled_kwargs(images: Sequence[TrajectoryImage], device: torch.device | str,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    pairs = [_tiles(image) for image in images]
    for image, (pixels, _) in zip(images, pairs):
        zero = [i for i, tile in enumerate(pixels) if not np.any(tile)]
        if zero:
            raise ValueError(f"image at {image.start}: tile(s) {zero} are all 0.0, which transformers' Idefics3 "
                             "drops as padding; these are not the processor's pixel values")
    height = max(p.shape[2] for p, _ in pairs)
    width = max(p.shape[3] for p, _ in pairs)
    num_tiles = sum(p.shape[0] for p, _ in pairs)
    pixels_NCHW = np.zeros((num_tiles, pairs[0][0].shape[1], height, width), dtype=np.float32)
    mask_NHW = np.zeros((num_tiles, height, width), dtype=bool)
    n = 0
    for pixels, mask in pairs:
        t, _, h, w = pixels.shape
        pixels_NCHW[n:n + t, :, :h, :w] = pixels
        mask_NHW[n:n + t, :h, :w] = mask
        n += t
    return {"pixel_values": torch.from_numpy(pixels_NCHW)[None].to(device=device, dtype=dtype),
            "pixel_attention_mask": torch.from_numpy(mask_NHW)[None].to(device)}


_BUILDERS: dict[str, Callable[[Sequence[TrajectoryImage], torch.device | str, torch.dtype],
                              dict[str, torch.Tensor]]] = {family: _tiled_kwargs for family in TILED_FAMILIES}


def build_vision_kwargs(config: PretrainedConfig, images: Sequence[TrajectoryImage],
                        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                        ) -> dict[str, torch.Tensor]:
    """The model keyword arguments of `images` (all images of one forward, in the order
    their runs appear in it; row-major for a padded batch), on `device` with pixel values
    in `dtype`. {} without images."""
    if not images:
        return {}
    return _BUILDERS[_require_family(config)](images, device, dtype)
