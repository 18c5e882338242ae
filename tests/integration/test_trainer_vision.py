"""The trainer's image forward on the tiny vision-language model (Idefics3, CPU, fp32): an
image trajectory packed between text-only ones gets, chunked and unchunked, the logprobs
transformers' own Idefics3ForConditionalGeneration gives each sequence alone with the
processor's pixel values, and different ones without its images; gradients reach the
vision tower through the chunked path; a whole train step, with the torch backend and with
DeepSpeed ZeRO-3, trains on image batches; the warm-start SFT takes image examples; and a
push of the trainer's VL weights is what an in-process vLLM engine then serves, for a text
prompt and for an image prompt the trainer scores alike.

The image trajectory is built by hand with the processor, as the rollout side records one:
the conversation rendered by the model's chat template, expanded by
`processor(text=..., images=[[...]])`, each image's run found as the processor's expansion
of one `<image>`, its arrays the full call's, split per image."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from PIL import Image as PILImage, ImageDraw

from envs.types import Image, Trajectory, TrajectoryImage
from trainer.run.tiny_vl_model import IMAGE_TOKEN, ensure_tiny_vl_model
from trainer.train.backends.logprobs import PACKED_SDPA, compute_token_logprobs_and_entropy
from trainer.train.backends.packing import pack_trajectories, unpack_sequences
from trainer.train.backends.policy_model import build_policy_model
from trainer.train.sft import SftExample, compute_sft_loss, run_sft

# fp32 on CPU: the text path's tolerance (test_backend_torch, test_chunked_logprobs*).
TOLERANCE = 1e-4
TOOLS = [{"type": "function", "function": {"name": "click", "description": "Click a cell.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def screenshot(width: int, height: int, colour: str) -> PILImage.Image:
    picture = PILImage.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(picture)
    draw.rectangle([4, 4, width // 3, height // 2], fill=colour)
    draw.line([0, height - 1, width - 1, 0], fill="black", width=3)
    return picture


def conversation(first: str, after: str) -> list[dict]:
    """A user turn with an image, a tool call, a tool result with an image, an answer."""
    return [{"role": "user", "content": [{"type": "text", "text": f"Which cell is {first}? "}, {"type": "image"}]},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "click", "arguments": {}}}]},
            {"role": "tool", "content": [{"type": "text", "text": f"after: {after} "}, {"type": "image"}]},
            {"role": "assistant", "content": f"Done: {after}."}]


@dataclasses.dataclass(frozen=True)
class ImageCase:
    trajectory: Trajectory
    pixel_values: torch.Tensor  # the processor's (1, tiles, 3, H, W) for the whole conversation
    pixel_attention_mask: torch.Tensor


def build_image_case(processor, pictures: list[PILImage.Image], first: str, after: str, index: int) -> ImageCase:
    tok = processor.tokenizer
    messages = conversation(first, after)
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    prompt_text = tok.apply_chat_template(messages[:1], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    full = processor(text=[text], images=[pictures], add_special_tokens=False, return_tensors="np")
    ids = full["input_ids"][0].tolist()
    prompt = processor(text=[prompt_text], images=[pictures[:1]], add_special_tokens=False,
                       return_tensors="np")["input_ids"][0].tolist()
    assert ids[:len(prompt)] == prompt
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    runs, last = [], 0
    for picture in pictures:
        run = processor(text=[IMAGE_TOKEN], images=[[picture]], add_special_tokens=False,
                        return_tensors="np")["input_ids"][0].tolist()
        start = next(i for i in range(last, len(ids)) if ids[i:i + len(run)] == run)
        runs.append((start, run))
        last = start + len(run)
    tiles = [run.count(image_id) // 16 for _, run in runs]
    pixels = np.split(full["pixel_values"][0], np.cumsum(tiles)[:-1])
    masks = np.split(full["pixel_attention_mask"][0].astype(bool), np.cumsum(tiles)[:-1])
    images = tuple(TrajectoryImage(start=start, num_tokens=len(run), image=Image.from_pil(picture),
                                   prompt_ids=(image_id,), inputs={"pixel_values": pv, "pixel_attention_mask": pm},
                                   num_image_tokens=run.count(image_id))
                   for (start, run), picture, pv, pm in zip(runs, pictures, pixels, masks))
    # The model's tokens: the first assistant turn (up to its <|im_end|>) and the answer's text.
    response = ids[len(prompt):]
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    mask = np.zeros(len(response), dtype=np.int8)
    mask[:response.index(end_id) + 1] = 1
    answer = tok.encode(f"Done: {after}.<|im_end|>", add_special_tokens=False)
    tail = len(response) - 1 - len(answer)  # the template's closing newline is glue
    assert response[tail:len(response) - 1] == answer
    mask[tail:len(response) - 1] = 1
    trajectory = Trajectory(task_id="screen", group_id="g", index=index, prompt_ids=prompt, response_ids=response,
                            response_mask=mask, logprobs=np.where(mask == 1, -1.0, 0.0),
                            versions=np.where(mask == 1, 0, -1), termination="finished", images=images)
    return ImageCase(trajectory, torch.from_numpy(full["pixel_values"]),
                     torch.from_numpy(full["pixel_attention_mask"]))


def text_trajectory(seed: int, num_prompt: int, num_response: int, index: int) -> Trajectory:
    rng = np.random.default_rng(seed)
    mask = (rng.random(num_response) < 0.7).astype(np.int8)
    return Trajectory(task_id=f"text{seed}", group_id="g", index=index,
                      prompt_ids=rng.integers(3, 500, num_prompt), response_ids=rng.integers(3, 500, num_response),
                      response_mask=mask, logprobs=np.where(mask == 1, -1.0, 0.0),
                      versions=np.where(mask == 1, 0, -1), termination="finished")


@pytest.fixture(scope="module")
def vl_model_path():
    return ensure_tiny_vl_model()


@pytest.fixture(scope="module")
def processor(vl_model_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vl_model_path)


@pytest.fixture(scope="module")
def image_case(processor) -> ImageCase:
    # 5 tiles (2 x 2 and the whole) then 3 (1 x 2 and the whole): the order of tiles matters.
    return build_image_case(processor, [screenshot(120, 90, "red"), screenshot(200, 50, "blue")],
                            "red", "blue", index=1)


@pytest.fixture(scope="module")
def reference_model(vl_model_path):
    """transformers' own model, as loaded for inference (sdpa everywhere, unpacked inputs)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vl_model_path, dtype=torch.float32).eval()


