"""Weight push from the trainer to the rollout engines, verified.

Two ways, both from train rank 0: the driver hands over a version and gets a verified
PushResult, never the weights. CPU transport: rank 0 serialises the full state as
safetensors bytes once and every engine loads them in place (`send_prepared`;
`push_weights` does the same from a state dict in this process). Broadcast transport
(`trainer.train.weight_sync_nccl`; NCCL on GPU clusters, gloo on CPU ones): rank 0 broadcasts
bucketed weights to every engine worker through a group of their own, each step bounded
in time, and a failed engine is dropped from the group. Afterwards each engine reports a
checksum of a few tensors and its version; any mismatch stops training with an error,
because an engine silently serving stale weights corrupts every later batch.

The controller pushes at a turn boundary: after closing every worker's turn gate
(in-flight turns drained) and before opening them again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from rollout.router import Router
from rollout.weight_reload import checksum_tensors

if TYPE_CHECKING:
    from trainer.train.config import TrainRecipe
    from trainer.train.weight_sync_nccl import BroadcastTransport, WeightSenderClient

log = logging.getLogger(__name__)

MAX_CHECKSUM_TENSORS = 4


class WeightSyncError(RuntimeError):
    """An engine does not serve the weights the trainer pushed."""


@dataclass(frozen=True, slots=True)
class PushResult:
    version: int
    num_bytes: int
    seconds: float
    encode_s: float  # serialising (cpu) or planning buckets (broadcast)
    engines: tuple[str, ...]  # the engines that serve `version`, verified
    failed_engines: tuple[str, ...] = ()  # gone during the push, removed from the router
    attempts: int = 1  # broadcast: pushes of this version (a failed one forms a new group)


@dataclass(frozen=True, slots=True)
class SentWeights:
    num_bytes: int
    encode_s: float  # serialising (cpu) or planning buckets (nccl)


class WeightTransport(Protocol):
    """Moves `state` into every engine as `version`; verification is not its job."""

    async def send(self, router: Router, state: Mapping[str, torch.Tensor],
                   version: int) -> SentWeights: ...


class CpuTransport:
    """safetensors bytes through Ray; every engine loads them in place."""

    async def send(self, router: Router, state: Mapping[str, torch.Tensor],
                   version: int) -> SentWeights:
        start = time.monotonic()
        blob = encode_state(state)
        encode_s = time.monotonic() - start
        await router.update_weights_all(version, blob=blob)
        return SentWeights(len(blob), encode_s)


def resolve_transport(cfg: "TrainRecipe") -> str:
    """The transport a run uses: 'cpu', 'nccl' or 'gloo'; ValueError for nccl without GPUs."""
    transport = cfg.sync.transport
    if transport == "auto":
        transport = "nccl" if cfg.cluster.device == "cuda" else "cpu"
    if transport == "nccl" and cfg.cluster.device != "cuda":
        raise ValueError(f"sync.transport=nccl broadcasts between GPUs but cluster.device="
                         f"{cfg.cluster.device}; set sync.transport=cpu (or auto, or gloo)")
    return transport


def build_transport(cfg: TrainRecipe, sender: WeightSenderClient | None = None
                    ) -> CpuTransport | BroadcastTransport:
    """The transport `cfg` asks for; a broadcast (nccl, gloo) needs `sender`, the train
    group (its rank 0 plans and sends)."""
    if resolve_transport(cfg) == "cpu":
        return CpuTransport()
    if sender is None:
        raise ValueError(f"sync.transport={resolve_transport(cfg)} needs the train group to "
                         "send from rank 0; pass it as sender, or set sync.transport=cpu")
    from trainer.train.weight_sync_nccl import BroadcastTransport

    return BroadcastTransport(sender, timeout_s=cfg.sync.timeout_s)


def encode_state(state: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of a state dict (CPU, contiguous copies)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in state.items()})


def checksum_names(state: Mapping[str, torch.Tensor]) -> list[str]:
    return choose_checksum_names((n, t.ndim) for n, t in state.items())


def choose_checksum_names(names_ndims: Iterable[tuple[str, int]]) -> list[str]:
    """Tensors both sides hold under the same name and shape: engines fuse projections and
    pad vocabularies, but keep norm weights as they are. Takes (name, ndim) pairs."""
    names = [n for n, ndim in names_ndims if ndim == 1 and n.endswith("norm.weight")]
    if not names:
        raise WeightSyncError("no norm weights to checksum in the pushed state; cannot verify")
    step = max(1, len(names) // MAX_CHECKSUM_TENSORS)
    return names[::step][:MAX_CHECKSUM_TENSORS]


def expected_checksum(state: Mapping[str, torch.Tensor]) -> tuple[list[str], str]:
    """The tensors engines are asked to checksum after a push, and the digest they must give."""
    names = checksum_names(state)
    return names, checksum_tensors(dict(state), names)


async def verify_engines(router: Router, state: Mapping[str, torch.Tensor], version: int) -> None:
    await check_engines(router, expected_checksum(state), version)


async def check_engines(router: Router, expected: tuple[list[str], str], version: int) -> None:
    """WeightSyncError unless every engine serves `version` with the expected checksum."""
    names, digest = expected
    digests = await router.checksum_all(names)
    stats = await router.engine_stats()
    wrong = [n for n, d in digests.items() if d != digest]
    stale = [n for n, s in stats.items() if s.version != version]
    if wrong or stale:
        raise WeightSyncError(f"after pushing version {version}: engines {wrong} serve other weights "
                              f"(checksum of {names}), engines {stale} report another version")


async def send_prepared(router: Router, blob: bytes, expected: tuple[list[str], str], version: int,
                        verify: bool = True) -> PushResult:
    """Send weights encoded beforehand (`encode_state`) to every engine as `version` and
    verify them against `expected` (`expected_checksum`): the push from train rank 0."""
    start, before = time.monotonic(), router.engine_names
    await router.update_weights_all(version, blob=blob)  # an engine that fails is dropped
    if verify:
        await check_engines(router, expected, version)
    failed = tuple(n for n in before if n not in router.engine_names)
    result = PushResult(version, len(blob), time.monotonic() - start, 0.0, router.engine_names, failed)
    log.info("pushed version %d (%.1f MB) to %d engines in %.3fs", version, len(blob) / 2**20,
             len(result.engines), result.seconds)
    return result


async def push_weights(router: Router, state: Mapping[str, torch.Tensor], version: int,
                       verify: bool = True, transport: WeightTransport | None = None) -> PushResult:
    """Send `state` (Hugging Face names), held in this process, to every engine as
    `version` through `transport` (None: the CPU transport); verify if asked. The broadcast
    transport pushes from rank 0 instead (`BroadcastTransport.push`)."""
    start = time.monotonic()
    sent = await (transport or CpuTransport()).send(router, state, version)
    if verify:
        await verify_engines(router, state, version)
    result = PushResult(version, sent.num_bytes, time.monotonic() - start, sent.encode_s,
                        router.engine_names)
    log.info("pushed version %d (%.1f MB) to %d engines in %.3fs", version, sent.num_bytes / 2**20,
             len(result.engines), result.seconds)
    return result
