"""The event-loop watchdog of an agent-loop worker: a thread of its own notices when the
worker's event loop stops turning (a tool or a reward function doing blocking work on it,
so every trajectory of the worker waits and no timeout can fire), says which tool or
which line of code, and bounds a blocking tool.

Why a thread: a watchdog that runs on the loop it watches wakes only after the block
ends, so a tool that sleeps ten minutes is reported ten minutes late. The thread reads a
heartbeat the loop writes every PROBE_S and, when it is late, the loop's current asyncio
task and the loop thread's stack.

What a stall leads to (a tool is blamed only when the same call of it was on the loop's
stack at every tick of the stall: a loop merely saturated by many short steps, thousands of
trajectories waking together, is as late, and a tick then often lands inside some tool):
- after STALL_S with a tool executing on the loop: a warning naming the tool, repeated
  every REPORT_S while the block lasts; from then on the tool's calls run on a thread (as
  if it declared `blocking = True`), where agent.tool_timeout_s holds;
- after agent.tool_timeout_s: ToolBlockedLoop is raised inside the tool, and the call
  ends as a timeout observation. Python delivers it at the tool's next bytecode: at once
  for Python code, when a single blocking C call returns (time.sleep, a socket read: no
  thread can interrupt those), so the warnings say so;
- with no tool executing (a reward function, an agent loop's own code): a warning with the
  blocked line after REPORT_S, so an import or a loaded machine is not blamed on a plug-in.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import sys
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from types import CodeType, FrameType

log = logging.getLogger(__name__)

PROBE_S = 0.25  # the heartbeat's period and the watchdog's tick
STALL_S = 1.0  # a heartbeat this late means the loop is blocked
REPORT_S = 30.0  # how often a lasting block is reported again


class ToolBlockedLoop(Exception):
    """Raised inside a tool that kept its worker's event loop blocked longer than its timeout."""


class ToolActivity:
    """Which tool each asyncio task of a worker is executing on the event loop, and the
    tools that were found blocking it (they run on a thread from then on)."""

    def __init__(self) -> None:
        self.on_loop: dict[asyncio.Task | None, str] = {}
        self.blocking: set[str] = set()

    @contextlib.contextmanager
    def executing(self, name: str) -> Generator[None, None, None]:
        task = asyncio.current_task()
        self.on_loop[task] = name
        try:
            yield
        finally:
            self.on_loop.pop(task, None)


@dataclass(slots=True)
class _Stall:
    tool: str | None
    reported_at: float  # monotonic; 0.0 before the first report
    stopped: bool = False  # ToolBlockedLoop was raised in the tool


