"""SandboxPool: the sandboxes of one sandbox worker, shared by many trajectories.

It keeps `num_warm` generic sandboxes ready so a trajectory without task files starts
without waiting for a create, creates per-task sandboxes on demand, caps the live total
at `max_sandboxes` with a FIFO queue for the callers beyond it, and shields callers from
sandboxes that break: such an exec returns an error ExecResult (exit code
SANDBOX_FAULT_EXIT_CODE) after the pool recreated the sandbox from its last snapshot.

    acquire(spec) --generic, warm ready--> warm deque ------------------+
         |        --slot free (or an idle warm one evicted)--> create --+--> lease (id)
         +--all slots busy--> FIFO waiters, woken by release/refill ----+
    release(lease) -> teardown -> slot to the oldest waiter, else warm refill

SandboxPool does admission, the warm pool and the metrics; each lease's sandbox lives in
a LeasedSandbox, which serializes its operations, snapshots it and recreates it.

Snapshot policy: a sandbox's state lives in its workspace, and a tar of it costs time
proportional to its size (a repository: tens of ms to seconds), so tarring after every
command would double the cost of the short commands agents mostly run. Instead a lease
is marked dirty by each exec or write and a snapshot is taken in the background (so it
overlaps the model's next generation) after the first change and then at most once per
`snapshot_interval_s`; `checkpoint` takes one on demand. A crash therefore loses at most
the changes of one interval, and before any change the spec itself (source_dir) is the
exact initial state. `snapshot_interval_s=0` snapshots after every change.

Final workspace: before a trajectory releases its sandbox, `workspace_changes` snapshots
it a last time and compares the tar with the spec's source_dir here, on the pool's host,
so only the changed files (capped) travel back to the caller and on to grading.

Crash detection: a backend exception during exec is a crash. A broken launcher looks
like a failing command (the local backend reports a vanished workspace as bwrap's exit
1), so an exec that failed without any stdout is followed by a probe (`true`); if the
probe fails too the sandbox is broken. Failing commands that print something (most
test runs) are never probed.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import logging
import math
import os
import shutil
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from envs.sandbox.backends import load_sandbox_backend
from envs.sandbox.base import (ExecResult, Sandbox, SandboxLimits, SandboxRole, SandboxSpec,
                               Snapshot, build_sandbox_limits)
from envs.sandbox.changes import changes_from_snapshot
from envs.types import WorkspaceChanges
from envs.config import EnvsConfig

log = logging.getLogger(__name__)

SandboxFactory = Callable[[SandboxSpec], Awaitable[Sandbox]]

# Exit code of an ExecResult the pool made up because the sandbox itself failed; no
# command can exit with a negative code, so the model and the metrics can tell them apart.
SANDBOX_FAULT_EXIT_CODE = -1
PROBE_TIMEOUT_S = 10.0
EXEC_BUCKETS_S = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
QUEUE_BUCKETS_S = (0.001, 0.01, 0.1, 1.0, 10.0, 60.0, 600.0)
CREATE_BUCKETS_S = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
_WINDOW = 4096  # recent samples kept per duration for p50/p99
_MAX_REFILL_BACKOFF_S = 60.0


@dataclass(frozen=True, slots=True)
class SandboxLease:
    """A caller's claim on one pool sandbox. Only ids: it is picklable, so remote callers
    address the sandbox through the pool's Ray actor with it."""

    pool: str  # name of the pool that owns the sandbox
    sandbox_id: str
    warm: bool  # taken from the warm pool (no create on the caller's path)
    queue_wait_s: float  # time spent waiting for a free slot


class SandboxProvider(Protocol):
    """Where sandbox tools get their sandbox: the in-process SandboxPool or a client of
    its Ray actor. Every call but acquire addresses the sandbox by its lease."""

    async def acquire(self, spec: SandboxSpec) -> SandboxLease: ...

    async def release(self, lease: SandboxLease) -> None: ...

    async def exec(self, lease: SandboxLease, cmd: str | list[str], timeout_s: float,
                   stdin: str | None = None) -> ExecResult: ...

    async def read_file(self, lease: SandboxLease, path: str) -> bytes: ...

    async def write_file(self, lease: SandboxLease, path: str, data: bytes) -> None: ...

    async def checkpoint(self, lease: SandboxLease) -> None:
        """Snapshot the sandbox now, so a crash restores at least this state."""
        ...

    async def workspace_changes(self, lease: SandboxLease, max_bytes: int) -> WorkspaceChanges:
        """The sandbox's workspace now, as changes against its spec's source_dir; over
        `max_bytes` of changed files: a WorkspaceChanges with a problem and no files."""
        ...

    async def save_state(self, lease: SandboxLease, path: str) -> int:
        """Snapshot the sandbox now and keep the snapshot at `path` (a file on the pool's
        node, which outlives the pool: a durable trajectory's turn boundary); its bytes."""
        ...

    async def restore_state(self, lease: SandboxLease, path: str) -> None:
        """Put the state `save_state` kept at `path` into the lease's sandbox."""
        ...


