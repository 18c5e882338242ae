"""LocalSandbox: the sandbox backend that needs no container daemon. Each sandbox is a
workspace folder on the host, its own unprivileged host uid and its own cgroups; each
command runs in fresh bubblewrap namespaces (user, mount, pid, net, ipc, uts, cgroup)
that see the read-only system runtime and the workspace at /workspace, nothing else,
under the seccomp filter of `envs.sandbox.seccomp` (keyrings, io_uring, userfaultfd,
perf, bpf, fanotify, the kernel log, x32 and foreign-architecture calls denied).

The host side (this process) must be root: it hands each sandbox a uid, chowns the
workspace to it and creates cgroups. Nothing of a sandbox runs between commands; its
state is the workspace folder, which `snapshot`/`restore` save and load as tar files.
Agent and grading sandboxes lease uids from separate halves of the range
(SandboxSpec.role). Keyrings are per user namespace (since Linux 5.3), and each command
gets a fresh one, so nothing a command could keep there outlives it; the filter denies
the keyring calls anyway, and the uid's keyrings in the host's namespace are emptied at
release for older kernels, where the user keyring was one per host uid.

What a sandbox can still reach of the host's kernel: see envs.sandbox.seccomp (channels
between sandboxes that run at the same time, through the shared read-only runtime and
timing, remain; nothing of this class outlives a sandbox).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from typing import Literal, Self

from envs.sandbox import bwrap, seccomp, workspace
from envs.sandbox.base import (
    WORKSPACE_MOUNT,
    ExecResult,
    SandboxCapabilities,
    SandboxLimits,
    SandboxSpec,
)
from envs.sandbox.cgroups import SandboxCgroup
from envs.sandbox.hostuid import (
    HostUidLease,
    all_pids,
    clear_keyrings_of_uid,
    kill_all_of_uid,
    live_of_uid,
)
from envs.sandbox.launch import kill_launcher, run_launcher

log = logging.getLogger(__name__)

RLIMITS = ("AS", "CPU", "FSIZE", "NOFILE", "NPROC", "CORE")


@dataclass(frozen=True, slots=True)
class LocalSandboxConfig:
    """Host-side settings of the local backend (the same for every sandbox of a worker)."""

    root_dir: str | None = None  # parent of the sandbox folders; None: the system temp dir
    snapshot_dir: str | None = None  # where snapshot tars go; None: the system temp dir
    # Host uids [first, first + num) are leased to sandboxes: the first half to agent
    # sandboxes, the second to grading ones (SandboxSpec.role), so each role has
    # num // 2 sandboxes alive at once at most on this host.
    first_host_uid: int = 1_200_000
    num_host_uids: int = 4096
    lease_dir: str = "/run/sluice-sandbox-uids"  # uid lease files, shared by all workers of a host
    # tmpfs: the workspace is a tmpfs of SandboxLimits.disk_mb, so it cannot fill the host
    # disk, but what the sandbox writes there counts against its memory limit. dir: a
    # plain folder on root_dir's disk, bounded only per file (RLIMIT_FSIZE).
    workspace_fs: Literal["tmpfs", "dir"] = "tmpfs"
    exit_grace_s: float = 1.0  # after a command exits, how long its output pipes may stay open


class LocalSandbox(workspace.HostWorkspaceSandbox):
    """A sandbox on this host (see the module docstring). Create with `await
    LocalSandbox.create(spec)`; always `await release()`."""

    def __init__(self, *, spec: SandboxSpec, config: LocalSandboxConfig, lease: HostUidLease,
                 sandbox_dir: str, cgroup: SandboxCgroup, disk_limit_mb: int | None) -> None:
        self._limits: SandboxLimits = spec.limits
        self._config = config
        self._lease = lease
        self._sandbox_dir = sandbox_dir
        self._workspace = os.path.join(sandbox_dir, "workspace")
        self._etc = os.path.join(sandbox_dir, "etc")
        self._cgroup = cgroup
        self._cgroup_dirs = tuple(sorted(set(cgroup.dirs.values())))
        self._runtime = bwrap.detect_host_runtime()
        self._ws = workspace.HostWorkspace(self._workspace, lease.uid, config.snapshot_dir,
                                           spec.limits.disk_mb << 20)
        self._capabilities = SandboxCapabilities(
            backend="local", namespaces=bwrap.namespaces_of(self._runtime),
            cgroup_version=cgroup.version, cgroup_controllers=cgroup.controllers,
            rlimits=RLIMITS, unprivileged_uid=True, sandbox_uid=bwrap.SANDBOX_UID,
            host_uid=lease.uid, nested_userns_blocked=self._runtime.disable_userns,
            disk_limit_mb=disk_limit_mb, denied_syscalls=seccomp.denied_names())

    @classmethod
    async def create(cls, spec: SandboxSpec, config: LocalSandboxConfig | None = None) -> Self:
        config = config or LocalSandboxConfig()
        if os.geteuid() != 0:
            raise ValueError("LocalSandbox gives each sandbox its own host uid and cgroup, "
                             "which needs root; run the sandbox worker as root (in its "
                             "container)")
        bwrap.detect_host_runtime()  # fails early, with the fix, when a tool is missing
        seccomp.build_filter()  # and when this architecture has no system call table
        if spec.workdir != WORKSPACE_MOUNT:
            raise ValueError(f"LocalSandbox mounts the workspace at {WORKSPACE_MOUNT} only; "
                             f"SandboxSpec.workdir={spec.workdir!r} (a repository inside a "
                             "task image) needs envs.sandbox_backend=container")
        if spec.image is not None and spec.image not in _warned:
            _warned.add(spec.image)
            log.warning("LocalSandbox runs commands on the host's own runtime and ignores "
                        "SandboxSpec.image=%r; set envs.sandbox_backend=container to run "
                        "tasks in their images", spec.image)
        if spec.source_dir is not None and not os.path.isdir(spec.source_dir):
            raise ValueError(f"SandboxSpec.source_dir={spec.source_dir!r} is not a directory "
                             "on this host; pass an existing folder or None for an empty workspace")
        root = config.root_dir or tempfile.gettempdir()
        _check_traversable(root)
        lease = HostUidLease.acquire(config.first_host_uid, config.num_host_uids,
                                     config.lease_dir, spec.role)
        sandbox_dir = None
        try:
            # A worker that crashed may have left processes, mounts and files of this uid.
            # (Not keys: the commands' keyrings live in their own user namespaces, which
            # die with them; the host's keyrings of the uid are emptied at release.)
            await asyncio.to_thread(kill_all_of_uid, lease.uid)
            pattern = os.path.join(glob.escape(root), f"sluice-sandbox-{lease.uid}-*")
            for stale in glob.glob(pattern):
                await asyncio.to_thread(workspace.remove_sandbox_dir, stale)
            sandbox_dir = await asyncio.to_thread(
                workspace.make_sandbox_dir, root, lease.uid, "sluice-sandbox-",
                {"passwd": bwrap.PASSWD, "group": bwrap.GROUP, "hosts": bwrap.HOSTS})
            ws = os.path.join(sandbox_dir, "workspace")
            disk_limit_mb = None
            if config.workspace_fs == "tmpfs":
                disk_limit_mb = await asyncio.to_thread(workspace.mount_capped_workspace, ws,
                                                        spec.limits.disk_mb, lease.uid)
            if spec.source_dir is not None:
                await workspace.fill_from_source(spec.source_dir, ws, lease.uid)
            limits = spec.limits
            cgroup = await asyncio.to_thread(
                SandboxCgroup.create, f"sluice-sandbox-{lease.uid}", limits.memory_mb,
                limits.max_processes + 2, limits.cpu_quota_cores)
        except BaseException:  # cancellation included: the half-made sandbox is removed, then re-raised
            if sandbox_dir is not None:
                workspace.remove_sandbox_dir(sandbox_dir)
            lease.release()
            raise
        return cls(spec=spec, config=config, lease=lease, sandbox_dir=sandbox_dir, cgroup=cgroup,
                   disk_limit_mb=disk_limit_mb)

    def host_paths(self) -> tuple[str, ...]:
        """Every host path this sandbox owns: its folder and its cgroup dirs."""
        return (self._sandbox_dir, *self._cgroup_dirs)

    async def exec(self, cmd: str | list[str], timeout_s: float,
                   stdin: str | None = None) -> ExecResult:
        argv = workspace.command_argv(cmd, timeout_s)
        async with self._ws.turn():
            return await self._run(argv, timeout_s, stdin)

    def launcher_argv(self, argv: list[str], seccomp_fd: int | None) -> list[str]:
        """The launcher of one command as `exec` runs it, with the seccomp program read
        from `seccomp_fd` (None leaves the filter out: only tests/bench/bench_seccomp.py
        does, to price it)."""
        return bwrap.build_command(
            self._runtime, host_uid=self._lease.uid, cgroup_procs=self._cgroup.procs_files(),
            limits=self._limits, memory_cgroup="memory" in self._cgroup.dirs,
            workspace=self._workspace, etc_dir=self._etc, argv=argv, seccomp_fd=seccomp_fd)

    async def _run(self, argv: list[str], timeout_s: float, stdin: str | None) -> ExecResult:
        # A pipe per command: the program lives in this process's memory only.
        seccomp_fd = seccomp.filter_pipe()
        try:
            oom_before = self._cgroup.oom_kills()
            outcome = await run_launcher(
                self.launcher_argv(argv, seccomp_fd), env=bwrap.LAUNCHER_ENV, stdin=stdin,
                timeout_s=timeout_s, max_output_bytes=self._limits.max_output_bytes,
                kill_tree=self._kill_tree, exit_grace_s=self._config.exit_grace_s,
                label=f"sandbox uid {self._lease.uid}", pass_fds=(seccomp_fd,))
        finally:
            os.close(seccomp_fd)
        return outcome.to_result(oom_killed=self._cgroup.oom_kills() > oom_before)

    async def _kill_tree(self, proc: asyncio.subprocess.Process) -> None:
        """Kill bwrap (its PID namespace dies with it), then anything else of this
        sandbox's uid still alive: the cgroup lists them cheaply, without one /proc is
        scanned."""
        kill_launcher(proc)
        uid = self._lease.uid
        try:
            await asyncio.wait_for(proc.wait(), timeout=5.0)
        except TimeoutError:
            log.error("sandbox uid %d: bwrap pid %d does not exit after SIGKILL", uid, proc.pid)
        list_pids = self._cgroup.pids if self._cgroup.dirs else all_pids
        if live_of_uid(list_pids(), uid):
            await asyncio.to_thread(kill_all_of_uid, uid, list_pids)

    def _teardown(self) -> None:
        survivors = kill_all_of_uid(self._lease.uid)
        workspace.remove_sandbox_dir(self._sandbox_dir)
        stuck = self._cgroup.remove()
        if survivors or stuck:
            # Keep the uid leased: handing it to a new sandbox would give that sandbox
            # these processes. The lease frees itself when this worker exits.
            log.error("sandbox uid %d not released: processes %s, cgroups %s",
                      self._lease.uid, survivors, stuck)
            return
        # Only now that none of its processes runs (one could race the clearing child).
        # Before Linux 5.3 the user keyring was one per host uid; since, each command's
        # keyrings live and die in its own user namespace, so the clearing (a child
        # process as that uid, 40-290 ms per release measured here) would buy nothing.
        if KEYRINGS_SHARED_BY_HOST_UID:
            clear_keyrings_of_uid(self._lease.uid)
        self._lease.release()


def _kernel_before(major: int, minor: int) -> bool:
    parts = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return parts is None or (int(parts[1]), int(parts[2])) < (major, minor)


KEYRINGS_SHARED_BY_HOST_UID = _kernel_before(5, 3)


def _check_traversable(root: str) -> None:
    """bwrap runs as the sandbox's uid, so it must be able to pass through every folder
    above the sandbox folders."""
    path = os.path.realpath(root)
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            raise ValueError(f"LocalSandboxConfig.root_dir={root!r}: {path} is not searchable "
                             f"by other users, so sandbox uids cannot reach their workspace; "
                             f"run `chmod o+x {path}` or pick another root_dir")
        if path == "/":
            return
        path = os.path.dirname(path)


_warned: set[str] = set()  # images already warned about
