"""Broadcast weight transport: train rank 0 sends every weight bucket to all engine
workers through one communicator of its own (NCCL on GPUs; gloo on CPUs, for tests).

The group is formed once, on the first push, outside torch.distributed's default group
(which DeepSpeed owns): rank 0 is the trainer, engine i's workers are ranks
1 + i*tp .. i*tp + tp, world size 1 + num_engines * tp. The trainer binds the rendezvous
socket itself (no port race) and sends host and port to the engines over the Ray control
calls. Each push then sends the bucket plan (names, shapes, dtypes, offsets) over those
calls and the tensors through the group, one `sync.bucket_mb` buffer at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rollout.weight_reload import (
    SENDER_RANK,
    CommBackend,
    build_weight_communicator,
    decode_plan,
    encode_plan,
    pack_bucket,
    plan_state_buckets,
)
from trainer.weight_sync import SentWeights, WeightSyncError

if TYPE_CHECKING:
    import torch

    from rollout.router import Router

T = TypeVar("T")


def open_listen_socket(host: str) -> socket.socket:
    """A listening TCP socket on `host` and a free port the kernel picks; rank 0 serves
    the rendezvous store from it. `host` must be an address engines can reach (the train
    rank's node address), not a wildcard."""
    if host in ("", "0.0.0.0", "::"):
        raise ValueError(f"rendezvous host {host!r} is a wildcard; pass the node's address")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


def engine_rank_offsets(engine_names: Sequence[str], tp_size: int) -> dict[str, int]:
    """Rank of each engine's first worker in the group (rank 0 is the trainer)."""
    return {name: 1 + i * tp_size for i, name in enumerate(engine_names)}


class WeightSender:
    """Rank 0 of the group, in the process that holds the weights (train rank 0)."""

    def __init__(self, backend: CommBackend, device: Any, timeout_s: float) -> None:
        self.backend, self.device, self.timeout_s = backend, device, timeout_s
        self._socket: socket.socket | None = None
        self._address: tuple[str, int] | None = None
        self._comm: Any = None

    def listen(self, host: str) -> tuple[str, int]:
        self._socket = open_listen_socket(host)
        self._address = (host, int(self._socket.getsockname()[1]))
        return self._address

    def connect(self, world_size: int) -> None:
        """Blocks until every engine worker joined (their init calls run concurrently)."""
        if self._address is None:
            raise RuntimeError("WeightSender.connect before listen")
        host, port = self._address
        with self._on_device():
            self._comm = build_weight_communicator(self.backend, host, port, SENDER_RANK, world_size,
                                                   self.device, self.timeout_s,
                                                   listen_socket=self._socket)
        self._socket = None  # the store owns it now

    def _on_device(self) -> contextlib.AbstractContextManager:
        """NCCL runs on the current CUDA device's stream; a caller thread may have another."""
        if not str(self.device).startswith("cuda"):
            return contextlib.nullcontext()
        import torch

        return torch.cuda.device(self.device)

    def send(self, wire: list[dict[str, Any]], tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast `tensors` (in plan order) bucket by bucket; returns bytes sent."""
        if self._comm is None:
            raise RuntimeError("WeightSender.send before connect")
        source = iter(tensors)
        sent = 0
        with self._on_device():
            for bucket in decode_plan(wire):
                self._comm.broadcast(pack_bucket(bucket, source, self.device), src=SENDER_RANK)
                sent += bucket.num_bytes
            if str(self.device).startswith("cuda"):
                import torch

                torch.cuda.current_stream(self.device).synchronize()
        extra = next(source, None)
        if extra is not None:
            raise ValueError(f"weights to send hold {extra[0]!r} and more beyond the plan")
        return sent


class WeightSenderClient(Protocol):
    """How the transport drives rank 0: a Ray train group or a sender in this process."""

    async def open_weight_group(self, backend: CommBackend, timeout_s: float) -> tuple[str, int]: ...
    async def connect_weight_group(self, world_size: int) -> None: ...
    async def send_weights(self, wire: list[dict[str, Any]]) -> None: ...


class LocalSender:
    """A WeightSender in this process (threads keep the event loop free), sending what
    `source` yields; for single-process use and the CPU tests of the broadcast path."""

    def __init__(self, source: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                 host: str = "127.0.0.1", device: Any = "cpu") -> None:
        self._source, self._host, self._device = source, host, device
        self._sender: WeightSender | None = None

    async def open_weight_group(self, backend: CommBackend, timeout_s: float) -> tuple[str, int]:
        self._sender = WeightSender(backend, self._device, timeout_s)
        return self._sender.listen(self._host)

    async def connect_weight_group(self, world_size: int) -> None:
        assert self._sender is not None
        await asyncio.to_thread(self._sender.connect, world_size)

    async def send_weights(self, wire: list[dict[str, Any]]) -> None:
        assert self._sender is not None
        await asyncio.to_thread(self._sender.send, wire, self._source())


class BroadcastTransport:
    """Pushes through the broadcast group; joins it on the first push."""

    def __init__(self, sender: WeightSenderClient, backend: CommBackend, bucket_bytes: int,
                 tp_size: int, timeout_s: float) -> None:
        self.sender, self.backend = sender, backend
        self.bucket_bytes, self.tp_size, self.timeout_s = bucket_bytes, tp_size, timeout_s
        self._engines: tuple[str, ...] | None = None
        self._broken: str | None = None  # why an earlier collective failed

    async def _both(self, trainer_side: Awaitable[Any], engine_side: Awaitable[T], what: str) -> T:
        """Run the trainer's and the engines' halves of a collective together and wait for
        both (bounded by sync.timeout_s): when one half fails, the other is stuck in the
        group until its own timeout, and its outcome belongs in the error."""
        trainer = asyncio.ensure_future(trainer_side)
        engines = asyncio.ensure_future(engine_side)
        await asyncio.wait([trainer, engines], timeout=self.timeout_s)
        problems = []
        for side, task in (("trainer", trainer), ("engines", engines)):
            if not task.done():
                task.cancel()
                problems.append(f"{side}: still in the broadcast group after "
                                f"sync.timeout_s={self.timeout_s}")
            elif task.exception() is not None:
                problems.append(f"{side}: {type(task.exception()).__name__}: {task.exception()}")
        if problems:
            self._broken = f"{what} failed"
            cause = next((t.exception() for t in (trainer, engines)
                          if t.done() and not t.cancelled() and t.exception()), None)
            raise WeightSyncError(f"{what} failed; " + "; ".join(problems)) from cause
        return engines.result()

    async def join(self, router: Router) -> None:
        names = router.engine_names
        offsets = engine_rank_offsets(names, self.tp_size)
        world_size = 1 + len(names) * self.tp_size
        host, port = await self.sender.open_weight_group(self.backend, self.timeout_s)
        ranks = await self._both(
            self.sender.connect_weight_group(world_size),
            router.init_weight_group_all(host, port, offsets, world_size, self.backend, self.timeout_s),
            f"forming the {self.backend} weight group at {host}:{port}")
        joined = sorted(r for worker_ranks in ranks.values() for r in worker_ranks)
        if joined != list(range(1, world_size)):
            raise WeightSyncError(f"engine workers joined the weight group as ranks {joined}, "
                                  f"expected 1..{world_size - 1} (is rollout.tp_size right?)")
        self._engines = names

    async def send(self, router: Router, state: Mapping[str, torch.Tensor],
                   version: int) -> SentWeights:
        if self._broken is not None:
            raise WeightSyncError(f"the weight group is out of step since {self._broken}; "
                                  "restart the run (from its last checkpoint)")
        if self._engines is None:
            await self.join(router)
        elif router.engine_names != self._engines:
            raise WeightSyncError(f"the weight group was formed with engines {self._engines}, now "
                                  f"{router.engine_names} are live; a broadcast would wait for "
                                  "the missing ones forever")
        start = time.monotonic()
        wire = encode_plan(plan_state_buckets(state, self.bucket_bytes))
        plan_s = time.monotonic() - start
        await self._both(self.sender.send_weights(wire), router.receive_weights_all(version, wire),
                         f"pushing version {version}")
        return SentWeights(sum(b["num_bytes"] for b in wire), plan_s)
