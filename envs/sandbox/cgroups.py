"""Per-sandbox cgroups: a memory, pids and cpu limit on the whole process tree of a
sandbox, on whichever cgroup version the host offers (v1 hierarchies or the v2 tree).

Each sandbox's cgroup is created under the cgroup of the process that creates it, so a
worker's own limits (its container's) still bound everything its sandboxes use. What
cannot be created (read-only cgroupfs, a v2 parent with processes) is simply not
active, logged once, and reported by `SandboxCapabilities`.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids", "cpu")
_CPU_PERIOD_US = 100_000


@dataclass(frozen=True, slots=True)
class CgroupHost:
    """Where per-sandbox cgroups go on this host: the parent folder of each controller."""

    version: int | None
    parents: tuple[tuple[str, str], ...]  # (controller, parent dir); v2: one dir for all


def _own_paths() -> dict[str, str]:
    """Controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [""]:
                out[name] = path
    return out


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(fstype, mountpoint, options) of the cgroup mounts."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, post = line.split(" - ", 1)
            mountpoint = pre.split()[4]
            fstype, _, superopts = post.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                found.append((fstype, mountpoint, set(superopts.split(","))))
    return found


def _parent_dir(mountpoint: str, own_path: str) -> str:
    # Inside a cgroup namespace the mount root is our own cgroup and /proc/self/cgroup
    # reads "/", so joining gives the mountpoint; where the join does not exist the
    # mount shows a different root and the mountpoint is the best parent we know.
    joined = os.path.join(mountpoint, own_path.lstrip("/"))
    return joined if os.path.isdir(joined) else mountpoint