class SandboxUnavailableError(RuntimeError):
    """The lease's sandbox broke and could not be recreated."""


@dataclass(frozen=True, slots=True)
class DurationSummary:
    """Durations seen so far: exact count, total and max; p50/p99 over the most recent
    samples; `counts[i]` durations <= `bounds_s[i]`, the last entry those above all."""

    count: int
    total_s: float
    max_s: float
    p50_s: float
    p99_s: float
    bounds_s: tuple[float, ...]
    counts: tuple[int, ...]


class DurationRecorder:
    """Bucketed counts plus a bounded window of recent samples: O(1) per sample."""

    def __init__(self, bounds_s: tuple[float, ...]) -> None:
        self._bounds_s = bounds_s
        self._counts = [0] * (len(bounds_s) + 1)
        self._recent: deque[float] = deque(maxlen=_WINDOW)
        self._total_s = 0.0
        self._max_s = 0.0

    def record(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._bounds_s, seconds)] += 1
        self._recent.append(seconds)
        self._total_s += seconds
        self._max_s = max(self._max_s, seconds)

    def summary(self) -> DurationSummary:
        ordered = sorted(self._recent)

        def quantile(q: float) -> float:
            if not ordered:
                return 0.0
            return ordered[max(0, min(len(ordered), math.ceil(q * len(ordered))) - 1)]

        return DurationSummary(count=sum(self._counts), total_s=self._total_s, max_s=self._max_s,
                               p50_s=quantile(0.5), p99_s=quantile(0.99),
                               bounds_s=self._bounds_s, counts=tuple(self._counts))


@dataclass(slots=True)
class PoolCounters:
    """Running totals behind PoolStats; only the pool's event loop writes them."""

    num_acquires: int = 0
    num_warm_hits: int = 0  # acquires served from the warm pool
    num_evictions: int = 0  # warm sandboxes released to make room for a per-task one
    num_create_failures: int = 0
    num_execs: int = 0  # commands run (sandbox faults excluded)
    num_timeouts: int = 0  # commands killed by their wall-clock limit
    num_oom_kills: int = 0  # commands that lost a process to the memory limit
    num_crashes: int = 0  # sandboxes found broken
    num_recreates: int = 0  # broken sandboxes recreated (from their last snapshot)
    num_recreate_failures: int = 0
    num_snapshots: int = 0
    num_snapshot_failures: int = 0


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A point-in-time view of one pool; the num_* totals are PoolCounters' fields."""

    max_sandboxes: int
    num_in_use: int  # leased to callers
    num_warm: int  # created and waiting for a generic acquire
    num_creating: int  # being created (warm refills and on-demand creates)
    queue_length: int  # callers waiting for a slot
    queue_wait: DurationSummary  # of every acquire, ~0 for those admitted at once
    create: DurationSummary  # latency of the backend's create
    exec: DurationSummary  # duration of commands (sandbox faults excluded)
    num_acquires: int
    num_warm_hits: int
    num_evictions: int
    num_create_failures: int
    num_execs: int
    num_timeouts: int
    num_oom_kills: int
    num_crashes: int
    num_recreates: int
    num_recreate_failures: int
    num_snapshots: int
    num_snapshot_failures: int
    # Task images on this pool's node after prewarm (envs.sandbox.images; set by the
    # pool actor): already present, loaded from an archive, pulled.
    num_images_ready: int = 0
    num_images_loaded: int = 0
    num_images_pulled: int = 0


Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


