"""The stale-state reaper: at start, remove what earlier sluice runs on THIS machine left
behind when they died without cleaning up (a SIGKILL, an OOM kill, a crashed worker).

    report = reap_stale_state()      # call once at start, before pools are built
    print(report.summary())

What belongs to sluice, and how a dead owner is told apart from a live one:

    sandbox state of host uid U          the uid lease file <lease_dir>/U.lock is flock'ed by
      (folders sluice-sandbox-U-*,       the live process that owns the sandbox; a free lease
      sluice-csandbox-U-*, their          means its owner is gone. The reaper holds the lease
      workspace tmpfs mounts, processes   while it cleans, so no new sandbox can take U then.
      of uid U, cgroups
      sluice-sandbox-U, containers
      sluice-sandbox-U labelled
      sluice.sandbox=1)
    snapshot tars, engine folders        an owner tag in the name (envs.owner): the pid
      (sluice-snapshot-<tag>-*.tar,       of this pid namespace that made them no longer runs
      sluice-container-engine-<tag>-*,
      vLLM sockets sluice-vllm-ipc-<tag>-*)
    the processes of a private Ray       an owner record written by trainer.run.pools when it
      cluster (raylet, GCS, agents,       started the cluster: the driver it names is gone.
      workers and their children)         Members: processes whose command line names the
                                          session folder, whose stdout/stderr go into it, or
                                          `ray::` processes holding a file in it.

Nothing else is touched: no uid outside the lease range, no folder without the exact name
pattern, no cluster sluice did not start (a `ray start` cluster has no record), and state
whose owner cannot be judged (another pid namespace) is left alone. Sandbox state needs
root to exist, so without root only the Ray records are looked at.
"""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from envs.owner import owner_record, record_is_dead, tag_is_dead

log = logging.getLogger(__name__)

SANDBOX_DIR = re.compile(r"^sluice-c?sandbox-(\d+)-[^/]+$")  # envs.sandbox.workspace.make_sandbox_dir
CGROUP_DIR = re.compile(r"^sluice-sandbox-(\d+)$")  # envs.sandbox.local: SandboxCgroup.create
CONTAINER = re.compile(r"^sluice-sandbox-(\d+)$")  # envs.sandbox.container: one per leased uid
WORKSPACE_FS_SOURCE = "sluice-workspace"  # envs.sandbox.workspace.mount_tmpfs
TAGGED = re.compile(r"^sluice-(?:snapshot|container-engine|vllm-ipc)-(\d+\.\d+)-")
RAY_RECORD = "ray-session-{pid}.json"
MAX_CGROUP_DEPTH = 8


def default_state_dir() -> Path:
    """Where owner records live: SLUICE_STATE_DIR, else /run/sluice (per boot) when it is
    writable, else a per-user folder in the temp dir."""
    if os.environ.get("SLUICE_STATE_DIR"):
        return Path(os.environ["SLUICE_STATE_DIR"])
    if os.geteuid() == 0:
        return Path("/run/sluice")
    return Path(tempfile.gettempdir()) / f"sluice-state-{os.geteuid()}"


@dataclass(frozen=True, slots=True)
class ReapScope:
    """Where sluice keeps per-machine state; the defaults are the sandbox backends'."""

    roots: tuple[str, ...] = ()  # parents of sandbox folders and temp files; (): the temp dir
    lease_dir: str = "/run/sluice-sandbox-uids"  # LocalSandboxConfig / ContainerSandboxConfig
    first_uid: int = 1_200_000
    num_uids: int = 4096
    state_dir: str | None = None  # owner records; None: default_state_dir()
    containers: bool = True  # also look for podman/docker containers (needs the engine CLI)

    def root_dirs(self) -> tuple[str, ...]:
        return self.roots or (tempfile.gettempdir(),)

    def owns_uid(self, uid: int) -> bool:
        return self.first_uid <= uid < self.first_uid + self.num_uids

    def records_dir(self) -> Path:
        return Path(self.state_dir) if self.state_dir else default_state_dir()


@dataclass(slots=True)
class ReapReport:
    """What was removed (one readable line each), and what could not be."""

    processes: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    folders: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    ray_sessions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def num_removed(self) -> int:
        return sum(len(getattr(self, k)) for k in ("processes", "mounts", "folders", "files",
                                                   "cgroups", "containers", "ray_sessions"))

    def summary(self) -> str:
        parts = [f"{len(v)} {k.replace('_', ' ')}" for k in
                 ("processes", "mounts", "folders", "files", "cgroups", "containers",
                  "ray_sessions") if (v := getattr(self, k))]
        text = ("removed what dead sluice runs left: " + ", ".join(parts)) if parts else \
            "nothing stale from earlier sluice runs"
        if self.errors:
            text += f"; {len(self.errors)} could not be removed: " + "; ".join(self.errors[:5])
        return text


def reap_stale_state(scope: ReapScope | None = None) -> ReapReport:
    """Remove every piece of stale sluice state on this machine (see the module docstring).
    Never raises for what it cannot remove: that goes to `ReapReport.errors` and the log."""
    scope = scope or ReapScope()
    report = ReapReport()
    _reap_ray_sessions(scope, report)
    if os.geteuid() == 0:
        _reap_sandboxes(scope, report)
    _reap_tagged(scope, report)
    if report.num_removed or report.errors:
        log.warning("%s", report.summary())
    return report


