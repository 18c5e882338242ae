"""A gateway session's journal: each change to the session's segments (a segment started,
observation ids appended, a generation dispatched, a generation completed) is appended to
a file on the worker's node, so that when the gateway process holding the session dies
the worker rebuilds the segments the engine generated, exactly, from the file.

    gateway process:  SessionOpened, SegmentStarted, [ObservationAdded], CallDispatched
                      --generate_turn--> worker --> engine        (CallFailed if it raises)
                      CallCompleted (ids, logprobs, versions, finish reason, timings, parse)
    worker, after the process died:  read_journal -> rebuild_session -> segments

A record is a typed dataclass, stored as the `marshal` of its kind and field values
(arrays as raw bytes: 4-8 µs to encode, where pickling the dataclass and its arrays took
~50; marshal cannot run code on load, and the writer and the reader are the same
interpreter), framed as magic, length and CRC-32 of the payload, and written with one
write(2) on an O_APPEND descriptor. No fsync: the journal only has to outlive the gateway
process, never the node (a crashed node takes the worker, its reader, with it), and what
write(2) took is in the page cache whatever happens to the writer afterwards. A process
killed mid-write leaves a short or corrupt last record: the reader stops there and reports
it torn. A CallDispatched that nothing settled (no CallCompleted or CallFailed after it) is
a generation in flight when the process died: the engine's answer never reached the
segment, so the session cannot say what the model's last turn was, and the sample ends
`error` (rebuild_session), which `buffer.failure_policy` masks, drops or resubmits like any
failed sample: a half-recorded turn is never trained.

Only gateway processes (rollout.gateway.procs) journal. The in-process gateway
(num_gateway_processes=0) skips it (Gateway(journal_dir=None)): its sessions live in the
worker's own memory, so whatever kills them kills the worker, the only reader a journal
would have; the run's resume re-admits the groups that were running. Files are opened per
record rather than held (a process with 1000 sessions would hold 1000 more descriptors
beside the harnesses' sockets), and one session's file is removed when the session closes:
the journals on disk are those of the open sessions, each about the size of the ids its
segments hold.
"""

from __future__ import annotations

import dataclasses
import marshal
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np

from envs.types import TerminationReason, Trajectory, Turn
from rollout.engine import FinishReason, TokenOutput
from rollout.recorder import Budgets, TrajectoryRecorder

# A record: magic, payload length, CRC-32 of the payload; then the payload. The
# magic fails on a zero-filled tail, which length 0 and CRC 0 of an empty payload would pass.
_MAGIC = 0x534A  # "SJ"
_HEADER = struct.Struct("<HII")
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


@dataclass(frozen=True, slots=True)
class ObservationAdded:
    """New messages appended to the open segment after its last generation (mask 0)."""

    segment: int
    ids: np.ndarray
    num_tool_calls: int
    tool_s: float


@dataclass(frozen=True, slots=True)
class CallDispatched:
    """Written before a generation is sent: the prompt is the open segment's whole context,
    `num_prompt_ids` long (rebuilt from the records before, checked on rebuild)."""

    segment: int
    call: int  # the session's request number (its router request id ends with #call)
    num_prompt_ids: int


@dataclass(frozen=True, slots=True)
class CallCompleted:
    """What the live recorder appended for the call, after the reply was parsed: the
    engine's TokenOutput field by field, the turn's timings, engine and parse status."""

    segment: int
    call: int
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason
    num_prompt_tokens: int
    cached_prompt_tokens: int
    cache_salted: bool
    queue_s: float
    generate_s: float
    engine: str
    started_at: float
    tool_parse_status: str

    @property
    def output(self) -> TokenOutput:
        return TokenOutput(self.token_ids, self.logprobs, self.versions, self.finish_reason,
                           self.num_prompt_tokens, self.cached_prompt_tokens, self.cache_salted)


@dataclass(frozen=True, slots=True)
class CallFailed:
    """The call raised (engine failure, cancellation): nothing was recorded for it."""

    segment: int
    call: int


JournalRecord = SessionOpened | SegmentStarted | ObservationAdded | CallDispatched | CallCompleted | CallFailed
_KINDS: tuple[type[JournalRecord], ...] = (SessionOpened, SegmentStarted, ObservationAdded, CallDispatched,
                                           CallCompleted, CallFailed)
# The array fields and their dtypes (what the recorder and Trajectory hold).
_DTYPES = {"prompt_ids": np.int32, "ids": np.int32, "token_ids": np.int32, "logprobs": np.float32,
           "versions": np.int32}
# Per record type: its kind number, and each field's name with its dtype (None: not an array).
_LAYOUT = {cls: (kind, tuple((f.name, _DTYPES.get(f.name)) for f in fields(cls))) for kind, cls in enumerate(_KINDS)}