class LeasedSandbox:
    """One lease's sandbox: runs its operations one at a time (so snapshots see a quiet
    workspace), snapshots it by the policy of the module docstring, and replaces it by a
    restored one when it breaks."""

    def __init__(self, spec: SandboxSpec, sandbox: Sandbox, *, create: SandboxFactory,
                 counters: PoolCounters, exec_time: DurationRecorder, spawn: Spawn,
                 snapshot_interval_s: float, max_recreates: int, label: str) -> None:
        self.spec = spec
        self.sandbox: Sandbox | None = sandbox  # None after a crash whose recreate failed
        self._create = create
        self._counters = counters
        self._exec_time = exec_time
        self._spawn = spawn
        self._snapshot_interval_s = snapshot_interval_s
        self._max_recreates = max_recreates
        self._label = label
        self._lock = asyncio.Lock()
        self._snapshot: Snapshot | None = None
        self._snapshot_at = -math.inf  # the first change is snapshotted at once
        self._dirty = False
        self._snapshot_task: asyncio.Task[None] | None = None
        self._num_recreates = 0
        self._released = False

    async def exec(self, cmd: str | list[str], timeout_s: float,
                   stdin: str | None) -> ExecResult:
        async with self._lock:
            result = await self._guarded_exec(cmd, timeout_s, stdin)
        self._maybe_snapshot()
        return result

    async def _guarded_exec(self, cmd: str | list[str], timeout_s: float,
                            stdin: str | None) -> ExecResult:
        if self.sandbox is None:  # a previous recreate failed: try again
            return await self._recreate("it broke earlier")
        try:
            result = await self.sandbox.exec(cmd, timeout_s, stdin)
        except Exception as exc:  # the backend itself failed, not the command
            return await self._recover(f"{type(exc).__name__}: {exc}")
        if (result.exit_code != 0 and not result.stdout and not result.timed_out
                and not result.oom_killed and not await _is_healthy(self.sandbox)):
            return await self._recover(result.stderr.strip()[-500:]
                                       or f"exit code {result.exit_code}")
        c = self._counters
        c.num_execs += 1
        c.num_timeouts += result.timed_out
        c.num_oom_kills += result.oom_killed
        self._exec_time.record(result.duration_s)
        self._dirty = True
        return result

    async def _recover(self, reason: str) -> ExecResult:
        self._counters.num_crashes += 1
        log.warning("%s: sandbox broke (%s); recreating", self._label, reason)
        broken, self.sandbox = self.sandbox, None
        if broken is not None:
            await _release_quietly(broken, self._label)
        return await self._recreate(reason)

    async def _recreate(self, reason: str) -> ExecResult:
        """Replace the broken sandbox by a new one restored from the last snapshot."""
        if self._num_recreates >= self._max_recreates:
            return _fault(f"the sandbox broke ({reason}) and was already recreated "
                          f"{self._num_recreates} times; it is gone, so stop using it")
        self._num_recreates += 1
        try:
            self.sandbox = await self._restored()
        except Exception as exc:  # create/restore of any backend may fail in any way: the caller gets a fault result
            self._counters.num_recreate_failures += 1
            log.error("%s: recreating a sandbox failed: %s", self._label, exc)
            return _fault(f"the sandbox broke ({reason}) and could not be recreated yet; "
                          "try again later")
        self._counters.num_recreates += 1
        self._dirty = False
        origin = "its last checkpoint" if self._snapshot else "the task's initial files"
        return _fault(f"the sandbox broke ({reason}) and was recreated from {origin}; changes "
                      "made after that are lost. Check the files and run the command again.")

    async def _restored(self) -> Sandbox:
        sandbox = await self._create(self.spec)
        if self._snapshot is None:
            return sandbox
        try:
            await sandbox.restore(self._snapshot)
        except BaseException:  # cancellation included: the half-made sandbox is released, then re-raised
            await _release_quietly(sandbox, self._label)
            raise
        return sandbox

    async def read_file(self, path: str) -> bytes:
        async with self._lock:
            return await self._live().read_file(path)

    async def write_file(self, path: str, data: bytes) -> None:
        async with self._lock:
            await self._live().write_file(path, data)
            self._dirty = True
        self._maybe_snapshot()

    async def checkpoint(self) -> None:
        async with self._lock:
            await self._snapshot_locked()

    async def save_state(self, path: str) -> int:
        """A snapshot now, kept at `path` too (a hard link where it can be: no copy)."""
        async with self._lock:
            if self._dirty or self._snapshot is None:
                await self._snapshot_locked()
            snapshot = self._snapshot
            assert snapshot is not None
            await asyncio.to_thread(_keep_at, snapshot.tar_path, path)
            return snapshot.num_bytes

    async def restore_state(self, path: str) -> None:
        async with self._lock:
            await self._live().restore(Snapshot(path, os.path.getsize(path)))
            self._dirty = True  # the pool's own snapshot is taken from the sandbox, never `path`
        self._maybe_snapshot()

    async def workspace_changes(self, max_bytes: int) -> WorkspaceChanges:
        """The workspace now versus the spec's source_dir. A broken sandbox whose recreate
        failed is represented by its last snapshot: the state the agent would get back."""
        async with self._lock:
            if self.sandbox is not None and (self._dirty or self._snapshot is None):
                await self._snapshot_locked()
            if self._snapshot is None:  # broken before any snapshot: the spec's own files
                return WorkspaceChanges()
            return await asyncio.to_thread(changes_from_snapshot, self._snapshot,
                                           self.spec.source_dir, max_bytes)

    def _live(self) -> Sandbox:
        if self.sandbox is None:
            raise SandboxUnavailableError("the sandbox broke and could not be recreated yet; "
                                          "run a command to retry")
        return self.sandbox

    def _maybe_snapshot(self) -> None:
        due = time.monotonic() - self._snapshot_at >= self._snapshot_interval_s
        if self._dirty and due and self._snapshot_task is None and not self._released:
            self._snapshot_task = self._spawn(self._background_snapshot())

    async def _background_snapshot(self) -> None:
        try:
            async with self._lock:
                if self._dirty and not self._released:  # else a checkpoint came first
                    await self._snapshot_locked()
        except Exception as exc:  # the next exec finds out whether the sandbox broke
            self._counters.num_snapshot_failures += 1
            log.warning("%s: snapshot failed: %s", self._label, exc)
        finally:
            self._snapshot_task = None

    async def _snapshot_locked(self) -> None:
        dirty, self._dirty = self._dirty, False  # an op after this one marks it again
        try:
            snapshot = await self._live().snapshot()
        except BaseException:  # cancellation included: the dirty mark comes back, then re-raised
            self._dirty = dirty
            raise
        previous, self._snapshot = self._snapshot, snapshot
        self._snapshot_at = time.monotonic()
        self._counters.num_snapshots += 1
        if previous is not None:
            previous.discard()

    async def teardown(self) -> None:
        """Release the sandbox and delete the snapshot; later calls fail."""
        self._released = True
        try:
            if self._snapshot_task is not None:
                await asyncio.wait([self._snapshot_task])  # its tar must not outlive us
            if self.sandbox is not None:
                await _release_quietly(self.sandbox, self._label)
        finally:
            if self._snapshot is not None:
                self._snapshot.discard()