# --- sandboxes -----------------------------------------------------------------------------

def _reap_sandboxes(scope: ReapScope, report: ReapReport) -> None:
    procs = _process_uids()
    folders = {path: int(m.group(1)) for root in scope.root_dirs()
               for path in glob.glob(os.path.join(glob.escape(root), "sluice-*sandbox-*"))
               if (m := SANDBOX_DIR.match(os.path.basename(path)))}
    mounts = _workspace_mounts()
    # A mount's sandbox folder may sit outside the roots (another TMPDIR): it goes too.
    folders.update({os.path.dirname(point): uid for point, uid in mounts.items()})
    cgroups = list(_sandbox_cgroups())
    containers = _sandbox_containers(report) if scope.containers else {}
    uids = ({u for u in procs.values()} | set(folders.values()) | set(mounts.values())
            | {u for _, u in cgroups} | set(containers.values()))
    for uid in sorted(u for u in uids if scope.owns_uid(u)):
        with _free_lease(scope.lease_dir, uid) as free:
            if not free:
                continue  # a live sandbox holds this uid
            _reap_uid(uid, report, folders=[f for f, u in folders.items() if u == uid],
                      cgroups=[c for c, u in cgroups if u == uid],
                      containers=[c for c, u in containers.items() if u == uid])


def _reap_uid(uid: int, report: ReapReport, *, folders: list[str], cgroups: list[str],
              containers: list[str]) -> None:
    from envs.sandbox import workspace
    from envs.sandbox.hostuid import kill_all_of_uid, live_of_uid

    for name in containers:  # first: its processes run under the engine, not only uid U
        if _remove_container(name, report):
            report.containers.append(name)
    for path in cgroups:
        for pid in _cgroup_pids(path):
            if _kill_pinned(pid, lambda p, path=path: p in _cgroup_pids(path)):
                report.processes.append(f"pid {pid} (cgroup {path})")
    before = live_of_uid(_all_pids(), uid)
    survivors = kill_all_of_uid(uid)
    report.processes += [f"pid {pid} (uid {uid})" for pid in before if pid not in survivors]
    if survivors:
        report.errors.append(f"uid {uid}: processes {survivors} survive SIGKILL")
    for path in cgroups:
        _remove(path, os.rmdir, report.cgroups, report)
    for folder in folders:  # unmounts the workspace tmpfs, then deletes the tree
        inside = workspace.mounts_starting_with(folder + "/")
        try:
            workspace.remove_sandbox_dir(folder)
        except OSError as exc:
            report.errors.append(f"folder {folder}: {exc}")
        report.mounts += [m for m in inside if m not in workspace.mounts_starting_with(folder + "/")]
        if os.path.lexists(folder):
            report.errors.append(f"folder {folder} could not be deleted")
        else:
            report.folders.append(folder)


class _free_lease:
    """Hold uid's lease (as HostUidLease does) if nobody does; `as` gives whether it was free."""

    def __init__(self, lease_dir: str, uid: int) -> None:
        self._path = os.path.join(lease_dir, f"{uid}.lock")
        self._fd: int | None = None

    def __enter__(self) -> bool:
        os.makedirs(os.path.dirname(self._path), mode=0o700, exist_ok=True)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)


def _all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _process_uids() -> dict[int, int]:
    """pid -> real uid, for every process (one pass over /proc)."""
    out = {}
    for pid in _all_pids():
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        out[pid] = int(line.split()[1])
                        break
        except OSError:
            continue
    return out


def _mountinfo() -> Iterator[tuple[str, str, str]]:
    """(mount point, fstype, source) of this mount namespace."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fstype, source = (post.split() + ["", ""])[:2]
            # Blanks are escaped as \040; a deleted mount point shows a //deleted suffix.
            yield pre.split()[4].removesuffix("//deleted"), fstype, source


def _workspace_mounts() -> dict[str, int]:
    """Workspace tmpfs mount point -> the uid in its sandbox folder's name."""
    out = {}
    for point, fstype, source in _mountinfo():
        parent, leaf = os.path.split(point)
        m = SANDBOX_DIR.match(os.path.basename(parent))
        if fstype == "tmpfs" and source == WORKSPACE_FS_SOURCE and leaf == "workspace" and m:
            out[point] = int(m.group(1))
    return out


def _sandbox_cgroups() -> Iterator[tuple[str, int]]:
    """(cgroup dir, uid) of every sluice-sandbox-<uid> cgroup under any cgroup mount."""
    roots = sorted({p for p, fstype, _ in _mountinfo() if fstype in ("cgroup", "cgroup2")})
    for root in roots:
        yield from _find_cgroups(root, 0)


