"""A gateway session's journal: each change to the session's segments (a segment started,
observation ids appended, a generation dispatched, a generation completed) is appended to
a file on the worker's node, so that when the gateway process holding the session dies
the worker rebuilds the segments the engine generated, exactly, from the file.

    gateway process:  SessionOpened, SegmentStarted, [ObservationAdded], CallDispatched
                      (a segment's and an observation's images with them: rebuilt exactly)
                      --generate_turn--> worker --> engine        (CallFailed if it raises)
                      CallCompleted (ids, logprobs, versions, finish reason, timings, parse)
    worker, after the process died:  read_journal -> rebuild_session -> segments

Records are typed dataclasses in rollout.journal_file's framing (CRC-checked marshal
frames, one write(2) each, no fsync: the journal only has to outlive the gateway process,
never the node; a crashed node takes the worker, its reader, with it). A process killed
mid-write leaves a torn last record, which the reader ignores.

A CallDispatched that nothing settled (no CallCompleted or CallFailed after it) is a
generation in flight when the process died: the engine's answer never reached the
segment, so the session cannot say what the model's last turn was, and the sample ends
`error` (rebuild_session), which `buffer.failure_policy` masks, drops or resubmits like any
failed sample: a half-recorded turn is never trained.

Only gateway processes (rollout.gateway.procs) journal. The in-process gateway
(num_gateway_processes=0) skips it (Gateway(journal_dir=None)): its sessions live in the
worker's own memory, so whatever kills them kills the worker, the only reader a journal
would have; the run's resume re-admits the groups that were running. One session's file is
removed when the session closes: the journals on disk are those of the open sessions, each
about the size of the ids its segments hold.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from envs.types import TerminationReason, Trajectory, TrajectoryImage, Turn
from rollout.engine import TokenOutput
from rollout.journal_file import (GENERATION_DTYPES, GenerationRecord, JournalCodec, JournalRead, append_frame,
                                  remove_file)
from rollout.recorder import Budgets, TrajectoryRecorder
from rollout.vision import ImageRecord, PromptIds, image_of_record, image_record, images_of

# The ending of a segment the harness left by rewriting its history (the live gateway and
# the rebuild finish it the same way).
REWRITE_DETAIL = "the harness rewrote its history"


@dataclass(frozen=True, slots=True)
class SessionOpened:
    """The trajectory identity every segment of the session carries."""

    task_id: str
    group_id: str
    index: int


@dataclass(frozen=True, slots=True)
class SegmentStarted:
    """A new segment from a fresh render; the previous one ends (if it generated)."""

    segment: int  # 0, 1, ... in the session
    prompt_ids: np.ndarray
    images: tuple[ImageRecord, ...] = ()  # the prompt's images (rollout.vision.image_record)


@dataclass(frozen=True, slots=True)
class ObservationAdded:
    """New messages appended to the open segment after its last generation (mask 0)."""

    segment: int
    ids: np.ndarray
    num_tool_calls: int
    tool_s: float
    images: tuple[ImageRecord, ...] = ()  # the observation's images, starts relative to `ids`


@dataclass(frozen=True, slots=True)
class CallDispatched:
    """Written before a generation is sent: the prompt is the open segment's whole context,
    `num_prompt_ids` long (rebuilt from the records before, checked on rebuild)."""

    segment: int
    call: int  # the session's request number (its router request id ends with #call)
    num_prompt_ids: int


@dataclass(frozen=True, slots=True)
class CallCompleted(GenerationRecord):
    """What the live recorder appended for the call, after the reply was parsed
    (GenerationRecord), with the turn's parse status."""

    segment: int
    call: int
    tool_parse_status: str


@dataclass(frozen=True, slots=True)
class CallFailed:
    """The call raised (engine failure, cancellation): nothing was recorded for it."""

    segment: int
    call: int


JournalRecord = SessionOpened | SegmentStarted | ObservationAdded | CallDispatched | CallCompleted | CallFailed
CODEC: JournalCodec[JournalRecord] = JournalCodec(
    (SessionOpened, SegmentStarted, ObservationAdded, CallDispatched, CallCompleted, CallFailed),
    {"prompt_ids": np.int32, "ids": np.int32, **GENERATION_DTYPES})


def read_journal(path: str) -> JournalRead[JournalRecord]:
    """Every whole record of a session's file, in order (none if it does not exist)."""
    return CODEC.read(path)


