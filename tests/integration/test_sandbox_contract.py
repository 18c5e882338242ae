"""The contract every Sandbox backend must pass: commands, stdin/stdout/stderr, timeouts,
bounded output, workspace files, path checks, snapshots, isolation between sandboxes and
a release that leaves nothing behind. A new backend adds one entry to BACKENDS; a backend
this host cannot run is skipped with the reason."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from sandbox_probes import (
    container_leftovers,
    live_processes_of_uid,
    skip_without_container_engine,
)

from envs.sandbox.base import Sandbox, SandboxLimits, SandboxSpec

SMALL = SandboxLimits(memory_mb=256, max_processes=64, cpu_time_s=30, file_size_mb=64,
                      open_files=256, max_output_bytes=65_536)


@dataclass(frozen=True, slots=True)
class BackendUnderTest:
    name: str
    create: Callable[[SandboxSpec], Awaitable[Sandbox]]
    leftovers: Callable[[Sandbox], list[str]]  # what remains on the host after release


def _local_leftovers(sandbox: Sandbox) -> list[str]:
    from envs.sandbox.local import LocalSandbox

    assert isinstance(sandbox, LocalSandbox)
    left = [f"path {p}" for p in sandbox.host_paths() if os.path.lexists(p)]
    mount_points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    left += [f"mount {m}" for m in mount_points
             if any(m.startswith(p) for p in sandbox.host_paths())]
    deadline = time.monotonic() + 3.0
    while (pids := live_processes_of_uid(sandbox.host_uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left + [f"process {pid} of uid {sandbox.host_uid}" for pid in pids]


def _local_backend() -> BackendUnderTest:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the local backend needs root and bubblewrap")
    from envs.sandbox.local import LocalSandbox

    return BackendUnderTest("local", LocalSandbox.create, _local_leftovers)


def _container_backend() -> BackendUnderTest:
    skip_without_container_engine()
    from envs.sandbox.container import ContainerSandbox

    return BackendUnderTest("container", ContainerSandbox.create, container_leftovers)


BACKENDS: dict[str, Callable[[], BackendUnderTest]] = {"local": _local_backend,
                                                       "container": _container_backend}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> BackendUnderTest:
    return BACKENDS[request.param]()


MakeSandbox = Callable[..., Awaitable[Sandbox]]


@pytest.fixture
async def make_sandbox(backend: BackendUnderTest) -> AsyncIterator[MakeSandbox]:
    made: list[Sandbox] = []

    async def make(source_dir: str | None = None, limits: SandboxLimits = SMALL) -> Sandbox:
        sandbox = await backend.create(SandboxSpec(source_dir=source_dir, limits=limits))
        made.append(sandbox)
        return sandbox

    yield make
    for sandbox in made:
        await sandbox.release()


async def test_exit_codes(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    assert (await sb.exec("exit 0", 10)).exit_code == 0
    assert (await sb.exec("exit 7", 10)).exit_code == 7
    assert (await sb.exec(["false"], 10)).exit_code == 1
    assert (await sb.exec("kill -TERM $$", 10)).exit_code == 128 + 15
    missing = await sb.exec(["no-such-program"], 10)
    assert missing.exit_code != 0 and not missing.timed_out


async def test_stdout_and_stderr_are_separate(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    r = await sb.exec("echo to-out; echo to-err >&2", 10)
    assert (r.stdout, r.stderr, r.output_truncated, r.timed_out) == ("to-out\n", "to-err\n",
                                                                     False, False)
    assert r.duration_s > 0


async def test_argv_list_is_not_parsed_by_a_shell(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    r = await sb.exec(["printf", "%s|", "a b", "$HOME", ";ls"], 10)
    assert r.stdout == "a b|$HOME|;ls|"


async def test_stdin_reaches_the_command(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    r = await sb.exec(["python3", "-c", "import sys; print(sys.stdin.read().upper())"], 10,
                      stdin="hello\nworld")
    assert r.stdout == "HELLO\nWORLD\n"
    no_stdin = await sb.exec("cat; echo done", 10)  # no stdin: EOF at once, no hang
    assert no_stdin.stdout == "done\n"


async def test_invalid_utf8_is_replaced(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    r = await sb.exec(["python3", "-c", "import sys; sys.stdout.buffer.write(b'a\\xffb')"], 10)
    assert r.stdout == "a\ufffdb"


async def test_timeout_kills_the_command(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    r = await sb.exec("echo started; sleep 60; echo never", 1.0)
    assert r.timed_out and r.exit_code == 137
    assert r.stdout == "started\n"
    assert r.duration_s < 5
    assert (await sb.exec("echo next", 10)).stdout == "next\n"


async def test_output_is_truncated_keeping_head_and_tail(make_sandbox: MakeSandbox) -> None:
    limits = SandboxLimits(memory_mb=256, max_output_bytes=4096)
    sb = await make_sandbox(limits=limits)
    r = await sb.exec(["python3", "-c", "print('HEAD' + 'x' * 200000 + 'TAIL')"], 20)
    assert r.output_truncated
    assert r.stdout.startswith("HEAD") and r.stdout.endswith("TAIL\n")
    match = re.search(r"\n\[\.\.\. (\d+) bytes cut \.\.\.\]\n", r.stdout)
    assert match is not None
    kept = len(r.stdout) - len(match.group(0))
    assert kept == 4096
    assert int(match.group(1)) == 200_009 - kept


async def test_output_budget_goes_to_the_stream_that_needs_it(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox(limits=SandboxLimits(memory_mb=256, max_output_bytes=1000))
    r = await sb.exec(["python3", "-c", "import sys; print('e', file=sys.stderr); print('o' * 5000)"],
                      20)
    assert r.stderr == "e\n" and r.output_truncated
    marker = re.search(r"\n\[\.\.\. (\d+) bytes cut \.\.\.\]\n", r.stdout)
    assert marker is not None
    assert len(r.stdout) - len(marker.group(0)) == 1000 - len(r.stderr)


async def test_source_dir_is_copied_into_the_workspace(make_sandbox: MakeSandbox,
                                                       tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("VALUE = 41\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tmp_path / "run.sh").chmod(0o755)
    sb = await make_sandbox(source_dir=str(tmp_path))
    r = await sb.exec(["python3", "-c", "from pkg.mod import VALUE; print(VALUE + 1)"], 10)
    assert r.stdout == "42\n"
    assert (await sb.exec("./run.sh && touch pkg/new && echo writable", 10)).stdout == "ran\nwritable\n"
    assert (tmp_path / "pkg" / "new").exists() is False  # a copy, not the source itself


async def test_missing_source_dir_is_a_clear_error(make_sandbox: MakeSandbox,
                                                    tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="source_dir"):
        await make_sandbox(source_dir=str(tmp_path / "missing"))


async def test_files_round_trip(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    await sb.write_file("dir/sub/a.txt", b"from host\n")
    r = await sb.exec("cat dir/sub/a.txt && echo more >> dir/sub/a.txt", 10)
    assert r.stdout == "from host\n" and r.exit_code == 0
    assert await sb.read_file("dir/sub/a.txt") == b"from host\nmore\n"
    await sb.exec(["python3", "-c", "open('b.bin', 'wb').write(bytes(range(256)))"], 10)
    assert await sb.read_file("b.bin") == bytes(range(256))
    with pytest.raises(FileNotFoundError):
        await sb.read_file("missing.txt")


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside", "a/../../outside", "", "./.."])
async def test_paths_leaving_the_workspace_are_rejected(make_sandbox: MakeSandbox, path: str) -> None:
    sb = await make_sandbox()
    with pytest.raises(ValueError):
        await sb.read_file(path)
    with pytest.raises(ValueError):
        await sb.write_file(path, b"x")


async def test_symlinks_resolving_outside_are_rejected(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    await sb.exec("echo inside > real.txt; ln -s real.txt inner; ln -s /etc/passwd outer; "
                  "ln -s .. up; mkfifo pipe", 10)
    assert await sb.read_file("inner") == b"inside\n"
    for path in ("outer", "up/x", "up"):
        with pytest.raises(ValueError, match="outside the workspace"):
            await sb.read_file(path)
        with pytest.raises(ValueError, match="outside the workspace"):
            await sb.write_file(path, b"x")
    with pytest.raises(ValueError, match="not a regular file"):  # a FIFO must not hang us
        await sb.read_file("pipe")


async def test_snapshot_and_restore_round_trip(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    await sb.exec("mkdir d && echo v1 > d/f.txt && ln -s d/f.txt link && chmod +x d/f.txt", 10)
    snap = await sb.snapshot()
    try:
        await sb.exec("echo v2 > d/f.txt && touch added && rm link", 10)
        await sb.restore(snap)
        r = await sb.exec("cat d/f.txt; cat link; test -x d/f.txt && echo exec; ls", 10)
        assert r.stdout == "v1\nv1\nexec\nd\nlink\n"
        assert (await sb.exec("echo v3 > d/f.txt && cat d/f.txt", 10)).stdout == "v3\n"
    finally:
        snap.discard()


async def test_snapshot_resumes_in_a_new_sandbox(make_sandbox: MakeSandbox) -> None:
    first = await make_sandbox()
    await first.exec("echo state > progress.txt", 10)
    snap = await first.snapshot()
    await first.release()
    try:
        second = await make_sandbox()
        await second.restore(snap)
        assert (await second.exec("cat progress.txt; echo more >> progress.txt", 10)).stdout == "state\n"
        assert await second.read_file("progress.txt") == b"state\nmore\n"
    finally:
        snap.discard()


async def test_release_leaves_nothing(backend: BackendUnderTest, make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    await sb.write_file("data.txt", b"x" * 1000)
    await sb.exec("sleep 60 & echo bg", 10)
    await sb.release()
    assert backend.leftovers(sb) == []
    await sb.release()  # idempotent
    with pytest.raises(ValueError, match="released"):
        await sb.exec("true", 10)


async def test_two_sandboxes_are_isolated(make_sandbox: MakeSandbox) -> None:
    a, b = await make_sandbox(), await make_sandbox()
    await a.exec("echo secret-a > secret.txt; echo a-tmp > /tmp/t", 10)
    r = await b.exec("cat /workspace/secret.txt /tmp/t", 10)
    assert r.exit_code != 0 and "secret-a" not in r.stdout and "a-tmp" not in r.stdout
    assert (await b.exec("ls -A /workspace /tmp", 10)).stdout == "/tmp:\n\n/workspace:\n"
    assert (await a.exec("cat /tmp/t", 10)).exit_code != 0  # /tmp lives one command only


async def test_environment_has_no_host_variables(make_sandbox: MakeSandbox,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CANARY_SECRET", "canary-4242")
    sb = await make_sandbox()
    r = await sb.exec("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'", 10)
    assert "canary-4242" not in r.stdout and "SLUICE_CANARY" not in r.stdout
    names = {line.split("=", 1)[0] for line in r.stdout.splitlines() if "=" in line}
    assert {"PATH", "HOME", "LANG"} <= names
    assert "HOME=/workspace" in r.stdout


async def test_commands_of_one_sandbox_run_one_at_a_time(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    results = await asyncio.gather(*(sb.exec(f"echo {i} >> log.txt; sleep 0.2", 10)
                                     for i in range(3)))
    assert all(r.exit_code == 0 for r in results)
    assert sorted((await sb.read_file("log.txt")).split()) == [b"0", b"1", b"2"]


async def test_many_sandboxes_run_concurrently(make_sandbox: MakeSandbox) -> None:
    sandboxes = await asyncio.gather(*(make_sandbox() for _ in range(6)))
    results = await asyncio.gather(*(sb.exec(f"sleep 1; echo {i}", 20)
                                     for i, sb in enumerate(sandboxes)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    assert max(r.duration_s for r in results) < 6  # overlapped, not one after another


async def test_capabilities_name_the_backend(backend: BackendUnderTest,
                                             make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    caps = sb.capabilities()
    assert caps.backend == backend.name
    assert {"pid", "net", "mount"} <= set(caps.namespaces)
    r = await sb.exec("id -u", 10)
    assert r.stdout.strip() == str(caps.sandbox_uid)


async def test_cancelled_exec_leaves_nothing_running(backend: BackendUnderTest,
                                                     make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    task = asyncio.create_task(sb.exec("sleep 60 & sleep 60", 30))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await sb.exec("echo usable", 10)).stdout == "usable\n"
    await sb.release()
    assert backend.leftovers(sb) == []
