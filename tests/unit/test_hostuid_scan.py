"""The /proc scan behind every sandbox release (envs.sandbox.hostuid): the real uid and
state of each process, read from the head of /proc/<pid>/status, agree with the full text;
gone processes and zombies are not live."""

from __future__ import annotations

import os
import subprocess
import sys

from envs.sandbox.hostuid import _proc_uid_and_state, all_pids, live_of_uid


def full_text_uid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(lines["Uid"].split()[0]), lines["State"].split()[0]


def test_each_process_reads_as_its_full_status_says():
    pids = all_pids()
    assert os.getpid() in pids
    compared = 0
    for pid in pids:
        ours, theirs = _proc_uid_and_state(pid), full_text_uid_and_state(pid)
        if ours is not None and theirs is not None:  # both read before the process changed
            assert ours[0] == theirs[0], pid
            compared += 1
    assert compared > 1
    assert _proc_uid_and_state(os.getpid()) == (os.getuid(), "R")


def test_gone_and_zombie_processes_are_not_live():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while _proc_uid_and_state(child.pid) not in (None, (os.getuid(), "Z")):
        os.sched_yield()
    assert live_of_uid([child.pid], os.getuid()) == []  # a zombie until it is waited for
    child.wait()
    assert _proc_uid_and_state(child.pid) is None
    assert live_of_uid([child.pid, os.getpid()], os.getuid()) == [os.getpid()]
