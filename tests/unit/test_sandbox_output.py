"""Head-and-tail output capture, checked against hand-computed cuts. Pure and fast (it
belongs with the unit tests; it sits here with the other sandbox tests)."""

from __future__ import annotations

import pytest

from envs.sandbox.output import HeadTailBuffer, cut_marker, render_streams, split_budget


def feed_all(buffer: HeadTailBuffer, data: bytes, chunk: int) -> None:
    for i in range(0, len(data), chunk):
        buffer.feed(data[i:i + chunk])


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 10_000])
def test_head_and_tail_survive_any_chunking(chunk: int) -> None:
    data = bytes(range(256)) * 4  # 1024 bytes
    buffer = HeadTailBuffer(100)
    feed_all(buffer, data, chunk)
    text, cut = buffer.render(100)
    assert cut and buffer.total_bytes == 1024
    assert text == data[:50] + cut_marker(924) + data[-50:]


def test_short_output_is_kept_whole() -> None:
    buffer = HeadTailBuffer(100)
    feed_all(buffer, b"x" * 100, 7)
    assert buffer.render(100) == (b"x" * 100, False)


def test_render_within_a_smaller_budget_cuts_more() -> None:
    buffer = HeadTailBuffer(100)
    buffer.feed(b"a" * 50 + b"b" * 50)  # kept whole, but only 10 bytes fit
    assert buffer.render(10) == (b"a" * 5 + cut_marker(90) + b"b" * 5, True)


@pytest.mark.parametrize("sizes, budget, expected", [
    ((10, 20), 100, (10, 20)),  # both fit
    ((500, 500), 100, (50, 50)),  # both over: halves
    ((500, 3), 100, (97, 3)),  # stderr small: stdout gets the rest
    ((3, 500), 100, (3, 97)),
])
def test_split_budget(sizes: tuple[int, int], budget: int, expected: tuple[int, int]) -> None:
    assert split_budget(sizes, budget) == expected


def test_render_streams_decodes_with_replacement() -> None:
    out, err = HeadTailBuffer(64), HeadTailBuffer(64)
    out.feed(b"ok \xff")
    err.feed("é".encode()[:1])  # half of a two-byte character
    assert render_streams(out, err, 64) == ("ok \ufffd", "\ufffd", False)
