"""The run's signal handling (trainer.run.system.StopSignals) with real signals: the first
SIGINT or SIGTERM stops the controller (or, before it exists, cancels the start-up), the
second cancels the run at once."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from trainer.run.system import StopSignals


class StandInController:
    def __init__(self) -> None:
        self.stopped = 0

    def stop(self) -> None:
        self.stopped += 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_first_signal_stops_the_controller_second_cancels(sig):
    main = asyncio.current_task()
    signals = StopSignals(main)
    signals.controller = StandInController()
    try:
        os.kill(os.getpid(), sig)
        await asyncio.sleep(0.05)
        assert signals.controller.stopped == 1  # stop at the next step boundary
        os.kill(os.getpid(), sig)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(5)  # the second signal cancels the run's task
        main.uncancel()
    finally:
        signals.close()


async def test_a_signal_during_start_up_cancels_it():
    async def starting_up():
        signals = StopSignals(asyncio.current_task())
        try:
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(5)  # e.g. waiting for an engine to start
        finally:
            signals.close()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(starting_up())
