"""Weight push from the trainer to the rollout engines, verified.

Two ways, both from train rank 0: the driver hands over a version and gets a verified
PushResult, never the weights. CPU transport: rank 0 encodes the full state as safetensors
bytes while rollout goes on, then sends them to every engine, which loads them in place
(`send_prepared`). Broadcast transport (`trainer.train.weight_sync_nccl`; NCCL on GPU
clusters, gloo on CPU ones): rank 0 broadcasts bucketed weights to every engine worker
through a group of their own, each step bounded in time, and a failed engine is dropped
from the group. Afterwards each engine reports a checksum of a few tensors and its
version; any mismatch stops training with an error, because an engine silently serving
stale weights corrupts every later batch. What travels is `rollout.weight_protocol`.

The controller pushes at a turn boundary: after closing every worker's turn gate
(in-flight turns drained) and before opening them again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout.router import Router

if TYPE_CHECKING:
    from trainer.train.config import TrainRecipe
    from trainer.train.weight_sync_nccl import BroadcastTransport, WeightSenderClient

log = logging.getLogger(__name__)


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


def resolve_transport(cfg: TrainRecipe) -> str:
    """The transport a run uses: 'cpu', 'nccl' or 'gloo'; ValueError for nccl without GPUs."""
    transport = cfg.sync.transport
    if transport == "auto":
        transport = "nccl" if cfg.cluster.device == "cuda" else "cpu"
    if transport == "nccl" and cfg.cluster.device != "cuda":
        raise ValueError(f"sync.transport=nccl broadcasts between GPUs but cluster.device="
                         f"{cfg.cluster.device}; set sync.transport=cpu (or auto, or gloo)")
    return transport


def build_transport(cfg: TrainRecipe, sender: WeightSenderClient | None = None
                    ) -> BroadcastTransport | None:
    """The broadcast transport `cfg` asks for (nccl, gloo), which needs `sender`, the train
    group (its rank 0 plans and sends); None on the CPU transport, where rank 0 sends the
    prepared bytes itself (`send_prepared`)."""
    if resolve_transport(cfg) == "cpu":
        return None
    if sender is None:
        raise ValueError(f"sync.transport={resolve_transport(cfg)} needs the train group to "
                         "send from rank 0; pass it as sender, or set sync.transport=cpu")
    from trainer.train.weight_sync_nccl import BroadcastTransport

    return BroadcastTransport(sender, timeout_s=cfg.sync.timeout_s)


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
    """Send weights encoded beforehand (`rollout.weight_protocol.encode_state`) to every
    engine as `version` and verify them against `expected` (`expected_checksum` there):
    the CPU push from train rank 0."""
    start, before = time.monotonic(), router.engine_names
    await router.update_weights_all(version, blob=blob)  # an engine that fails is dropped
    if verify:
        await check_engines(router, expected, version)
    failed = tuple(n for n in before if n not in router.engine_names)
    result = PushResult(version, len(blob), time.monotonic() - start, 0.0, router.engine_names, failed)
    log.info("pushed version %d (%.1f MB) to %d engines in %.3fs", version, len(blob) / 2**20,
             len(result.engines), result.seconds)
    return result
