"""Durable trajectories: each in-flight trajectory's turns are journaled on its worker's
node as they happen, so that a restart (Ctrl-C, SIGKILL, a resume from a checkpoint)
continues the trajectory from its last turn boundary instead of generating it again.

    live:    ctx.start      -> TrajectoryBegun (run, task, group, index, loop, prompt ids)
             ctx.generate   -> TurnGenerated   (the engine's ids, logprobs, versions, ...)
             ctx.run_tools  -> ToolsRan        (the calls run and the observations they gave)
    resume:  the same agent loop runs again on a TurnReplay of the journal: ctx.generate
             and ctx.run_tools hand back what the journal holds, in order, without the
             engine or the tools, until the journal is used up; from then on the trajectory
             is live again (its next turn's prompt is prefilled under the current weights).

Replayed tokens keep the versions they were sampled under, so the decoupled loss and the
staleness bound treat them exactly (the buffer drops a group older than the bound, and
counts it). A replay is only as good as the loop is deterministic given the same model
outputs and observations: the built-in loops are, and declare it (`durable = True` on the
class); a loop without that flag, or one whose replay asks for something else than the
journal recorded (another prompt, other tool calls), starts the trajectory over
(`ReplayDiverged`), which costs the work, never correctness.

Tools that work in a sandbox change state the journal's records do not hold: after each
live ctx.run_tools of such a trajectory the sandbox's workspace is saved beside the
journal (the pool's snapshot, hard-linked out: `<index>.journal.stateN`, only the newest
kept) and the record names it; a continued trajectory's new sandbox is restored to the
last replayed record's state before its loop runs. Tools whose state could not be saved
end the replay there: they run again, live, on the state before them.

The journal is a rollout.journal_file record file, `<folder>/<group id>/<index>.journal`,
removed with its group's folder when the group is returned; every record carries nothing
but what the trajectory itself holds, so its size is that of the trajectory's ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from envs.types import Content, Image, Message
from rollout.journal_file import (GENERATION_DTYPES, GenerationRecord, JournalCodec, append_frame, remove_file,
                                 truncate_to)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DurableSetup:
    """What the run tells its workers: where journals go on their node, the run they belong
    to (kept across resumes), and the version it resumed at (0 for a fresh run)."""

    folder: str
    run_id: str
    resumed_version: int = 0


class StatefulEnv(Protocol):
    """What of a trajectory's environment (envs.trajectory_env.TrajectoryEnv) keeps its state."""

    async def save_state(self, path: str) -> int: ...

    async def restore_state(self, path: str) -> None: ...


class ReplayDiverged(Exception):
    """The loop, run again on the journal, asked for something the journal did not record:
    the trajectory starts over."""


@dataclass(frozen=True, slots=True)
class TrajectoryBegun:
    run_id: str  # the run that wrote it: a journal of another run is never replayed
    task_id: str
    group_id: str
    index: int
    loop: str  # the agent loop's class, as module:qualname
    prompt_ids: np.ndarray
    has_sandbox: bool  # its tools work in a sandbox: state the journal does not hold


@dataclass(frozen=True, slots=True)
class TurnGenerated(GenerationRecord):
    """One generation of the trajectory (GenerationRecord), and the context it was
    generated on (checked on replay)."""

    num_context_ids: int


@dataclass(frozen=True, slots=True)
class ToolsRan:
    """One ctx.run_tools: the calls it was given (checked on replay) and its ToolOutcome."""

    calls: tuple[str, ...]  # each call's tool name and JSON arguments, in order
    contents: tuple[JournalContent, ...]  # the observation messages (role "tool"), in order (encode_content)
    names: tuple[str | None, ...]
    num_calls: int
    num_errors: int
    num_timeouts: int
    ends_trajectory: bool
    seconds: float
    tools: tuple[str, ...]
    failed_tools: tuple[str, ...]
    # The sandbox's workspace after these calls, a file beside the journal ("": the
    # trajectory has no sandbox, or saving it failed: the replay stops before this record).
    state: str = ""

    @property
    def messages(self) -> tuple[Message, ...]:
        return tuple(Message("tool", decode_content(c), name=n) for c, n in zip(self.contents, self.names, strict=True))


