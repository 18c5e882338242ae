"""The command line that runs one sandboxed command: a root launcher joins the sandbox's
cgroups, sets rlimits, drops to the sandbox's host uid, and execs bubblewrap, which builds
fresh namespaces with only the system's read-only runtime and the workspace visible.

    sh (root: join cgroups) -> prlimit (rlimits) -> setpriv (host uid) -> bwrap -> command

Every step execs the next, so the process asyncio waits on ends up being bwrap itself;
killing it kills the PID namespace's init (--die-with-parent) and with it every process
of the command, daemons included. bwrap installs the seccomp filter of
`envs.sandbox.seccomp` (read from a pipe the launcher inherits, `--seccomp FD`) right
before it execs the command, on the namespace's init too.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass

from envs.sandbox.base import WORKSPACE_MOUNT, SandboxLimits

SANDBOX_UID = 65534  # "nobody" inside every sandbox
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
# Environment of the launcher itself; bwrap --clearenv starts the command from nothing.
LAUNCHER_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
# Host /etc entries the system python and coreutils need; everything else in /etc
# (shadow, ssh keys, pip/npm tokens, resolv.conf) stays invisible.
ETC_ALLOWED = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime",
                "python3", "python3.11", "python3.12", "python3.13", "ssl/openssl.cnf",
                "mime.types", "debian_version", "os-release")
TOP_LEVEL_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Joins each cgroup.procs file given as an argument, then execs the rest of argv.
_JOIN_CGROUPS = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; ' \
                'shift; n=$((n-1)); done; exec "$@"'
PASSWD = f"root:x:0:0:root:/root:/bin/sh\nnobody:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:" \
         f"{WORKSPACE_MOUNT}:/bin/sh\n"
GROUP = f"root:x:0:\nnogroup:x:{SANDBOX_UID}:\n"
HOSTS = "127.0.0.1 localhost sandbox\n::1 localhost\n"


@dataclass(frozen=True, slots=True)
class HostRuntime:
    """What this host offers to sandboxes, found once at first use."""

    bwrap: str
    prlimit: str
    setpriv: str
    sh: str
    python3: str | None  # the system python visible inside, or None
    disable_userns: bool  # bwrap >= 0.8 can forbid nested user namespaces
    has_cgroup_ns: bool


@functools.cache
def detect_host_runtime() -> HostRuntime:
    tools = {}
    for name in ("bwrap", "prlimit", "setpriv", "sh"):
        path = shutil.which(name, path=LAUNCHER_ENV["PATH"])
        if path is None:
            raise ValueError(f"LocalSandbox needs `{name}` on the host; install bubblewrap "
                             "(Debian: apt-get install bubblewrap) and util-linux")
        tools[name] = path
    python3 = None
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        # Only interpreters under the read-only system trees are visible inside.
        real = os.path.realpath(candidate)
        if os.access(real, os.X_OK) and real.startswith("/usr/"):
            python3 = candidate
            break
    help_text = subprocess.run([tools["bwrap"], "--help"], capture_output=True, text=True,
                               env=LAUNCHER_ENV, check=False).stdout
    return HostRuntime(bwrap=tools["bwrap"], prlimit=tools["prlimit"], setpriv=tools["setpriv"],
                       sh=tools["sh"], python3=python3,
                       disable_userns="--disable-userns" in help_text,
                       has_cgroup_ns=os.path.exists("/proc/self/ns/cgroup"))


def rlimit_args(limits: SandboxLimits, memory_cgroup: bool) -> list[str]:
    """prlimit options. With a memory cgroup the cgroup is the real bound (and flags OOM
    kills) and RLIMIT_AS is a looser per-process backstop at twice the limit, since
    runtimes reserve far more address space than they touch; without one, RLIMIT_AS
    at the limit is all there is."""
    address_space = (limits.memory_mb * (2 if memory_cgroup else 1)) << 20
    # Two tasks more than asked: bwrap's monitor and the namespace's init count too.
    tasks = limits.max_processes + 2
    return [f"--as={address_space}", f"--cpu={limits.cpu_time_s}:{limits.cpu_time_s + 1}",
            f"--fsize={limits.file_size_mb << 20}", f"--nofile={limits.open_files}",
            f"--nproc={tasks}", "--core=0"]  # core=0: no dumps handed to a host core handler


def mount_args(workspace: str, etc_dir: str, tmp_size_mb: int) -> list[str]:
    """bwrap filesystem: read-only system trees, synthetic /etc files, private /tmp."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in TOP_LEVEL_LINKS:
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for name in ETC_ALLOWED:
        path = f"/etc/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    for name in ("passwd", "group", "hosts"):
        args += ["--ro-bind", os.path.join(etc_dir, name), f"/etc/{name}"]
    size = str(tmp_size_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev",
             "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/dev/shm",
             "--bind", workspace, WORKSPACE_MOUNT, "--chdir", WORKSPACE_MOUNT,
             # bwrap's root is a tmpfs the sandbox uid owns; read-only, only /workspace,
             # /tmp and /dev/shm take writes.
             "--remount-ro", "/"]
    return args


def build_command(runtime: HostRuntime, *, host_uid: int, cgroup_procs: list[str],
                  limits: SandboxLimits, memory_cgroup: bool, workspace: str, etc_dir: str,
                  argv: list[str], seccomp_fd: int | None) -> list[str]:
    """The full launcher argv for one command (see the module docstring). `seccomp_fd`:
    the descriptor, inherited by the launcher, that holds the seccomp program (None: no
    filter, for benchmarks that measure its cost)."""
    namespaces = ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                  "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                  "--hostname", "sandbox"]
    if runtime.has_cgroup_ns:
        namespaces.append("--unshare-cgroup-try")
    if runtime.disable_userns:
        namespaces.append("--disable-userns")
    env = ["--clearenv", "--setenv", "PATH", SANDBOX_PATH, "--setenv", "HOME", WORKSPACE_MOUNT,
           "--setenv", "LANG", "C.UTF-8"]
    seccomp = ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    bwrap = [runtime.bwrap, *namespaces, "--die-with-parent", "--new-session", *seccomp, *env,
             *mount_args(workspace, etc_dir, limits.memory_mb), "--", *argv]
    drop = [runtime.setpriv, "--reuid", str(host_uid), "--regid", str(host_uid),
            "--clear-groups", "--"]
    rlimits = [runtime.prlimit, *rlimit_args(limits, memory_cgroup), "--"]
    join = [runtime.sh, "-c", _JOIN_CGROUPS, "sh", str(len(cgroup_procs)), *cgroup_procs]
    return [*join, *rlimits, *drop, *bwrap]


def namespaces_of(runtime: HostRuntime) -> tuple[str, ...]:
    return ("user", "mount", "pid", "net", "ipc", "uts") + (
        ("cgroup",) if runtime.has_cgroup_ns else ())
