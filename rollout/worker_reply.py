"""What each of an engine's TP workers answers to a sluice `collective_rpc` call, and how
the engine folds the answers into one result or one exception.

vLLM's multiprocessing executor reads the workers' replies in rank order and raises at the
first failed one, leaving the later workers' replies queued; the next call then reads
them as its own answers (a failed push on worker 0 made the next checksum return the push's
error, and the one after `[digest, None]`). So the worker-extension methods
(`rollout.weight_reload`) never raise an Exception: every worker answers every call with a
`WorkerReply`, and the engine decides once all of them have answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout.weight_group import WeightGroupError

# On the wire a reply is a plain tuple (rank, value, error_type, error): vLLM's engine core
# sends utility results back as msgpack, which turns a tuple into a list and a dataclass
# into a dict, and refuses other objects unless insecure serialization is switched on.
ReplyWire = tuple[int, Any, str | None, str | None]


class WorkerError(RuntimeError):
    """One or more TP workers failed a call; the message names each rank and its error."""


@dataclass(frozen=True, slots=True)
class WorkerReply:
    """One worker's answer: its value, or the error it caught (`error_type` is the class
    name, e.g. "WeightGroupError"; `error` its message)."""

    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None

    @classmethod
    def failed(cls, rank: int, exc: Exception) -> "WorkerReply":
        return cls(rank, None, type(exc).__name__, str(exc))

    def to_wire(self) -> ReplyWire:
        return (self.rank, self.value, self.error_type, self.error)

    @classmethod
    def from_wire(cls, wire: Any) -> "WorkerReply":
        if isinstance(wire, WorkerReply):
            return wire
        if not isinstance(wire, (tuple, list)) or len(wire) != 4:
            raise WorkerError(f"a TP worker answered {wire!r:.200}, not a sluice worker reply "
                              "(rank, value, error_type, error)")
        rank, value, error_type, error = wire
        return cls(int(rank), value, error_type, error)


def fold_replies(method: str, replies: Sequence[Any]) -> list[Any]:
    """The workers' values in rank order, or one exception naming every worker that failed
    `method`: WeightGroupError when any of them lost the weight group (the caller forms a
    new one), WorkerError otherwise. Call only once every worker has answered."""
    folded = [WorkerReply.from_wire(r) for r in replies]
    failed = [r for r in folded if not r.ok]
    if failed:
        ranks = ", ".join(str(r.rank) for r in failed)
        detail = "; ".join(f"worker {r.rank}: {r.error_type}: {r.error}" for r in failed)
        message = f"{method} failed on TP worker {ranks} of {len(folded)}: {detail}"
        if any(r.error_type == WeightGroupError.__name__ for r in failed):
            raise WeightGroupError(message)
        raise WorkerError(message)
    return [r.value for r in folded]


def fold_checksums(digests: Sequence[Any]) -> str:
    """The one digest every TP worker reported; where they disagree, a string naming the
    disagreement (it matches no expected digest). WorkerError for a worker whose answer
    is not a digest."""
    bad = [(rank, d) for rank, d in enumerate(digests) if not isinstance(d, str)]
    if bad or not digests:
        raise WorkerError("sluice_checksum: " + (", ".join(
            f"worker {rank} answered {d!r:.80} ({type(d).__name__}), not a digest"
            for rank, d in bad) or "no worker answered"))
    if len(set(digests)) > 1:
        return "TP workers disagree: " + ", ".join(d[:12] for d in digests)
    return digests[0]