def reference_logprobs(model, ids: list[int], **vision: torch.Tensor) -> torch.Tensor:
    """log p(ids[t + 1] | ids[:t + 1]) for t < len(ids) - 1, one sequence alone."""
    ids_BT = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=ids_BT, attention_mask=torch.ones_like(ids_BT), **vision).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids_BT[0, 1:, None])[:, 0]


@pytest.fixture(scope="module")
def packed_row(image_case):
    """Text, image, text: the image sequence's runs start after the first sequence."""
    trajectories = [text_trajectory(1, 9, 21, 0), image_case.trajectory, text_trajectory(2, 5, 13, 2)]
    return trajectories, pack_trajectories(trajectories, torch.zeros(3))


@pytest.fixture(scope="module")
def references(reference_model, image_case, packed_row):
    trajectories, _ = packed_row
    vision = {"pixel_values": image_case.pixel_values, "pixel_attention_mask": image_case.pixel_attention_mask}
    return [reference_logprobs(reference_model, t.input_ids().tolist(), **(vision if t.images else {}))
            for t in trajectories]


def worst_difference(packed, logprobs_T: torch.Tensor, references: list[torch.Tensor]) -> list[float]:
    """Per sequence, the largest |trainer - reference| over its positions with a target."""
    return [(seq[:-1] - ref).abs().max().item() for seq, ref in zip(unpack_sequences(packed, logprobs_T), references)]


