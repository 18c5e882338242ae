"""The one list of system calls every sandbox command fails, and the two forms it takes:
the container backend's seccomp profile rules (`profile_rules`, by name, for the engine's
libseccomp) and the local backend's classic-BPF program for `bwrap --seccomp`
(`build_filter`, by number, generated here).

The class denied: kernel objects that outlive a sandbox or are shared by the sandboxes
of one host uid or one host, which namespaces do not separate. A grading sandbox holds
the hidden tests and runs the agent's code next to them; a channel of this class would
let that code hand the tests to a later agent sandbox (keyrings: the container backend's
uids are reused, and a uid's persistent keyring lives three days). Denied calls fail with
an errno (never a kill), so a program that probes for them degrades as on a kernel built
without them.

What stays possible, by design or for lack of a cheap fix:
- Channels between sandboxes that run at the same time: timing and cache side channels,
  CPU and memory pressure, and locks or inotify watches on the read-only host runtime
  both can open (flock on a file in /usr, a watch on a file the other reads). They need
  two live, cooperating sandboxes, carry little, and end with them.
- ptrace, process_vm_readv, pidfd_getfd and kcmp stay allowed (debuggers, py-spy): the
  kernel's ptrace checks already confine them to the sandbox's own processes (its own
  pid namespace, its own host uid; a released uid has no process left).
- inotify stays allowed (file watchers, test runners); name_to_handle_at too: the handle
  it returns opens nothing without CAP_DAC_READ_SEARCH, and open_by_handle_at is denied.
- System V and POSIX IPC, abstract unix sockets and the hostname are per sandbox (ipc,
  net and uts namespaces); mounts and further namespaces need capabilities no sandbox has.

On x86_64 the local filter also fails every x32 call (the 0x40000000 bit) with ENOSYS and
kills a process that makes a call of another architecture (int 0x80, i386 numbers): the
numbers below would not apply to it. (The engine's libseccomp rules each architecture by
its own numbers, so there an i386 keyctl gets EPERM.) The program is built in memory and
handed to bubblewrap on a pipe per command (`filter_pipe`): nothing on disk for a sandbox
to alter.
"""

from __future__ import annotations

import errno
import functools
import os
import struct
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeniedSyscall:
    """A system call every sandbox command fails, the errno it gets and why."""

    name: str
    errno: int
    why: str


DENIED_SYSCALLS: tuple[DeniedSyscall, ...] = (
    # Keyrings are per host uid and outlive the process that filled them (the persistent
    # keyring for days); request_key also starts a host upcall (/sbin/request-key).
    DeniedSyscall("keyctl", errno.EPERM, "per-uid keyrings outlive the sandbox"),
    DeniedSyscall("add_key", errno.EPERM, "per-uid keyrings outlive the sandbox"),
    DeniedSyscall("request_key", errno.EPERM, "per-uid keyrings; starts a host upcall"),
    # io_uring runs operations in kernel workers that seccomp never sees, and is the
    # kernel's most exploited interface of late; ENOSYS is what every caller expects
    # from a kernel without it, and falls back on.
    DeniedSyscall("io_uring_setup", errno.ENOSYS, "ops bypass seccomp; large attack surface"),
    DeniedSyscall("io_uring_enter", errno.ENOSYS, "ops bypass seccomp; large attack surface"),
    DeniedSyscall("io_uring_register", errno.ENOSYS, "ops bypass seccomp; large attack surface"),
    # User-mode userfaultfd stalls the kernel's copies from user memory at will: the race
    # window of most kernel exploits. EPERM is what vm.unprivileged_userfaultfd=0 gives.
    DeniedSyscall("userfaultfd", errno.EPERM, "stalls kernel copies (exploit races)"),
    # Host-wide counters (perf), kernel programs and maps (bpf), whole-filesystem event
    # listeners (fanotify): shared by every sandbox of the host, or a kernel surface.
    DeniedSyscall("perf_event_open", errno.EPERM, "host-wide counters: side channel"),
    DeniedSyscall("bpf", errno.EPERM, "kernel programs and maps shared by fd or pin"),
    DeniedSyscall("fanotify_init", errno.EPERM, "filesystem events of other sandboxes"),
    # Opens a file by handle, past the mount namespace's view (needs a capability the
    # sandboxes lack: denied anyway, at no cost).
    DeniedSyscall("open_by_handle_at", errno.EPERM, "opens files outside the mount view"),
    # The kernel log is one per host; a process can write into it (its name, 16 bytes it
    # chooses, in a segfault line) and another could read it back.
    DeniedSyscall("syslog", errno.EPERM, "the host's kernel log is shared"),
    DeniedSyscall("kexec_load", errno.EPERM, "replaces the host kernel"),
    DeniedSyscall("kexec_file_load", errno.EPERM, "replaces the host kernel"),
)

