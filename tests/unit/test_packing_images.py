"""Images in the trainer's packed rows and their vision inputs, on hand-made arrays: packing
moves each image to row coordinates in row order; the Idefics3 vision kwargs stack the
tiles in that order (padding smaller tiles with mask False); the checks refuse runs that
do not fit their image-token ids, all-zero tiles and unsupported families; and the policy
loader's per-sub-model attention and dropout settings. No model, no transformers import."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from envs.types import Image, Trajectory, TrajectoryImage
from trainer.train.backends.packing import build_micro_batches, pack_trajectories
from trainer.train.backends.policy_model import attention_per_sub_model, zero_dropout
from trainer.train.backends.vision import build_vision_kwargs, check_image_runs, tokens_per_tile

IMAGE_ID = 9  # the fake config's image-token id
# A 28-pixel tile of 14-pixel patches, no pixel shuffle: 4 image tokens per tile.
CONFIG = SimpleNamespace(model_type="idefics3", image_token_id=IMAGE_ID, scale_factor=1,
                         vision_config=SimpleNamespace(image_size=28, patch_size=14))
PICTURE = Image(b"\x89PNG fake bytes: never decoded here")


def tiles(values: list[float], height: int = 28, width: int = 28) -> dict[str, np.ndarray]:
    """Processor-like arrays of len(values) tiles, tile i filled with values[i]."""
    pixels = np.stack([np.full((3, height, width), v, np.float32) for v in values])
    return {"pixel_values": pixels, "pixel_attention_mask": np.ones((len(values), height, width), bool)}


def image_at(start: int, values: list[float], **sizes: int) -> TrajectoryImage:
    """A run of `fake` + 4 image ids per tile + `fake` at `start` (see `run_ids`)."""
    return TrajectoryImage(start=start, num_tokens=4 * len(values) + 2, image=PICTURE, prompt_ids=(IMAGE_ID,),
                           inputs=tiles(values, **sizes), num_image_tokens=4 * len(values))


def run_ids(num_tiles: int) -> list[int]:
    return [7] + [IMAGE_ID] * 4 * num_tiles + [7]


def make_traj(prompt: list[int], response: list[int], mask: list[int], images=(), index: int = 0) -> Trajectory:
    m = np.asarray(mask)
    return Trajectory(task_id="t", group_id="g", index=index, prompt_ids=prompt, response_ids=response,
                      response_mask=m, logprobs=np.where(m == 1, -0.5, 0.0), versions=np.where(m == 1, 0, -1),
                      termination="finished", images=tuple(images))


@pytest.fixture
def image_traj() -> Trajectory:
    """Prompt: 2 text ids, an image of 2 tiles (10 ids at 2), 1 text id; response: 2 model
    ids, an observation with an image of 1 tile (6 ids at 18), 1 model id."""
    prompt = [1, 2, *run_ids(2), 3]
    response = [20, 21, *run_ids(1), 22]
    mask = [1, 1] + [0] * 6 + [1]
    return make_traj(prompt, response, mask, [image_at(2, [0.5, -0.5]), image_at(15, [0.25])], index=1)


def test_images_move_to_row_coordinates_in_row_order(image_traj):
    text_a = make_traj([30, 31, 32], [40, 41], [1, 1])
    text_b = make_traj([50], [60, 61, 62], [1, 0, 1], index=2)
    packed = pack_trajectories([text_a, image_traj, text_b, image_traj], torch.zeros(4))
    # Sequences start at 0, 5, 27, 31: each image moves by its sequence's start.
    assert packed.cu_seqlens.tolist() == [0, 5, 27, 31, 53]
    assert [i.start for i in packed.images] == [7, 20, 33, 46]
    assert [i.num_tokens for i in packed.images] == [10, 6, 10, 6]
    for image in packed.images:
        assert packed.input_ids_T[image.start:image.end].tolist() == run_ids(image.num_image_tokens // 4)
        assert not packed.loss_mask_T[image.start:image.end - 1].any()  # never a target
    # The arrays are the trajectory's own objects, not copies or re-derivations.
    assert packed.images[0].inputs["pixel_values"] is image_traj.images[0].inputs["pixel_values"]
    assert pack_trajectories([text_a, text_b], torch.zeros(2)).images == ()


def test_micro_batches_keep_each_sequence_with_its_images(image_traj):
    text = make_traj([30, 31, 32], [40, 41], [1, 1])
    batches = build_micro_batches([image_traj, text, image_traj], torch.zeros(3), max_tokens=30)
    assert [b.traj_indices for b in batches] == [(0, 1), (2,)]
    assert [i.start for i in batches[0].images] == [2, 15]
    assert [i.start for i in batches[1].images] == [2, 15]


def test_a_run_outside_its_sequence_is_refused(image_traj):
    # Trajectory itself refuses such runs; the packer does not rely on it (a run that spills
    # into the next sequence would give that sequence another trajectory's features).
    bad = dataclasses.replace(image_traj)
    object.__setattr__(bad, "images", (image_traj.images[0].shifted(20),))
    with pytest.raises(ValueError, match="outside its 22 ids"):
        pack_trajectories([bad], torch.zeros(1))


def test_vision_kwargs_stack_tiles_in_row_order(image_traj):
    packed = pack_trajectories([make_traj([30], [40], [1]), image_traj], torch.zeros(2))
    check_image_runs(CONFIG, packed.input_ids_T, packed.images)
    kwargs = build_vision_kwargs(CONFIG, packed.images, "cpu", torch.float64)
    assert set(kwargs) == {"pixel_values", "pixel_attention_mask"}
    pixels, mask = kwargs["pixel_values"], kwargs["pixel_attention_mask"]
    assert pixels.shape == (1, 3, 3, 28, 28) and pixels.dtype == torch.float64
    assert mask.shape == (1, 3, 28, 28) and mask.dtype == torch.bool and bool(mask.all())
    assert pixels[0, :, 0, 0, 0].tolist() == [0.5, -0.5, 0.25]  # tile order: first image's, then the second's
    assert build_vision_kwargs(CONFIG, ()) == {}
    assert tokens_per_tile(SimpleNamespace(scale_factor=2, vision_config=SimpleNamespace(
        image_size=112, patch_size=14))) == 16  # the tiny VL model's


def test_smaller_tiles_are_padded_with_zeros_and_mask_false():
    images = [image_at(0, [1.0]), image_at(6, [2.0, 3.0], height=14, width=28)]
    kwargs = build_vision_kwargs(CONFIG, images)
    pixels, mask = kwargs["pixel_values"][0], kwargs["pixel_attention_mask"][0]
    assert pixels.shape == (3, 3, 28, 28)
    assert bool((pixels[1:, :, :14] == torch.tensor([2.0, 3.0])[:, None, None, None]).all())
    assert bool((pixels[1:, :, 14:] == 0).all()) and not bool(mask[1:, 14:].any()) and bool(mask[1:, :14].all())


def test_runs_that_do_not_fit_their_image_tokens_are_refused(image_traj):
    ids = torch.from_numpy(image_traj.input_ids().astype(np.int64))
    first, second = image_traj.images
    with pytest.raises(ValueError, match="must agree"):  # run moved by two: 7 of its 8 image ids inside
        check_image_runs(CONFIG, ids, [first.shifted(2), second])
    with pytest.raises(ValueError, match="must agree"):  # 1 tile's arrays for a run of 2 tiles' tokens
        check_image_runs(CONFIG, ids, [dataclasses.replace(first, inputs=second.inputs), second])
    with pytest.raises(ValueError, match="outside any image run"):  # an image id in the text
        check_image_runs(CONFIG, torch.cat([ids, torch.tensor([IMAGE_ID])]), [first, second])
    with pytest.raises(ValueError, match="pixel_values"):
        check_image_runs(CONFIG, ids, [dataclasses.replace(first, inputs={}), second])


def test_an_all_zero_tile_is_refused_because_idefics3_drops_it():
    with pytest.raises(ValueError, match=r"tile\(s\) \[1\] are all 0.0"):
        build_vision_kwargs(CONFIG, [image_at(0, [0.5, 0.0])])


def test_unsupported_families_and_text_models_are_named():
    qwen = SimpleNamespace(model_type="qwen2_vl", vision_config=SimpleNamespace())
    with pytest.raises(ValueError, match="supported: idefics3, smolvlm"):
        build_vision_kwargs(qwen, [image_at(0, [0.5])])
    with pytest.raises(ValueError, match="is a text model"):
        build_vision_kwargs(SimpleNamespace(model_type="llama"), [image_at(0, [0.5])])
    smolvlm = SimpleNamespace(**{**vars(CONFIG), "model_type": "smolvlm"})
    assert build_vision_kwargs(smolvlm, [image_at(0, [0.5])])["pixel_values"].shape == (1, 1, 3, 28, 28)


def vl_config(**top: float) -> SimpleNamespace:
    return SimpleNamespace(**top, sub_configs={"text_config": None, "vision_config": None},
                           text_config=SimpleNamespace(attention_dropout=0.1),
                           vision_config=SimpleNamespace(attention_dropout=0.2, hidden_dropout=0.3))


def test_vision_tower_gets_sdpa_and_the_text_model_the_packed_attention():
    config = vl_config()
    assert attention_per_sub_model(config, "sluice_packed_sdpa") == {
        "": "sluice_packed_sdpa", "text_config": "sluice_packed_sdpa", "vision_config": "sdpa"}
    assert attention_per_sub_model(config, "flash_attention_2")["vision_config"] == "sdpa"
    assert attention_per_sub_model(config, "eager")["vision_config"] == "eager"
    assert attention_per_sub_model(SimpleNamespace(), "sluice_packed_sdpa") == "sluice_packed_sdpa"


def test_dropout_is_zeroed_in_every_sub_config():
    config = vl_config(dropout=0.5)
    zero_dropout(config)
    assert config.dropout == 0.0 and config.text_config.attention_dropout == 0.0
    assert config.vision_config.attention_dropout == 0.0 and config.vision_config.hidden_dropout == 0.0
