"""ContainerSandbox: the sandbox backend on a container engine (podman, or docker with a
local daemon), for tasks that bring their own image (SandboxSpec.image, as SWE-bench
does) and hosts where containers are the isolation of choice.

One long-lived container per sandbox, each command a `podman exec` into it:

    create:  lease a host uid (of the spec's role; its keyrings emptied) -> workspace
             folder (tmpfs, like local) -> `run -d` a root init (catatonit -P) with no
             network, read-only root, no capabilities, a seccomp profile (no nested user
             namespaces, no envs.sandbox.seccomp kernel channels), memory/pids/cpu limits
             and rlimits, the workspace bound at /workspace
    exec:    `exec --user <uid>` (head+tail capped output, wall-clock limit) -> kill every
             process of the uid in the container's cgroup -> empty /tmp and /dev/shm
    release: `rm -f` the container -> kill any straggler of the uid -> delete the folder
             -> empty the uid's keyrings

The workspace is a host folder, as in the local backend, and the same code does file
operations and snapshots (`workspace.HostWorkspace`). Commands run as the leased host uid
(not 65534), so RLIMIT_NPROC is per sandbox and "what is left" is checkable from /proc.

Containers share the host's user namespace, so what the kernel keeps per uid there (its
keyrings) would pass from one sandbox of a uid to the next: the profile denies the
keyring calls, agent and grading sandboxes never share a uid (SandboxSpec.role), and a
uid's keyrings are emptied whenever it is leased and released. What remains possible
between sandboxes is listed in envs.sandbox.seccomp.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Self

from envs.sandbox import engine as engines
from envs.sandbox import seccomp, workspace
from envs.sandbox.base import (
    ExecResult,
    SandboxCapabilities,
    SandboxSpec,
)
from envs.sandbox.cgroups import SandboxCgroup
from envs.sandbox.engine import ContainerEngine
from envs.sandbox.hostuid import (
    HostUidLease,
    clear_keyrings_of_uid,
    kill_all_of_uid,
    live_of_uid,
)
from envs.sandbox.launch import kill_launcher, run_launcher

log = logging.getLogger(__name__)

RLIMITS = ("CPU", "FSIZE", "NOFILE", "NPROC", "CORE")  # no AS: the engines cannot set it
NAMESPACES = ("mount", "pid", "net", "ipc", "uts", "cgroup")
_PRIVATE_DIRS = ("tmp", "dev/shm")  # emptied after every command, as local's live one command


@dataclass(frozen=True, slots=True)
class ContainerSandboxConfig:
    """Host-side settings of the container backend (the same for every sandbox of a worker).
    The uid range and lease dir default to the local backend's, so both backends can
    run on one host without ever sharing a uid."""

    root_dir: str | None = None  # parent of the sandbox folders; None: the system temp dir
    snapshot_dir: str | None = None  # where snapshot tars go; None: the system temp dir
    # Host uids [first, first + num) are leased to sandboxes: the first half to agent
    # sandboxes, the second to grading ones (SandboxSpec.role).
    first_host_uid: int = 1_200_000
    num_host_uids: int = 4096
    lease_dir: str = "/run/sluice-sandbox-uids"
    cap_workspace: bool = True  # a tmpfs of SandboxLimits.disk_mb (see LocalSandboxConfig)
    exit_grace_s: float = 1.0  # after a command exits, how long its output pipes may stay open
    engine_timeout_s: float = 120.0  # one `run` or `rm` of the engine


class ContainerSandbox(workspace.HostWorkspaceSandbox):
    """A sandbox in a container (see the module docstring). Create with `await
    ContainerSandbox.create(spec)`; always `await release()`."""

    def __init__(self, *, spec: SandboxSpec, config: ContainerSandboxConfig,
                 engine: ContainerEngine, lease: HostUidLease, sandbox_dir: str,
                 container: str, init_pid: int, disk_limit_mb: int | None) -> None:
        self._limits = spec.limits
        self._config = config
        self._engine = engine
        self._lease = lease
        self._sandbox_dir = sandbox_dir
        self._container = container
        self._workdir = spec.workdir
        self._ws = workspace.HostWorkspace(os.path.join(sandbox_dir, "workspace"), lease.uid,
                                           config.snapshot_dir, spec.limits.disk_mb << 20)
        self._cgroup = SandboxCgroup.of_process(init_pid)
        self._cgroup_dirs = tuple(sorted(set(self._cgroup.dirs.values())))
        # The container's private folders, held open from the host: clearing them goes
        # through these descriptors, never through a path the sandbox could redirect.
        self._private_fds = [os.open(f"/proc/{init_pid}/root/{d}",
                                     os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                             for d in _PRIVATE_DIRS]
        self._capabilities = SandboxCapabilities(
            backend="container", namespaces=NAMESPACES, cgroup_version=self._cgroup.version,
            cgroup_controllers=self._cgroup.controllers, rlimits=RLIMITS,
            unprivileged_uid=True, sandbox_uid=lease.uid, host_uid=lease.uid,
            # engine.seccomp_profile refuses CLONE_NEWUSER (tests/integration/
            # test_sandbox_redteam.py proves it on the real engine).
            nested_userns_blocked=True, disk_limit_mb=disk_limit_mb,
            denied_syscalls=seccomp.denied_names())

    @classmethod
    async def create(cls, spec: SandboxSpec,
                     config: ContainerSandboxConfig | None = None) -> Self:
        config = config or ContainerSandboxConfig()
        if os.geteuid() != 0:
            raise ValueError("ContainerSandbox leases host uids and runs the engine as root; "
                             "run the sandbox worker as root (in its container)")
        engine = await asyncio.to_thread(engines.detect_engine)
        if spec.source_dir is not None and not os.path.isdir(spec.source_dir):
            raise ValueError(f"SandboxSpec.source_dir={spec.source_dir!r} is not a directory "
                             "on this host; pass an existing folder or None for an empty workspace")
        image = await asyncio.to_thread(_resolve_image, engine, spec.image)
        root = config.root_dir or tempfile.gettempdir()
        lease = HostUidLease.acquire(config.first_host_uid, config.num_host_uids,
                                     config.lease_dir, spec.role)
        sandbox_dir = None
        name = f"sluice-sandbox-{lease.uid}"  # unique while leased; --replace clears a stale one
        try:
            # A crashed worker's leftovers: processes, and keys it never cleared.
            await asyncio.to_thread(kill_all_of_uid, lease.uid)
            await asyncio.to_thread(clear_keyrings_of_uid, lease.uid)
            sandbox_dir = await asyncio.to_thread(
                workspace.make_sandbox_dir, root, lease.uid, "sluice-csandbox-",
                _identity_files(lease.uid))
            ws = os.path.join(sandbox_dir, "workspace")
            disk_limit_mb = None
            if config.cap_workspace:
                disk_limit_mb = await asyncio.to_thread(workspace.mount_capped_workspace, ws,
                                                        spec.limits.disk_mb, lease.uid)
            if spec.source_dir is not None:
                await workspace.fill_from_source(spec.source_dir, ws, lease.uid)
            options = engines.build_run_options(engine, name=name, limits=spec.limits,
                                                workspace=ws, tmp_size_mb=spec.limits.memory_mb,
                                                workdir=spec.workdir)
            if spec.image is None:
                options += engines.host_runtime_mounts(os.path.join(sandbox_dir, "etc"))
            else:
                options += ["--env", f"PATH={engines.IMAGE_PATH}"]
            if engine.name == "docker":
                await asyncio.to_thread(_remove_container, engine, name, config)
            container = (await asyncio.to_thread(
                engines.run_engine, engine, *options, image, "-P",
                timeout_s=config.engine_timeout_s)).strip()
            pid = int(await asyncio.to_thread(engines.run_engine, engine, "inspect", "--format",
                                              "{{.State.Pid}}", container))
            return cls(spec=spec, config=config, engine=engine, lease=lease,
                       sandbox_dir=sandbox_dir, container=container, init_pid=pid,
                       disk_limit_mb=disk_limit_mb)
        except BaseException:  # cancellation included: the half-made container is removed, then re-raised
            await asyncio.to_thread(_remove_container, engine, name, config)
            if sandbox_dir is not None:
                workspace.remove_sandbox_dir(sandbox_dir)
            lease.release()
            raise

    @property
    def container_id(self) -> str:
        return self._container

    @property
    def engine_name(self) -> str:
        return self._engine.name

    def host_paths(self) -> tuple[str, ...]:
        """Every host path this sandbox owns: its folder and its container's cgroup dirs."""
        return (self._sandbox_dir, *self._cgroup_dirs)

    async def exec(self, cmd: str | list[str], timeout_s: float,
                   stdin: str | None = None) -> ExecResult:
        argv = workspace.command_argv(cmd, timeout_s)
        async with self._ws.turn():
            uid = self._lease.uid
            launcher = self._engine.command(
                "exec", *(["-i"] if stdin is not None else []), "--user", f"{uid}:{uid}",
                "-w", self._workdir, self._container, *argv)
            oom_before = self._cgroup.oom_kills()
            try:
                outcome = await run_launcher(
                    launcher, env=engines.engine_env(), stdin=stdin, timeout_s=timeout_s,
                    max_output_bytes=self._limits.max_output_bytes, kill_tree=self._kill_tree,
                    exit_grace_s=self._config.exit_grace_s, label=f"container {self._container[:12]}",
                    cwd=self._sandbox_dir)  # conmon drops files (e.g. `oom`) in its cwd
            finally:
                await asyncio.to_thread(self._clear_private_dirs)
            return outcome.to_result(oom_killed=self._cgroup.oom_kills() > oom_before)

    async def _kill_tree(self, proc: asyncio.subprocess.Process) -> None:
        """Kill every process of the sandbox's uid in the container's cgroup (killing the
        exec client alone would leave them running under the engine), then the client if
        it does not exit on its own once its command is gone."""
        uid = self._lease.uid
        if live_of_uid(self._cgroup.pids(), uid):
            await asyncio.to_thread(kill_all_of_uid, uid, self._pids_oldest_first)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=2.0)
        except TimeoutError:
            kill_launcher(proc)
            await proc.wait()

    def _pids_oldest_first(self) -> list[int]:
        """The container's pids, parents before their children: a parent killed first
        never runs again, so a shell cannot see its child die and carry on (`sleep 60;
        echo never` must not print), which killing in any other order allows."""
        return sorted(self._cgroup.pids(), key=_start_time)

    def _clear_private_dirs(self) -> None:
        for fd in self._private_fds:
            try:
                workspace.clear_dir_fd(fd)
            except OSError as e:
                log.error("container %s: clearing a private folder failed: %s",
                          self._container[:12], e)

    def _teardown(self) -> None:
        for fd in self._private_fds:
            os.close(fd)
        self._private_fds = []
        removed = _remove_container(self._engine, self._container, self._config)
        if removed:
            _wait_for_engine_helpers(self._container)
        survivors = kill_all_of_uid(self._lease.uid)
        workspace.remove_sandbox_dir(self._sandbox_dir)
        if survivors or not removed:
            # Keep the uid leased: a new sandbox with it would meet these leftovers.
            log.error("sandbox uid %d not released: processes %s, container %s removed: %s",
                      self._lease.uid, survivors, self._container[:12], removed)
            return
        # Only now that none of its processes runs (one could race the clearing child).
        clear_keyrings_of_uid(self._lease.uid)
        self._lease.release()


