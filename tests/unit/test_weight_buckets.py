"""The broadcast weight transport's pure parts: bucket planning under a byte budget, the
plan's trip through the rpc, packing and unpacking bytes, the group layout, the
rendezvous socket, the transport choice from config, the deadline every collective waits
under, and the driver's policy when rank 0 reports engines that failed a push."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import torch

from rollout.weight_protocol import (ALIGN_BYTES, Bucket, decode_plan, encode_plan, pack_bucket,
                                     plan_buckets, plan_state_buckets, unpack_bucket)
from trainer.run.recipe import build_config, load_config
from trainer.train.weight_sync import build_transport, resolve_transport
from trainer.train.weight_sync_nccl import (BroadcastTransport, engine_rank_offsets,
                                            open_listen_socket)


def flat_names(buckets: tuple[Bucket, ...]) -> list[str]:
    return [s.name for b in buckets for s in b.slots]


def test_buckets_keep_order_hold_every_tensor_once_and_respect_the_budget():
    sizes = [100, 300, 20, 700, 64, 64, 1, 500, 900]
    tensors = [(f"t{i}", (n,), "float32", 4) for i, n in enumerate(sizes)]
    budget = 1600
    buckets = plan_buckets(tensors, budget)
    assert flat_names(buckets) == [t[0] for t in tensors]
    assert [s.num_bytes for b in buckets for s in b.slots] == [4 * n for n in sizes]
    for b in buckets:
        assert b.num_bytes <= budget or len(b.slots) == 1  # t3 (2800 B) is alone
        assert all(s.offset % ALIGN_BYTES == 0 for s in b.slots)
        ends = [s.offset + s.num_bytes for s in b.slots]
        assert all(e <= nxt.offset for e, nxt in zip(ends, b.slots[1:]))  # no overlap
        assert b.num_bytes == ends[-1]
    # greedy: t0 (400 B) + t1 (1200 B at offset 448) would need 1648 > 1600 bytes
    assert [flat_names((b,)) for b in buckets] == [["t0"], ["t1", "t2"], ["t3"],
                                                   ["t4", "t5", "t6"], ["t7"], ["t8"]]


def test_a_tensor_larger_than_the_bucket_gets_its_own_bucket():
    tensors = [("small", (4,), "float32", 4), ("huge", (1000,), "bfloat16", 2),
               ("after", (2, 3), "float32", 4)]
    buckets = plan_buckets(tensors, 256)
    assert [flat_names((b,)) for b in buckets] == [["small"], ["huge"], ["after"]]
    assert buckets[1].num_bytes == 2000 and buckets[1].slots[0].offset == 0


def test_one_bucket_when_everything_fits_and_none_for_nothing():
    buckets = plan_buckets([("a", (3,), "float32", 4), ("b", (), "int64", 8)], 1 << 20)
    assert len(buckets) == 1 and buckets[0].slots[1].offset == ALIGN_BYTES
    assert plan_buckets([], 1024) == ()
    with pytest.raises(ValueError, match="must be > 0"):
        plan_buckets([("a", (1,), "float32", 4)], 0)


def test_plan_survives_the_rpc_as_plain_data():
    state = {"w": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7),
             "step": torch.tensor(3), "mask": torch.zeros(2, 2, dtype=torch.bool)}
    buckets = plan_state_buckets(state, 128)
    wire = encode_plan(buckets)
    assert json.loads(json.dumps(wire)) == wire  # only lists, dicts, str and int
    assert decode_plan(json.loads(json.dumps(wire))) == buckets
    assert [s.dtype for b in buckets for s in b.slots] == ["bfloat16", "float32", "int64", "bool"]


def test_pack_then_unpack_returns_the_same_tensors():
    gen = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(11, 6, generator=gen).to(torch.bfloat16),
             "norm.weight": torch.randn(6, generator=gen),
             "counter": torch.tensor(9, dtype=torch.int64),
             "odd": torch.randn(3, 5, generator=gen).t()}  # not contiguous
    buckets = plan_state_buckets(state, 200)
    assert len(buckets) > 1
    source = iter(state.items())
    received = {}
    for bucket in buckets:
        received.update(unpack_bucket(bucket, pack_bucket(bucket, source, "cpu")))
    assert list(received) == list(state)
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)


def test_packing_refuses_weights_that_differ_from_the_plan():
    planned = {"a": torch.zeros(4), "b": torch.zeros(4)}
    (bucket,) = plan_state_buckets(planned, 1 << 20)
    with pytest.raises(ValueError, match="differ from the plan"):
        pack_bucket(bucket, iter({"a": torch.zeros(4), "b": torch.zeros(5)}.items()), "cpu")
    with pytest.raises(ValueError, match="differ from the plan"):
        pack_bucket(bucket, iter({"a": torch.zeros(4)}.items()), "cpu")  # one missing


def test_group_ranks_trainer_first_then_each_engines_workers():
    assert engine_rank_offsets(["engine-0", "engine-1", "engine-2"], 4) == {
        "engine-0": 1, "engine-1": 5, "engine-2": 9}
    assert engine_rank_offsets(["e"], 1) == {"e": 1}


def test_rendezvous_listens_on_the_given_host_with_a_free_port():
    sock = open_listen_socket("127.0.0.1")
    try:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
        with socket.create_connection((host, port), timeout=5):
            pass  # an engine can reach it before the store starts
    finally:
        sock.close()
    with pytest.raises(ValueError, match="wildcard"):
        open_listen_socket("0.0.0.0")


def test_transport_follows_the_config():
    assert resolve_transport(load_config("quickstart.yaml")) == "cpu"
    gpu = load_config("swe_grpo.yaml")
    assert resolve_transport(gpu) == "nccl"
    assert build_transport(load_config("quickstart.yaml")) is None  # rank 0 sends the bytes itself
    transport = build_transport(gpu, sender=object())  # type: ignore[arg-type]
    assert isinstance(transport, BroadcastTransport)
    assert transport.timeout_s == gpu.sync.timeout_s
    with pytest.raises(ValueError, match="sender"):
        build_transport(gpu)
    gloo = build_config({"sync": {"transport": "gloo"}})
    assert resolve_transport(gloo) == "gloo"
    assert isinstance(build_transport(gloo, sender=object()), BroadcastTransport)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gloo broadcasts CPU tensors"):
        build_config({"cluster": {"device": "cuda"}, "sync": {"transport": "gloo"}})
    assert resolve_transport(build_config({"cluster": {"device": "cuda"},
                                           "sync": {"transport": "cpu"}})) == "cpu"


def test_nccl_on_cpu_is_rejected_naming_the_fix():
    with pytest.raises(ValueError, match="sync.transport"):
        build_config({"cluster": {"device": "cpu"}, "sync": {"transport": "nccl"}})
    # resolve_transport says the same for a config that skipped the schema checks
    cfg = load_config("quickstart.yaml")
    object.__setattr__(cfg.sync, "transport", "nccl")
    with pytest.raises(ValueError, match="set sync.transport=cpu"):
        resolve_transport(cfg)


def test_a_deadline_bounds_every_wait_and_then_refuses():
    from rollout.weight_group import Deadline, wait_for_event

    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within"):
        wait_for_event(lambda: False, 0.05, 0.005)  # a broadcast that never completes
    assert time.monotonic() - start < 1.0
    polls = iter([False, False, True])
    wait_for_event(lambda: next(polls), 5.0, 0.001)  # returns once done
    deadline = Deadline(0.05)
    assert 0 < deadline.remaining_s() <= 0.05
    time.sleep(0.06)
    with pytest.raises(TimeoutError, match="sync.timeout_s=0.05"):
        deadline.remaining_s()


class FakeRankZero:
    """Stands in for train rank 0's BroadcastPusher: replays scripted outcomes and
    records which engines each attempt was asked to push to."""

    def __init__(self, outcomes):
        self.outcomes = list(outcomes)
        self.asked: list[tuple[str, ...]] = []

    async def push_broadcast(self, version, engines, verify):
        self.asked.append(tuple(engines))
        return self.outcomes.pop(0)


def outcome(served, failures=(), **errors):
    from trainer.train.weight_sync_nccl import BroadcastOutcome

    return BroadcastOutcome(7, 1000, 0.0, 0.1, tuple(served), tuple(failures), **errors)


def fake_router(names):
    from rollout.router import Router

    return Router({n: object() for n in names})  # type: ignore[misc]


def test_the_driver_drops_gone_engines_and_pushes_again_to_the_rest():
    from trainer.train.weight_sync_nccl import BroadcastTransport, EngineFailure

    router = fake_router(["e0", "e1", "e2"])
    rank0 = FakeRankZero([
        outcome([], [EngineFailure("e1", "RayActorError: died", gone=True),
                     EngineFailure("e0", "WeightGroupError: reset by peer", gone=False),
                     EngineFailure("e2", "WeightGroupError: reset by peer", gone=False)]),
        outcome(["e0", "e2"])])
    result = asyncio.run(BroadcastTransport(rank0, timeout_s=5).push(router, 7))
    assert rank0.asked == [("e0", "e1", "e2"), ("e0", "e2")]  # the second group is smaller
    assert router.engine_names == ("e0", "e2") and router.stats().failed_engines == ("e1",)
    assert (result.version, result.engines, result.failed_engines, result.attempts) == (
        7, ("e0", "e2"), ("e1",), 2)


def test_an_engine_gone_after_taking_nothing_does_not_need_a_second_push():
    from trainer.train.weight_sync_nccl import BroadcastTransport, EngineFailure

    router = fake_router(["e0", "e1"])
    rank0 = FakeRankZero([outcome(["e0"], [EngineFailure("e1", "no answer", gone=True)])])
    result = asyncio.run(BroadcastTransport(rank0, timeout_s=5).push(router, 7))
    assert (result.engines, result.failed_engines, result.attempts) == (("e0",), ("e1",), 1)
    assert router.engine_names == ("e0",)


def test_a_push_fails_loudly_when_rank_zero_breaks_checksums_differ_or_attempts_run_out():
    from trainer.train.weight_sync import WeightSyncError
    from trainer.train.weight_sync_nccl import MAX_ATTEMPTS, BroadcastTransport, EngineFailure

    cases = [([outcome([], sender_error="ValueError: weights to send differ from the plan")],
              "differ from the plan"),
             ([outcome(["e0", "e1"], verify_error="engines ['e1'] serve other weights")],
              "serve other weights"),
             ([outcome(["e0"], [EngineFailure("e1", "WeightGroupError: x", gone=False)])] * MAX_ATTEMPTS,
              f"in {MAX_ATTEMPTS} attempts")]
    for outcomes, message in cases:
        rank0 = FakeRankZero(outcomes)
        with pytest.raises(WeightSyncError, match=message):
            asyncio.run(BroadcastTransport(rank0, timeout_s=5).push(fake_router(["e0", "e1"]), 7))
        assert not rank0.outcomes  # no attempt beyond the scripted ones


class RacingWork:
    """A c10d Work whose op finishes just after a wait's slice ran out: that wait raises
    "Operation timed out!" while is_completed() is already True (seen on a loaded machine:
    the healthy push of test_weight_group_faults failed so). `error`: the op's own failure."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.waits = error, 0

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        if timeout is not None and self.waits == 1:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.waits >= 1


