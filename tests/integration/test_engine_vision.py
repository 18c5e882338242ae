"""Images through the chat layer and the real vLLM engine wrapper (tiny vision-language
model): the continuity builder expands each image as the processor does, the engine sends
vLLM the placeholders and the images and checks that vLLM arrives at the same ids, its
logprobs equal transformers' with the pixel arrays the trajectory keeps, and a weight push
resets the engine's encoder and processor caches (test_engine_vision_resets.py shows what
a push without them does)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import pytest_asyncio
import torch
from PIL import Image as PILImage, ImageDraw

from envs.types import Image, Message, ToolCall
from rollout.chat import build_continuity_builder, check_continuity, load_tokenizer
from rollout.engine import EngineSpec, Sampling, VLLMEngine
from rollout.vision import PromptIds, for_engine, load_image_expander
from test_trainer_vision import (SERVED_AS_PUSHED, image_case, perturbed_backend, processor,  # noqa: F401 - fixtures
                                 reference_logprobs, text_trajectory, vl_model_path)
from trainer.run.tiny_vl_model import ensure_tiny_vl_model
from trainer.train.backends.logprobs import compute_token_logprobs_and_entropy
from trainer.train.backends.packing import pack_trajectories, unpack_sequences

in_module_loop = pytest.mark.asyncio(loop_scope="module")  # the engine fixture's loop


def screen(colour: str, width: int = 120, height: int = 90) -> Image:
    picture = PILImage.new("RGB", (width, height), "white")
    ImageDraw.Draw(picture).rectangle([10, 10, width // 2, height // 2], fill=colour)
    return Image.from_pil(picture)


@pytest.fixture(scope="module")
def vl_path():
    return ensure_tiny_vl_model()


@pytest.fixture(scope="module")
def chat(vl_path):
    return build_continuity_builder(load_tokenizer(vl_path), "auto", images=load_image_expander(vl_path))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def vl_engine(vl_path):
    engine = VLLMEngine(EngineSpec(model_path=str(vl_path), max_model_len=2048, enforce_eager=True,
                                   kv_cache_memory_bytes=128 << 20, max_num_seqs=8))
    await engine.start()
    yield engine
    engine.shutdown()


def _model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def _reference_logprobs(model, context: PromptIds, generated) -> np.ndarray:
    """transformers' logprobs of `generated` after `context`, with the pixel arrays the
    context's images carry (not re-derived)."""
    ids = torch.tensor([list(context) + [int(t) for t in generated]])
    pixels = torch.from_numpy(np.concatenate([i.inputs["pixel_values"] for i in context.images]))[None]
    mask = torch.from_numpy(np.concatenate([i.inputs["pixel_attention_mask"] for i in context.images]))[None]
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels, pixel_attention_mask=mask).logits
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(context) - 1:].numpy()


def _perturbed(model, seed: int, prefix: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: (v + 0.2 * torch.randn(v.shape, generator=gen) if k.startswith(prefix) else v).contiguous()
            for k, v in model.state_dict().items()}


def _blob(state) -> bytes:
    from safetensors.torch import save

    return save(state)


def _context(chat) -> PromptIds:
    """A first prompt with an image, a tool call, and an observation with another image."""
    prompt = chat.initial_prompt_ids([Message("system", "Answer with the colour."),
                                      Message("user", ("What colour is the square? ", screen("red")))], None)
    generated = chat.tokenizer.encode('<tool_call>\n{"name": "screenshot", "arguments": {}}\n</tool_call><|im_end|>',
                                      add_special_tokens=False)
    observation = chat.observation_ids([Message("tool", ("Screenshot:", screen("blue", 200, 100)),
                                                 name="screenshot")], True)
    images = (*prompt.images, *(i.shifted(len(prompt) + len(generated)) for i in observation.images))
    return PromptIds([*prompt, *generated, *observation], images)