def _start_time(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # Fields after the command name, which may hold spaces and parentheses.
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _wait_for_engine_helpers(container: str, deadline_s: float = 5.0) -> None:
    """`rm` returns while the container's monitor (conmon) and the engine's cleanup
    process are still exiting; wait for them, so a released sandbox has no process
    left (they are the engine's, so they are waited for, not killed)."""
    needle = container.encode()
    end = time.monotonic() + deadline_s
    while True:
        left = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if needle in f.read():
                            left.append(int(entry))
                except OSError:
                    continue
        if not left:
            return
        if time.monotonic() > end:
            log.warning("container %s: engine processes %s still running after release",
                        container[:12], left)
            return
        time.sleep(0.02)


def _resolve_image(engine: ContainerEngine, image: str | None) -> str:
    if image is None:
        return engines.ensure_default_image(engine)
    if not engines.image_exists(engine, image):
        raise ValueError(f"SandboxSpec.image={image!r} is not in {engine.name}'s local storage; "
                         f"build or load it on this host first (`{engine.name} load -i "
                         "image.tar` or `import`): images are never pulled")
    return image


def _remove_container(engine: ContainerEngine, name: str, config: ContainerSandboxConfig) -> bool:
    """Remove the container (killing its processes); True when it is gone."""
    args = ("rm", "-f", "-t", "0", name) if engine.name == "podman" else ("rm", "-f", name)
    try:
        engines.run_engine(engine, *args, timeout_s=config.engine_timeout_s)
    except OSError as e:
        if "no such container" not in str(e).lower():
            log.error("removing container %s failed: %s", name, e)
            return False
    return True


def _identity_files(uid: int) -> dict[str, str]:
    """/etc/passwd, group and hosts of a sandbox on the default image: the leased uid
    has a name and HOME, as `whoami`, git and pip expect."""
    return {"passwd": f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{uid}:{uid}:sandbox:"
                      f"/workspace:/bin/sh\n",
            "group": f"root:x:0:\nsandbox:x:{uid}:\n",
            "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n"}


@functools.cache
def probe_container_backend() -> str | None:
    """Why the container backend cannot run here, or None when a sandbox could be made,
    run a command and be released (tried once per process; for tests and set-up checks)."""
    async def attempt() -> None:
        sandbox = await ContainerSandbox.create(SandboxSpec())
        try:
            result = await sandbox.exec(["true"], 60)
            if result.exit_code != 0:
                raise OSError(f"`true` in a container exited {result.exit_code}: "
                              f"{result.stderr.strip()[-500:]}")
        finally:
            await sandbox.release()

    # A fresh thread: the caller may be inside a running event loop.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        try:
            pool.submit(asyncio.run, attempt()).result()
            return None
        except (ValueError, OSError) as e:
            return str(e)