@dataclass(frozen=True, slots=True)
class _Grant:
    """What an admitted caller gets: a warm sandbox, or a slot to create in (after the
    evicted warm sandbox that held the slot is gone)."""

    warm: Sandbox | None = None
    evicted: Sandbox | None = None


@dataclass(frozen=True, slots=True)
class _Waiter:
    spec: SandboxSpec
    future: asyncio.Future[_Grant]


class SandboxPool:
    """See the module docstring: admission, the warm pool and the metrics live here, each
    lease's sandbox in a LeasedSandbox. All methods run on one event loop."""

    def __init__(self, factory: SandboxFactory, *, max_sandboxes: int, num_warm: int,
                 warm_limits: SandboxLimits | None = None, snapshot_interval_s: float = 30.0,
                 max_recreates: int = 3, name: str = "sandbox-pool") -> None:
        if max_sandboxes < 1:
            raise ValueError(f"envs.sandboxes_per_worker={max_sandboxes} must be >= 1")
        if not 0 <= num_warm <= max_sandboxes:
            raise ValueError(f"envs.num_warm_sandboxes={num_warm} must be between 0 and "
                             f"envs.sandboxes_per_worker={max_sandboxes}; lower it")
        if snapshot_interval_s < 0 or max_recreates < 0:
            raise ValueError("snapshot_interval_s and max_recreates must be >= 0, got "
                             f"{snapshot_interval_s} and {max_recreates}")
        self.name = name
        self._factory = factory
        self._max = max_sandboxes
        self._num_warm_target = num_warm
        self._warm_spec = SandboxSpec(limits=warm_limits or SandboxLimits())
        self._snapshot_interval_s = snapshot_interval_s
        self._max_recreates = max_recreates
        self._leases: dict[str, LeasedSandbox] = {}
        self._warm: deque[Sandbox] = deque()
        self._waiters: deque[_Waiter] = deque()  # cancelled ones are dropped at the head
        self._num_waiting = 0
        self._num_live = 0  # warm + leased + being created: what counts against the cap
        self._num_creating = 0
        self._num_warm_creating = 0
        self._refill_backoff_s = 0.0
        self._refill_paused = False
        self._refill_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ids = itertools.count()
        self._closed = False
        self._counters = PoolCounters()
        self._queue_wait = DurationRecorder(QUEUE_BUCKETS_S)
        self._create_latency = DurationRecorder(CREATE_BUCKETS_S)
        self._exec_time = DurationRecorder(EXEC_BUCKETS_S)

    # ---- admission -------------------------------------------------------------------

    async def start(self) -> None:
        """Create the warm sandboxes and wait until they are ready (or failed)."""
        self._refill()
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending)

    async def acquire(self, spec: SandboxSpec) -> SandboxLease:
        """A sandbox for `spec`: a warm one if the spec is generic (no source_dir, the
        warm limits), else a new one. Waits in FIFO order while all slots are busy."""
        self._check_open()
        start = time.monotonic()
        grant = None if self._num_waiting else self._admit(spec)
        if grant is None:
            grant = await self._wait_turn(spec)
        queue_wait_s = time.monotonic() - start
        self._queue_wait.record(queue_wait_s)
        # A task of the pool's, so that close() waits for a create in progress and for its
        # sandbox's release (else the process ends with it mounted).
        sandbox = grant.warm or await self._spawn(self._create_for_caller(spec, grant))
        if self._closed:  # closed while this caller waited for a warm one
            await _release_quietly(sandbox, self.name)
            raise ValueError(f"{self.name} was closed; build a new pool")
        self._counters.num_acquires += 1
        lease = SandboxLease(self.name, f"{self.name}/{next(self._ids)}", grant.warm is not None,
                             queue_wait_s)
        self._leases[lease.sandbox_id] = LeasedSandbox(
            spec, sandbox, create=self._create, counters=self._counters,
            exec_time=self._exec_time, spawn=self._spawn,
            snapshot_interval_s=self._snapshot_interval_s, max_recreates=self._max_recreates,
            label=lease.sandbox_id)
        self._refill()
        return lease

    def _admit(self, spec: SandboxSpec) -> _Grant | None:
        """A grant if a caller with `spec` can go now; None if it must wait."""
        if self._warm and spec == self._warm_spec:
            self._counters.num_warm_hits += 1
            return _Grant(warm=self._warm.popleft())
        if self._num_live < self._max:
            self._num_live += 1
            return _Grant()
        if self._warm:  # full, but idle warm sandboxes are worth less than a waiting task
            self._counters.num_evictions += 1
            return _Grant(evicted=self._warm.popleft())
        return None

    async def _wait_turn(self, spec: SandboxSpec) -> _Grant:
        waiter = _Waiter(spec, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._num_waiting += 1
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.cancelled():  # still queued: _dispatch drops it later
                self._num_waiting -= 1
            else:  # admitted, but cancelled before it could resume
                self._give_back(waiter.future.result())
            raise

    def _dispatch(self) -> None:
        """Admit waiters from the head of the queue while there is room."""
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():
                self._waiters.popleft()
                continue
            grant = self._admit(waiter.spec)
            if grant is None:
                return
            self._waiters.popleft()
            self._num_waiting -= 1
            waiter.future.set_result(grant)

    def _give_back(self, grant: _Grant) -> None:
        if grant.warm is not None:
            self._warm.appendleft(grant.warm)
            self._dispatch()
            return
        if grant.evicted is not None:
            self._spawn(_release_quietly(grant.evicted, self.name))
        self._free_slot()

    async def _create_for_caller(self, spec: SandboxSpec, grant: _Grant) -> Sandbox:
        sandbox = await self._create_in_slot(spec, grant)
        if self._closed:  # closed while this caller was creating: released before close() returns
            await _release_quietly(sandbox, self.name)
            raise ValueError(f"{self.name} was closed; build a new pool")
        return sandbox

    async def _create_in_slot(self, spec: SandboxSpec, grant: _Grant) -> Sandbox:
        self._num_creating += 1
        try:
            if grant.evicted is not None:
                # Released before the create, so the host never holds max_sandboxes + 1.
                await asyncio.shield(self._spawn(_release_quietly(grant.evicted, self.name)))
            return await self._create(spec)
        except BaseException:  # cancellation included: the slot is freed, then re-raised
            self._free_slot()
            raise
        finally:
            self._num_creating -= 1

    async def _create(self, spec: SandboxSpec) -> Sandbox:
        start = time.monotonic()
        try:
            # Every sandbox the pool makes is driven by the policy: it leases host uids
            # apart from grading sandboxes' (SandboxRole), whatever the caller's spec says.
            sandbox = await self._factory(dataclasses.replace(spec, role=SandboxRole.AGENT))
        except Exception:  # any failure of a backend's create is counted as one, then re-raised
            self._counters.num_create_failures += 1
            raise
        self._create_latency.record(time.monotonic() - start)
        return sandbox

    def _free_slot(self) -> None:
        self._num_live -= 1
        self._dispatch()
        self._refill()

    # ---- warm refill -----------------------------------------------------------------

    def _refill(self) -> None:
        """Start creates until the warm target is met or the cap is reached."""
        while (not self._closed and not self._refill_paused and self._num_live < self._max
               and len(self._warm) + self._num_warm_creating < self._num_warm_target):
            self._num_live += 1
            self._num_warm_creating += 1
            self._spawn(self._create_warm())

    async def _create_warm(self) -> None:
        self._num_creating += 1
        sandbox = None
        try:
            sandbox = await self._create(self._warm_spec)
        except Exception as exc:  # a background warm create may fail in any way: refill pauses with the error
            self._pause_refill(exc)
        finally:
            self._num_creating -= 1
            self._num_warm_creating -= 1
        if sandbox is None:
            self._free_slot()
        elif self._closed:
            await _release_quietly(sandbox, self.name)
            self._num_live -= 1
        else:
            self._refill_backoff_s = 0.0
            self._warm.append(sandbox)
            self._dispatch()

    def _pause_refill(self, exc: Exception) -> None:
        # Back off exponentially: a backend that cannot create (no root, full disk)
        # should not be retried in a tight loop.
        self._refill_backoff_s = min(_MAX_REFILL_BACKOFF_S, max(1.0, 2 * self._refill_backoff_s))
        log.warning("%s: warm sandbox create failed (%s: %s); retrying in %.0f s", self.name,
                    type(exc).__name__, exc, self._refill_backoff_s)
        self._refill_paused = True
        if self._refill_timer is None:
            self._refill_timer = asyncio.get_running_loop().call_later(self._refill_backoff_s,
                                                                       self._resume_refill)

    def _resume_refill(self) -> None:
        self._refill_timer = None
        self._refill_paused = False
        self._refill()

    # ---- release and close -----------------------------------------------------------

    async def release(self, lease: SandboxLease) -> None:
        """Delete the lease's sandbox and hand its slot on. Idempotent; the teardown
        finishes even if the caller is cancelled."""
        entry = self._leases.pop(lease.sandbox_id, None)
        if entry is not None:
            await asyncio.shield(self._spawn(self._teardown(entry)))

    async def _teardown(self, entry: LeasedSandbox) -> None:
        try:
            await entry.teardown()
        finally:
            self._free_slot()

    async def close(self) -> None:
        """Fail the waiters, stop refills, release every sandbox (leased ones included)."""
        self._closed = True
        if self._refill_timer is not None:
            self._refill_timer.cancel()
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_exception(ValueError(f"{self.name} was closed"))
        self._waiters.clear()
        self._num_waiting = 0
        for lease_id in list(self._leases):
            self._spawn(self._teardown(self._leases.pop(lease_id)))
        while self._warm:
            self._spawn(_release_quietly(self._warm.popleft(), self.name))
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # a strong reference: the loop only keeps weak ones
        task.add_done_callback(self._tasks.discard)
        return task

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.name} was closed; build a new pool")

    # ---- operations on a lease -------------------------------------------------------

    def _entry(self, lease: SandboxLease) -> LeasedSandbox:
        entry = self._leases.get(lease.sandbox_id)
        if entry is None:
            raise ValueError(f"sandbox {lease.sandbox_id} is not leased from {self.name} "
                             "(released already?); acquire a new one")
        return entry

    async def exec(self, lease: SandboxLease, cmd: str | list[str], timeout_s: float,
                   stdin: str | None = None) -> ExecResult:
        """Run `cmd` in the lease's sandbox. A broken sandbox is recreated and reported
        as an ExecResult with exit code SANDBOX_FAULT_EXIT_CODE; this never raises for
        it (arguments that are wrong still raise ValueError)."""
        if isinstance(cmd, list) and (not cmd or not all(isinstance(a, str) for a in cmd)):
            raise ValueError(f"cmd must be a shell string or a non-empty list of str, got {cmd!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        return await self._entry(lease).exec(cmd, timeout_s, stdin)

    async def read_file(self, lease: SandboxLease, path: str) -> bytes:
        return await self._entry(lease).read_file(path)

    async def write_file(self, lease: SandboxLease, path: str, data: bytes) -> None:
        await self._entry(lease).write_file(path, data)

    async def checkpoint(self, lease: SandboxLease) -> None:
        """Snapshot the lease's sandbox now (a crash restores at least this state)."""
        await self._entry(lease).checkpoint()

    async def workspace_changes(self, lease: SandboxLease, max_bytes: int) -> WorkspaceChanges:
        """The lease's workspace as changes against its source (see the module docstring);
        call it before `release`."""
        return await self._entry(lease).workspace_changes(max_bytes)

    async def save_state(self, lease: SandboxLease, path: str) -> int:
        return await self._entry(lease).save_state(path)

    async def restore_state(self, lease: SandboxLease, path: str) -> None:
        await self._entry(lease).restore_state(path)

    # ---- metrics ---------------------------------------------------------------------

    def stats(self) -> PoolStats:
        return PoolStats(
            max_sandboxes=self._max, num_in_use=len(self._leases), num_warm=len(self._warm),
            num_creating=self._num_creating, queue_length=self._num_waiting,
            queue_wait=self._queue_wait.summary(), create=self._create_latency.summary(),
            exec=self._exec_time.summary(), **dataclasses.asdict(self._counters))


async def _release_quietly(sandbox: Sandbox, label: str) -> None:
    try:
        await sandbox.release()
    except Exception:  # best-effort cleanup, often in a background task: a failed release is logged
        log.exception("%s: releasing a sandbox failed", label)


async def _is_healthy(sandbox: Sandbox) -> bool:
    try:
        return (await sandbox.exec(["true"], PROBE_TIMEOUT_S)).exit_code == 0
    except Exception:  # a probe failing in any way means the sandbox is not healthy
        return False


def _fault(message: str) -> ExecResult:
    return ExecResult(exit_code=SANDBOX_FAULT_EXIT_CODE, stdout="",
                      stderr=f"sandbox error: {message}", timed_out=False, oom_killed=False,
                      output_truncated=False, duration_s=0.0)


def load_sandbox_factory(backend: str) -> SandboxFactory:
    """The create function of a built-in backend name or an import string
    'package.module:Class' (envs.sandbox_backend)."""
    try:
        return load_sandbox_backend(backend).create
    except ValueError as exc:
        raise ValueError(f"envs.sandbox_backend={backend!r}: {exc}") from exc


def build_sandbox_pool(envs: EnvsConfig, factory: SandboxFactory | None = None,
                       name: str = "sandbox-pool") -> SandboxPool:
    """The pool of one sandbox worker as the recipe's `envs.*` describes it."""
    return SandboxPool(factory or load_sandbox_factory(envs.sandbox_backend),
                       max_sandboxes=envs.sandboxes_per_worker,
                       num_warm=envs.num_warm_sandboxes, warm_limits=build_sandbox_limits(envs),
                       name=name)


def _keep_at(tar_path: str, path: str) -> None:
    """`tar_path`'s content at `path` as well, replacing it atomically (a reader never sees
    half a file): a hard link, or a copy across file systems."""
    tmp = f"{path}.tmp"
    try:
        os.link(tar_path, tmp)
    except OSError:
        shutil.copyfile(tar_path, tmp)
    os.replace(tmp, path)