# A message's content as the journal (marshal) holds it: the text, or its parts with each
# image as (media type, encoded bytes).
JournalContent = str | tuple[str | tuple[str, bytes], ...]


def encode_content(content: Content) -> JournalContent:
    if isinstance(content, str):
        return content
    return tuple(p if isinstance(p, str) else (p.media_type, p.data) for p in content)


def decode_content(content: JournalContent) -> Content:
    if isinstance(content, str):
        return content
    return tuple(p if isinstance(p, str) else Image(p[1], p[0]) for p in content)


TrajectoryRecord = TrajectoryBegun | TurnGenerated | ToolsRan
CODEC: JournalCodec[TrajectoryRecord] = JournalCodec(
    (TrajectoryBegun, TurnGenerated, ToolsRan),
    {"prompt_ids": np.int32, **GENERATION_DTYPES})


@dataclass(slots=True)
class TurnReplay:
    """What a journal recorded after its TrajectoryBegun, handed back in order."""

    begun: TrajectoryBegun
    records: list[TurnGenerated | ToolsRan]
    at: int = 0
    turns_replayed: int = field(default=0)
    state: str = ""  # the sandbox state after the last replayed tools: restored before the loop runs

    @property
    def done(self) -> bool:
        return self.at >= len(self.records)

    def check_prompt(self, prompt_ids: Sequence[int] | np.ndarray) -> None:
        if not np.array_equal(np.asarray(prompt_ids, np.int32), self.begun.prompt_ids):
            raise ReplayDiverged("the loop rendered another prompt than the journal's")

    def next_generation(self, num_context_ids: int) -> TurnGenerated | None:
        """The recorded generation for this call, or None once the journal is used up."""
        if self.done:
            return None
        record = self.records[self.at]
        if not isinstance(record, TurnGenerated):
            raise ReplayDiverged("the loop generated where the journal ran tools")
        if record.num_context_ids != num_context_ids:
            raise ReplayDiverged(f"the loop generated on {num_context_ids} context ids, the journal "
                                 f"on {record.num_context_ids}")
        self.at += 1
        self.turns_replayed += 1
        return record

    def next_tools(self, calls: tuple[str, ...]) -> ToolsRan | None:
        """The recorded outcome of these calls, or None once the journal is used up."""
        if self.done:
            return None
        record = self.records[self.at]
        if not isinstance(record, ToolsRan) or record.calls != calls:
            raise ReplayDiverged("the loop ran other tool calls than the journal's")
        self.at += 1
        return record