def test_the_builder_expands_each_image_as_the_processor_does_and_continuity_holds(chat):
    context = _context(chat)
    assert len(context.images) == 2
    image_id = chat.images.image_token_id
    for image in context.images:
        run = context[image.start:image.end]
        tiles = image.inputs["pixel_values"].shape[0]  # up to 2 x 2 tiles and the whole image
        assert run.count(image_id) == image.num_image_tokens == tiles * 16
        assert image.prompt_ids == (image_id,)
        assert image.inputs["pixel_values"].shape[1:] == (3, 112, 112)
        assert image.inputs["pixel_attention_mask"].dtype == bool
    # 120 x 90 is resized to 224 x 168: 2 x 2 tiles; 200 x 100 to 224 x 112: 2 x 1 (+ the whole each)
    assert [i.inputs["pixel_values"].shape[0] for i in context.images] == [5, 3]
    assert context.count(image_id) == (5 + 3) * 16  # no placeholder left unexpanded
    messages = [Message("system", "Answer with the colour."),
                Message("user", ("What colour is the square? ", screen("red"))),
                Message("assistant", "", (ToolCall("screenshot", {}),)),
                Message("tool", ("Screenshot:", screen("blue", 200, 100)), name="screenshot")]
    assert check_continuity(chat.tokenizer, messages, None, context, images=chat.images) is None
    # The re-render without expansion would not match: the check compares expanded ids.
    assert check_continuity(chat.tokenizer, messages, None, context) is not None


def test_text_with_the_placeholder_token_or_images_for_a_text_model_are_refused(chat, tiny_model_path):
    with pytest.raises(ValueError, match="may not contain '<image>'"):
        chat.observation_ids([Message("tool", "look: <image>", name="screenshot")], True)
    text_chat = build_continuity_builder(load_tokenizer(tiny_model_path), "auto")
    with pytest.raises(ValueError, match="takes no images"):
        text_chat.initial_prompt_ids([Message("user", ("see ", screen("red")))], None)


@in_module_loop
async def test_engine_scores_an_image_context_like_transformers(vl_engine, chat, vl_path):
    context = _context(chat)
    out = await vl_engine.generate("vl-1", context, Sampling(max_new_tokens=12, seed=3, ignore_eos=True),
                                   for_engine(context.images))
    assert out.num_prompt_tokens == len(context) and len(out.token_ids) == 12
    ref = _reference_logprobs(_model(vl_path), context, out.token_ids)
    assert np.abs(out.logprobs - ref).max() < 1e-4


@in_module_loop
async def test_a_context_whose_runs_vllm_expands_otherwise_fails_the_request(vl_engine, chat):
    context = _context(chat)
    wrong = list(context)
    first = context.images[0]
    del wrong[first.start + 2]  # one image token fewer in the first run than the processor made
    shorter = (first.__class__(first.start, first.num_tokens - 1, first.image, first.prompt_ids, {}),
               context.images[1].shifted(-1))
    with pytest.raises(ValueError, match="vLLM expanded the request's images"):
        await vl_engine.generate("vl-bad", wrong, Sampling(max_new_tokens=2), shorter)


@in_module_loop
async def test_a_push_resets_the_multimodal_caches_and_the_next_request_sees_the_new_vision_tower(
        vl_engine, chat, vl_path):
    context = _context(chat)
    sampling = Sampling(max_new_tokens=8, seed=5, stop_token_ids=())
    await vl_engine.generate("vl-warm", context, sampling, for_engine(context.images))  # caches its features
    resets = vl_engine.stats().mm_cache_resets
    model = _model(vl_path)
    state = _perturbed(model, seed=2, prefix="model.vision_model.")
    await vl_engine.update_weights(vl_engine.version + 1, blob=_blob(state))
    assert vl_engine.stats().mm_cache_resets == resets + 1
    out = await vl_engine.generate("vl-fresh", context, sampling, for_engine(context.images))
    before = _reference_logprobs(model, context, out.token_ids)
    model.load_state_dict(state)
    after = _reference_logprobs(model, context, out.token_ids)
    assert np.abs(out.logprobs - after).max() < 1e-4
    assert np.abs(out.logprobs - before).max() > 1e-3  # the push changed what the images encode to


def test_the_start_up_template_check_plays_images_and_refuses_a_template_that_drops_them(vl_path):
    import copy

    from rollout.template_check import probe_template
    from trainer.run.tiny_vl_model import IMAGE_TOKEN, VL_CHAT_TEMPLATE

    tokenizer, images = load_tokenizer(vl_path), load_image_expander(vl_path)
    assert probe_template(tokenizer, images=images).family == "tiny"
    dropping = copy.deepcopy(tokenizer)
    dropping.chat_template = VL_CHAT_TEMPLATE.replace(f"'{IMAGE_TOKEN}'", "''")  # image parts render nothing
    with pytest.raises(ValueError, match=r"renders 0 image placeholder\(s\) '<image>' for 2 image part\(s\)"):
        probe_template(dropping, images=images)


