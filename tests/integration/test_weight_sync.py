"""Weight push to two real engine actors, over the CPU transport and over the broadcast
transport: engines then serve the pushed weights (logprobs match transformers), report
the version, and a checksum mismatch is an error, never a silent stale engine.

The broadcast tests run the same plan, pack, broadcast, receive and in-place load code
as the NCCL transport, with a gloo group in place of NCCL (the only difference is the
communicator), first from a sender in this process, then from a real train rank 0
(TrainRankActor), which plans, sends and verifies while the driver passes a version; the
last test kills one engine in the middle of a push. Tests run in file order and share
the engines: versions only grow."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import time

import numpy as np
import pytest
import pytest_asyncio
import torch

from rollout.engine import EngineSpec, Sampling
from rollout.router import Router
from trainer.run.recipe import load_config
from rollout.weight_protocol import encode_state, expected_checksum, specs_of
from trainer.train.weight_sync import WeightSyncError, check_engines, resolve_transport, send_prepared
from trainer.train.weight_sync_nccl import BroadcastTransport, LocalSender

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


async def push_bytes(router, state, version):
    """The CPU push as train rank 0 makes it (prepared bytes, then send and verify), from here."""
    return await send_prepared(router, encode_state(state), expected_checksum(state), version)


async def test_push_updates_every_engine_and_is_verified(router, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    state = perturbed(model, 1)
    result = await push_bytes(router, state, version=1)
    assert result.version == 1 and set(result.engines) == {"engine-0", "engine-1"}
    assert result.num_bytes > 2_000_000
    model.load_state_dict(state)
    out = await assert_engines_serve(router, model)
    assert np.all(out.versions == 1)


async def test_a_stale_or_different_engine_is_an_error(router, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    pushed, believed = perturbed(model, 2), perturbed(model, 3)
    await push_bytes(router, pushed, version=2)
    with pytest.raises(WeightSyncError, match="serve other weights"):
        await check_engines(router, expected_checksum(believed), 2)
    with pytest.raises(WeightSyncError, match="report another version"):
        await check_engines(router, expected_checksum(pushed), 5)


async def test_checksum_names_are_norm_weights(tiny_model_path):
    from transformers import AutoModelForCausalLM

    names, _ = expected_checksum(AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict())
    assert 1 <= len(names) <= 4 and all(n.endswith("norm.weight") for n in names)


async def test_transport_resolution():
    assert resolve_transport(load_config("quickstart.yaml")) == "cpu"
    assert resolve_transport(load_config("swe_grpo.yaml")) == "nccl"


async def test_broadcast_push_loads_every_engine_and_is_verified(router, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    current: dict[str, torch.Tensor] = {}
    sender = LocalSender(lambda: current, "gloo", bucket_bytes=1 << 20, timeout_s=120)
    transport = BroadcastTransport(sender, timeout_s=120)
    for version, seed in [(3, 11), (4, 12)]:  # the second push reuses the group
        current = perturbed(model, seed)
        result = await transport.push(router, version)
        assert result.version == version and set(result.engines) == {"engine-0", "engine-1"}
        assert result.failed_engines == () and result.attempts == 1
        total = sum(t.numel() * t.element_size() for t in current.values())
        assert total <= result.num_bytes < total + 64 * len(current)  # aligned, nothing twice
        model.load_state_dict(current)
        out = await assert_engines_serve(router, model)
        assert np.all(out.versions == version)
    assert sender.pusher.num_groups_formed == 1
    assert sum(1 for _ in current) > 1 and total > 1 << 20  # so there was more than one bucket

    with pytest.raises(WeightSyncError, match="serve other weights"):
        await check_engines(router, expected_checksum(perturbed(model, 13)), 4)


class MisorderedWeights:
    """Plans one order and sends another: a backend whose walk breaks its own specs."""

    def __init__(self, state):
        self.state = state

    def specs(self):
        return specs_of(self.state)

    def walk(self):
        return iter(reversed(list(self.state.items())))


async def test_a_sender_that_breaks_the_plan_fails_the_push_loudly_and_the_next_one_works(
        router, tiny_model_path):
    """Runs after the test above (file order): engines are at version 4."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    pushed = perturbed(model, 21)
    sender = LocalSender(MisorderedWeights(pushed), "gloo", bucket_bytes=1 << 20, timeout_s=20)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="differ from the plan"):
        await BroadcastTransport(sender, timeout_s=20).push(router, 5)
    assert time.monotonic() - start < 15  # the engines left the aborted group, no deadline
    stats = await router.engine_stats()
    assert {s.version for s in stats.values()} == {4}  # nobody adopted the broken push
    good = LocalSender(lambda: pushed, "gloo", bucket_bytes=1 << 20, timeout_s=20)
    result = await BroadcastTransport(good, timeout_s=20).push(router, 5)  # a new group
    assert set(result.engines) == {"engine-0", "engine-1"}
    model.load_state_dict(pushed)
    await assert_engines_serve(router, model)


# --- from a real train rank 0 (TrainRankActor, torch backend) over gloo ------------------
TIMEOUT_S = 30.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rank_zero(router, tiny_model_path):
    from trainer.train.train_actor import TrainGroup

    return TrainGroup(rank_zero_config(tiny_model_path), str(tiny_model_path), None)


def rank_zero_config(tiny_model_path):
    return load_config("quickstart.yaml", [f"model.path={tiny_model_path}", "model.warm_start=null",
                                           "train.backend=torch", "sync.transport=gloo",
                                           "sync.bucket_mb=1", f"sync.timeout_s={TIMEOUT_S}"])


