"""vLLM worker extension that loads pushed weights in place, and the bucket format both
ends of a collective weight push share.

vLLM imports `WeightReloadExtension` into each of its workers (`worker_extension_cls`);
the engine calls its methods through `collective_rpc`. Tensors cannot travel as rpc
arguments (they arrive as lists), so weights come as safetensors bytes, a folder path, or
through a broadcast group: train rank 0 is rank 0 and every engine worker a receiver.
Only the bucket plan (names, shapes, dtypes, byte offsets) travels through the rpc; each
bucket is one flat byte buffer broadcast in one collective call.
torch, vllm and NCCL are imported inside the functions that use them.
"""

from __future__ import annotations

import hashlib
import socket
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


class WeightCommunicator(Protocol):
    """One broadcast group; vLLM's PyNcclCommunicator on GPUs, gloo on CPUs."""

    def broadcast(self, tensor: Any, src: int) -> None: ...


class GlooBroadcast:
    """Broadcast over a gloo process group that lives outside torch.distributed's
    default group (CPU tensors)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo

        self._group = ProcessGroupGloo(PrefixStore("sluice/weights", store), rank, world_size,
                                       timedelta(seconds=timeout_s))

    def broadcast(self, tensor: Any, src: int) -> None:
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        self._group.broadcast([tensor], options).wait()


def build_weight_communicator(backend: CommBackend, host: str, port: int, rank: int,
                              world_size: int, device: Any, timeout_s: float,
                              listen_socket: socket.socket | None = None) -> WeightCommunicator:
    """Join the weight broadcast group through a TCP store at host:port, which rank 0
    serves (from `listen_socket` when given). Blocks until all `world_size` ranks joined."""
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                         store_timeout=int(timeout_s), listen_socket=listen_socket)
    if backend == "gloo":
        return GlooBroadcast(group.store, rank, world_size, timeout_s)
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    comm = PyNcclCommunicator(group, device=device)
    if comm.disabled:
        # PyNccl turns itself into a no-op when it cannot load NCCL; a silent no-op
        # broadcast would leave the engines on old weights.
        raise RuntimeError(f"NCCL is not available in this process (device {device}); "
                           "use sync.transport=cpu")
    return comm


class BucketReceiver:
    """Receives the planned buckets one at a time, as its iterator is consumed."""

    def __init__(self, comm: WeightCommunicator, buckets: Sequence[Bucket], device: Any) -> None:
        self._comm, self._buckets, self._device = comm, buckets, device
        self._next = 0
        self._broken = False  # a broadcast failed: the group is out of step for good

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        while self._next < len(self._buckets):
            yield from unpack_bucket(self._buckets[self._next], self._receive_next())

    def _receive_next(self) -> Any:
        import torch

        bucket = self._buckets[self._next]
        self._next += 1
        buffer = torch.empty(bucket.num_bytes, dtype=torch.uint8, device=self._device)
        try:
            self._comm.broadcast(buffer, src=SENDER_RANK)
        except BaseException:
            self._broken = True
            raise
        return buffer

    def drain(self) -> int:
        """Receive the buckets the loader did not ask for (the sender blocks until every
        rank took every bucket); returns how many there were."""
        left = len(self._buckets) - self._next
        while self._next < len(self._buckets) and not self._broken:
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
        """Join the trainer's broadcast group as rank `rank_offset + self.rank`; returns it."""
        rank = rank_offset + self.rank  # type: ignore[attr-defined]
        self._sluice_comm = build_weight_communicator(backend, host, port, rank, world_size,
                                                      self.device, timeout_s)  # type: ignore[attr-defined]
        return rank

    def sluice_receive_weights(self, wire: list[dict[str, Any]]) -> None:
        """Receive the planned buckets from the trainer and load them in place, one bucket
        in memory at a time."""
        comm = getattr(self, "_sluice_comm", None)
        if comm is None:
            raise RuntimeError("sluice_receive_weights before sluice_init_weight_group")
        receiver = BucketReceiver(comm, decode_plan(wire), self.device)  # type: ignore[attr-defined]
        try:
            self.model_runner.reload_weights(weights_iterator=iter(receiver))  # type: ignore[attr-defined]
        finally:
            unread = receiver.drain()  # keeps the group in step even when loading failed
        if unread:
            raise RuntimeError(f"the model loader stopped before {unread} weight buckets")

    def sluice_checksum(self, names: list[str]) -> str:
        """Digest of the served parameters `names` (vLLM's own, possibly fused, names)."""
        params = dict(self.model_runner.get_model().named_parameters())  # type: ignore[attr-defined]
        missing = [n for n in names if n not in params]
        if missing:
            raise KeyError(f"engine has no parameters {missing}")
        return checksum_tensors(params, names)