class OneWorkGroup:
    def __init__(self, work: RacingWork) -> None:
        self.work = work

    def broadcast(self, tensors, options) -> RacingWork:
        return self.work


class NeverRaisedStore:
    def check(self, keys) -> bool:
        return False


def _broadcast_with(work: RacingWork) -> None:
    from rollout.weight_group import AbortFlag, GlooBroadcast

    comm = GlooBroadcast.__new__(GlooBroadcast)  # no process group: the stand-in's op
    comm._flag, comm._group = AbortFlag(NeverRaisedStore()), OneWorkGroup(work)
    comm.broadcast(torch.zeros(4), 0, timeout_s=5.0)


def test_a_broadcast_done_just_after_its_wait_slice_ran_out_succeeds():
    work = RacingWork()
    _broadcast_with(work)
    assert work.waits == 2  # the slice's timeout, then the op's own (successful) outcome


def test_a_broadcast_that_failed_just_after_its_wait_slice_ran_out_raises_its_own_error():
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        _broadcast_with(RacingWork(RuntimeError("Connection reset by peer")))


def test_only_the_rotary_layers_reload_warning_is_dropped():
    """vLLM warns "<Layer>: Failed to load weights" for every layer an in-place reload
    found nothing for: the rotary cache (never in a push) is harmless, any other is not."""
    import logging

    from rollout.weight_reload import quiet_rotary_reload_warning

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    quiet_rotary_reload_warning()
    quiet_rotary_reload_warning()  # once per process, however often a push calls it
    assert len(logger.filters) == 1

    def passes(layer: str) -> bool:
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1,
                                   "%s: Failed to load weights", (layer,), None)
        return logger.filter(record)
    assert not passes("RotaryEmbedding") and not passes("YaRNScalingRotaryEmbedding")
    assert passes("VocabParallelEmbedding") and passes("QKVParallelLinear")
