"""SandboxPool on an in-memory fake backend: admission and FIFO queueing, warm refill and
eviction, crash recovery from snapshots, and the stats it reports."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable

import pytest

from envs.pool import (SANDBOX_FAULT_EXIT_CODE, DurationRecorder, SandboxPool,
                       SandboxUnavailableError, build_sandbox_pool)
from envs.sandbox.base import (ExecResult, SandboxCapabilities, SandboxLimits, SandboxRole,
                               SandboxSpec, Snapshot)
from trainer.run.config import EnvsConfig

GENERIC = SandboxSpec()


class FakeBackend:
    """Makes FakeSandboxes and keeps count of the live ones (peak included)."""

    def __init__(self) -> None:
        self.made: list[FakeSandbox] = []
        self.snapshots: dict[str, dict[str, bytes]] = {}
        self.num_failing_creates = 0  # the next N creates raise
        self.create_gate: asyncio.Event | None = None  # creates wait on it when set
        self.peak_alive = 0
        self._ids = itertools.count()

    @property
    def alive(self) -> int:
        return sum(not sb.released for sb in self.made)

    async def create(self, spec: SandboxSpec) -> FakeSandbox:
        if self.create_gate is not None:
            await self.create_gate.wait()
        await asyncio.sleep(0)
        if self.num_failing_creates:
            self.num_failing_creates -= 1
            raise OSError("fake create failure")
        sandbox = FakeSandbox(self, spec)
        self.made.append(sandbox)
        self.peak_alive = max(self.peak_alive, self.alive)
        return sandbox


class FakeSandbox:
    """An in-memory sandbox that understands a handful of made-up commands:
    `echo X`, `put NAME TEXT`, `cat NAME`, `exit N`, `loud-fail`, `sleep S`, `timeout`,
    `oom`, `raise` (the backend fails), `break` (the sandbox breaks for good)."""

    def __init__(self, backend: FakeBackend, spec: SandboxSpec) -> None:
        self.backend = backend
        self.spec = spec
        self.files: dict[str, bytes] = {}
        if spec.source_dir is not None:
            self.files["source.txt"] = spec.source_dir.encode()
        self.broken = False
        self.released = False
        self.num_probes = 0

    def capabilities(self) -> SandboxCapabilities:
        return SandboxCapabilities("fake", (), None, (), (), False, 0, 0, False, None)

    async def exec(self, cmd: str | list[str], timeout_s: float,
                   stdin: str | None = None) -> ExecResult:
        assert not self.released
        argv = cmd if isinstance(cmd, list) else cmd.split(" ", 2)
        await asyncio.sleep(0)
        if argv == ["true"]:
            self.num_probes += 1
        if argv[0] == "raise":
            raise OSError("fake backend failure")
        if argv[0] == "break":
            self.broken = True
        if self.broken:
            return _result(1, "", "fake: workspace is gone")
        return await self._run(argv)

    async def _run(self, argv: list[str]) -> ExecResult:
        name, args = argv[0], argv[1:]
        if name == "echo":
            return _result(0, args[0] + "\n")
        if name == "put":
            self.files[args[0]] = args[1].encode()
            return _result(0)
        if name == "cat":
            if args[0] not in self.files:
                return _result(1, "", f"cat: {args[0]}: no such file")
            return _result(0, self.files[args[0]].decode())
        if name == "sleep":
            await asyncio.sleep(float(args[0]))
            return _result(0)
        if name == "loud-fail":
            return _result(2, "3 tests failed\n")
        if name in ("timeout", "oom"):
            return _result(137, timed_out=name == "timeout", oom_killed=name == "oom")
        return _result(int(args[0]) if name == "exit" else 0)

    async def read_file(self, path: str) -> bytes:
        if path not in self.files:
            raise FileNotFoundError(f"no file {path!r} in the workspace")
        return self.files[path]

    async def write_file(self, path: str, data: bytes) -> None:
        self.files[path] = data

    async def snapshot(self) -> Snapshot:
        path = f"/nonexistent/fake-snapshot-{len(self.backend.snapshots)}"
        self.backend.snapshots[path] = dict(self.files)
        return Snapshot(tar_path=path, num_bytes=0)

    async def restore(self, snapshot: Snapshot) -> None:
        self.files = dict(self.backend.snapshots[snapshot.tar_path])

    async def release(self) -> None:
        self.released = True


def _result(code: int, stdout: str = "", stderr: str = "", timed_out: bool = False,
            oom_killed: bool = False) -> ExecResult:
    return ExecResult(exit_code=code, stdout=stdout, stderr=stderr, timed_out=timed_out,
                      oom_killed=oom_killed, output_truncated=False, duration_s=0.002)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


def make_pool(backend: FakeBackend, **kwargs: object) -> SandboxPool:
    options: dict = {"max_sandboxes": 4, "num_warm": 0, "snapshot_interval_s": 0.0, **kwargs}
    return SandboxPool(backend.create, **options)


async def test_start_fills_the_warm_pool_and_generic_acquires_take_from_it() -> None:
    backend = FakeBackend()
    pool = make_pool(backend, num_warm=2)
    await pool.start()
    assert (pool.stats().num_warm, backend.alive) == (2, 2)
    first_warm = backend.made[0]
    lease = await pool.acquire(GENERIC)
    assert lease.warm
    assert (await pool.exec(lease, "echo hi", 5)).stdout == "hi\n"
    await wait_until(lambda: pool.stats().num_warm == 2)  # refilled in the background
    stats = pool.stats()
    assert (stats.num_in_use, stats.num_warm_hits, backend.alive) == (1, 1, 3)
    # The pool's sandboxes are the policy's: stamped AGENT (their own half of the uids).
    assert first_warm.spec == dataclasses.replace(GENERIC, role=SandboxRole.AGENT)
    assert not first_warm.released
    await pool.close()
    assert backend.alive == 0


async def test_per_task_and_non_default_specs_are_created_on_demand() -> None:
    backend = FakeBackend()
    pool = make_pool(backend, num_warm=1)
    await pool.start()
    lease = await pool.acquire(SandboxSpec(source_dir="/tasks/t1"))
    assert not lease.warm
    assert (await pool.read_file(lease, "source.txt")) == b"/tasks/t1"
    other = await pool.acquire(SandboxSpec(limits=SandboxLimits(memory_mb=64)))
    assert not other.warm
    stats = pool.stats()
    assert (stats.num_warm, stats.num_warm_hits, stats.create.count) == (1, 0, 3)
    await pool.close()


async def test_callers_beyond_the_cap_wait_in_fifo_order() -> None:
    backend = FakeBackend()
    pool = make_pool(backend, max_sandboxes=2)
    held = [await pool.acquire(GENERIC), await pool.acquire(GENERIC)]
    order: list[int] = []

    async def waiter(i: int) -> None:
        lease = await pool.acquire(SandboxSpec(source_dir=f"/tasks/{i}") if i % 2 else GENERIC)
        order.append(i)
        held.append(lease)

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await wait_until(lambda: pool.stats().queue_length == 3)
    for expected in ([0], [0, 1], [0, 1, 2]):
        await pool.release(held.pop(0))
        await wait_until(lambda: len(order) == len(expected))
        assert order == expected
    await asyncio.gather(*tasks)
    stats = pool.stats()
    assert stats.queue_length == 0 and stats.queue_wait.count == 5
    assert stats.queue_wait.max_s > 0 and backend.peak_alive == 2
    await pool.close()


async def test_a_cancelled_waiter_gives_up_its_place() -> None:
    backend = FakeBackend()
    pool = make_pool(backend, max_sandboxes=1)
    held = await pool.acquire(GENERIC)
    first = asyncio.create_task(pool.acquire(GENERIC))
    second = asyncio.create_task(pool.acquire(GENERIC))
    await wait_until(lambda: pool.stats().queue_length == 2)
    first.cancel()
    await wait_until(lambda: pool.stats().queue_length == 1)
    await pool.release(held)
    lease = await asyncio.wait_for(second, 2)
    assert first.cancelled() and pool.stats().num_in_use == 1
    await pool.release(lease)
    assert (backend.alive, pool.stats().num_in_use) == (0, 0)


async def test_a_per_task_acquire_evicts_an_idle_warm_sandbox_when_full() -> None:
    backend = FakeBackend()
    pool = make_pool(backend, max_sandboxes=2, num_warm=2)
    await pool.start()
    lease = await pool.acquire(SandboxSpec(source_dir="/tasks/t"))
    stats = pool.stats()
    assert (stats.num_evictions, stats.num_warm, stats.num_in_use) == (1, 1, 1)
    assert backend.peak_alive == 2 and backend.alive == 2
    await pool.release(lease)
    await wait_until(lambda: pool.stats().num_warm == 2)
    await pool.close()


async def test_thousands_of_concurrent_callers_all_get_a_sandbox_within_the_cap() -> None:
    backend = FakeBackend()
    pool = make_pool(backend, max_sandboxes=8, num_warm=2)
    await pool.start()

    async def trajectory(i: int) -> str:
        spec = SandboxSpec(source_dir=f"/tasks/{i}") if i % 3 == 0 else GENERIC
        lease = await pool.acquire(spec)
        try:
            return (await pool.exec(lease, f"echo {i}", 5)).stdout
        finally:
            await pool.release(lease)

    outputs = await asyncio.gather(*(trajectory(i) for i in range(2000)))
    assert outputs == [f"{i}\n" for i in range(2000)]
    stats = pool.stats()
    assert backend.peak_alive <= 8
    assert (stats.num_acquires, stats.num_in_use, stats.queue_length) == (2000, 0, 0)
    assert stats.queue_wait.count == 2000 and stats.num_execs == 2000
    await pool.close()
    assert backend.alive == 0


async def test_release_is_idempotent_and_ends_the_lease() -> None:
    backend = FakeBackend()
    pool = make_pool(backend, max_sandboxes=1)
    lease = await pool.acquire(GENERIC)
    await pool.release(lease)
    await pool.release(lease)
    assert backend.alive == 0
    with pytest.raises(ValueError, match="not leased"):
        await pool.exec(lease, "echo x", 5)
    assert (await pool.acquire(GENERIC)).sandbox_id != lease.sandbox_id  # the slot is free
    await pool.close()


async def test_a_broken_sandbox_is_recreated_from_its_last_snapshot() -> None:
    backend = FakeBackend()
    pool = make_pool(backend)
    lease = await pool.acquire(GENERIC)
    await pool.exec(lease, "put a.txt v1", 5)
    await wait_until(lambda: pool.stats().num_snapshots == 1)
    broken = backend.made[0]
    result = await pool.exec(lease, "break", 5)
    assert result.exit_code == SANDBOX_FAULT_EXIT_CODE
    assert "recreated from its last checkpoint" in result.stderr
    stats = pool.stats()
    assert (stats.num_crashes, stats.num_recreates, stats.num_execs) == (1, 1, 1)
    assert broken.released and backend.alive == 1
    assert (await pool.exec(lease, "cat a.txt", 5)).stdout == "v1"
    await pool.close()


async def test_a_backend_exception_is_a_crash_reported_as_a_result() -> None:
    backend = FakeBackend()
    pool = make_pool(backend)
    lease = await pool.acquire(SandboxSpec(source_dir="/tasks/t"))
    result = await pool.exec(lease, "raise", 5)
    assert result.exit_code == SANDBOX_FAULT_EXIT_CODE
    assert "fake backend failure" in result.stderr and "initial files" in result.stderr
    assert (await pool.read_file(lease, "source.txt")) == b"/tasks/t"  # recreated from the spec
    assert pool.stats().num_crashes == 1
    await pool.close()


async def test_failing_commands_are_not_crashes() -> None:
    backend = FakeBackend()
    pool = make_pool(backend)
    lease = await pool.acquire(GENERIC)
    silent = await pool.exec(lease, "exit 3", 5)
    loud = await pool.exec(lease, "loud-fail", 5)
    assert (silent.exit_code, loud.exit_code) == (3, 2)
    # Only the silent failure could be a broken launcher, so only it was probed.
    assert backend.made[0].num_probes == 1
    stats = pool.stats()
    assert (stats.num_crashes, stats.num_execs) == (0, 2)
    await pool.close()


async def test_snapshots_follow_changes_at_most_once_per_interval() -> None:
    backend = FakeBackend()
    pool = make_pool(backend, snapshot_interval_s=3600.0)
    lease = await pool.acquire(GENERIC)
    for i in range(3):
        await pool.exec(lease, f"put f{i} x", 5)
        await pool.write_file(lease, f"g{i}", b"y")
    await wait_until(lambda: pool.stats().num_snapshots == 1)  # the first change only
    await asyncio.sleep(0.01)
    assert pool.stats().num_snapshots == 1
    await pool.checkpoint(lease)
    assert pool.stats().num_snapshots == 2
    assert len(backend.snapshots["/nonexistent/fake-snapshot-1"]) == 6
    await pool.close()


async def test_recreating_gives_up_after_max_recreates() -> None:
    backend = FakeBackend()
    pool = make_pool(backend, max_recreates=1)
    lease = await pool.acquire(GENERIC)
    assert "recreated" in (await pool.exec(lease, "break", 5)).stderr
    gone = await pool.exec(lease, "break", 5)
    assert gone.exit_code == SANDBOX_FAULT_EXIT_CODE and "already recreated 1 times" in gone.stderr
    with pytest.raises(SandboxUnavailableError):
        await pool.read_file(lease, "a.txt")
    again = await pool.exec(lease, "echo x", 5)
    assert again.exit_code == SANDBOX_FAULT_EXIT_CODE
    stats = pool.stats()
    assert (stats.num_crashes, stats.num_recreates) == (2, 1)
    assert backend.alive == 0  # the broken ones were released
    await pool.release(lease)


async def test_a_failed_recreate_is_retried_by_the_next_exec() -> None:
    backend = FakeBackend()
    pool = make_pool(backend)
    lease = await pool.acquire(GENERIC)
    backend.num_failing_creates = 1
    failed = await pool.exec(lease, "break", 5)
    assert "could not be recreated" in failed.stderr
    retried = await pool.exec(lease, "echo back", 5)
    assert "recreated" in retried.stderr
    assert (await pool.exec(lease, "echo back", 5)).stdout == "back\n"
    stats = pool.stats()
    assert (stats.num_crashes, stats.num_recreate_failures, stats.num_recreates) == (1, 1, 1)
    await pool.close()


async def test_stats_count_timeouts_oom_kills_and_bucket_exec_times() -> None:
    backend = FakeBackend()
    pool = make_pool(backend)
    lease = await pool.acquire(GENERIC)
    for cmd in ("timeout", "oom", "echo a", "sleep 0.05"):
        await pool.exec(lease, cmd, 5)
    stats = pool.stats()
    assert (stats.num_timeouts, stats.num_oom_kills, stats.num_execs) == (1, 1, 4)
    assert stats.exec.count == 4 and sum(stats.exec.counts) == 4
    assert stats.exec.counts[0] == 4  # the fake reports 2 ms for every command
    assert stats.create.count == 1 and stats.num_in_use == 1
    await pool.close()


async def test_a_failed_create_frees_its_slot() -> None:
    backend = FakeBackend()
    pool = make_pool(backend, max_sandboxes=1)
    backend.num_failing_creates = 1
    with pytest.raises(OSError, match="fake create failure"):
        await pool.acquire(GENERIC)
    await pool.acquire(GENERIC)
    stats = pool.stats()
    assert (stats.num_create_failures, stats.num_in_use, backend.alive) == (1, 1, 1)
    await pool.close()


async def test_warm_create_failures_back_off_without_blocking_acquires() -> None:
    backend = FakeBackend()
    backend.num_failing_creates = 2
    pool = make_pool(backend, max_sandboxes=2, num_warm=2)
    await pool.start()
    assert pool.stats().num_warm == 0 and pool.stats().num_create_failures == 2
    lease = await pool.acquire(GENERIC)  # created on demand while the refill waits
    assert not lease.warm
    await pool.close()


async def test_close_fails_waiters_and_releases_everything() -> None:
    backend = FakeBackend()
    pool = make_pool(backend, max_sandboxes=1, num_warm=1)
    await pool.start()
    await pool.acquire(GENERIC)
    waiting = asyncio.create_task(pool.acquire(GENERIC))
    await wait_until(lambda: pool.stats().queue_length == 1)
    await pool.close()
    with pytest.raises(ValueError, match="closed"):
        await waiting
    assert backend.alive == 0
    with pytest.raises(ValueError, match="closed"):
        await pool.acquire(GENERIC)


async def test_close_waits_for_a_create_in_progress_and_releases_its_sandbox() -> None:
    """The run's end closes the pools while an acquire is still creating: close() must not
    return (and let the process end) before that sandbox is released."""
    backend = FakeBackend()
    pool = make_pool(backend)
    backend.create_gate = asyncio.Event()
    acquiring = asyncio.create_task(pool.acquire(SandboxSpec(source_dir="/task")))
    await asyncio.sleep(0.01)
    closing = asyncio.create_task(pool.close())
    await asyncio.sleep(0.01)
    assert not closing.done()  # it waits for the create
    backend.create_gate.set()
    await closing
    assert len(backend.made) == 1 and backend.alive == 0  # made after close() began, released before it ended
    with pytest.raises(ValueError, match="closed"):
        await acquiring


def test_config_mistakes_raise_value_errors_naming_the_key() -> None:
    backend = FakeBackend()
    with pytest.raises(ValueError, match="envs.num_warm_sandboxes"):
        SandboxPool(backend.create, max_sandboxes=2, num_warm=3)
    with pytest.raises(ValueError, match="envs.sandboxes_per_worker"):
        SandboxPool(backend.create, max_sandboxes=0, num_warm=0)
    with pytest.raises(ValueError, match="envs.sandbox_backend='kubernetes'"):
        build_sandbox_pool(EnvsConfig(sandbox_backend="kubernetes"))  # type: ignore[arg-type]


def test_duration_recorder_quantiles_and_buckets() -> None:
    recorder = DurationRecorder((10.0, 50.0))
    for i in range(1, 101):
        recorder.record(float(i))
    summary = recorder.summary()
    assert (summary.count, summary.total_s, summary.max_s) == (100, 5050.0, 100.0)
    assert (summary.p50_s, summary.p99_s) == (50.0, 99.0)
    assert summary.counts == (10, 40, 50)
    empty = DurationRecorder((1.0,)).summary()
    assert (empty.count, empty.p50_s, empty.counts) == (0, 0.0, (0, 0))
