"""Running one sandboxed command's launcher process on the host (bwrap for the local
backend, `podman exec` for containers): stdin fed, stdout and stderr captured with the
head+tail cap, the wall-clock limit enforced, and the backend's tree kill always run, on
timeout, on cancellation and after a normal exit, so nothing of the command survives."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from envs.sandbox.base import ExecResult
from envs.sandbox.output import HeadTailBuffer, pump, render_streams

log = logging.getLogger(__name__)

# Kills everything the command started, the launcher included, and waits for the
# launcher to exit; called more than once per command, so it must be idempotent.
KillTree = Callable[[asyncio.subprocess.Process], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class LaunchOutcome:
    """What the host saw of one launcher run; the backend adds what only it knows (OOM)."""

    exit_code: int  # shell convention: 128 + signal number when the launcher died of a signal
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    duration_s: float

    def to_result(self, oom_killed: bool) -> ExecResult:
        return ExecResult(exit_code=self.exit_code, stdout=self.stdout, stderr=self.stderr,
                          timed_out=self.timed_out, oom_killed=oom_killed,
                          output_truncated=self.output_truncated, duration_s=self.duration_s)


async def run_launcher(argv: list[str], *, env: Mapping[str, str], stdin: str | None,
                       timeout_s: float, max_output_bytes: int, kill_tree: KillTree,
                       exit_grace_s: float, label: str, cwd: str | None = None,
                       pass_fds: tuple[int, ...] = ()) -> LaunchOutcome:
    """Run `argv` (the launcher of one command) until it exits or `timeout_s` passes, in
    `cwd` (None: this process's), with `pass_fds` inherited (the others are closed)."""
    out, err = HeadTailBuffer(max_output_bytes), HeadTailBuffer(max_output_bytes)
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, env=dict(env), start_new_session=True, cwd=cwd, pass_fds=pass_fds,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        timed_out = await _wait(proc, out, err, stdin, timeout_s, kill_tree, exit_grace_s, label)
    finally:
        # Also on cancellation: nothing of the command may outlive the call.
        await kill_tree(proc)
    duration_s = time.monotonic() - start
    stdout, stderr, truncated = render_streams(out, err, max_output_bytes)
    code = proc.returncode
    assert code is not None
    return LaunchOutcome(exit_code=128 - code if code < 0 else code, stdout=stdout,
                         stderr=stderr, timed_out=timed_out, output_truncated=truncated,
                         duration_s=duration_s)


async def _wait(proc: asyncio.subprocess.Process, out: HeadTailBuffer, err: HeadTailBuffer,
                stdin: str | None, timeout_s: float, kill_tree: KillTree, exit_grace_s: float,
                label: str) -> bool:
    """Stream output until the command ends or times out; True if it timed out."""
    assert proc.stdout is not None and proc.stderr is not None
    io = asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err), _feed(proc.stdin, stdin))
    exited = asyncio.ensure_future(proc.wait())
    try:
        done, _ = await asyncio.wait({exited}, timeout=timeout_s)
        timed_out = not done
        if timed_out:
            await kill_tree(proc)
        # The pipes close once every process holding them is gone, which the launcher's
        # exit triggers (bwrap's PID namespace, the container's exec session); the grace
        # only covers that teardown.
        done, _ = await asyncio.wait({io}, timeout=exit_grace_s)
        if not done:
            log.warning("%s: output pipes open %.1fs after exit; killing", label, exit_grace_s)
            await kill_tree(proc)
            await asyncio.wait({io}, timeout=exit_grace_s)
        await exited
        return timed_out
    finally:
        io.cancel()
        exited.cancel()


def kill_launcher(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


async def _feed(writer: asyncio.StreamWriter | None, data: str | None) -> None:
    if writer is None or data is None:
        return
    try:
        writer.write(data.encode())
        await writer.drain()
        writer.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command exited without reading all of its stdin