# The trainer's side of a push (test_trainer_vision.py's fixtures), on this file's engine.
@in_module_loop
async def test_a_push_of_trainer_vl_weights_is_served_by_vllm(vl_engine, vl_model_path, processor):  # noqa: F811 - fixtures
    """The trainer's names are the ones vLLM's Idefics3 loads: after a push of perturbed
    weights the engine's checksums of vision and text tensors are the trainer's, and a
    text prompt's logprobs are the perturbed model's."""
    from rollout.engine import Sampling
    from rollout.weight_protocol import checksum_tensors, encode_state, expected_checksum

    backend = perturbed_backend(vl_model_path, seed=5)
    state = backend.state_dict_for_push()
    assert [spec[0] for spec in backend.push_specs()] == list(state)
    names, digest = expected_checksum(state)
    assert any(n.startswith("model.vision_model.") for n in names)
    assert await vl_engine.checksum(SERVED_AS_PUSHED) != checksum_tensors(state, SERVED_AS_PUSHED)
    await vl_engine.update_weights(vl_engine.version + 1, blob=encode_state(state))
    assert await vl_engine.checksum(names) == digest
    assert await vl_engine.checksum(SERVED_AS_PUSHED) == checksum_tensors(state, SERVED_AS_PUSHED)

    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": "Which cell is red?"}],
                                                   tokenize=False, add_generation_prompt=True)
    prompt = processor.tokenizer.encode(text, add_special_tokens=False)
    out = await vl_engine.generate("vl-push-text", prompt, Sampling(max_new_tokens=12, seed=3))
    assert np.all(out.versions == vl_engine.version)
    ref = reference_logprobs(backend.forward_model.eval(), prompt + out.token_ids.tolist())[len(prompt) - 1:]
    assert np.abs(out.logprobs - ref.numpy()).max() < 1e-3


@in_module_loop
async def test_after_a_push_engine_and_trainer_score_an_image_prompt_alike(vl_engine, vl_model_path, image_case):  # noqa: F811 - fixtures
    """Beyond text: the same image before and after a push (vLLM must not reuse features
    the old vision tower computed), then the engine's logprobs of its sample against the
    trainer's packed forward of that sample with the trajectory's own image arrays."""
    from rollout.engine import Sampling
    from rollout.weight_protocol import encode_state

    traj = image_case.trajectory
    prompt = traj.prompt_ids.tolist()
    images = tuple(i for i in traj.images if i.end <= len(prompt))
    assert len(images) == 1
    sampling = Sampling(max_new_tokens=10, seed=4)
    before = await vl_engine.generate("vl-image-before", prompt, sampling, images=images)
    backend = perturbed_backend(vl_model_path, seed=6)
    await vl_engine.update_weights(vl_engine.version + 1, blob=encode_state(backend.state_dict_for_push()))
    after = await vl_engine.generate("vl-image-after", prompt, sampling, images=images)
    assert np.all(after.versions == vl_engine.version)

    n = len(after.token_ids)
    sample = dataclasses.replace(traj, response_ids=after.token_ids, response_mask=np.ones(n, np.int8),
                                 logprobs=after.logprobs, versions=after.versions, images=images)
    packed = pack_trajectories([text_trajectory(1, 9, 21, 0), sample], torch.zeros(2))
    with torch.no_grad():
        logprobs_T, _ = compute_token_logprobs_and_entropy(backend.forward_model.eval(), packed, chunk_tokens=7)
    trainer = unpack_sequences(packed, logprobs_T)[1][len(prompt) - 1:-1].numpy()
    worst = np.abs(after.logprobs - trainer).max()
    assert worst < 1e-3, f"engine vs trainer logprobs after the push differ by up to {worst:.2e}"
    if np.array_equal(before.token_ids[:n], after.token_ids):  # same tokens: their scores must have moved
        assert np.abs(before.logprobs[:n] - after.logprobs).max() > 1e-3