class LoopWatchdog:
    """Watches the event loop that calls `start()`; `num_stalls` counts blocks blamed on a tool."""

    def __init__(self, activity: ToolActivity, tool_code: CodeType, bound_s: float, *,
                 probe_s: float = PROBE_S, stall_s: float = STALL_S,
                 report_s: float = REPORT_S) -> None:
        self.activity = activity
        self.tool_code = tool_code  # the code of the frame that runs a tool on the loop
        self.bound_s = bound_s
        self.probe_s, self.stall_s, self.report_s = probe_s, stall_s, report_s
        self.num_stalls = 0
        self._beat = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._heartbeat: asyncio.Task | None = None  # held: a task nothing refers to can be collected
        self.thread: threading.Thread | None = None  # the watching thread, once started

    def start(self) -> None:
        """Start watching the running loop (once; later calls do nothing)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._heartbeat = self._loop.create_task(self._beats())
        self.thread = threading.Thread(target=self._watch, name="sluice-loop-watchdog", daemon=True)
        self.thread.start()

    async def _beats(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(self.probe_s)

    def _watch(self) -> None:
        stall: _Stall | None = None
        loop = self._loop
        assert loop is not None
        held: tuple[asyncio.Task | None, FrameType] | None = None  # the tool call seen last tick
        held_since = 0.0
        while True:
            time.sleep(self.probe_s)
            if loop.is_closed():  # the worker's loop is gone (asyncio.run ended): so is the watch
                return
            now = time.monotonic()
            if not loop.is_running():  # between runs nothing beats, and nothing is blocked
                self._beat, stall, held = now, None, None
                continue
            # A late heartbeat alone blames no tool (a saturated loop is late too): only the
            # same tool call, seen tick after tick for the whole stall, has held the loop.
            holder = self._tool_call_on_stack()
            if holder is None or held is None or holder[0] is not held[0] or holder[1] is not held[1]:
                held_since = now
            held = holder
            blocked = now - self._beat - self.probe_s
            if blocked <= self.stall_s:
                if stall is not None and stall.reported_at:
                    log.warning("the event loop turns again (%s)",
                                f"tool {stall.tool!r} returned" if stall.tool else "unblocked")
                stall = None
                continue
            tool = self._tool_blocking(held, now - held_since)
            if stall is None or stall.tool != tool:
                stall = _Stall(tool, 0.0)
                if tool is not None:
                    self.num_stalls += 1
                    self.activity.blocking.add(tool)
            if tool is not None:
                if not stall.reported_at or now - stall.reported_at >= self.report_s:
                    stall.reported_at = now
                    self._report_tool(tool, blocked, stall.stopped)
                if not stall.stopped and blocked > self.bound_s:
                    stall.stopped = self._raise_in_tool()
            elif blocked >= self.report_s and now - stall.reported_at >= self.report_s:
                stall.reported_at = now
                log.warning("the event loop of this agent-loop worker has been blocked for %.0f s "
                            "at %s; every trajectory of the worker waits. Move blocking work off "
                            "the loop (`await asyncio.to_thread(...)`)", blocked, self._blocked_at())

    def _tool_call_on_stack(self) -> tuple[asyncio.Task | None, FrameType] | None:
        """(the loop's current task, the frame of the tool call it is in), when the loop
        thread is inside a tool call now."""
        assert self._loop is not None
        frame = next((f for f in self._stack() if f.f_code is self.tool_code), None)
        return None if frame is None else (asyncio.current_task(self._loop), frame)

    def _tool_blocking(self, held: tuple[asyncio.Task | None, FrameType] | None,
                       held_s: float) -> str | None:
        """The tool whose call has held the loop for the stall (`held`, seen `held_s` on
        end), if a tool's has: the first tick may come up to one probe after it began."""
        if held is None or held_s < self.stall_s - self.probe_s:
            return None
        return self.activity.on_loop.get(held[0])

    def _stack(self) -> list[FrameType]:
        frame = sys._current_frames().get(self._loop_thread)
        frames = []
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        return frames

    def _in_tool(self) -> bool:
        return any(f.f_code is self.tool_code for f in self._stack())

    def _blocked_at(self) -> str:
        frames = self._stack()
        if not frames:
            return "an unknown place"
        f = frames[0]
        return f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})"

    def _report_tool(self, tool: str, blocked: float, stopped: bool) -> None:
        if stopped:
            log.warning("tool %r still blocks the event loop (%.0f s, at %s): it was told to stop "
                        "after agent.tool_timeout_s=%g s, which Python delivers only when its "
                        "blocking call returns", tool, blocked, self._blocked_at(), self.bound_s)
            return
        log.warning("tool %r has blocked the event loop of this agent-loop worker for %.1f s (at "
                    "%s); every trajectory of the worker waits and no timeout can fire. It is "
                    "stopped after agent.tool_timeout_s=%g s and runs on a thread from now on. "
                    "Fix the tool: `await asyncio.to_thread(...)` around blocking work, or "
                    "`blocking = True` on its class", tool, blocked, self._blocked_at(), self.bound_s)

    def _raise_in_tool(self) -> bool:
        """Raise ToolBlockedLoop in the loop thread if it is still inside the tool; True if raised."""
        set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
        thread = ctypes.c_ulong(self._loop_thread)
        if set_async_exc(thread, ctypes.py_object(ToolBlockedLoop)) != 1:
            return False
        if not self._in_tool():  # the tool returned meanwhile: take it back
            set_async_exc(thread, None)
            return False
        return True