def _find_cgroups(folder: str, depth: int) -> Iterator[tuple[str, int]]:
    try:
        entries = [e for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for entry in entries:
        if m := CGROUP_DIR.match(entry.name):
            yield entry.path, int(m.group(1))
        elif depth < MAX_CGROUP_DEPTH:
            yield from _find_cgroups(entry.path, depth + 1)


def _cgroup_pids(path: str) -> set[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return set()


def _kill_pinned(pid: int, still_ours: Callable[[int], bool]) -> bool:
    """SIGKILL `pid` if `still_ours(pid)` holds while a pidfd pins it (a recycled pid of
    someone else is never hit); True when the signal was sent."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if still_ours(pid):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            return True
        return False
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


def _engine_cli() -> list[str] | None:
    podman = shutil.which("podman")
    if podman:  # as root podman needs runc on these hosts (envs.sandbox.engine)
        return [podman, "--runtime", "runc"] if os.geteuid() == 0 else [podman]
    docker = shutil.which("docker")
    return [docker] if docker else None


def _sandbox_containers(report: ReapReport) -> dict[str, int]:
    """Container name -> uid, for sluice's sandbox containers (label sluice.sandbox=1)."""
    cli = _engine_cli()
    if cli is None:
        return {}
    try:
        done = subprocess.run([*cli, "ps", "-a", "--filter", "label=sluice.sandbox=1",
                               "--format", "{{.Names}}"], capture_output=True, text=True,
                              timeout=60, cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired) as exc:
        report.errors.append(f"listing containers: {exc}")
        return {}
    if done.returncode != 0:  # no daemon, no storage: nothing of ours can be there
        return {}
    return {name: int(m.group(1)) for name in done.stdout.split()
            if (m := CONTAINER.match(name))}


def _remove_container(name: str, report: ReapReport) -> bool:
    cli = _engine_cli()
    assert cli is not None  # only called for containers the CLI listed
    done = subprocess.run([*cli, "rm", "-f", name], capture_output=True, text=True, timeout=120,
                          cwd=tempfile.gettempdir())
    if done.returncode != 0 and "no such container" not in done.stderr.lower():
        report.errors.append(f"container {name}: {done.stderr.strip()[-300:]}")
        return False
    return True


# --- temp files with an owner tag ----------------------------------------------------------

def _reap_tagged(scope: ReapScope, report: ReapReport) -> None:
    for root in scope.root_dirs():
        for path in glob.glob(os.path.join(glob.escape(root), "sluice-*-*")):
            m = TAGGED.match(os.path.basename(path))
            if not m or not tag_is_dead(m.group(1)):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                _remove(path, shutil.rmtree, report.folders, report)
            else:
                _remove(path, os.unlink, report.files, report)


def _remove(path: str, remove: Callable[[str], object], removed: list[str],
            report: ReapReport) -> None:
    """`remove(path)`, noting it in `removed`, or the failure in the report."""
    try:
        remove(path)
        removed.append(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        report.errors.append(f"{path}: {exc.strerror or exc}")


# --- private Ray clusters ------------------------------------------------------------------

def record_ray_session(session_dir: str, state_dir: str | Path | None = None) -> Path:
    """Note that this process started the private Ray cluster of `session_dir` (called by
    trainer.run.pools right after ray.init); the reaper stops its processes once this process
    is gone. Returns the record, which `forget_ray_session` deletes at a clean exit."""
    folder = Path(state_dir) if state_dir else default_state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / RAY_RECORD.format(pid=os.getpid())
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps({"owner": owner_record(), "session_dir": session_dir}))
    os.replace(tmp, record)
    return record


def forget_ray_session(record: Path) -> None:
    record.unlink(missing_ok=True)


def _reap_ray_sessions(scope: ReapScope, report: ReapReport) -> None:
    folder = scope.records_dir()
    for record in sorted(folder.glob(RAY_RECORD.format(pid="*"))) if folder.is_dir() else []:
        try:
            data = json.loads(record.read_text())
            session_dir = os.path.realpath(data["session_dir"])
            owner = data["owner"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written or not ours
        if not record_is_dead(owner):
            continue
        members = list(ray_session_members(session_dir))
        for pid in members:
            if _kill_pinned(pid, lambda p, d=session_dir: _in_session(p, d)):
                report.processes.append(f"pid {pid} (Ray session {os.path.basename(session_dir)})")
        report.ray_sessions.append(session_dir)
        forget_ray_session(record)


def ray_session_members(session_dir: str) -> Iterator[int]:
    """The pids of processes that belong to the Ray session of `session_dir` (see the
    module docstring), this process excepted."""
    for pid in _all_pids():
        if pid != os.getpid() and _in_session(pid, session_dir):
            yield pid


def _in_session(pid: int, session_dir: str) -> bool:
    prefix = session_dir.rstrip("/") + "/"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
    except OSError:
        return False
    if session_dir in cmdline:
        return True
    open_files = list(_open_files(pid))
    if any(target.startswith(prefix) for fd, target in open_files if fd in (1, 2)):
        return True  # Ray points every process's stdout/stderr at its session's logs
    # Ray's own daemons rename themselves (`ray::DashboardAgent`) and keep log files open.
    return cmdline.startswith("ray::") and any(t.startswith(prefix) for _, t in open_files)


def _open_files(pid: int) -> Iterable[tuple[int, str]]:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            yield int(fd), os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
