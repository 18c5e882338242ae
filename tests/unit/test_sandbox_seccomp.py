"""The sandboxes' one list of denied system calls, in both forms: the local backend's BPF
program, read back by a classic-BPF interpreter written here (so the program's behaviour
is checked, not its construction), and the container backend's seccomp profile. Both must
deny exactly the listed calls; the numbers are checked against libseccomp's tables where
the library is installed."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import struct

import pytest

from envs.sandbox import engine, seccomp

ALL_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
FOREIGN_ARCH = {"x86_64": 0x40000003, "aarch64": 0x40000028}  # i386 on x86_64, arm on arm64
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x50000, 0x7FFF0000


def run_bpf(program: bytes, nr: int, arch: int) -> int:
    """What a classic-BPF seccomp program returns for call `nr` of `arch` (the subset of
    opcodes a filter of plain comparisons uses; any other fails the test)."""
    assert len(program) % 8 == 0
    instructions = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    data = struct.pack("=iI", nr, arch)  # struct seccomp_data's first two fields
    accumulator, pc = 0, 0
    for _ in range(len(instructions)):  # no loops in seccomp BPF: each step moves forward
        code, jt, jf, k = instructions[pc]
        if code == BPF_LD_W_ABS:
            assert k in (0, 4), f"loads past nr/arch: offset {k}"
            accumulator = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code == BPF_JEQ_K:
            pc += 1 + (jt if accumulator == k else jf)
        elif code == BPF_JGE_K:
            pc += 1 + (jt if accumulator >= k else jf)
        elif code == BPF_RET_K:
            return k
        else:
            pytest.fail(f"instruction {pc}: unexpected opcode {code:#x}")
    pytest.fail("the program ran off its end")


def expected_action(machine: str, nr: int) -> int:
    by_number = {seccomp.SYSCALL_NUMBERS[machine][d.name]: d.errno for d in seccomp.DENIED_SYSCALLS}
    if nr in by_number:
        return SECCOMP_RET_ERRNO | by_number[nr]
    return SECCOMP_RET_ALLOW


@pytest.mark.parametrize("machine", sorted(ALL_ARCH))
def test_the_filter_denies_exactly_the_listed_calls(machine: str) -> None:
    program = seccomp.build_filter(machine)
    arch = ALL_ARCH[machine]
    denied = [nr for nr in range(1024) if run_bpf(program, nr, arch) != SECCOMP_RET_ALLOW]
    assert sorted(denied) == sorted(seccomp.SYSCALL_NUMBERS[machine][n]
                                    for n in seccomp.denied_names())
    for nr in range(1024):
        assert run_bpf(program, nr, arch) == expected_action(machine, nr), nr
    # Denials are errnos, never kills: callers degrade as on a kernel without the call.
    codes = {run_bpf(program, nr, arch) for nr in denied}
    assert all(code & 0xFFFF0000 == SECCOMP_RET_ERRNO for code in codes)


def test_listed_errnos_are_what_callers_expect() -> None:
    by_name = {d.name: d.errno for d in seccomp.DENIED_SYSCALLS}
    assert by_name["io_uring_setup"] == errno.ENOSYS  # liburing and libuv fall back on it
    assert {by_name[n] for n in ("keyctl", "add_key", "request_key", "userfaultfd")} == {errno.EPERM}
    assert len(by_name) == len(seccomp.DENIED_SYSCALLS), "a call is listed twice"


def test_x32_calls_fail_with_enosys_on_x86_64() -> None:
    program = seccomp.build_filter("x86_64")
    for nr in (0, 39, 250, 425, 511, 1023):  # read, getpid, keyctl, io_uring_setup, ...
        assert run_bpf(program, 0x40000000 | nr, ALL_ARCH["x86_64"]) == SECCOMP_RET_ERRNO | errno.ENOSYS
    assert run_bpf(program, -1, ALL_ARCH["x86_64"]) == SECCOMP_RET_ERRNO | errno.ENOSYS


@pytest.mark.parametrize("machine", sorted(ALL_ARCH))
def test_a_call_of_another_architecture_kills(machine: str) -> None:
    program = seccomp.build_filter(machine)
    for nr in (0, 20, 39, 250):  # i386 getpid is 20: the x86_64 numbers would not apply
        assert run_bpf(program, nr, FOREIGN_ARCH[machine]) == SECCOMP_RET_KILL_PROCESS
    other = next(m for m in ALL_ARCH if m != machine)
    assert run_bpf(program, 39, ALL_ARCH[other]) == SECCOMP_RET_KILL_PROCESS


def test_an_unknown_architecture_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="seccomp.py"):
        seccomp.build_filter("riscv64")


def test_the_pipe_holds_exactly_the_program() -> None:
    fd = seccomp.filter_pipe()
    try:
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
    finally:
        os.close(fd)
    assert data == seccomp.build_filter()


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        pytest.skip("libseccomp is not installed: the numbers cannot be cross-checked here")
    lib = ctypes.CDLL(name)
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name_arch.restype = ctypes.c_int
    return lib


@pytest.mark.parametrize("machine", sorted(ALL_ARCH))
def test_the_numbers_match_libseccomp(machine: str) -> None:
    lib = _libseccomp()
    for name in seccomp.denied_names():
        number = lib.seccomp_syscall_resolve_name_arch(ALL_ARCH[machine], name.encode())
        assert seccomp.SYSCALL_NUMBERS[machine][name] == number, name


def _profile_verdicts(profile: dict) -> dict[str, set[tuple[str, int | None]]]:
    """Call name -> the (action, errno) of every rule naming it."""
    verdicts: dict[str, set[tuple[str, int | None]]] = {}
    for rule in profile["syscalls"]:
        for name in rule["names"]:
            verdicts.setdefault(name, set()).add((rule["action"], rule.get("errnoRet")))
    return verdicts


# A default profile shaped as podman's: it allows keyctl and names io_uring under a cap.
PODMAN_LIKE = {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 38, "syscalls": [
    {"names": ["read", "keyctl", "clone", "unshare", "clone3"], "action": "SCMP_ACT_ALLOW"},
    {"names": ["bpf", "perf_event_open"], "action": "SCMP_ACT_ALLOW",
     "includes": {"caps": ["CAP_SYS_ADMIN"]}},
    {"names": ["userfaultfd"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}


def _host_default() -> dict | None:
    for path in engine.SECCOMP_DEFAULT_PATHS:
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    return None


@pytest.mark.parametrize("base", ["podman_like", "host_default", "none"])
def test_the_container_profile_denies_each_listed_call_and_nothing_allows_it(base: str) -> None:
    default = {"podman_like": PODMAN_LIKE, "host_default": _host_default(), "none": None}[base]
    if base == "host_default" and default is None:
        pytest.skip("this host has no containers-common seccomp.json")
    verdicts = _profile_verdicts(engine.build_seccomp_profile(default))
    for denied in seccomp.DENIED_SYSCALLS:
        assert verdicts[denied.name] == {("SCMP_ACT_ERRNO", denied.errno)}, denied.name
    if default is not None:
        # Every call the default names is still ruled on; the others keep their rules.
        assert {n for rule in default["syscalls"] for n in rule["names"]} <= set(verdicts)
        assert verdicts["read"] == {("SCMP_ACT_ALLOW", None)}