@dataclass(slots=True)
class DurableTrajectory:
    """One trajectory's journal and, when it continues after a restart, its replay: the
    hooks AgentContext calls at each turn boundary."""

    path: str
    run_id: str
    loop: str
    has_sandbox: bool
    replay: TurnReplay | None = None
    num_bytes: int = 0  # written by this run of the trajectory (the replayed part is on disk already)
    num_records: int = 0
    num_states: int = 0  # sandbox states saved, replayed ones included (their files are numbered by it)
    num_states_saved: int = 0  # by this run of the trajectory
    state_bytes: int = 0
    state_s: float = 0.0  # spent saving them
    last_state: str = ""  # the newest state file the journal names
    write_s: float = 0.0  # spent encoding and writing records
    _pending: "asyncio.Future[None] | None" = None  # a state being saved, then its record

    def __post_init__(self) -> None:
        if self.replay is not None:  # states continue after the replayed ones
            self.last_state = self.replay.state
            self.num_states = sum(1 for r in self.replay.records if isinstance(r, ToolsRan) and r.state)

    def _append(self, record: TrajectoryRecord) -> None:
        start = time.perf_counter()
        frame = CODEC.encode(record)
        append_frame(self.path, frame)
        self.num_bytes += len(frame)
        self.num_records += 1
        self.write_s += time.perf_counter() - start

    def begin(self, task_id: str, group_id: str, index: int, prompt_ids: Sequence[int] | np.ndarray) -> None:
        if self.replay is not None:
            self.replay.check_prompt(prompt_ids)
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._append(TrajectoryBegun(self.run_id, task_id, group_id, index, self.loop,
                                     np.asarray(prompt_ids, np.int32), self.has_sandbox))

    def take_generation(self, num_context_ids: int) -> TurnGenerated | None:
        """The journal's generation for this call while the replay lasts, else None."""
        return self.replay.next_generation(num_context_ids) if self.replay is not None else None

    async def record_generation(self, record: TurnGenerated) -> None:
        await self.settle()  # the tools before it are recorded first
        self._append(record)

    def take_tools(self, calls: tuple[str, ...]) -> ToolsRan | None:
        return self.replay.next_tools(calls) if self.replay is not None else None

    async def record_tools(self, record: ToolsRan, env: "StatefulEnv") -> None:
        """Journal the tools' outcome. With a sandbox, its state is saved first, in the
        background: a snapshot of a repository-sized workspace takes most of a second
        (tests/bench/bench_durable.py), which the next generation hides. The record is
        written when the save is done, and before the next generation's (`settle`)."""
        await self.settle()
        if not self.has_sandbox:
            self._append(dataclasses.replace(record, state=""))
            return
        self._pending = asyncio.ensure_future(self._save_then_record(record, env))

    async def settle(self) -> None:
        """Wait for a background save and its record: before the next record, and before
        the sandbox is released at the trajectory's end."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            await pending

    def abandon(self) -> None:
        """The trajectory was stopped: a save in progress is dropped (its record is not
        written, so a replay ends before those tools, which run again)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    async def _save_then_record(self, record: ToolsRan, env: "StatefulEnv") -> None:
        state = ""
        if self.has_sandbox:
            self.num_states += 1
            name = f"{os.path.basename(self.path)}.state{self.num_states}"
            start = time.perf_counter()
            try:
                self.state_bytes += await env.save_state(os.path.join(os.path.dirname(self.path), name))
                self.num_states_saved += 1
                state = name
            except Exception as exc:  # a sandbox that cannot be saved: a restart redoes this turn, no more
                log.warning("saving the sandbox state of %s failed: %s", self.path, exc)
            self.state_s += time.perf_counter() - start
        self._append(dataclasses.replace(record, state=state))
        if state and self.last_state:
            remove_file(os.path.join(os.path.dirname(self.path), self.last_state))
        self.last_state = state or self.last_state

    async def restore(self, env: "StatefulEnv") -> None:
        """Put the sandbox back as it was after the last replayed tools."""
        if self.replay is None or not self.replay.state:
            return
        try:
            await env.restore_state(os.path.join(os.path.dirname(self.path), self.replay.state))
        except Exception as exc:  # any failure of any backend: the trajectory starts over instead
            raise ReplayDiverged(f"its sandbox state could not be restored: {type(exc).__name__}: {exc}") from exc

    @property
    def turns_replayed(self) -> int:
        return self.replay.turns_replayed if self.replay is not None else 0


def journal_file(folder: str, group_id: str, index: int) -> str:
    return os.path.join(folder, _safe(group_id), f"{index}.journal")


def group_folder(folder: str, group_id: str) -> str:
    return os.path.join(folder, _safe(group_id))


def remove_group(folder: str, group_id: str) -> None:
    """The group is returned: its trajectories need no journal any more."""
    shutil.rmtree(group_folder(folder, group_id), ignore_errors=True)


def _safe(group_id: str) -> str:
    # Group ids are the controller's ("g12", "eval-v3-0"); a path separator would escape.
    return group_id.replace(os.sep, "_")


