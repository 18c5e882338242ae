"""The bound on forming a weight group's communicator (rollout.weight_group.build_within):
ncclCommInitRank blocks until every rank calls it, so a rank that reached the store but
never initialises must not hold the others. A blocking factory stands in for NCCL here."""

from __future__ import annotations

import threading
import time

import pytest

from rollout.weight_group import ABORT_KEY, AbortFlag, WeightGroupError, build_within


class DictStore:
    """The two calls AbortFlag makes of torch's TCPStore."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)


def test_a_set_up_that_never_returns_is_left_within_the_bound_and_its_late_result_discarded():
    store, release, discarded = DictStore(), threading.Event(), []

    def hangs() -> str:
        release.wait(30)
        return "communicator"

    start = time.monotonic()
    with pytest.raises(WeightGroupError, match="NCCL set-up did not finish within 0.3s"):
        build_within(hangs, 0.3, AbortFlag(store), discarded.append, what="NCCL set-up")
    assert time.monotonic() - start < 5
    assert ABORT_KEY in store.keys  # the other ranks stop waiting too
    release.set()  # NCCL returns at last: nobody waits for it, so it is freed
    deadline = time.monotonic() + 5
    while not discarded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert discarded == ["communicator"]


def test_another_rank_giving_up_ends_the_wait_before_the_bound():
    store, release = DictStore(), threading.Event()
    store.set(ABORT_KEY, "1")
    start = time.monotonic()
    with pytest.raises(WeightGroupError, match="another rank gave up"):
        build_within(lambda: release.wait(30), 20.0, AbortFlag(store), lambda _: None, what="set-up")
    assert time.monotonic() - start < 5
    release.set()


def test_a_set_up_that_returns_or_raises_is_passed_through():
    store = DictStore()
    assert build_within(lambda: 7, 5.0, AbortFlag(store), lambda _: None, what="set-up") == 7
    assert ABORT_KEY not in store.keys

    def fails() -> int:
        raise RuntimeError("NCCL error: unhandled system error")

    with pytest.raises(RuntimeError, match="unhandled system error"):
        build_within(fails, 5.0, AbortFlag(store), lambda _: None, what="set-up")
    assert ABORT_KEY in store.keys  # the others would wait for this rank in their own set-up