def perturb_rank_zero(group, seed) -> dict[str, torch.Tensor]:
    """Change rank 0's weights in place (as a train step would); their copy, for checks."""
    import ray

    def apply(actor, seed):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in actor.backend._model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        return actor.backend.state_dict_for_push()

    return ray.get(group.ranks[0].__ray_call__.remote(apply, seed))


async def serving_model(tiny_model_path, state):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    model.load_state_dict(state)
    return model


async def test_rank_zero_plans_sends_and_verifies_and_the_driver_moves_only_a_version(
        router, rank_zero, tiny_model_path, monkeypatch):
    from trainer.train.train_actor import RayTrainer
    from trainer.train.weight_sync import build_transport

    sent_to_rank_zero: list[bytes] = []
    push_broadcast = rank_zero.push_broadcast

    async def recording(version, engines, verify):
        sent_to_rank_zero.append(pickle.dumps((version, {n: e.handle for n, e in engines.items()}, verify)))
        return await push_broadcast(version, engines, verify)

    monkeypatch.setattr(rank_zero, "push_broadcast", recording)
    transport = build_transport(rank_zero_config(tiny_model_path), rank_zero)
    trainer = RayTrainer(rank_zero, router, transport)
    state = perturb_rank_zero(rank_zero, 31)
    await trainer.prepare_weights(6)
    await trainer.push_weights(6)
    result = trainer.last_push
    assert result.version == 6 and set(result.engines) == {"engine-0", "engine-1"}
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert result.num_bytes >= total > 1 << 20  # the weights went, as several buckets
    # What crossed the driver: a version and two actor handles out, a PushResult back.
    assert len(sent_to_rank_zero) == 1 and len(sent_to_rank_zero[0]) < 4096
    assert len(pickle.dumps(result)) < 1024
    await assert_engines_serve(router, await serving_model(tiny_model_path, state))


def engine_processes(router, name) -> tuple[int, list[int]]:
    """The engine actor's pid and its vLLM engine-core child (where its weights live): the
    child named VLLM::EngineCore, or the actor's multiprocessing-spawned child (the only
    one besides multiprocessing's resource tracker), whose rename is not always seen (in
    one suite run both children still read `python`). psutil can race a process's exit,
    so this waits up to 10 s rather than reading the process table once."""
    import psutil
    import ray

    pid = ray.get(router.engines[name].handle.__ray_call__.remote(lambda actor: os.getpid()))
    seen: list[str] = []
    deadline = time.monotonic() + 10
    while True:
        cores, seen = [], []
        for child in psutil.Process(pid).children(recursive=True):
            try:
                label = f"{child.name()} {' '.join(child.cmdline())[:160]}"
            except psutil.Error:
                continue
            seen.append(label)
            if "EngineCor" in label or "spawn_main" in label:
                cores.append(child.pid)
        if cores or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert cores, f"no vLLM engine core under {name}'s actor (pid {pid}); children: {seen}"
    return pid, cores


async def test_an_engine_killed_mid_push_is_dropped_and_the_run_goes_on(
        router, rank_zero, tiny_model_path):
    """Runs last (file order): kills engine-1. Its engine core is stopped first so the
    push is surely under way when it dies: engine-0 and rank 0 are in the group (or
    waiting for engine-1's reply) at the kill."""
    from trainer.train.train_actor import RayTrainer

    trainer = RayTrainer(rank_zero, router, BroadcastTransport(rank_zero, timeout_s=TIMEOUT_S))
    # Two trajectories in flight between turns, one stuck to each engine.
    first = await asyncio.gather(*(router.generate(f"traj-{i}", f"traj-{i}.turn-0", PROMPT,
                                                   Sampling(4, seed=i)) for i in range(2)))
    on_victim = [f"traj-{i}" for i, o in enumerate(first) if o.engine == "engine-1"]
    assert on_victim, [o.engine for o in first]

    state = perturb_rank_zero(rank_zero, 41)
    actor_pid, cores = engine_processes(router, "engine-1")
    for pid in cores:
        os.kill(pid, signal.SIGSTOP)
    push = asyncio.ensure_future(trainer.push_weights(7))
    await asyncio.sleep(2.0)
    assert not push.done()  # waiting for engine-1: mid-push
    killed = time.monotonic()
    for pid in [*cores, actor_pid]:
        os.kill(pid, signal.SIGKILL)
    await push
    recover_s = time.monotonic() - killed
    result = trainer.last_push
    print(f"\nengine killed mid-push: push returned {recover_s:.2f}s after the kill "
          f"(sync.timeout_s={TIMEOUT_S}), attempts {result.attempts}")
    assert recover_s < TIMEOUT_S  # rank 0 and engine-0 left the group, no deadline waited
    assert (result.version, result.engines, result.failed_engines) == (7, ("engine-0",), ("engine-1",))
    assert router.engine_names == ("engine-0",)
    model = await serving_model(tiny_model_path, state)
    out = await assert_engines_serve(router, model)  # verified by checksum too
    assert np.all(out.versions == 7)

    # The trajectory that was on engine-1 takes its next turn on engine-0, new weights.
    turn = await router.generate(on_victim[0], f"{on_victim[0]}.turn-1", PROMPT, Sampling(4, seed=9))
    assert turn.engine == "engine-0" and turn.rerouted and np.all(turn.output.versions == 7)

    # The next push goes through the smaller group at once.
    state = perturb_rank_zero(rank_zero, 42)
    await trainer.push_weights(8)
    assert (trainer.last_push.engines, trainer.last_push.failed_engines,
            trainer.last_push.attempts) == (("engine-0",), (), 1)
    out = await assert_engines_serve(router, await serving_model(tiny_model_path, state))
    assert np.all(out.versions == 8)
