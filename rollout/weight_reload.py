"""vLLM worker extension that loads pushed weights in place, and the bucket format both
ends of a collective weight push share.

vLLM imports `WeightReloadExtension` into each of its workers (`worker_extension_cls`);
the engine calls its methods through `collective_rpc`. Tensors cannot travel as rpc
arguments (they arrive as lists), so weights come as safetensors bytes, a folder path, or
through a broadcast group: train rank 0 is rank 0 and every engine worker a receiver.
Only the bucket plan (names, shapes, dtypes, byte offsets) travels through the rpc; each
bucket is one flat byte buffer broadcast in one collective call.

Every collective on the weight group is bounded inside the process that runs it: a push
has one deadline (`sync.timeout_s`) and each broadcast waits at most for what is left of
it. A broadcast that fails or runs out of time aborts the communicator (gloo's
`ProcessGroup.abort`, NCCL's `ncclCommAbort`) and the process drops the group, so no
rank stays blocked in it; the next push forms a new group with the ranks that are left.
torch, vllm and NCCL are imported inside the functions that use them.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol

CommBackend = Literal["nccl", "gloo"]
ALIGN_BYTES = 64  # every tensor starts at an offset any dtype can be viewed from
SENDER_RANK = 0


def checksum_tensors(named: dict[str, Any], names: list[str]) -> str:
    """sha256 over the raw bytes of the named tensors (fp32 view), in the given order.

    The trainer computes the same digest over the weights it pushed; a mismatch means an
    engine serves different weights than the trainer believes.
    """
    digest = hashlib.sha256()
    for name in names:
        tensor = named[name].detach().to("cpu").contiguous().float()
        digest.update(name.encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor lives inside its bucket's byte buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    offset: int  # bytes from the start of the bucket, a multiple of ALIGN_BYTES
    num_bytes: int


@dataclass(frozen=True, slots=True)
class Bucket:
    slots: tuple[TensorSlot, ...]
    num_bytes: int  # buffer size: the end of the last slot


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise ValueError(f"unknown tensor dtype {name!r} in a weight bucket plan")


def _align(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def plan_buckets(tensors: Iterable[tuple[str, Sequence[int], str, int]],
                 bucket_bytes: int) -> tuple[Bucket, ...]:
    """Group (name, shape, dtype name, element size) into buckets of at most `bucket_bytes`,
    keeping the order; a tensor larger than the budget gets a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    end = 0
    for name, shape, dtype, element_size in tensors:
        numel = 1
        for dim in shape:
            numel *= int(dim)
        num_bytes = numel * element_size
        offset = _align(end)
        if slots and offset + num_bytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), end))
            slots, offset = [], 0
        slots.append(TensorSlot(name, tuple(int(d) for d in shape), dtype, offset, num_bytes))
        end = offset + num_bytes
    if slots:
        buckets.append(Bucket(tuple(slots), end))
    return tuple(buckets)


def plan_state_buckets(state: Any, bucket_bytes: int) -> tuple[Bucket, ...]:
    """`plan_buckets` over a name -> tensor mapping, in its order."""
    return plan_buckets(((name, tuple(t.shape), dtype_name(t.dtype), t.element_size())
                         for name, t in state.items()), bucket_bytes)


def encode_plan(buckets: Sequence[Bucket]) -> list[dict[str, Any]]:
    """Plain lists, dicts, strings and ints: what survives vLLM's rpc serialisation."""
    return [{"num_bytes": b.num_bytes,
             "tensors": [[s.name, list(s.shape), s.dtype, s.offset, s.num_bytes] for s in b.slots]}
            for b in buckets]


def decode_plan(wire: Sequence[dict[str, Any]]) -> tuple[Bucket, ...]:
    return tuple(Bucket(tuple(TensorSlot(str(name), tuple(int(d) for d in shape), str(dtype),
                                         int(offset), int(num_bytes))
                              for name, shape, dtype, offset, num_bytes in b["tensors"]),
                        int(b["num_bytes"]))
                 for b in wire)


def pack_bucket(bucket: Bucket, tensors: Iterator[tuple[str, Any]], device: Any) -> Any:
    """The bucket's byte buffer on `device`, filled from the next tensors of `tensors`,
    which must arrive in plan order with the planned shape and dtype."""
    import torch

    buffer = torch.empty(bucket.num_bytes, dtype=torch.uint8, device=device)
    for slot in bucket.slots:
        name, tensor = next(tensors, (None, None))
        if name != slot.name or tuple(tensor.shape) != slot.shape or dtype_name(tensor.dtype) != slot.dtype:
            got = None if name is None else (name, tuple(tensor.shape), dtype_name(tensor.dtype))
            raise ValueError(f"weights to send differ from the plan: expected "
                             f"{(slot.name, slot.shape, slot.dtype)}, got {got}")
        raw = tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        buffer[slot.offset:slot.offset + slot.num_bytes].copy_(raw)
    return buffer


