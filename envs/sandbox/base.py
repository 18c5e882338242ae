"""The Sandbox protocol every backend implements, and the typed values it exchanges.

A sandbox is a workspace folder plus a way to run commands in it under limits. The
trainer only sees this module: backends (local bubblewrap, containers) are swapped by
import string and must pass `tests/integration/test_sandbox_contract.py`.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Protocol, Self

from envs.config import EnvsConfig

WORKSPACE_MOUNT = "/workspace"  # where the workspace appears inside every backend


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Resource limits of one sandbox; every backend enforces what its host allows and
    reports which mechanisms are active in `SandboxCapabilities`."""

    memory_mb: int = 1024  # all processes together (cgroup); also bounds each process (RLIMIT_AS)
    max_processes: int = 64  # tasks (processes and threads) alive at once
    cpu_time_s: int = 120  # CPU seconds of each process (RLIMIT_CPU); wall time is exec's timeout_s
    file_size_mb: int = 256  # largest file a command may write (RLIMIT_FSIZE)
    open_files: int = 256  # file descriptors per process (RLIMIT_NOFILE)
    max_output_bytes: int = 65_536  # captured stdout+stderr of one command, head and tail kept
    cpu_quota_cores: float = 1.0  # CPU bandwidth of the whole sandbox, in cores (cgroup cpu)
    disk_mb: int = 1024  # size of the workspace, where the backend can cap it

    def __post_init__(self) -> None:
        for name in ("memory_mb", "max_processes", "cpu_time_s", "file_size_mb", "open_files",
                     "disk_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"SandboxLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.memory_mb < 32:
            raise ValueError(f"SandboxLimits.memory_mb={self.memory_mb} cannot start python3; "
                             "use at least 32")
        if self.max_output_bytes < 64:
            raise ValueError(f"SandboxLimits.max_output_bytes={self.max_output_bytes} leaves no "
                             "room for head and tail; use at least 64")
        if self.cpu_quota_cores <= 0:
            raise ValueError(f"SandboxLimits.cpu_quota_cores must be > 0, got {self.cpu_quota_cores}")


def build_sandbox_limits(envs: EnvsConfig) -> SandboxLimits:
    """The recipe's `envs.*` limits as SandboxLimits (other fields keep their defaults)."""
    return SandboxLimits(memory_mb=envs.memory_limit_mb, max_processes=envs.max_processes,
                         max_output_bytes=envs.max_output_bytes)


class SandboxRole(enum.Enum):
    """Whose sandbox it is. Each role leases host uids from its own half of a backend's
    range, so what the kernel keeps per uid after a sandbox is gone (keyrings, key
    quotas) never passes from a sandbox that held hidden tests to one the policy drives."""

    AGENT = "agent"  # the policy's commands, their output shown to the model (envs.pool)
    GRADER = "grader"  # grading and everything else: may hold what the policy must not see


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """What to create: the workspace's initial content, the limits and the image."""

    # Folder copied into the workspace, on the host that runs the sandbox (checked there,
    # by the backend's create); None: an empty workspace.
    source_dir: str | None = None
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    # Container image the commands run in (Task.image), looked up in the engine's local
    # storage, never pulled; None: the backend's default (the host's own runtime). Only
    # container backends use it; the local backend warns once and runs on the host's.
    image: str | None = None
    # Where the workspace appears inside the sandbox, the commands' working directory:
    # WORKSPACE_MOUNT, or where the image keeps its repository (Task.workdir, e.g.
    # /testbed). Only container backends mount it elsewhere.
    workdir: str = WORKSPACE_MOUNT
    # GRADER unless the agent pool made it: envs.pool stamps AGENT on every sandbox it
    # creates for trajectories, so a sandbox made anywhere else (reward code, tools,
    # benchmarks) never shares host uids with the policy's.
    role: SandboxRole = SandboxRole.GRADER

    def __post_init__(self) -> None:
        if not os.path.isabs(self.workdir) or os.path.normpath(self.workdir) != self.workdir \
                or self.workdir == "/":
            raise ValueError(f"SandboxSpec.workdir={self.workdir!r} must be a normalised "
                             "absolute path below /, such as /testbed")


@dataclass(frozen=True, slots=True)
class ExecResult:
    """Outcome of one command. Output is decoded with errors="replace"; when it was cut,
    the middle is replaced by a `[... N bytes cut ...]` marker and `output_truncated` is set."""

    exit_code: int  # shell convention: 128 + signal number when killed by a signal
    stdout: str
    stderr: str
    timed_out: bool  # the wall-clock limit killed it
    oom_killed: bool  # the memory limit killed a process of it (only known with a memory cgroup)
    output_truncated: bool
    duration_s: float


@dataclass(frozen=True, slots=True)
class SandboxCapabilities:
    """Which isolation and limit mechanisms are actually active for a sandbox."""

    backend: str
    namespaces: tuple[str, ...]  # e.g. ("user", "mount", "pid", "net", "ipc", "uts", "cgroup")
    cgroup_version: int | None  # 1, 2, or None when no cgroup could be created
    cgroup_controllers: tuple[str, ...]  # controllers with a per-sandbox limit, e.g. ("memory", "pids")
    rlimits: tuple[str, ...]  # resource limits set on every command, e.g. ("AS", "NPROC")
    unprivileged_uid: bool  # commands run as a non-root host uid (RLIMIT_NPROC applies)
    sandbox_uid: int  # uid the commands see inside
    host_uid: int  # uid the commands have on the host
    nested_userns_blocked: bool  # commands cannot create further user namespaces
    disk_limit_mb: int | None  # cap on the workspace's size; None: bounded only per file
    # System calls every command fails by seccomp (envs.sandbox.seccomp: kernel channels
    # between sandboxes); empty for a backend that installs no such filter.
    denied_syscalls: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A tar of a workspace kept on the host; it outlives the sandbox it came from, so a
    sandbox can be released between turns and resumed by `restore` into a new one."""

    tar_path: str
    num_bytes: int

    def discard(self) -> None:
        """Delete the tar (restoring from it afterwards fails)."""
        try:
            os.unlink(self.tar_path)
        except FileNotFoundError:
            pass


class Sandbox(Protocol):
    """A workspace and a way to run commands in it. Paths of `read_file`/`write_file` are
    relative to the workspace; absolute paths, `..` escapes and symlinks that resolve
    outside it raise ValueError. Commands of one sandbox run one at a time."""

    @classmethod
    async def create(cls, spec: SandboxSpec) -> Self: ...

    def capabilities(self) -> SandboxCapabilities: ...

    async def exec(self, cmd: str | list[str], timeout_s: float,
                   stdin: str | None = None) -> ExecResult:
        """Run `cmd` (a string goes through /bin/sh -c) in the workspace. Nothing it
        started outlives the call."""
        ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes) -> None: ...

    async def snapshot(self) -> Snapshot: ...

    async def restore(self, snapshot: Snapshot) -> None:
        """Replace the workspace's content by the snapshot's."""
        ...

    async def release(self) -> None:
        """Kill everything left, free the limits' resources and delete the workspace.
        Idempotent; the sandbox is unusable afterwards."""
        ...


def resolve_workspace_path(workspace: str, path: str) -> str:
    """The host path of `path` inside `workspace`, with symlinks resolved; raises ValueError
    for paths that are absolute, empty, or lead outside the workspace."""
    if not path or "\0" in path:
        raise ValueError(f"workspace path {path!r} is empty or contains NUL; "
                         "pass a relative path such as 'src/main.py'")
    if os.path.isabs(path):
        raise ValueError(f"workspace path {path!r} is absolute; pass it relative to the "
                         f"workspace (e.g. {path.lstrip('/')!r} for {WORKSPACE_MOUNT}/...)")
    normalized = os.path.normpath(path)
    if normalized == ".." or normalized.startswith("../"):
        raise ValueError(f"workspace path {path!r} leaves the workspace through '..'; "
                         "pass a path that stays inside it")
    root = os.path.realpath(workspace)
    resolved = os.path.realpath(os.path.join(root, normalized))
    if os.path.commonpath([root, resolved]) != root:
        raise ValueError(f"workspace path {path!r} resolves outside the workspace (through a "
                         "symlink); only paths whose target is inside the workspace are allowed")
    return resolved
