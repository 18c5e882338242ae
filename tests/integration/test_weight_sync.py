"""Weight push to two real engine actors, over the CPU transport and over the broadcast
transport: engines then serve the pushed weights (logprobs match transformers), report
the version, and a checksum mismatch is an error, never a silent stale engine.

The broadcast tests run the same plan, pack, broadcast, receive and in-place load code
as the NCCL transport, with a gloo group in place of NCCL (the only difference is the
communicator). Tests run in file order and share the engines: versions only grow."""

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
from trainer.weight_sync_nccl import BroadcastTransport, LocalSender

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


async def assert_engines_serve(router, model):
    for name in router.engine_names:
        out = await router._engines[name].generate(f"check-{name}-{id(model)}", PROMPT, Sampling(16, seed=3))
        ids = torch.tensor([PROMPT + out.token_ids.tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert np.abs(out.logprobs - logp[len(PROMPT) - 1:].numpy()).max() < 1e-3
    return out


async def test_push_updates_every_engine_and_is_verified(router, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    state = perturbed(model, 1)
    result = await push_weights(router, state, version=1)
    assert result.version == 1 and set(result.engines) == {"engine-0", "engine-1"}
    assert result.num_bytes > 2_000_000
    model.load_state_dict(state)
    out = await assert_engines_serve(router, model)
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


async def test_checksum_names_are_norm_weights(tiny_model_path):
    from transformers import AutoModelForCausalLM

    names = checksum_names(AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict())
    assert 1 <= len(names) <= 4 and all(n.endswith("norm.weight") for n in names)


async def test_transport_resolution():
    assert resolve_transport(load_config("quickstart.yaml")) == "cpu"
    assert resolve_transport(load_config("swe_grpo.yaml")) == "nccl"


async def test_broadcast_push_loads_every_engine_and_is_verified(router, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    current: dict[str, torch.Tensor] = {}
    transport = BroadcastTransport(LocalSender(lambda: iter(current.items())), "gloo",
                                   bucket_bytes=1 << 20, tp_size=1, timeout_s=120)
    for version, seed in [(3, 11), (4, 12)]:  # the second push reuses the group
        current = perturbed(model, seed)
        result = await push_weights(router, current, version, transport=transport)
        assert result.version == version and set(result.engines) == {"engine-0", "engine-1"}
        total = sum(t.numel() * t.element_size() for t in current.values())
        assert total <= result.num_bytes < total + 64 * len(current)  # aligned, nothing twice
        model.load_state_dict(current)
        out = await assert_engines_serve(router, model)
        assert np.all(out.versions == version)
    assert sum(1 for _ in current) > 1 and total > 1 << 20  # so there was more than one bucket

    with pytest.raises(WeightSyncError, match="serve other weights"):
        await verify_engines(router, perturbed(model, 13), 4)


async def test_a_sender_that_breaks_the_plan_fails_the_push_loudly(router, tiny_model_path):
    """Runs after the test above (file order): engines are at version 4."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    pushed = perturbed(model, 21)
    wrong = dict(reversed(list(pushed.items())))  # right tensors, wrong order
    transport = BroadcastTransport(LocalSender(lambda: iter(wrong.items())), "gloo",
                                   bucket_bytes=1 << 20, tp_size=1, timeout_s=20)
    with pytest.raises(WeightSyncError, match="differ from the plan"):
        await push_weights(router, pushed, 5, transport=transport)
    stats = await router.engine_stats()
    assert {s.version for s in stats.values()} == {4}  # nobody adopted the broken push
    with pytest.raises(WeightSyncError, match="out of step"):
        await push_weights(router, pushed, 5, transport=transport)
