"""Host uids for sandboxes: each live sandbox leases its own unprivileged uid, and every
process of that uid belongs to that sandbox, which makes "kill everything it started"
and "nothing is left" checkable from /proc.

Why one uid per sandbox instead of a shared 65534: RLIMIT_NPROC counts all processes of
a host uid, so sandboxes sharing one uid share one process budget (measured: a second
sandbox fails to start while the first holds the budget). Leases are flock'ed files, so
worker processes on one host never hand out the same uid and a crashed worker's leases
free themselves.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import signal
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class HostUidLease:
    """An exclusive claim on one host uid, held until `release()` or process exit."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, first_uid: int, num_uids: int, lease_dir: str) -> HostUidLease:
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
        raise ValueError(f"all {num_uids} sandbox uids from {first_uid} are leased; release "
                         "sandboxes or raise LocalSandboxConfig.num_host_uids")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _proc_uid_and_state(pid: int) -> tuple[int, str] | None:
    """Real uid and state letter from /proc/<pid>/status (the directory's owner is not
    used: a process can make itself non-dumpable, which shows its /proc entry as root)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    uid, state = -1, "?"
    for line in text.splitlines():
        if line.startswith("State:"):
            state = line.split()[1]
        elif line.startswith("Uid:"):
            uid = int(line.split()[1])
            break
    return uid, state


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
