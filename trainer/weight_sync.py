"""Weight push from the trainer to the rollout engines, verified.

CPU transport (runs here): the full state dict is serialised once as safetensors bytes and
every engine loads it in place (`rollout.weight_reload`). Afterwards each engine reports a
checksum of a few tensors and its version; any mismatch stops training with an error,
because an engine silently serving stale weights corrupts every later batch. The NCCL
transport (GPU clusters) is not built yet: `resolve_transport` rejects it when a run
starts (a dry run still shows the plan).

The controller calls `push_weights` at a turn boundary: after closing every worker's
turn gate (in-flight turns drained) and before opening them again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.router import Router
from rollout.weight_reload import checksum_tensors

if TYPE_CHECKING:
    from trainer.config import SluiceConfig

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


def resolve_transport(cfg: "SluiceConfig") -> str:
    """The transport a run uses; ValueError for one that is not built."""
    transport = cfg.sync.transport
    if transport == "auto":
        transport = "nccl" if cfg.cluster.device == "cuda" else "cpu"
    if transport == "nccl":
        raise ValueError("sync.transport=nccl is not built yet; set sync.transport=cpu "
                         "(safetensors bytes through Ray, slower for large models)")
    return transport


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


async def verify_engines(router: Router, state: Mapping[str, torch.Tensor], version: int) -> None:
    names = checksum_names(state)
    expected = checksum_tensors(dict(state), names)
    digests = await router.checksum_all(names)
    stats = await router.engine_stats()
    wrong = [n for n, d in digests.items() if d != expected]
    stale = [n for n, s in stats.items() if s.version != version]
    if wrong or stale:
        raise WeightSyncError(f"after pushing version {version}: engines {wrong} serve other weights "
                              f"(checksum of {names}), engines {stale} report another version")


async def push_weights(router: Router, state: Mapping[str, torch.Tensor], version: int,
                       verify: bool = True) -> PushResult:
    """Send `state` (Hugging Face names) to every engine as `version`; verify if asked."""
    start = time.monotonic()
    blob = encode_state(state)
    encode_s = time.monotonic() - start
    await router.update_weights_all(version, blob=blob)
    if verify:
        await verify_engines(router, state, version)
    result = PushResult(version, len(blob), time.monotonic() - start, encode_s, router.engine_names)
    log.info("pushed version %d (%.1f MB) to %d engines in %.3fs", version, len(blob) / 2**20,
             len(result.engines), result.seconds)
    return result
