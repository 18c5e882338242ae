"""Who owns a piece of machine state (a temp file, a folder, a Ray session) and whether
that owner still runs: what lets `envs.reaper` remove what dead runs left, and only that.

Two forms. A name tag `<pid namespace>.<pid>` goes into file and folder names (cheap,
no extra file); a reused pid only makes dead state look alive, so it leaks rather than
being removed under a live owner. An owner record (a dict kept as JSON) adds the pid's
start time and the boot id, so a reused pid is told apart. State of another pid
namespace (a container sharing /tmp) is never judged dead: its pids mean nothing here.

This module imports nothing from the project, so any layer may use it.
"""

from __future__ import annotations

import os


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start_time(pid: int) -> int | None:
    """The pid's start time (clock ticks after boot, /proc/<pid>/stat field 22); None when
    no such process runs. A zombie counts as gone: it holds nothing but its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name may hold spaces and parentheses: split after the last ')'.
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def owner_tag() -> str:
    """This process as a name tag: '<pid namespace inode>.<pid>'."""
    return f"{_pid_namespace()}.{os.getpid()}"


def tag_is_dead(tag: str) -> bool:
    """True only when `tag` (from `owner_tag`) names a process of this pid namespace that
    no longer runs; False when it runs, or when the tag cannot be judged here."""
    ns, _, pid = tag.partition(".")
    if not (ns.isdigit() and pid.isdigit()) or int(ns) != _pid_namespace():
        return False
    return process_start_time(int(pid)) is None


def owner_record(pid: int | None = None) -> dict[str, int | str | None]:
    """A record naming `pid` (default: this process) exactly: pid, start time, pid
    namespace and boot."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start_time": process_start_time(pid), "pid_namespace": _pid_namespace(),
            "boot_id": _boot_id()}


def record_is_dead(record: object) -> bool:
    """True when the owner a record names (as read back from JSON) is gone: the machine
    rebooted since, or its pid runs no more or runs a newer process. False for another pid
    namespace (unknown), and for anything this module did not write."""
    if not isinstance(record, dict):
        return False
    pid, start, ns = record.get("pid"), record.get("start_time"), record.get("pid_namespace")
    if not isinstance(pid, int) or not isinstance(ns, int):
        return False  # not a record this module wrote: leave it alone
    boot_id = record.get("boot_id")
    if boot_id and _boot_id() and boot_id != _boot_id():
        return True
    if ns != _pid_namespace():
        return False
    return process_start_time(pid) != start