def encode_record(record: JournalRecord) -> bytes:
    """One self-delimiting frame: the marshal of the kind and the field values, arrays as
    raw bytes, numpy scalars as Python's (marshal takes neither)."""
    kind, layout = _LAYOUT[type(record)]
    row: list[int | float | str | bytes | None] = [kind]
    for name, dtype in layout:
        value = getattr(record, name)
        if dtype is not None:
            value = np.asarray(value, dtype).tobytes()
        elif isinstance(value, np.generic):
            value = value.item()
        row.append(value)
    payload = marshal.dumps(tuple(row))
    return _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload


def decode_record(payload: bytes) -> JournalRecord:
    kind, *values = marshal.loads(payload)
    cls = _KINDS[kind]
    _, layout = _LAYOUT[cls]
    return cls(*(v if dtype is None else np.frombuffer(v, dtype).copy()
                 for (_, dtype), v in zip(layout, values, strict=True)))


class SessionJournal:
    """The writing end: one session's file, appended record by record. Closed (or made with
    no path, the in-process gateway), it writes nothing, so a reply arriving after the
    worker closed the session does not recreate the file."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.segment = -1  # the open segment's number

    def append(self, record: JournalRecord) -> None:
        if self.path is None:
            return
        data = encode_record(record)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            view = memoryview(data)
            while view:  # a regular file takes it whole; a short write is resumed, not lost
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def opened(self, task_id: str, group_id: str, index: int) -> None:
        self.append(SessionOpened(task_id, group_id, index))

    def segment_started(self, prompt_ids: np.ndarray) -> None:
        self.segment += 1
        self.append(SegmentStarted(self.segment, np.asarray(prompt_ids, np.int32)))

    def observation_added(self, ids: list[int] | np.ndarray, num_tool_calls: int, tool_s: float) -> None:
        self.append(ObservationAdded(self.segment, np.asarray(ids, np.int32), num_tool_calls, tool_s))

    def dispatched(self, call: int, num_prompt_ids: int) -> None:
        self.append(CallDispatched(self.segment, call, num_prompt_ids))

    def completed(self, call: int, output: TokenOutput, turn: Turn) -> None:
        """`turn`: the recorder's turn for `output` (its timings, engine and parse status)."""
        o = output
        self.append(CallCompleted(self.segment, call, o.token_ids, o.logprobs, o.versions, o.finish_reason,
                                  o.num_prompt_tokens, o.cached_prompt_tokens, o.cache_salted, turn.queue_s,
                                  turn.generate_s, turn.engine, turn.started_at, turn.tool_parse_status))

    def failed(self, call: int) -> None:
        self.append(CallFailed(self.segment, call))

    def close(self) -> None:
        """The session closed with its segments in hand: the file is not needed."""
        if self.path is not None:
            remove_journal(self.path)
            self.path = None


def journal_path(folder: str, session_id: str) -> str:
    return os.path.join(folder, f"{session_id}.journal")


def remove_journal(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class JournalError(ValueError):
    """The records are out of order (a bug, or a file not written by SessionJournal): the
    session cannot be rebuilt, and its sample fails."""


def _check(ok: bool, what: str) -> None:
    # Not `assert`: under python -O a bad journal would be rebuilt into a wrong trajectory.
    if not ok:
        raise JournalError(f"session journal out of order: {what}")


@dataclass(frozen=True, slots=True)
class JournalRead:
    records: tuple[JournalRecord, ...]
    torn: bool  # the last record was cut short or corrupt (the writer died mid-write): ignored


def read_journal(path: str) -> JournalRead:
    """Every whole record of the file, in order (none if it does not exist)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return JournalRead((), False)
    records = list(_frames(data))
    torn = sum(_HEADER.size + n for n, _ in records) != len(data)
    return JournalRead(tuple(decode_record(payload) for _, payload in records), torn)


def _frames(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(length, payload) of each whole frame, up to the first that is not."""
    at = 0
    while at + _HEADER.size <= len(data):
        magic, size, crc = _HEADER.unpack_from(data, at)
        payload = data[at + _HEADER.size:at + _HEADER.size + size]
        if magic != _MAGIC or len(payload) != size or zlib.crc32(payload) != crc:
            return
        yield size, payload
        at += _HEADER.size + size


@dataclass(frozen=True, slots=True)
class RecoveredSession:
    segments: tuple[Trajectory, ...]  # as the live gateway's close_session would have returned them
    masked: bool  # a generation was dispatched and never completed: the sample ends `error`
    torn: bool


def rebuild_session(read: JournalRead, budgets: Budgets, reason: TerminationReason, detail: str,
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
            rec = TrajectoryRecorder(identity.task_id, identity.group_id, identity.index, r.prompt_ids, budgets)
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
            rec.add_observation(r.ids, r.num_tool_calls, 0, r.tool_s)
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
