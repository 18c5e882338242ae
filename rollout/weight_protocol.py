"""The weight push protocol, the one format both ends share: train rank 0 sends
(`trainer.train.weight_sync`, `trainer.train.weight_sync_nccl`) and each vLLM worker
receives (`rollout.weight_reload`). What travels:

- on the CPU transport, the full state as safetensors bytes (`encode_state` /
  `decode_state`);
- on the broadcast transports, a bucket plan over the rpc (`plan_buckets`, `encode_plan` /
  `decode_plan`: names, shapes, dtypes, byte offsets), then each bucket as one flat byte
  buffer through the weight group (`pack_bucket` / `unpack_bucket`);
- after either, a checksum of a few tensors both sides hold under the same name and shape
  (`choose_checksum_names`, `checksum_tensors`), so an engine serving other weights is
  caught.

It sits in rollout, the lower of the two ends' packages: the engines define what they
accept, and the trainer imports it from below. torch is imported inside the functions
that use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ALIGN_BYTES = 64  # every tensor starts at an offset any dtype can be viewed from
MAX_CHECKSUM_TENSORS = 4
TensorSpec = tuple[str, tuple[int, ...], str, int]  # name, full shape, dtype name, element size


# --- CPU transport: the whole state as bytes -----------------------------------------------

def encode_state(state: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of a state dict (CPU, contiguous copies)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in state.items()})


def decode_state(blob: bytes) -> dict[str, torch.Tensor]:
    """The state dict `encode_state` wrote."""
    from safetensors.torch import load

    return load(blob)


# --- checksum: which tensors, and their digest ---------------------------------------------

def choose_checksum_names(names_ndims: Iterable[tuple[str, int]]) -> list[str]:
    """Tensors both sides hold under the same name and shape: engines fuse projections and
    pad vocabularies, but keep norm weights as they are. Takes (name, ndim) pairs."""
    names = [n for n, ndim in names_ndims if ndim == 1 and n.endswith("norm.weight")]
    if not names:
        raise ValueError("no norm weights to checksum in the pushed state; cannot verify")
    step = max(1, len(names) // MAX_CHECKSUM_TENSORS)
    return names[::step][:MAX_CHECKSUM_TENSORS]


def checksum_tensors(named: Mapping[str, torch.Tensor], names: Sequence[str]) -> str:
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


def expected_checksum(state: Mapping[str, torch.Tensor]) -> tuple[list[str], str]:
    """The tensors engines are asked to checksum after a push of `state`, and the digest
    they must give."""
    names = choose_checksum_names((n, t.ndim) for n, t in state.items())
    return names, checksum_tensors(state, names)


# --- broadcast transports: the bucket plan and its byte buffers ------------------------------

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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
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
            numel *= dim
        num_bytes = numel * element_size
        offset = _align(end)
        if slots and offset + num_bytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), end))
            slots, offset = [], 0
        slots.append(TensorSlot(name, tuple(shape), dtype, offset, num_bytes))
        end = offset + num_bytes
    if slots:
        buckets.append(Bucket(tuple(slots), end))
    return tuple(buckets)


def specs_of(state: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """(name, shape, dtype name, element size) of each tensor of `state`, in its order."""
    return [(name, tuple(t.shape), dtype_name(t.dtype), t.element_size()) for name, t in state.items()]


def plan_state_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> tuple[Bucket, ...]:
    """`plan_buckets` over a name -> tensor mapping, in its order."""
    return plan_buckets(specs_of(state), bucket_bytes)


# The plan on the wire is plain rpc values (Any: lists, dicts, strings and ints of the
# shape below), turned back into typed Buckets on arrival by `decode_plan`.
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


def pack_bucket(bucket: Bucket, tensors: Iterator[tuple[str, torch.Tensor]],
                device: torch.device | str) -> torch.Tensor:
    """The bucket's byte buffer on `device`, filled from the next tensors of `tensors`,
    which must arrive in plan order with the planned shape and dtype."""
    import torch

    buffer = torch.empty(bucket.num_bytes, dtype=torch.uint8, device=device)
    for slot in bucket.slots:
        item = next(tensors, None)
        got = None if item is None else (item[0], tuple(item[1].shape), dtype_name(item[1].dtype))
        if item is None or got != (slot.name, slot.shape, slot.dtype):
            raise ValueError(f"weights to send differ from the plan: expected "
                             f"{(slot.name, slot.shape, slot.dtype)}, got {got}")
        raw = item[1].detach().to(device).contiguous().reshape(-1).view(torch.uint8)
        buffer[slot.offset:slot.offset + slot.num_bytes].copy_(raw)
    return buffer


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a received buffer, in plan order."""
    for slot in bucket.slots:
        raw = buffer[slot.offset:slot.offset + slot.num_bytes]
        yield slot.name, raw.view(_torch_dtype(slot.dtype)).reshape(slot.shape)