def unpack_bucket(bucket: Bucket, buffer: Any) -> Iterator[tuple[str, Any]]:
    """(name, tensor) views into a received buffer, in plan order."""
    for slot in bucket.slots:
        raw = buffer[slot.offset:slot.offset + slot.num_bytes]
        yield slot.name, raw.view(_torch_dtype(slot.dtype)).reshape(slot.shape)


class WeightGroupError(RuntimeError):
    """A collective on the weight group failed or ran out of time; this process has
    aborted its communicator and left the group."""


class Deadline:
    """The end of one push; each collective gets what is left of it."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._end = time.monotonic() + timeout_s

    def remaining_s(self) -> float:
        left = self._end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the weight push ran past sync.timeout_s={self.timeout_s}")
        return left


class WeightCommunicator(Protocol):
    """One broadcast group; gloo on CPUs, vLLM's PyNcclCommunicator on GPUs. `broadcast`
    returns within `timeout_s` or raises; `abort` unblocks and frees the group without
    the other ranks (idempotent)."""

    def broadcast(self, tensor: Any, src: int, timeout_s: float) -> None: ...
    def abort(self) -> None: ...


ABORT_KEY = "sluice/weights/abort"


class AbortFlag:
    """The group's shared "give up" mark, a key in its rendezvous store: a rank that
    aborts sets it, and every rank waiting in a broadcast checks it a few times a second.
    A dead peer does not always fail a pending send (gloo notices only on its next read),
    so without the mark the ranks still in step would wait for their own deadline."""

    CHECK_S = 0.1

    def __init__(self, store: Any) -> None:
        self._store = store
        self._next_check = 0.0

    def raised(self) -> bool:
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + self.CHECK_S
        try:
            return bool(self._store.check([ABORT_KEY]))
        except Exception:  # the store lives in rank 0: gone with it
            return True

    def raise_(self) -> None:
        try:
            self._store.set(ABORT_KEY, "1")
        except Exception:
            pass  # rank 0 (the store) is gone: the others find that out themselves


def wait_for_event(is_done: Any, timeout_s: float, poll_s: float,
                   aborted: Any = lambda: False) -> None:
    """Poll `is_done()` until it is true; TimeoutError after `timeout_s`, WeightGroupError
    as soon as `aborted()` (another rank gave up on the group)."""
    end = time.monotonic() + timeout_s
    while not is_done():
        if time.monotonic() >= end:
            raise TimeoutError(f"a weight broadcast did not finish within {timeout_s:.1f}s")
        if aborted():
            raise WeightGroupError("another rank aborted the weight group")
        time.sleep(poll_s)


class GlooBroadcast:
    """Broadcast over a gloo process group that lives outside torch.distributed's
    default group (CPU tensors). Waits in slices of AbortFlag.CHECK_S (gloo lets a timed
    out wait be waited on again), so a finished op returns at once and the abort mark is
    read between slices."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo

        self._flag = AbortFlag(store)
        self._group: Any = ProcessGroupGloo(PrefixStore("sluice/weights", store), rank,
                                            world_size, timedelta(seconds=timeout_s))

    def broadcast(self, tensor: Any, src: int, timeout_s: float) -> None:
        from torch.distributed import BroadcastOptions

        if self._group is None:
            raise WeightGroupError("broadcast on an aborted weight group")
        options = BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        work = self._group.broadcast([tensor], options)
        end = time.monotonic() + timeout_s
        while True:
            slice_s = min(AbortFlag.CHECK_S, end - time.monotonic())
            if slice_s <= 0:
                raise TimeoutError(f"a weight broadcast did not finish within {timeout_s:.1f}s")
            try:
                work.wait(timedelta(seconds=slice_s))
                return
            except RuntimeError as exc:  # what failed the op (a peer's reset), or the slice
                if work.is_completed() or "timed out" not in str(exc).lower():
                    raise
            if self._flag.raised():
                raise WeightGroupError("another rank aborted the weight group")

    def abort(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            self._flag.raise_()
            group.abort()  # closes every pair: an op still queued in gloo fails, not hangs


class NcclBroadcast:
    """PyNcclCommunicator with a CPU-side deadline: NCCL kernels wait for a dead peer
    forever, so the host polls an event recorded after the broadcast and aborts the
    communicator (ncclCommAbort, which also ends the kernel) when time is up or another
    rank gave up."""

    POLL_S = 0.002

    def __init__(self, comm: Any, store: Any) -> None:
        self._comm = comm
        self._flag = AbortFlag(store)

    def broadcast(self, tensor: Any, src: int, timeout_s: float) -> None:
        import torch

        if self._comm is None:
            raise WeightGroupError("broadcast on an aborted weight group")
        stream = torch.cuda.current_stream(tensor.device)
        self._comm.broadcast(tensor, src=src, stream=stream)
        done = torch.cuda.Event()
        done.record(stream)
        wait_for_event(done.query, timeout_s, self.POLL_S, self._flag.raised)

    def abort(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            self._flag.raise_()
            comm.destroy()  # ncclCommAbort on a helper thread, bounded by vLLM (5 s)


def join_weight_group(backend: CommBackend, host: str, port: int, rank: int, world_size: int,
                      device: Any, timeout_s: float) -> WeightCommunicator:
    """An engine worker joins the group whose store rank 0 serves at host:port."""
    return build_weight_communicator(backend, build_store(host, port, timeout_s), rank,
                                     world_size, device, timeout_s)


def build_weight_communicator(backend: CommBackend, store: Any, rank: int, world_size: int,
                              device: Any, timeout_s: float) -> WeightCommunicator:
    """Join the weight broadcast group through its store (`build_store`): wait until all
    `world_size` ranks arrived (at most `timeout_s`, less if a rank gives up), then build
    the communicator, which then finds every peer there."""
    wait_for_all_ranks(store, world_size, timeout_s)
    if backend == "gloo":
        return GlooBroadcast(store, rank, world_size, timeout_s)
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    comm = PyNcclCommunicator(StatelessProcessGroup(rank=rank, world_size=world_size, store=store),
                              device=device)
    if comm.disabled:
        # PyNccl turns itself into a no-op when it cannot load NCCL; a silent no-op
        # broadcast would leave the engines on old weights.
        raise RuntimeError(f"NCCL is not available in this process (device {device}); "
                           "use sync.transport=cpu")
    return NcclBroadcast(comm, store)


def build_store(host: str, port: int, timeout_s: float,
                listen_socket: socket.socket | None = None) -> Any:
    """The group's TCP store: rank 0 serves it from `listen_socket`, the other ranks
    connect to host:port. It carries the rendezvous and the abort mark."""
    from torch.distributed import TCPStore

    kwargs: dict[str, Any] = {}
    if listen_socket is not None:
        kwargs["master_listen_fd"] = listen_socket.detach()
    return TCPStore(host, port, None, listen_socket is not None, timedelta(seconds=timeout_s),
                    wait_for_workers=False, **kwargs)


ARRIVED_KEY = "sluice/weights/arrived"


def wait_for_all_ranks(store: Any, world_size: int, timeout_s: float) -> None:
    """Count this rank in and wait for the others, giving up at the abort mark (a rank
    that learnt a peer is gone) or after `timeout_s`: the collective set-up that follows
    would wait for a missing rank without a way out."""
    store.add(ARRIVED_KEY, 1)
    flag = AbortFlag(store)
    wait_for_event(lambda: int(store.add(ARRIVED_KEY, 0)) >= world_size, timeout_s, 0.02,
                   flag.raised)


def bounded_broadcast(comm: WeightCommunicator, tensor: Any, deadline: Deadline) -> None:
    """One broadcast from the sender within what is left of `deadline`; on any failure
    the communicator is aborted and WeightGroupError raised (the group is gone)."""
    try:
        comm.broadcast(tensor, SENDER_RANK, deadline.remaining_s())
    except BaseException as exc:
        abort_quietly(comm)
        raise WeightGroupError(f"weight broadcast failed, group aborted: "
                               f"{type(exc).__name__}: {str(exc)[:300]}") from exc


ABORT_WAIT_S = 1.0


def abort_quietly(comm: WeightCommunicator | None) -> None:
    """Abort `comm` on a helper thread, waiting at most ABORT_WAIT_S: gloo's abort waits
    for an op stuck sending to a dead peer (until gloo's own timeout), and leaving must
    not hold the caller. The abort mark is set first, so the other ranks know at once."""
    if comm is None:
        return
    thread = threading.Thread(target=_abort_logged, args=(comm,), daemon=True,
                              name="sluice-weight-group-abort")
    thread.start()
    thread.join(timeout=ABORT_WAIT_S)


def _abort_logged(comm: WeightCommunicator) -> None:
    import logging

    try:
        comm.abort()
    except Exception as exc:  # the group is being dropped anyway
        logging.getLogger(__name__).warning("aborting the weight group: %s", exc)


class BucketReceiver:
    """Receives the planned buckets one at a time, as its iterator is consumed, each
    within what is left of the push's deadline."""

    def __init__(self, comm: WeightCommunicator, buckets: Sequence[Bucket], device: Any,
                 deadline: Deadline) -> None:
        self._comm, self._buckets, self._device = comm, buckets, device
        self._deadline = deadline
        self._next = 0
        self.failure: WeightGroupError | None = None  # the group is gone after one

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        while self._next < len(self._buckets):
            yield from unpack_bucket(self._buckets[self._next], self._receive_next())

    def _receive_next(self) -> Any:
        import torch

        bucket = self._buckets[self._next]
        self._next += 1
        buffer = torch.empty(bucket.num_bytes, dtype=torch.uint8, device=self._device)
        try:
            bounded_broadcast(self._comm, buffer, self._deadline)
        except WeightGroupError as exc:
            self.failure = exc
            raise
        return buffer

    def drain(self) -> int:
        """Receive the buckets the loader did not ask for (the sender blocks until every
        rank took every bucket); returns how many there were."""
        left = len(self._buckets) - self._next
        while self._next < len(self._buckets) and self.failure is None:
            self._receive_next()
        return left


class WeightReloadExtension:
    """Methods mixed into vLLM's worker; `self.model_runner` is the worker's runner,
    `self.rank` its rank inside the engine and `self.device` its device."""

    def sluice_load_weights(self, blob: bytes | None = None, path: str | None = None) -> None:
        if (blob is None) == (path is None):
            raise ValueError("pass exactly one of blob (safetensors bytes) or path (a folder)")
        if path is not None:
            self.model_runner.reload_weights(weights_path=path)  # type: ignore[attr-defined]
            return
        from safetensors.torch import load

        state = load(blob)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))  # type: ignore[attr-defined]

    def sluice_init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                 backend: CommBackend, timeout_s: float) -> int:
        """Join the trainer's broadcast group as rank `rank_offset + self.rank`; returns it.
        A group this worker was in before is aborted first (the trainer formed a new one)."""
        self.sluice_drop_weight_group()
        rank = rank_offset + self.rank  # type: ignore[attr-defined]
        self._sluice_comm = join_weight_group(backend, host, port, rank, world_size,
                                              self.device, timeout_s)  # type: ignore[attr-defined]
        self._sluice_timeout_s = timeout_s
        return rank

    def sluice_drop_weight_group(self) -> None:
        abort_quietly(getattr(self, "_sluice_comm", None))
        self._sluice_comm = None

    def sluice_receive_weights(self, wire: list[dict[str, Any]]) -> None:
        """Receive the planned buckets from the trainer and load them in place, one bucket
        in memory at a time, within sync.timeout_s. When a broadcast fails the group is
        aborted and dropped, and this raises WeightGroupError: the weights are then partly
        loaded, and the trainer sends them again through a new group."""
        comm = getattr(self, "_sluice_comm", None)
        if comm is None:
            raise WeightGroupError("no weight group: sluice_receive_weights before "
                                   "sluice_init_weight_group, or the last push aborted it")
        receiver = BucketReceiver(comm, decode_plan(wire), self.device,  # type: ignore[attr-defined]
                                  Deadline(self._sluice_timeout_s))
        try:
            try:
                self.model_runner.reload_weights(weights_iterator=iter(receiver))  # type: ignore[attr-defined]
            finally:
                unread = receiver.drain()  # keeps the group in step even when loading failed
        except BaseException:
            if receiver.failure is None:
                raise
            self._sluice_comm = None  # aborted by the failed broadcast
            raise receiver.failure from None
        if unread:
            raise RuntimeError(f"the model loader stopped before {unread} weight buckets")

    def sluice_checksum(self, names: list[str]) -> str:
        """Digest of the served parameters `names` (vLLM's own, possibly fused, names)."""
        params = dict(self.model_runner.get_model().named_parameters())  # type: ignore[attr-defined]
        missing = [n for n in names if n not in params]
        if missing:
            raise KeyError(f"engine has no parameters {missing}")
        return checksum_tensors(params, names)
