"""The turn gate: every agent loop passes it before each generate call, so weights change
only at turn boundaries.

Closing the gate stops new turns from starting, lets turns already generating finish, and
returns once none is in flight ("drained"). Tools keep running while it is closed: only
generation waits. The time turns spend waiting here is reported as queue time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from envs.types import TrajectoryImage
    from rollout.engine import Sampling, TokenOutput
    from rollout.router import Router


class TurnGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()  # set while no turn is generating
        self._idle.set()
        self._num_generating = 0
        self._closed_since: float | None = None
        self.closed_s = 0.0  # total seconds the gate was closed

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def num_generating(self) -> int:
        return self._num_generating

    @asynccontextmanager
    async def turn(self) -> AsyncGenerator[float, None]:
        """Hold the gate for one generate call; yields the seconds spent waiting for it."""
        start = time.monotonic()
        while not self._open.is_set():  # loop: the gate may close again before we run
            await self._open.wait()
        self._num_generating += 1
        self._idle.clear()
        try:
            yield time.monotonic() - start
        finally:
            self._num_generating -= 1
            if self._num_generating == 0:
                self._idle.set()

    async def close(self) -> None:
        """Stop new turns and return once every turn in flight has finished generating."""
        if self._open.is_set():
            self._open.clear()
            self._closed_since = time.monotonic()
        await self._idle.wait()

    def open(self) -> None:
        if self._closed_since is not None:
            self.closed_s += time.monotonic() - self._closed_since
            self._closed_since = None
        self._open.set()


@dataclass(frozen=True, slots=True)
class GeneratedTurn:
    output: TokenOutput
    engine: str  # the engine that generated it
    queue_s: float  # waiting at the turn gate
    generate_s: float


class LocalTurns:
    """One model turn through this process's turn gate and sticky router: what an agent
    loop's `ctx.generate` and an in-process gateway both do."""

    def __init__(self, router: Router, gate: TurnGate) -> None:
        self.router, self.gate = router, gate

    async def generate_turn(self, router_session: str, request_id: str,
                            prompt_ids: Sequence[int] | np.ndarray, sampling: Sampling,
                            images: tuple[TrajectoryImage, ...] = ()) -> GeneratedTurn:
        ids = prompt_ids if isinstance(prompt_ids, (np.ndarray, list)) else list(prompt_ids)
        async with self.gate.turn() as queue_s:
            start = time.monotonic()
            routed = await self.router.generate(router_session, request_id, ids, sampling, images)
        return GeneratedTurn(routed.output, routed.engine, queue_s, time.monotonic() - start)
