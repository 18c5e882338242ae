"""Weight push from the trainer to the rollout engines, verified.

Two transports behind one entry, `push_weights`. CPU: the full state dict is serialised
once as safetensors bytes and every engine loads it in place (`rollout.weight_reload`).
NCCL (GPU clusters, `trainer.weight_sync_nccl`): train rank 0 broadcasts bucketed weights
to every engine worker through a group of their own. Afterwards each engine reports a
checksum of a few tensors and its version; any mismatch stops training with an error,
because an engine silently serving stale weights corrupts every later batch.

The controller calls `push_weights` at a turn boundary: after closing every worker's
turn gate (in-flight turns drained) and before opening them again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from rollout.router import Router
from rollout.weight_reload import checksum_tensors

if TYPE_CHECKING:
    from trainer.config import SluiceConfig
    from trainer.weight_sync_nccl import WeightSenderClient

log = logging.getLogger(__name__)

MAX_CHECKSUM_TENSORS = 4


class WeightSyncError(RuntimeError):
    """An engine does not serve the weights the trainer pushed."""


@dataclass(frozen=True, slots=True)
class PushResult:
    version: int
    num_bytes: int
    seconds: float
    encode_s: float
    engines: tuple[str, ...]


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


def resolve_transport(cfg: "SluiceConfig") -> str:
    """The transport a run uses: 'cpu' or 'nccl'; ValueError for nccl without GPUs."""
    transport = cfg.sync.transport
    if transport == "auto":
        transport = "nccl" if cfg.cluster.device == "cuda" else "cpu"
    if transport == "nccl" and cfg.cluster.device != "cuda":
        raise ValueError(f"sync.transport=nccl broadcasts between GPUs but cluster.device="
                         f"{cfg.cluster.device}; set sync.transport=cpu (or auto)")
    return transport


def build_transport(cfg: SluiceConfig, sender: WeightSenderClient | None = None) -> WeightTransport:
    """The transport `cfg` asks for; nccl needs `sender`, the train group (rank 0 sends)."""
    if resolve_transport(cfg) == "cpu":
        return CpuTransport()
    if sender is None:
        raise ValueError("sync.transport=nccl needs the train group to send from rank 0; "
                         "pass it as sender, or set sync.transport=cpu")
    from trainer.weight_sync_nccl import BroadcastTransport

    return BroadcastTransport(sender, "nccl", bucket_bytes=cfg.sync.bucket_mb << 20,
                              tp_size=cfg.rollout.tp_size, timeout_s=cfg.sync.timeout_s)


def encode_state(state: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of a state dict (CPU, contiguous copies)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in state.items()})


def checksum_names(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Tensors both sides hold under the same name and shape: engines fuse projections and
    pad vocabularies, but keep norm weights as they are."""
    names = [n for n, t in state.items() if t.ndim == 1 and n.endswith("norm.weight")]
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
    start = time.monotonic()
    await router.update_weights_all(version, blob=blob)
    if verify:
        await check_engines(router, expected, version)
    result = PushResult(version, len(blob), time.monotonic() - start, 0.0, router.engine_names)
    log.info("pushed version %d (%.1f MB) to %d engines in %.3fs", version, len(blob) / 2**20,
             len(result.engines), result.seconds)
    return result


async def push_weights(router: Router, state: Mapping[str, torch.Tensor], version: int,
                       verify: bool = True, transport: WeightTransport | None = None) -> PushResult:
    """Send `state` (Hugging Face names) to every engine as `version` through `transport`
    (`build_transport(cfg, ...)`; None: the CPU transport); verify if asked."""
    start = time.monotonic()
    sent = await (transport or CpuTransport()).send(router, state, version)
    if verify:
        await verify_engines(router, state, version)
    result = PushResult(version, sent.num_bytes, time.monotonic() - start, sent.encode_s,
                        router.engine_names)
    log.info("pushed version %d (%.1f MB) to %d engines in %.3fs", version, sent.num_bytes / 2**20,
             len(result.engines), result.seconds)
    return result
