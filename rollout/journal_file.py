"""Append-only journals of typed records, shared by the gateway's session journals
(rollout.gateway.journal) and the worker's trajectory journals (rollout.durable).

A record is a frozen dataclass of one of the journal's kinds, stored as the `marshal` of
its kind number and field values (numpy arrays as raw bytes of a fixed dtype: 4-8 µs to
encode, where pickling a dataclass with its arrays took ~50; marshal cannot run code on
load, and writer and reader are the same interpreter), framed as magic, length and CRC-32
of the payload, and appended with one write(2) on an O_APPEND descriptor. No fsync: a
journal has to outlive the process that writes it, never the node (what write(2) took is
in the page cache whatever happens to the writer afterwards). A writer killed mid-write
leaves a short or corrupt last frame: the reader stops there and says the file is torn.

Files are opened per record rather than held open: a worker with a thousand trajectories
in flight would otherwise hold a thousand descriptors more.
"""

from __future__ import annotations

import itertools
import marshal
import os
import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

import numpy as np

from rollout.engine import FinishReason, TokenOutput

# The magic fails on a zero-filled tail, which length 0 and CRC 0 of an empty payload would pass.
_MAGIC = 0x534A  # "SJ"
_HEADER = struct.Struct("<HII")

R = TypeVar("R")
G = TypeVar("G", bound="GenerationRecord")


@dataclass(frozen=True, slots=True)
class GenerationRecord:
    """One generation as a recorder took it, the part every journal's generation record
    shares: the engine's TokenOutput field by field, its timings and engine (records add
    where it belongs: a trajectory's context length, a gateway session's call)."""

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

    @classmethod
    def of(cls: type[G], output: TokenOutput, queue_s: float, generate_s: float, engine: str,
           started_at: float, **where: Any) -> G:
        o = output
        return cls(o.token_ids, o.logprobs, o.versions, o.finish_reason, o.num_prompt_tokens,  # type: ignore[call-arg]
                   o.cached_prompt_tokens, o.cache_salted, queue_s, generate_s, engine, started_at, **where)

    @property
    def output(self) -> TokenOutput:
        return TokenOutput(self.token_ids, self.logprobs, self.versions, self.finish_reason,
                           self.num_prompt_tokens, self.cached_prompt_tokens, self.cache_salted)


# The array fields of GenerationRecord and their dtypes (what the recorder holds).
GENERATION_DTYPES = {"token_ids": np.int32, "logprobs": np.float32, "versions": np.int32}


class JournalCodec(Generic[R]):
    """Encodes and decodes the records of one journal: `kinds` in a fixed order (a kind's
    number is its position: append new kinds at the end), `dtypes` the dtype of each field
    name that holds an array."""

    def __init__(self, kinds: Sequence[type[R]], dtypes: Mapping[str, Any]) -> None:
        self.kinds = tuple(kinds)
        self._layout = {cls: (kind, tuple((f.name, dtypes.get(f.name)) for f in fields(cls)))  # type: ignore[arg-type]
                        for kind, cls in enumerate(self.kinds)}

    def encode(self, record: R) -> bytes:
        """One self-delimiting frame: numpy scalars become Python's (marshal takes neither)."""
        kind, layout = self._layout[type(record)]
        row: list[Any] = [kind]
        for name, dtype in layout:
            value = getattr(record, name)
            if dtype is not None:
                value = np.asarray(value, dtype).tobytes()
            elif isinstance(value, np.generic):
                value = value.item()
            row.append(value)
        payload = marshal.dumps(tuple(row))
        return _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload

    def decode(self, payload: bytes) -> R:
        kind, *values = marshal.loads(payload)
        cls = self.kinds[kind]
        _, layout = self._layout[cls]
        return cls(*(v if dtype is None else np.frombuffer(v, dtype).copy()
                     for (_, dtype), v in zip(layout, values, strict=True)))

    def read(self, path: str) -> "JournalRead[R]":
        """Every whole record of the file, in order (none if it does not exist)."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return JournalRead((), False, 0, ())
        frames = list(_frames(data))
        ends = tuple(itertools.accumulate(_HEADER.size + len(payload) for payload in frames))
        whole = ends[-1] if ends else 0
        return JournalRead(tuple(self.decode(p) for p in frames), whole != len(data), whole, ends)


@dataclass(frozen=True, slots=True)
class JournalRead(Generic[R]):
    records: tuple[R, ...]
    torn: bool  # the last record was cut short or corrupt (the writer died mid-write): ignored
    num_bytes: int = 0  # of the whole records: where an append may go on (truncate_to)
    ends: tuple[int, ...] = ()  # the file offset after each record


def append_frame(path: str, frame: bytes) -> None:
    """Append one encoded record (JournalCodec.encode) to `path`, creating it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        view = memoryview(frame)
        while view:  # a regular file takes it whole; a short write is resumed, not lost
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def truncate_to(path: str, num_bytes: int) -> None:
    """Cut a torn tail off, so that appends go on after the last whole record."""
    os.truncate(path, num_bytes)


def remove_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _frames(data: bytes) -> Iterator[bytes]:
    """The payload of each whole frame, up to the first that is not."""
    at = 0
    while at + _HEADER.size <= len(data):
        magic, size, crc = _HEADER.unpack_from(data, at)
        payload = data[at + _HEADER.size:at + _HEADER.size + size]
        if magic != _MAGIC or len(payload) != size or zlib.crc32(payload) != crc:
            return
        yield payload
        at += _HEADER.size + size