# System call numbers of the denied calls per architecture (uname -m), from the kernel's
# tables (x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: the generic table).
# tests/unit/test_sandbox_seccomp.py checks them against libseccomp where it is installed.
SYSCALL_NUMBERS: dict[str, dict[str, int]] = {
    "x86_64": {"keyctl": 250, "add_key": 248, "request_key": 249, "io_uring_setup": 425,
               "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 323,
               "perf_event_open": 298, "bpf": 321, "fanotify_init": 300,
               "open_by_handle_at": 304, "syslog": 103, "kexec_load": 246,
               "kexec_file_load": 320},
    "aarch64": {"keyctl": 219, "add_key": 217, "request_key": 218, "io_uring_setup": 425,
                "io_uring_enter": 426, "io_uring_register": 427, "userfaultfd": 282,
                "perf_event_open": 241, "bpf": 280, "fanotify_init": 262,
                "open_by_handle_at": 265, "syslog": 116, "kexec_load": 104,
                "kexec_file_load": 294},
}
# AUDIT_ARCH_* values seccomp reports in seccomp_data.arch (linux/audit.h).
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000  # x86_64 only: the x32 ABI's calls, numbered from here

# Classic BPF (linux/filter.h, linux/seccomp.h).
BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
BPF_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
BPF_RET_K = 0x06  # BPF_RET | BPF_K
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_DATA = 0x0000FFFF
OFFSET_NR, OFFSET_ARCH = 0, 4  # struct seccomp_data: int nr; __u32 arch; ...
_INSTRUCTION = struct.Struct("=HBBI")  # struct sock_filter: code, jt, jf, k


def denied_names() -> tuple[str, ...]:
    return tuple(d.name for d in DENIED_SYSCALLS)


def profile_rules() -> list[dict]:
    """OCI seccomp profile rules (as podman's and docker's seccomp.json write them) that
    fail each denied call with its errno; the engine's default profile must not name
    these calls in any other rule (engine.build_seccomp_profile strips them)."""
    by_errno: dict[int, list[str]] = {}
    for denied in DENIED_SYSCALLS:
        by_errno.setdefault(denied.errno, []).append(denied.name)
    return [{"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": code}
            for code, names in sorted(by_errno.items())]


def _instruction(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return _INSTRUCTION.pack(code, jt, jf, k)


@functools.cache
def build_filter(machine: str | None = None) -> bytes:
    """The classic-BPF program (struct sock_filter[], native byte order) for `machine`
    (uname -m; None: this host's): foreign architectures killed, x32 calls ENOSYS, each
    denied call its errno, everything else allowed. ValueError for an architecture
    without a table here."""
    machine = machine or os.uname().machine
    if machine not in SYSCALL_NUMBERS:
        raise ValueError(f"the local sandbox's seccomp filter knows the system call numbers "
                         f"of {sorted(SYSCALL_NUMBERS)}, not of {machine!r}; add its table to "
                         "envs/sandbox/seccomp.py or use envs.sandbox_backend=container")
    numbers = SYSCALL_NUMBERS[machine]
    program = [_instruction(BPF_LD_W_ABS, OFFSET_ARCH),
               _instruction(BPF_JEQ_K, AUDIT_ARCH[machine], jt=1),
               _instruction(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
               _instruction(BPF_LD_W_ABS, OFFSET_NR)]
    if machine == "x86_64":
        program += [_instruction(BPF_JGE_K, X32_SYSCALL_BIT, jf=1),
                    _instruction(BPF_RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS)]
    for denied in DENIED_SYSCALLS:
        program += [_instruction(BPF_JEQ_K, numbers[denied.name], jf=1),
                    _instruction(BPF_RET_K, SECCOMP_RET_ERRNO | denied.errno)]
    program.append(_instruction(BPF_RET_K, SECCOMP_RET_ALLOW))
    return b"".join(program)


def filter_pipe() -> int:
    """The read end of a fresh pipe holding this host's filter program, for one bwrap
    command (`--seccomp FD`, passed to it); the caller closes it once bwrap has started.
    The program fits a pipe's atomic write, so writing never blocks."""
    program = build_filter()
    assert len(program) <= 4096, "the filter no longer fits one atomic pipe write"
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, program)
    finally:
        os.close(write_fd)
    return read_fd

