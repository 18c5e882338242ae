"""Group deadlines (`buffer.group_deadline_s`): run a group's samples and cut the ones still
running when its deadline passes, so that one straggler (a hung build, a 30-minute test
run) cannot hold a training step hostage.

A cut sample's coroutine sees an ordinary cancellation with `cut.is_set()` true; it ends
what it holds (its sandbox, its router session) and returns what it has as a
`TerminationReason.DEADLINE` trajectory instead of raising. What the group becomes (dropped,
or trained on its finished samples) is the replay buffer's straggler policy. The agent-loop
worker and the simulator's rollout sides share this one mechanism.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

T = TypeVar("T")


class DeadlineCut:
    """Set once a group's deadline passed and its unfinished samples are being cut."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


async def gather_by_deadline(samples: Sequence[Awaitable[T]], deadline_s: float | None,
                             cut: DeadlineCut) -> list[T]:
    """The results of `samples` in order. With a deadline, the samples still running
    `deadline_s` after the call are cancelled with `cut` set; each must then return its
    cut result (see `absorb_cut`). Cancelling this call cancels every sample."""
    tasks = [asyncio.ensure_future(s) for s in samples]
    try:
        if deadline_s is not None:
            _, pending = await asyncio.wait(tasks, timeout=deadline_s)
            if pending:
                cut.set()
                for task in pending:
                    task.cancel()
        return list(await asyncio.gather(*tasks))
    finally:  # cancelled from outside (the run stops) or a sample raised: no sample outlives the call
        for task in tasks:
            task.cancel()  # a no-op for the finished ones
        await asyncio.gather(*tasks, return_exceptions=True)


def absorb_cut(cut: DeadlineCut | None) -> bool:
    """Called in a sample's `except asyncio.CancelledError`: True, with the cancellation
    absorbed, when it is the group's deadline cutting the sample (return the cut
    result); False for any other cancellation (re-raise it)."""
    if cut is None or not cut.is_set():
        return False
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    return True
