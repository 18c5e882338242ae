"""The weight broadcast group when a receiver hangs or dies mid-push, in real processes
over real gloo: rank 0 is the trainer's WeightSender, each receiver a process running
the engine workers' own receive code (join_weight_group, BucketReceiver, the push
deadline). Whatever happens to the victim, rank 0 and the surviving receivers leave
the group within sync.timeout_s instead of waiting in a collective, and a new group with
the survivors (new rendezvous, smaller world) delivers the weights intact. A hung victim
costs the deadline; a dead one costs the time until rank 0 hears of it (from Ray, in the
system) and aborts, which every survivor sees through the group store.

The push is 8 buckets of 4 MiB, more than the sockets buffer, so rank 0 is blocked
inside a broadcast to the victim when it stops (SIGSTOP: hung) or dies (SIGKILL)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from rollout.weight_group import Deadline, WeightGroupError
from rollout.weight_protocol import checksum_tensors, decode_plan, encode_plan, plan_state_buckets
from rollout.weight_reload import BucketReceiver, join_weight_group
from trainer.train.weight_sync_nccl import WeightSender

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


def stand_in(commands, replies) -> None:
    """An engine worker's weight-group half: join when told, receive when told (stopping
    itself after `stop_after` tensors if asked), report the checksum or the failure."""
    comm = None
    while True:
        command = commands.get()
        if command[0] == "join":
            _, host, port, rank, world_size, timeout_s = command
            start = time.monotonic()
            try:
                comm = join_weight_group("gloo", host, port, rank, world_size, "cpu", timeout_s)
                replies.put(("joined", rank))
            except WeightGroupError as exc:
                replies.put(("not joined", str(exc), time.monotonic() - start))
        elif command[0] == "receive":
            _, wire, timeout_s, stop_after, delay_s = command
            time.sleep(delay_s)  # a slow receiver: the others wait for it, across slices
            start, got = time.monotonic(), {}
            receiver = BucketReceiver(comm, decode_plan(wire), "cpu", Deadline(timeout_s))
            try:
                for name, tensor in receiver:
                    got[name] = tensor.clone()
                    if len(got) == stop_after:
                        os.kill(os.getpid(), signal.SIGSTOP)
                replies.put(("ok", checksum_tensors(got, sorted(got)), time.monotonic() - start))
            except WeightGroupError as exc:
                comm = None  # the group is gone, as in WeightReloadExtension
                replies.put(("failed", str(exc), time.monotonic() - start))
        else:
            return


class Receivers:
    def __init__(self, n: int) -> None:
        # Forked from one clean process that imported torch once: forking this one could
        # copy a lock held by a thread an earlier abort left behind.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "rollout.weight_reload"])
        self.queues = [(ctx.Queue(), ctx.Queue()) for _ in range(n)]
        self.procs = [ctx.Process(target=stand_in, args=q, daemon=True) for q in self.queues]
        for p in self.procs:
            p.start()

    def form_group(self, members: list[int], timeout_s: float) -> WeightSender:
        """A new group: rank 0 here, receiver members[i] as rank i + 1."""
        sender = WeightSender("gloo", "cpu", timeout_s)
        host, port = sender.listen("127.0.0.1")
        for rank, i in enumerate(members, start=1):
            self.queues[i][0].put(("join", host, port, rank, len(members) + 1, timeout_s))
        sender.connect(len(members) + 1)
        assert sorted(self.queues[i][1].get(timeout=30)[1] for i in members) == list(
            range(1, len(members) + 1))
        return sender

    def reply(self, i: int, timeout_s: float = 30) -> tuple:
        return self.queues[i][1].get(timeout=timeout_s)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)


@pytest.fixture
def weights():
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(MiB, generator=gen) for i in range(8)}  # 4 MiB each


@pytest.mark.parametrize("fault", ["hangs", "dies"])
def test_a_receiver_that_hangs_or_dies_mid_push_frees_every_rank_within_the_bound(weights, fault):
    timeout_s = 4.0 if fault == "hangs" else 60.0  # a dead peer must not need the deadline
    buckets = plan_state_buckets(weights, 4 * MiB)
    wire = encode_plan(buckets)
    assert len(buckets) == 8
    receivers = Receivers(3)
    victim, survivors = 2, [0, 1]
    try:
        sender = receivers.form_group([0, 1, 2], timeout_s)
        for i in range(3):
            receivers.queues[i][0].put(("receive", wire, timeout_s, 1 if i == victim else None, 0))
        if fault == "dies":
            # Ray reports the engine dead; rank 0's pusher then aborts the group (its
            # blocked send, and through the store's abort mark every survivor's wait).
            def kill_then_abort():
                time.sleep(1.0)
                os.kill(receivers.procs[victim].pid, signal.SIGKILL)
                sender.drop()
            threading.Thread(target=kill_then_abort, daemon=True).start()
        start = time.monotonic()
        with pytest.raises(WeightGroupError, match="group aborted"):
            sender.send(buckets, iter(weights.items()), Deadline(timeout_s))
        rank0_s = time.monotonic() - start
        assert not sender.connected
        # Slack for a loaded machine (three test workers on two cores); a rank stuck in a
        # collective would never come back, and "dies" stays far below its 60 s deadline.
        bound_s = timeout_s + 10 if fault == "hangs" else 20
        assert rank0_s < bound_s
        for i in survivors:
            status, message, seconds = receivers.reply(i)
            assert status == "failed", message
            assert seconds < bound_s
        if fault == "hangs":
            os.kill(receivers.procs[victim].pid, signal.SIGKILL)

        # The survivors, in the same processes, form a smaller group and get everything,
        # though one starts late (rank 0 waits for it over several wait slices). A healthy
        # push gets a deadline no loaded machine reaches: this half checks delivery.
        healthy_s = 60.0
        sender = receivers.form_group(survivors, healthy_s)
        for i in survivors:
            receivers.queues[i][0].put(("receive", wire, healthy_s, None, 0.5 if i == 0 else 0))
        assert sender.send(buckets, iter(weights.items()), Deadline(healthy_s)) == 32 * MiB
        expected = checksum_tensors(weights, sorted(weights))
        assert [receivers.reply(i)[:2] for i in survivors] == [("ok", expected)] * 2
        print(f"\n{fault}: rank 0 left the group after {rank0_s:.2f}s (sync.timeout_s={timeout_s})")
    finally:
        receivers.close()


def test_forming_a_group_stops_waiting_for_a_missing_rank_once_rank_zero_gives_up():
    """An engine that dies before joining (Ray tells rank 0, which drops the group):
    rank 0 and the engines that joined stop waiting for it at once, not at the deadline."""
    timeout_s = 60.0
    receivers = Receivers(2)
    try:
        sender = WeightSender("gloo", "cpu", timeout_s)
        host, port = sender.listen("127.0.0.1")
        receivers.queues[0][0].put(("join", host, port, 1, 3, timeout_s))  # rank 2 never comes
        threading.Timer(1.0, sender.drop).start()
        start = time.monotonic()
        with pytest.raises(WeightGroupError, match="another rank aborted"):
            sender.connect(3)
        assert time.monotonic() - start < 20  # far below the 60 s deadline, even loaded
        status, message, seconds = receivers.reply(0)
        assert status == "not joined" and "aborted" in message and seconds < 20
    finally:
        receivers.close()