@pytest.mark.parametrize(("attn", "chunk"), [(PACKED_SDPA, 0), (PACKED_SDPA, 7), ("sdpa", 0), ("sdpa", 7)])
def test_packed_image_row_matches_transformers_per_sequence(vl_model_path, packed_row, references, attn, chunk):
    _, packed = packed_row
    model = build_policy_model(vl_model_path, torch.float32, torch.device("cpu"), attn_implementation=attn)
    assert model.config.get_text_config()._attn_implementation == attn
    assert model.config.vision_config._attn_implementation == "sdpa"
    with torch.no_grad():
        logprobs_T, _ = compute_token_logprobs_and_entropy(model, packed, chunk_tokens=chunk)
    worst = worst_difference(packed, logprobs_T, references)
    assert max(worst) < TOLERANCE, f"largest logprob difference per sequence {worst}"


def test_without_its_images_the_row_scores_otherwise(vl_model_path, packed_row, references, image_case):
    """The comparison above can fail: the same row without its images (the image-token ids
    read as plain token embeddings) moves the image sequence's logprobs after its first run."""
    _, packed = packed_row
    model = build_policy_model(vl_model_path, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        blind_T, _ = compute_token_logprobs_and_entropy(model, dataclasses.replace(packed, images=()), chunk_tokens=7)
    text_a, image_seq, text_b = worst_difference(packed, blind_T, references)
    assert max(text_a, text_b) < TOLERANCE  # text sequences do not depend on the images
    assert image_seq > 0.05, image_seq
    # ... and the images in the wrong order do not fit their runs (5 and 3 tiles).
    first, second = packed.images
    swapped = (dataclasses.replace(first, inputs=second.inputs), dataclasses.replace(second, inputs=first.inputs))
    with pytest.raises(ValueError, match="must agree"):
        compute_token_logprobs_and_entropy(model, dataclasses.replace(packed, images=swapped))


def test_gradients_reach_the_vision_tower_alike_chunked_and_unchunked(vl_model_path, packed_row):
    _, packed = packed_row
    model = build_policy_model(vl_model_path, torch.float32, torch.device("cpu"))
    model.train()
    weights_T = torch.linspace(-1, 1, packed.num_tokens) * packed.loss_mask_T

    def run(chunk: int) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logprobs_T, entropy_T = compute_token_logprobs_and_entropy(model, packed, with_entropy=True,
                                                                   chunk_tokens=chunk)
        ((logprobs_T + entropy_T) * weights_T).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full, chunked = run(0), run(50)  # 9 chunks, their boundaries inside image runs too
    vision = [n for n in full if n.startswith(("model.vision_model.", "model.connector."))]
    assert len(vision) == sum(1 for n, _ in model.named_parameters()
                              if n.startswith(("model.vision_model.", "model.connector.")))
    assert all(full[n].abs().max() > 0 for n in vision)
    assert set(chunked) == set(full)
    for name, grad in chunked.items():
        torch.testing.assert_close(grad, full[name], rtol=1.3e-6, atol=1e-5 * max(1.0, float(full[name].abs().max())),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_a_train_step_on_image_and_text_trajectories_moves_the_vision_tower(vl_model_path, packed_row):
    """The torch backend's whole step: two minibatches (the second's proximal pass carries
    the images too); 400-token micro-batches: the first minibatch's image (376 ids) and text
    (30) sequences apart, the second's image and text (18) in one row."""
    from buffer.batch import TrainBatch
    from trainer.train.backends.torch_backend import TorchBackend
    from trainer.train.config import LossConfig, TrainConfig

    trajectories, _ = packed_row
    batch = TrainBatch([*trajectories, trajectories[1]], [1.0, -1.0, 0.5, 1.0], version=0)
    backend = TorchBackend(TrainConfig(backend="torch", lr=1e-3, num_minibatches=2, micro_batch_tokens=400,
                                       logprob_chunk_tokens=2048), vl_model_path, dtype="float32", device="cpu")
    before = {n: t.clone() for n, t in backend.state_dict_for_push().items()}
    result = backend.train_step(batch, LossConfig())
    assert result.num_micro_batches == 3 and np.isfinite(result.loss) and all(g > 0 for g in result.grad_norms)
    after = backend.state_dict_for_push()
    for name in ("model.vision_model.encoder.layers.0.mlp.fc1.weight",
                 "model.connector.modality_projection.proj.weight"):
        assert not torch.equal(before[name], after[name]), name


def test_zero3_with_chunked_logprobs_trains_image_batches_like_plain_torch(vl_model_path, packed_row):
    """DeepSpeed ZeRO-3 (one CPU rank, gloo) gathers the vision tower's partitioned weights
    in the chunked image forward and trains as the torch backend does unchunked."""
    from buffer.batch import TrainBatch
    from trainer.train.backends.deepspeed_backend import DeepSpeedBackend
    from trainer.train.backends.torch_backend import TorchBackend
    from trainer.train.config import LossConfig, TrainConfig

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    trajectories, _ = packed_row
    batch = TrainBatch([*trajectories, trajectories[1]], [1.0, -1.0, 0.5, 1.0], version=0)
    base = dict(lr=1e-3, num_minibatches=2, micro_batch_tokens=400, max_grad_norm=1.0)
    zero3 = DeepSpeedBackend(TrainConfig(**base, zero_stage=3, logprob_chunk_tokens=16), vl_model_path)
    plain = TorchBackend(TrainConfig(**base, backend="torch", logprob_chunk_tokens=0), vl_model_path,
                         dtype="float32", device="cpu")
    loss_cfg = LossConfig(entropy_coef=0.01)
    for _ in range(2):
        a = zero3.train_step(TrainBatch(batch.trajectories, batch.advantages, zero3.version), loss_cfg)
        b = plain.train_step(TrainBatch(batch.trajectories, batch.advantages, plain.version), loss_cfg)
        assert abs(a.loss - b.loss) < 1e-5
        assert a.grad_norms == pytest.approx(b.grad_norms, rel=1e-5)
    theirs = plain.state_dict_for_push()
    for name, tensor in zero3.state_dict_for_push().items():
        assert (tensor - theirs[name]).abs().max().item() < 0.05 * 1e-3, name  # as test_chunked_logprobs_zero


def sft_example(trajectory: Trajectory) -> SftExample:
    return SftExample(trajectory.input_ids().tolist(),
                      [0] * len(trajectory.prompt_ids) + trajectory.response_mask.tolist(), trajectory.images)


def test_sft_loss_of_image_examples_is_transformers_and_padding_keeps_image_order(
        processor, reference_model, image_case):
    other = build_image_case(processor, [screenshot(60, 100, "green")] * 2, "green", "left", index=3)
    text = text_trajectory(4, 6, 30, 4)
    examples = [sft_example(image_case.trajectory), sft_example(other.trajectory), sft_example(text)]
    with torch.no_grad():
        # One padded chunk holding both image examples (8 and 6 tiles, row-major) and a text one.
        together = compute_sft_loss(reference_model, examples, chunk_size=3).item()
        alone = compute_sft_loss(reference_model, examples, chunk_size=1).item()
    assert abs(together - alone) < 1e-5
    # The image example's loss: transformers' own cross-entropy over its masked targets.
    case = image_case
    ref_T = reference_logprobs(reference_model, case.trajectory.input_ids().tolist(),
                               pixel_values=case.pixel_values, pixel_attention_mask=case.pixel_attention_mask)
    mask_T = torch.tensor(examples[0].loss_mask[1:], dtype=torch.bool)
    with torch.no_grad():
        mine = compute_sft_loss(reference_model, examples[:1]).item()
        blind = compute_sft_loss(reference_model, [dataclasses.replace(examples[0], images=())]).item()
    assert abs(mine + ref_T[mask_T].mean().item()) < 1e-5
    assert abs(blind - mine) > 1e-3  # the images are part of the loss


def test_sft_example_keeps_the_images_the_chat_builder_returns(vl_model_path, image_case):
    """build_sft_example on the rollout's own continuity builder (rollout.vision's expander):
    the same ids, runs and arrays as the hand-built trajectory of the same conversation."""
    from envs.types import Message, ToolCall
    from rollout.chat import build_continuity_builder, load_tokenizer
    from rollout.vision import load_image_expander
    from trainer.train.sft import Demonstration, build_sft_example

    tok = load_tokenizer(vl_model_path)
    chat = build_continuity_builder(tok, "auto", images=load_image_expander(vl_model_path))
    first, second = (i.image for i in image_case.trajectory.images)
    demo = Demonstration((Message("user", ("Which cell is red? ", first)),
                          Message("assistant", "", tool_calls=(ToolCall("click", {}),)),
                          Message("tool", ("after: blue ", second), name="click"),
                          Message("assistant", "Done: blue.")), tools=tuple(TOOLS))
    example = build_sft_example(tok, chat, demo)
    expected = image_case.trajectory
    # The hand-built ids end with the template's newline after the last turn, never generated.
    assert example.input_ids == expected.input_ids().tolist()[:-1]
    assert [(i.start, i.num_tokens, i.num_image_tokens) for i in example.images] == \
        [(i.start, i.num_tokens, i.num_image_tokens) for i in expected.images] and len(example.images) == 2
    for mine, theirs in zip(example.images, expected.images):
        assert set(mine.inputs) == set(theirs.inputs)
        for key, array in mine.inputs.items():
            np.testing.assert_array_equal(array, theirs.inputs[key])


def test_warm_start_trains_on_image_examples_and_saves_a_vl_model(vl_model_path, processor, tmp_path):
    from transformers import AutoModelForImageTextToText

    cases = [build_image_case(processor, [screenshot(90, 90, c), screenshot(150, 60, c)], c, c, index=i)
             for i, c in enumerate(["red", "blue"])]
    examples = [sft_example(c.trajectory) for c in cases]
    # Five steps take the loss from 6.30 to 4.25 (seed 0); the bound is 0.8 of the start.
    result = run_sft(vl_model_path, tmp_path / "warm", examples, steps=5, batch_size=2, lr=3e-3)
    assert result.last_loss < 0.8 * result.first_loss
    model = AutoModelForImageTextToText.from_pretrained(result.path, dtype=torch.float32)
    assert model.config.model_type == "idefics3"
    assert (result.path / "processor_config.json").is_file() and (result.path / "chat_template.jinja").is_file()


def perturbed_backend(vl_model_path, seed: int):
    """A torch backend on the tiny VL model whose weights all moved (as after training)."""
    from trainer.train.backends.torch_backend import TorchBackend
    from trainer.train.config import TrainConfig

    backend = TorchBackend(TrainConfig(backend="torch"), vl_model_path, dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in backend.forward_model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return backend


# Tensors vLLM's CPU build keeps as loaded (it repacks Linear weights for its GEMM kernels, so
# their bytes differ from the checkpoint's even unpushed): the vision tower's convolution,
# position table, norms and biases, and the text model's norms.
SERVED_AS_PUSHED = ["model.vision_model.embeddings.patch_embedding.weight",
                    "model.vision_model.embeddings.position_embedding.weight",
                    "model.vision_model.encoder.layers.1.layer_norm2.weight",
                    "model.vision_model.encoder.layers.0.mlp.fc1.bias",
                    "model.vision_model.encoder.layers.1.self_attn.out_proj.bias",
                    "model.text_model.layers.1.post_attention_layernorm.weight"]