class SessionJournal:
    """The writing end: one session's file, appended record by record. Closed (or made with
    no path, the in-process gateway), it writes nothing, so a reply arriving after the
    worker closed the session does not recreate the file."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.segment = -1  # the open segment's number

    def append(self, record: JournalRecord) -> None:
        if self.path is not None:
            append_frame(self.path, CODEC.encode(record))

    def opened(self, task_id: str, group_id: str, index: int) -> None:
        self.append(SessionOpened(task_id, group_id, index))

    def segment_started(self, prompt_ids: np.ndarray, images: Sequence[TrajectoryImage] = ()) -> None:
        self.segment += 1
        self.append(SegmentStarted(self.segment, np.asarray(prompt_ids, np.int32), tuple(map(image_record, images))))

    def observation_added(self, ids: list[int] | np.ndarray, num_tool_calls: int, tool_s: float) -> None:
        """`ids` as the builder returned them: the images they carry are journaled too."""
        self.append(ObservationAdded(self.segment, np.asarray(ids, np.int32), num_tool_calls, tool_s,
                                     tuple(map(image_record, images_of(ids)))))

    def dispatched(self, call: int, num_prompt_ids: int) -> None:
        self.append(CallDispatched(self.segment, call, num_prompt_ids))

    def completed(self, call: int, output: TokenOutput, turn: Turn) -> None:
        """`turn`: the recorder's turn for `output` (its timings, engine and parse status)."""
        self.append(CallCompleted.of(output, turn.queue_s, turn.generate_s, turn.engine, turn.started_at,
                                     segment=self.segment, call=call, tool_parse_status=turn.tool_parse_status))

    def failed(self, call: int) -> None:
        self.append(CallFailed(self.segment, call))

    def close(self) -> None:
        """The session closed with its segments in hand: the file is not needed."""
        if self.path is not None:
            remove_journal(self.path)
            self.path = None


def journal_path(folder: str, session_id: str) -> str:
    return os.path.join(folder, f"{session_id}.journal")


remove_journal = remove_file


class JournalError(ValueError):
    """The records are out of order (a bug, or a file not written by SessionJournal): the
    session cannot be rebuilt, and its sample fails."""


def _check(ok: bool, what: str) -> None:
    # Not `assert`: under python -O a bad journal would be rebuilt into a wrong trajectory.
    if not ok:
        raise JournalError(f"session journal out of order: {what}")


@dataclass(frozen=True, slots=True)
class RecoveredSession:
    segments: tuple[Trajectory, ...]  # as the live gateway's close_session would have returned them
    masked: bool  # a generation was dispatched and never completed: the sample ends `error`
    torn: bool


def rebuild_session(read: JournalRead[JournalRecord], budgets: Budgets, reason: TerminationReason, detail: str,
                    lost: str) -> RecoveredSession:
    """The session's segments replayed into recorders, as Gateway.close_session(reason,
    detail) would have returned them. `lost` says what happened to the process; with a
    generation in flight, the last segment ends `error` saying so (join_segments gives every
    segment of the sample that ending, so the whole sample fails as one)."""
    segments: list[Trajectory] = []
    rec: TrajectoryRecorder | None = None
    identity: SessionOpened | None = None
    pending: CallDispatched | None = None
    unsettled = False  # a dispatch that something other than its own outcome followed
    for r in read.records:
        if isinstance(r, SessionOpened):
            identity = r
        elif isinstance(r, SegmentStarted):
            _check(identity is not None, "a segment before SessionOpened")
            assert identity is not None  # for the type checker: _check raised otherwise
            if rec is not None and rec.turns:  # a segment without a generation has nothing to train on
                segments.append(rec.finish(TerminationReason.FINISHED, REWRITE_DETAIL))
            prompt = PromptIds(r.prompt_ids.tolist(), [image_of_record(i) for i in r.images])
            rec = TrajectoryRecorder(identity.task_id, identity.group_id, identity.index, prompt, budgets)
        elif isinstance(r, CallDispatched):
            unsettled |= pending is not None
            pending = r
            _check(rec is not None and len(rec.context_ids) == r.num_prompt_ids,
                   f"call {r.call} dispatched with another prompt than the segment's")
        elif isinstance(r, (CallCompleted, CallFailed)):
            unsettled |= pending is None or pending.call != r.call
            pending = None
            if isinstance(r, CallCompleted):
                _check(rec is not None, f"call {r.call} completed before any segment")
                assert rec is not None
                rec.add_generation(r.output, r.queue_s, r.generate_s, r.engine, r.started_at)
                rec.record_tool_parse(r.tool_parse_status)
        else:
            _check(rec is not None, "an observation before any segment")
            assert rec is not None
            rec.add_observation(PromptIds(r.ids.tolist(), [image_of_record(i) for i in r.images]),
                                r.num_tool_calls, 0, r.tool_s)
    if rec is not None and rec.turns:
        segments.append(rec.finish(reason, detail))
    masked = pending is not None or unsettled
    if masked and segments:
        call = f"request #{pending.call}" if pending is not None else "a request"
        segments[-1] = dataclasses.replace(
            segments[-1], termination=TerminationReason.ERROR,
            termination_detail=f"{lost} with {call} of this session dispatched to the engine and never "
                               "completed: the sample is not trained (its last turn is unknown)")
    return RecoveredSession(tuple(segments), masked, read.torn)
