"""Host uids for sandboxes: each live sandbox leases its own unprivileged uid, and every
process of that uid belongs to that sandbox, which makes "kill everything it started"
and "nothing is left" checkable from /proc.

Why one uid per sandbox instead of a shared 65534: RLIMIT_NPROC counts all processes of
a host uid, so sandboxes sharing one uid share one process budget (measured: a second
sandbox fails to start while the first holds the budget). Leases are flock'ed files, so
worker processes on one host never hand out the same uid and a crashed worker's leases
free themselves.

A backend's uid range is split by SandboxRole: agent sandboxes lease from its first half,
grading ones from its second, so a uid never passes between the two. What the kernel
keeps per uid beyond its processes, its keyrings (the persistent keyring lives three days
in the host's user namespace), is emptied when a sandbox gives its uid back (and, in the
container backend, whose processes share that namespace, when one takes it: a crashed
holder never gave it back) by `clear_keyrings_of_uid`, although the sandboxes' seccomp
filters already deny the keyring calls.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

from envs.sandbox.base import SandboxRole

log = logging.getLogger(__name__)

# Empties the calling uid's persistent, user and user-session keyrings (what outlives its
# processes); keyctl operations of linux/keyctl.h. Exit 1 and a line per failure.
_CLEAR_KEYRINGS = """
import ctypes, errno, platform, sys
NR = {"x86_64": 250, "aarch64": 219}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
GET_PERSISTENT, CLEAR = 22, 7
PROCESS, USER, USER_SESSION = -2, -4, -5
failed = []
def keyctl(*args):
    rc = libc.syscall(L(NR), *(L(a) for a in args))
    return rc, ctypes.get_errno()
persistent, err = keyctl(GET_PERSISTENT, -1, PROCESS)
if persistent < 0 and err != errno.EOPNOTSUPP:
    failed.append(f"get persistent: {errno.errorcode.get(err, err)}")
rings = ([persistent] if persistent >= 0 else []) + [USER, USER_SESSION]
for ring in rings:
    rc, err = keyctl(CLEAR, ring)
    if rc < 0:
        failed.append(f"clear {ring}: {errno.errorcode.get(err, err)}")
print(*failed, sep="\\n")
sys.exit(1 if failed else 0)
"""
_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


class HostUidLease:
    """An exclusive claim on one host uid, held until `release()` or process exit."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, first_uid: int, num_uids: int, lease_dir: str,
                role: SandboxRole) -> HostUidLease:
        """A uid of `role`'s half of [first_uid, first_uid + num_uids)."""
        first_uid, num_uids = role_uid_range(role, first_uid, num_uids)
        os.makedirs(lease_dir, mode=0o700, exist_ok=True)
        # A random start spreads concurrent workers over the range instead of all
        # contending for the first uid.
        start = random.randrange(num_uids)
        for i in range(num_uids):
            uid = first_uid + (start + i) % num_uids
            fd = os.open(os.path.join(lease_dir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(uid, fd)
        raise ValueError(f"all {num_uids} {role.value} sandbox uids from {first_uid} are "
                         "leased; release sandboxes or raise the backend config's "
                         "num_host_uids (half of it goes to each role)")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def role_uid_range(role: SandboxRole, first_uid: int, num_uids: int) -> tuple[int, int]:
    """(first uid, number of uids) of `role`'s half of a backend's range: agents the
    first half, graders the rest."""
    if num_uids < 2:
        raise ValueError(f"num_host_uids={num_uids} leaves no uid for one of the sandbox "
                         "roles (agent, grader: half of the range each); use at least 2")
    half = num_uids // 2
    if role is SandboxRole.AGENT:
        return first_uid, half
    return first_uid + half, num_uids - half


def clear_keyrings_of_uid(uid: int, timeout_s: float = 10.0) -> bool:
    """Empty `uid`'s persistent, user and user-session keyrings in this process's user
    namespace (the kernel keeps them after the uid's last process exits), by a child
    running as `uid`; False, logged, when that failed. Call it only while no sandbox
    process of the uid runs (it could otherwise race the child)."""
    python = next((p for p in (*_PYTHONS, sys.executable) if os.access(p, os.X_OK)), None)
    if python is None:
        log.error("uid %d: no python3 to clear its keyrings with", uid)
        return False
    try:
        done = subprocess.run([python, "-I", "-S", "-c", _CLEAR_KEYRINGS], user=uid,
                              group=uid, extra_groups=[], cwd="/", env={"LANG": "C.UTF-8"},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.error("uid %d: clearing its keyrings failed to run: %s", uid, e)
        return False
    if done.returncode != 0:
        log.error("uid %d: clearing its keyrings failed (%d): %s", uid, done.returncode,
                  (done.stdout + done.stderr).strip()[-500:])
        return False
    return True


def _proc_uid_and_state(pid: int) -> tuple[int, str] | None:
    """Real uid and state letter from /proc/<pid>/status (the directory's owner is not
    used: a process can make itself non-dumpable, which shows its /proc entry as root).
    Raw reads of the head, where both lines are: every sandbox release scans all of
    /proc, and the text-file path cost 3x as much per process."""
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    try:
        head = os.read(fd, 1024)
        while b"\nUid:\t" not in head:  # a long (escaped) Name could push it further
            more = os.read(fd, 4096)
            if not more:
                return None
            head += more
    except ProcessLookupError:  # exited between the open and the read
        return None
    finally:
        os.close(fd)
    at = head.index(b"\nUid:\t") + 6
    uid = int(head[at:head.index(b"\t", at)])
    state_at = head.find(b"\nState:\t")
    return uid, head[state_at + 8:state_at + 9].decode() if state_at >= 0 else "?"


def live_of_uid(pids: Iterable[int], uid: int) -> list[int]:
    """The pids of `pids` that belong to `uid` and still run. Zombies are left out: they
    hold nothing but a pid and are reaped by their parent (often the host's init, after
    bwrap has exited)."""
    live = []
    for pid in pids:
        info = _proc_uid_and_state(pid)
        if info is not None and info[0] == uid and info[1] not in ("Z", "X"):
            live.append(pid)
    return live


def all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def kill_pid_of_uid(pid: int, uid: int) -> None:
    """SIGKILL `pid` if it still belongs to `uid`; a pidfd pins the process between the
    check and the signal, so a recycled pid of another user is never hit."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone already
        return
    try:
        info = _proc_uid_and_state(pid)
        if info is not None and info[0] == uid:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def kill_all_of_uid(uid: int, list_pids: Callable[[], Iterable[int]] = all_pids,
                    deadline_s: float = 5.0) -> list[int]:
    """Kill every process of `uid` among `list_pids()` (default: all of /proc) until none
    runs or the deadline passes; returns the pids still alive (empty on success).
    Repeats because a fork bomb forks between scans."""
    end = time.monotonic() + deadline_s
    pause_s = 0.001
    while True:
        pids = live_of_uid(list_pids(), uid)
        if not pids or time.monotonic() > end:
            if pids:
                log.error("uid %d: processes %s survive SIGKILL", uid, pids)
            return pids
        for pid in pids:
            kill_pid_of_uid(pid, uid)
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 0.05)