@dataclass(frozen=True, slots=True)
class DurableStats:
    """A worker's counters (cumulative; docs/metrics.md `durable/*`)."""

    num_continued: int = 0  # trajectories continued from their journal after a restart
    num_turns_replayed: int = 0  # generations taken from journals instead of the engine
    num_restarted: int = 0  # journals found that could not be continued: started over
    num_journal_bytes: int = 0  # written
    journal_write_s: float = 0.0  # spent writing them (encode + write)
    num_records: int = 0
    num_states: int = 0  # sandbox states saved at turn boundaries
    num_state_bytes: int = 0
    state_save_s: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        return {"durable/continued": float(self.num_continued),
                "durable/turns_replayed": float(self.num_turns_replayed),
                "durable/restarted": float(self.num_restarted),
                "durable/journal_bytes": float(self.num_journal_bytes),
                "durable/journal_write_us_per_record": 1e6 * self.journal_write_s / max(self.num_records, 1),
                "durable/state_bytes": float(self.num_state_bytes),
                "durable/state_save_ms_per_turn": 1e3 * self.state_save_s / max(self.num_states, 1)}


def sum_durable_stats(stats: Sequence[DurableStats]) -> DurableStats:
    return DurableStats(*(sum(getattr(s, f) for s in stats) for f in DurableStats.__dataclass_fields__))


@dataclass(frozen=True, slots=True)
class Resumable:
    """What a journal on disk allows for one trajectory: a replay, or why it starts over."""

    replay: TurnReplay | None
    reason: str = ""  # why not, when replay is None and a journal was there


def open_replay(path: str, run_id: str, task_id: str, group_id: str, index: int, loop: str,
                max_version: int) -> Resumable:
    """The replay of the journal at `path` for this trajectory; when there is none, or it
    cannot be replayed (unreadable, another run, task or loop), the file is removed so the
    trajectory's fresh journal starts empty. A sandboxed trajectory's replay ends at the
    first tools after its newest saved state (those run again, live). The replay stops before the first generation
    of a version over `max_version` (weights the restart no longer has: the run resumed
    from an earlier checkpoint) and the file is cut there, a torn tail with it."""
    try:
        read = CODEC.read(path)
    except (ValueError, TypeError, IndexError, EOFError) as exc:  # whole frames another version wrote
        remove_file(path)
        return Resumable(None, f"cannot be read ({type(exc).__name__}: {exc})")
    if not read.records:
        remove_file(path)
        return Resumable(None)
    begun, rest = read.records[0], read.records[1:]
    why = ""
    if not isinstance(begun, TrajectoryBegun) or any(isinstance(r, TrajectoryBegun) for r in rest):
        why = "not a trajectory journal"
    elif (begun.run_id, begun.task_id, begun.group_id, begun.index) != (run_id, task_id, group_id, index):
        why = "written by another run or for another task"
    elif begun.loop != loop:
        why = f"written by another agent loop ({begun.loop})"
    if why:
        remove_file(path)
        return Resumable(None, why)
    assert isinstance(begun, TrajectoryBegun)
    keep = next((k for k, r in enumerate(rest) if isinstance(r, TurnGenerated) and len(r.versions)
                 and int(r.versions.max()) > max_version), len(rest))
    state = ""
    if begun.has_sandbox:  # continue from the newest tools whose sandbox state is on disk
        folder = os.path.dirname(path)
        tools = {k: r for k, r in enumerate(rest[:keep]) if isinstance(r, ToolsRan)}
        saved = [k for k, r in tools.items() if r.state and os.path.isfile(os.path.join(folder, r.state))]
        restore_at = saved[-1] if saved else -1
        state = tools[restore_at].state if saved else ""
        # Tools after it changed a state that is not there: they run again, live.
        keep = next((k for k in tools if k > restore_at), keep)
    if keep < len(rest) or read.torn:
        truncate_to(path, read.ends[keep])  # ends[0] is TrajectoryBegun's: keep records 0..keep
    records = [r for r in rest[:keep] if isinstance(r, (TurnGenerated, ToolsRan))]
    return Resumable(TurnReplay(begun, records, state=state))


def call_key(name: str, arguments: object) -> str:
    """A tool call as ToolsRan.calls holds it."""
    return f"{name} {json.dumps(arguments, sort_keys=True, default=str)}"
