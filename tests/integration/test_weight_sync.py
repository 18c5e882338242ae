"""Weight push over the CPU transport to a real engine actor: the engine then serves the
pushed weights (logprobs match transformers), reports the version, and a checksum
mismatch is an error, never a silent stale engine."""

from __future__ import annotations

import numpy as np
import pytest
import pytest_asyncio
import torch

from rollout.engine import EngineSpec, Sampling
from rollout.router import Router
from trainer.recipe import load_config
from trainer.weight_sync import (WeightSyncError, checksum_names, push_weights, resolve_transport,
                                 verify_engines)

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = [1, 347, 201, 332, 284, 223, 20, 13, 21, 33, 2, 1, 349, 201]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def router(tiny_model_path):
    import ray

    from rollout.engine_actor import start_engines

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    spec = EngineSpec(model_path=str(tiny_model_path), max_model_len=1024,
                      kv_cache_memory_bytes=64 << 20, enforce_eager=True)
    yield Router(await start_engines(spec, 2))
    ray.shutdown()


def perturbed(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


async def test_push_updates_every_engine_and_is_verified(router, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    state = perturbed(model, 1)
    result = await push_weights(router, state, version=1)
    assert result.version == 1 and set(result.engines) == {"engine-0", "engine-1"}
    assert result.num_bytes > 2_000_000
    model.load_state_dict(state)
    for name in router.engine_names:
        out = await router._engines[name].generate(f"check-{name}", PROMPT, Sampling(16, seed=3))
        ids = torch.tensor([PROMPT + out.token_ids.tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert np.abs(out.logprobs - logp[len(PROMPT) - 1:].numpy()).max() < 1e-3
        assert np.all(out.versions == 1)


async def test_a_stale_or_different_engine_is_an_error(router, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    pushed, believed = perturbed(model, 2), perturbed(model, 3)
    await push_weights(router, pushed, version=2)
    with pytest.raises(WeightSyncError, match="serve other weights"):
        await verify_engines(router, believed, 2)
    with pytest.raises(WeightSyncError, match="report another version"):
        await verify_engines(router, pushed, 5)


def test_checksum_names_are_norm_weights(tiny_model_path):
    from transformers import AutoModelForCausalLM

    names = checksum_names(AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict())
    assert 1 <= len(names) <= 4 and all(n.endswith("norm.weight") for n in names)


def test_transport_resolution():
    assert resolve_transport(load_config("quickstart.yaml")) == "cpu"
    with pytest.raises(ValueError, match="not built yet"):
        resolve_transport(load_config("swe_grpo.yaml"))
