"""vLLM worker extension that loads pushed weights in place: the receiving end of the
weight push (`rollout.weight_protocol` is the format, `rollout.weight_group` the
broadcast group; train rank 0 is the sending end).

vLLM imports `WeightReloadExtension` into each of its workers (`worker_extension_cls`);
the engine calls its methods through `collective_rpc`. Tensors cannot travel as rpc
arguments (they arrive as lists), so weights come as safetensors bytes, a folder path, or
through the broadcast group, where only the bucket plan travels through the rpc.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rollout.weight_group import (CommBackend, Deadline, WeightCommunicator, WeightGroupError,
                                  abort_quietly, bounded_broadcast, build_store,
                                  build_weight_communicator)
from rollout.weight_protocol import Bucket, checksum_tensors, decode_plan, decode_state, unpack_bucket
from rollout.worker_reply import ReplyWire, WorkerReply

log = logging.getLogger(__name__)


def join_weight_group(backend: CommBackend, host: str, port: int, rank: int, world_size: int,
                      device: Any, timeout_s: float) -> WeightCommunicator:
    """An engine worker joins the group whose store rank 0 serves at host:port."""
    return build_weight_communicator(backend, build_store(host, port, timeout_s), rank,
                                     world_size, device, timeout_s)


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


class _RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" of every in-place reload.
    A rotary layer holds only its cos/sin cache, computed from the model config; no
    checkpoint and no push carries it, so the reload finds nothing for it and vLLM puts
    the cache it had back (the warning's own fallback). Any other layer's warning stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        layer = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (record.msg == "%s: Failed to load weights" and isinstance(layer, str)
                    and layer.endswith("RotaryEmbedding"))


def quiet_rotary_reload_warning() -> None:
    """Install _RotaryReloadFilter on vLLM's reload logger (once per process)."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(_RotaryReloadFilter())


class WeightReloadExtension:
    """Methods mixed into vLLM's worker; `self.model_runner` is the worker's runner,
    `self.rank` its rank inside the engine and `self.device` its device.

    Each `sluice_*` method returns a `WorkerReply` as a tuple and never raises an
    Exception (`rollout.worker_reply` says why): every worker answers every call, and the
    engine raises once all have. KeyboardInterrupt and SystemExit still end the worker."""

    _sluice_comm: WeightCommunicator | None = None  # the broadcast group, once joined

    def _sluice_answer(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> ReplyWire:
        rank = self.rank  # type: ignore[attr-defined]
        try:
            return WorkerReply(rank, method(*args, **kwargs)).to_wire()
        except Exception as exc:  # the worker's one catch-all: the error travels as a value
            log.exception("TP worker %d: %s failed", rank, method.__name__.removeprefix("_"))
            return WorkerReply.failed(rank, exc).to_wire()

    def sluice_load_weights(self, blob: bytes | None = None, path: str | None = None) -> ReplyWire:
        return self._sluice_answer(self._sluice_load_weights, blob, path)

    def sluice_init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                 backend: CommBackend, timeout_s: float) -> ReplyWire:
        """Join the trainer's broadcast group as rank `rank_offset + self.rank`; answers it.
        A group this worker was in before is aborted first (the trainer formed a new one)."""
        return self._sluice_answer(self._sluice_init_weight_group, host, port, rank_offset,
                                   world_size, backend, timeout_s)

    def sluice_drop_weight_group(self) -> ReplyWire:
        return self._sluice_answer(self._sluice_drop_weight_group)

    def sluice_receive_weights(self, wire: list[dict[str, Any]]) -> ReplyWire:
        """Receive the planned buckets from the trainer and load them in place, one bucket
        in memory at a time, within sync.timeout_s. When a broadcast fails the group is
        aborted and dropped, and the answer is a WeightGroupError: the weights are then
        partly loaded, and the trainer sends them again through a new group."""
        return self._sluice_answer(self._sluice_receive_weights, wire)

    def sluice_checksum(self, names: list[str]) -> ReplyWire:
        """Digest of the served parameters `names` (vLLM's own, possibly fused, names)."""
        return self._sluice_answer(self._sluice_checksum, names)

    def _sluice_load_weights(self, blob: bytes | None, path: str | None) -> None:
        if (blob is None) == (path is None):
            raise ValueError("pass exactly one of blob (safetensors bytes) or path (a folder)")
        if blob is None:
            self._sluice_reload(weights_path=path)
            return
        state = decode_state(blob)
        self._sluice_reload(weights_iterator=iter(state.items()))

    def _sluice_reload(self, **source: Any) -> None:
        quiet_rotary_reload_warning()
        # The worker's own entry point (vLLM's Worker.reload_weights, which CPUWorker
        # inherits), not its model runner's: it sets the current vLLM config around the
        # reload, which quantized and other layers' weight loaders read.
        self.reload_weights(**source)  # type: ignore[attr-defined]

    def _sluice_init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                  backend: CommBackend, timeout_s: float) -> int:
        self._sluice_drop_weight_group()
        rank = rank_offset + self.rank  # type: ignore[attr-defined]
        self._sluice_comm = join_weight_group(backend, host, port, rank, world_size,
                                              self.device, timeout_s)  # type: ignore[attr-defined]
        self._sluice_timeout_s = timeout_s
        return rank

    def _sluice_drop_weight_group(self) -> None:
        abort_quietly(self._sluice_comm)
        self._sluice_comm = None

    def _sluice_receive_weights(self, wire: list[dict[str, Any]]) -> None:
        comm = self._sluice_comm
        if comm is None:
            raise WeightGroupError("no weight group: sluice_receive_weights before "
                                   "sluice_init_weight_group, or the last push aborted it")
        receiver = BucketReceiver(comm, decode_plan(wire), self.device,  # type: ignore[attr-defined]
                                  Deadline(self._sluice_timeout_s))
        try:
            try:
                self._sluice_reload(weights_iterator=iter(receiver))
            finally:
                unread = receiver.drain()  # keeps the group in step even when loading failed
        except BaseException:  # only the broadcast's own failure is translated; the rest goes on
            if receiver.failure is None:
                raise
            self._sluice_comm = None  # aborted by the failed broadcast
            raise receiver.failure from None
        if unread:
            raise RuntimeError(f"the model loader stopped before {unread} weight buckets")

    def _sluice_checksum(self, names: list[str]) -> str:
        params = dict(self.model_runner.get_model().named_parameters())  # type: ignore[attr-defined]
        missing = [n for n in names if n not in params]
        if missing:
            raise KeyError(f"engine has no parameters {missing}")
        return checksum_tensors(params, names)
