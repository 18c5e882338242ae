"""Bounded capture of a command's stdout and stderr: the head and the tail of each stream
are kept, the middle is counted and replaced by a marker, so a command that prints
forever costs a fixed amount of memory."""

from __future__ import annotations

import asyncio

_READ_CHUNK = 65_536


def cut_marker(num_bytes: int) -> bytes:
    return f"\n[... {num_bytes} bytes cut ...]\n".encode()


class HeadTailBuffer:
    """Keeps the first `capacity // 2` and the last `capacity - capacity // 2` bytes fed."""

    def __init__(self, capacity: int) -> None:
        self._head_cap = capacity // 2
        self._tail_cap = capacity - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total_bytes = 0

    def feed(self, chunk: bytes) -> None:
        self.total_bytes += len(chunk)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail += chunk[-self._tail_cap:]
            excess = len(self._tail) - self._tail_cap
            if excess > 0:
                del self._tail[:excess]

    def render(self, budget: int) -> tuple[bytes, bool]:
        """At most `budget` bytes of the stream (plus a marker), and whether any was cut."""
        kept = len(self._head) + len(self._tail)
        if kept == self.total_bytes and kept <= budget:
            return bytes(self._head + self._tail), False
        head_n = min(len(self._head), budget // 2)
        tail_n = min(len(self._tail), budget - head_n)
        cut = self.total_bytes - head_n - tail_n
        tail = self._tail[len(self._tail) - tail_n:] if tail_n else b""
        return bytes(self._head[:head_n]) + cut_marker(cut) + bytes(tail), True


def split_budget(sizes: tuple[int, int], budget: int) -> tuple[int, int]:
    """Share `budget` between two streams: each gets half, and what one does not need
    goes to the other (so a command printing only to stdout gets the whole budget)."""
    first, second = sizes
    if first + second <= budget:
        return first, second
    half = budget // 2
    if first < half:
        return first, budget - first
    if second < budget - half:
        return budget - second, second
    return half, budget - half


async def pump(stream: asyncio.StreamReader, buffer: HeadTailBuffer) -> None:
    """Read `stream` to EOF into `buffer`."""
    while chunk := await stream.read(_READ_CHUNK):
        buffer.feed(chunk)


def render_streams(stdout: HeadTailBuffer, stderr: HeadTailBuffer,
                   budget: int) -> tuple[str, str, bool]:
    """Decoded stdout and stderr within `budget` bytes together, and whether any was cut."""
    out_budget, err_budget = split_budget((stdout.total_bytes, stderr.total_bytes), budget)
    out, out_cut = stdout.render(out_budget)
    err, err_cut = stderr.render(err_budget)
    return (out.decode("utf-8", errors="replace"), err.decode("utf-8", errors="replace"),
            out_cut or err_cut)