@functools.cache
def detect_cgroup_host() -> CgroupHost:
    """v1 hierarchies when they carry the controllers (the v2 mount of a hybrid host has
    none), else the v2 tree when its cgroup.controllers lists them."""
    own = _own_paths()
    mounts = _mounts()
    v1 = []
    for fstype, mountpoint, opts in mounts:
        for controller in CONTROLLERS:
            if fstype == "cgroup" and controller in opts and controller in own:
                v1.append((controller, _parent_dir(mountpoint, own[controller])))
    if v1:
        return CgroupHost(1, tuple(sorted(set(v1))))
    for fstype, mountpoint, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            parent = _parent_dir(mountpoint, own[""])
            try:
                with open(os.path.join(parent, "cgroup.controllers")) as f:
                    available = set(f.read().split())
            except OSError:
                continue
            controllers = [c for c in CONTROLLERS if c in available]
            if controllers:
                return CgroupHost(2, tuple((c, parent) for c in controllers))
    return CgroupHost(None, ())


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class SandboxCgroup:
    """The cgroup(s) of one sandbox: created with limits, joined by each command's
    launcher, emptied and removed on release."""

    def __init__(self, version: int | None, dirs: dict[str, str]) -> None:
        self.version = version
        self.dirs = dirs  # controller -> cgroup dir

    @classmethod
    def create(cls, name: str, memory_mb: int, max_tasks: int, cpu_cores: float) -> SandboxCgroup:
        host = detect_cgroup_host()
        if host.version == 2:
            return cls._create_v2(host, name, memory_mb, max_tasks, cpu_cores)
        dirs: dict[str, str] = {}
        for controller, parent in host.parents:
            path = os.path.join(parent, name)
            try:
                _remove_dir(path)  # a leftover of a crashed worker that held this uid
                os.mkdir(path)
                dirs[controller] = path
                _apply_v1(controller, path, memory_mb, max_tasks, cpu_cores)
            except OSError as e:
                _warn_once(controller, e)
                dirs.pop(controller, None)
                _remove_dir(path)
        return cls(1 if dirs else None, dirs)

    @classmethod
    def _create_v2(cls, host: CgroupHost, name: str, memory_mb: int, max_tasks: int,
                   cpu_cores: float) -> SandboxCgroup:
        parent = host.parents[0][1]
        path = os.path.join(parent, name)
        controllers = [c for c, _ in host.parents]
        try:
            # Fails when the parent holds processes (v2's no-internal-process rule);
            # then the host needs a delegated, empty parent and nothing is active here.
            _write(os.path.join(parent, "cgroup.subtree_control"),
                   " ".join(f"+{c}" for c in controllers))
            _remove_dir(path)
            os.mkdir(path)
        except OSError as e:
            _warn_once("v2", e)
            return cls(None, {})
        limits = {"memory": [("memory.max", str(memory_mb << 20)), ("memory.swap.max", "0")],
                  "pids": [("pids.max", str(max_tasks))],
                  "cpu": [("cpu.max", f"{int(cpu_cores * _CPU_PERIOD_US)} {_CPU_PERIOD_US}")]}
        active = {}
        for controller in controllers:
            try:
                for filename, value in limits[controller]:
                    if os.path.exists(os.path.join(path, filename)):
                        _write(os.path.join(path, filename), value)
                active[controller] = path
            except OSError as e:
                _warn_once(controller, e)
        return cls(2 if active else None, active)

    @classmethod
    def of_process(cls, pid: int) -> SandboxCgroup:
        """The cgroup(s) `pid` already lives in (a container's, made by its engine), to
        list its processes and read its OOM kills; never `remove()` it, its owner does.
        Controllers whose folder is not reachable from here are left out."""
        with open(f"/proc/{pid}/cgroup") as f:
            paths = {}
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                for name in names.split(",") if names else [""]:
                    paths[name] = path
        dirs: dict[str, str] = {}
        version = None
        for fstype, mountpoint, opts in _mounts():
            for controller in CONTROLLERS:
                key = controller if fstype == "cgroup" else ""
                if (fstype == "cgroup" and controller not in opts) or key not in paths:
                    continue
                path = os.path.join(mountpoint, paths[key].lstrip("/"))
                if controller not in dirs and os.path.isfile(os.path.join(path, "cgroup.procs")):
                    dirs[controller] = path
                    version = 1 if fstype == "cgroup" else 2
        return cls(version if dirs else None, dirs)

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(self.dirs))

    def procs_files(self) -> list[str]:
        """cgroup.procs files a command's launcher writes its pid to (one per hierarchy)."""
        return sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})

    def pids(self) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files():
            try:
                with open(procs) as f:
                    found.update(int(p) for p in f.read().split())
            except FileNotFoundError:
                pass
        return found

    def oom_kills(self) -> int:
        """Processes killed so far by this sandbox's memory limit."""
        path = self.dirs.get("memory")
        if path is None:
            return 0
        filename = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            with open(os.path.join(path, filename)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except FileNotFoundError:
            pass
        return 0

    def remove(self) -> list[str]:
        """Delete the cgroup dirs (their processes must be dead); returns those that stay."""
        left = [d for d in set(self.dirs.values()) if not _remove_dir(d)]
        self.dirs = {}
        return left


def _apply_v1(controller: str, path: str, memory_mb: int, max_tasks: int,
              cpu_cores: float) -> None:
    if controller == "memory":
        _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_mb << 20))
        memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):  # memory+swap = memory: swap cannot extend the limit
            _write(memsw, str(memory_mb << 20))
    elif controller == "pids":
        _write(os.path.join(path, "pids.max"), str(max_tasks))
    elif controller == "cpu":
        _write(os.path.join(path, "cpu.cfs_period_us"), str(_CPU_PERIOD_US))
        _write(os.path.join(path, "cpu.cfs_quota_us"), str(int(cpu_cores * _CPU_PERIOD_US)))


def _remove_dir(path: str, deadline_s: float = 2.0) -> bool:
    """rmdir a cgroup, retrying while just-killed tasks finish exiting (EBUSY)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > end:
                log.error("cgroup %s cannot be removed", path)
                return False
            time.sleep(0.01)


_warned: set[str] = set()


def _warn_once(what: str, error: OSError) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("sandbox cgroup %s not active: %s", what, error)
