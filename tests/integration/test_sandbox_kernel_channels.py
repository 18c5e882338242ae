"""Red-team tests of kernel channels between sandboxes, on the local and container
backends: keyrings planted in one sandbox and read from a later one of the same host uid
(each role), keys a uid holds surviving its release, io_uring, userfaultfd and the rest of
envs.sandbox.seccomp's list called with real arguments, 32-bit and x32 calls that would
bypass a filter written for x86_64 numbers, and agent and grading sandboxes sharing uids.
Each probe is a program a policy could run; what it achieved is read from its output and
from the host. Ordinary tool use (threads, subprocesses, multiprocessing, git) must still
work under the filter."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from sandbox_probes import skip_without_container_engine

from envs.sandbox import local as local_backend
from envs.sandbox import seccomp
from envs.sandbox.base import SandboxLimits, SandboxRole, SandboxSpec

# Host uids of these tests only (outside the backends' default range and the reaper
# tests'): two per backend, one per role, so "a later sandbox of the same uid" is certain.
FIRST_UID = {"local": 1_320_000, "container": 1_320_010}
LIMITS = SandboxLimits(memory_mb=256, max_processes=64, cpu_time_s=30, file_size_mb=16)
HOST_PYTHON = "/usr/bin/python3"
MACHINE = platform.machine()


def _config(backend: str, num_uids: int = 2) -> object:
    if backend == "local":
        from envs.sandbox.local import LocalSandboxConfig

        return LocalSandboxConfig(first_host_uid=FIRST_UID[backend], num_host_uids=num_uids)
    from envs.sandbox.container import ContainerSandboxConfig

    return ContainerSandboxConfig(first_host_uid=FIRST_UID[backend], num_host_uids=num_uids)


def _backend_class(backend: str) -> type:
    if backend == "local":
        if os.geteuid() != 0 or shutil.which("bwrap") is None:
            pytest.skip("the local sandbox needs root and bubblewrap")
        from envs.sandbox.local import LocalSandbox

        return LocalSandbox
    skip_without_container_engine()
    from envs.sandbox.container import ContainerSandbox

    return ContainerSandbox


MakeSandbox = Callable[..., Awaitable[object]]


@pytest.fixture(params=["local", "container"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def make_sandbox(backend: str) -> AsyncIterator[MakeSandbox]:
    """Creates sandboxes of `backend` in this module's uid range; those the test did not
    release are released at its end (release is idempotent)."""
    cls = _backend_class(backend)
    async with contextlib.AsyncExitStack() as releases:
        async def make(role: SandboxRole = SandboxRole.GRADER, config: object | None = None):
            spec = SandboxSpec(limits=LIMITS, role=role)
            sandbox = await cls.create(spec, config or _config(backend))
            releases.push_async_callback(sandbox.release)
            return sandbox

        yield make


def python(code: str) -> list[str]:
    return ["python3", "-c", code]


_PRELUDE = f"""
import ctypes, json, os, struct
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
NR = {seccomp.SYSCALL_NUMBERS.get(MACHINE, {})!r}
S = ctypes.c_char_p
def call(name, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(L(NR[name]), *args)
    return [rc, ctypes.get_errno()]
"""

# --- keyrings: planted by one sandbox, read by a later one of the same uid ------------

# What an agent's code in a grading sandbox would do with the hidden tests it can read: a
# named keyring holding them, linked into the uid's persistent keyring (three days), and a
# key in the uid's user keyring.
PLANT = _PRELUDE + """
out = {}
ring = libc.syscall(L(NR["keyctl"]), L(1), S(b"sluice-leak"))  # JOIN_SESSION_KEYRING
out["join_named"] = [ring, ctypes.get_errno()]
out["get_persistent"] = call("keyctl", L(22), L(-1), L(-3))
if ring > 0 and out["get_persistent"][0] > 0:
    out["link"] = call("keyctl", L(8), L(ring), L(out["get_persistent"][0]))
secret = b"def test_hidden(): assert f(2) == 4"
out["add_key_user"] = call("add_key", S(b"user"), S(b"hidden"), S(secret), L(len(secret)), L(-4))
out["add_key_named"] = call("add_key", S(b"user"), S(b"hidden"), S(secret), L(len(secret)),
                            L(ring if ring > 0 else -3))
print(json.dumps(out))
"""

# The later sandbox looks for it everywhere it could be.
READ = _PRELUDE + """
out = {}
buf = ctypes.create_string_buffer(4096)
persistent = call("keyctl", L(22), L(-1), L(-3))
out["get_persistent"] = persistent
if persistent[0] > 0:
    out["read_persistent"] = call("keyctl", L(11), L(persistent[0]), buf, L(4096))
out["read_user"] = call("keyctl", L(11), L(-4), buf, L(4096))
out["search_user"] = call("keyctl", L(10), L(-4), S(b"user"), S(b"hidden"), L(0))
out["join_named"] = call("keyctl", L(1), S(b"sluice-leak"))
out["request_key"] = call("request_key", S(b"user"), S(b"hidden"), None, L(0))
print(json.dumps(out))
"""


def _results(stdout: str) -> dict[str, list[int]]:
    lines = stdout.strip().splitlines()
    assert lines, "the probe printed nothing"
    return json.loads(lines[-1])


@pytest.mark.parametrize("role", list(SandboxRole), ids=lambda r: r.value)
async def test_a_keyring_planted_in_a_sandbox_is_not_read_by_a_later_one_of_its_uid(
        make_sandbox: MakeSandbox, role: SandboxRole) -> None:
    if MACHINE not in seccomp.SYSCALL_NUMBERS:
        pytest.skip(f"no system call table for {MACHINE}")
    first = await make_sandbox(role)
    r = await first.exec(python(PLANT), 30)
    planted = _results(r.stdout)
    assert all(rc == -1 for rc, _ in planted.values()), planted
    assert {err for _, err in planted.values()} == {1}, planted  # EPERM from the filter
    uid = first.host_uid
    await first.release()
    later = await make_sandbox(role)
    assert later.host_uid == uid  # the range holds one uid per role: the same one again
    found = _results((await later.exec(python(READ), 30)).stdout)
    assert all(rc == -1 for rc, _ in found.values()), found


# Run on the host as the uid (the test's own program, not the code under test): what a
# sandbox process could leave in its uid's keyrings without a filter, and how to read it.
HOST_KEYS = """
import ctypes, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
NR = {"x86_64": 250, "aarch64": 219}[sys.argv[2]]
ADD_KEY = {"x86_64": 248, "aarch64": 217}[sys.argv[2]]
def keyctl(*args):
    return libc.syscall(L(NR), *(L(a) if isinstance(a, int) else a for a in args))
persistent = keyctl(22, -1, -2)
if sys.argv[1] == "plant":
    ring = keyctl(1, b"sluice-host-leak")
    assert ring > 0 and persistent > 0 and keyctl(8, ring, persistent) == 0
    assert libc.syscall(L(ADD_KEY), b"user", b"hidden", b"text", L(4), L(-4)) > 0
names = []
for keyring in ([persistent] if persistent > 0 else []) + [-4]:
    buf = ctypes.create_string_buffer(4096)
    n = keyctl(11, keyring, buf, 4096)
    for serial in struct.unpack(f"{max(n, 0) // 4}i", buf.raw[:max(n, 0)]):
        desc = ctypes.create_string_buffer(256)
        keyctl(6, serial, desc, 256)
        names.append(desc.value.decode().rsplit(";", 1)[-1])
print(" ".join(sorted(names)))
"""


def _host_keys_of(uid: int, action: str) -> str:
    done = subprocess.run([HOST_PYTHON, "-I", "-c", HOST_KEYS, action, MACHINE], user=uid,
                          group=uid, extra_groups=[], cwd="/", capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


async def test_keys_a_uid_holds_are_gone_once_its_sandbox_is_released(
        make_sandbox: MakeSandbox, backend: str) -> None:
    if backend == "local" and not local_backend.KEYRINGS_SHARED_BY_HOST_UID:
        pytest.skip("local backend on Linux >= 5.3: each command's keyrings live in its own user "
                    "namespace, so there is nothing of the host uid's to clear")
    if not os.access(HOST_PYTHON, os.X_OK) or MACHINE not in seccomp.SYSCALL_NUMBERS:
        pytest.skip(f"needs {HOST_PYTHON} and a system call table for {MACHINE}")
    sandbox = await make_sandbox(SandboxRole.GRADER)
    uid = sandbox.host_uid
    # Planted in the host's user namespace, which the container backend's processes share.
    assert _host_keys_of(uid, "plant") == "hidden sluice-host-leak"
    await sandbox.release()
    assert _host_keys_of(uid, "list") == ""
    later = await make_sandbox(SandboxRole.GRADER)
    assert later.host_uid == uid
    assert _host_keys_of(uid, "list") == ""


async def test_agent_and_grading_sandboxes_never_share_a_uid(make_sandbox: MakeSandbox,
                                                             backend: str) -> None:
    agent = await make_sandbox(SandboxRole.AGENT)
    grader = await make_sandbox(SandboxRole.GRADER)
    assert agent.host_uid == FIRST_UID[backend]
    assert grader.host_uid == FIRST_UID[backend] + 1
    # With both roles' only uid held, another grading sandbox waits for its own half.
    with pytest.raises(ValueError, match="grader sandbox uids"):
        await make_sandbox(SandboxRole.GRADER)
    wide = _config(backend, num_uids=8)
    uids = [(await make_sandbox(role, wide)).host_uid
            for role in (SandboxRole.AGENT, SandboxRole.GRADER, SandboxRole.AGENT)]
    first = FIRST_UID[backend]
    assert first <= uids[0] < first + 4 and first <= uids[2] < first + 4
    assert first + 4 <= uids[1] < first + 8


async def test_the_agent_pool_stamps_its_sandboxes_as_agents(backend: str) -> None:
    from envs.pool import SandboxPool

    cls = _backend_class(backend)
    config = _config(backend)
    made: list = []

    async def create(spec: SandboxSpec) -> object:
        made.append(await cls.create(spec, config))
        return made[-1]

    pool = SandboxPool(create, max_sandboxes=1, num_warm=0)
    try:
        lease = await pool.acquire(SandboxSpec(limits=LIMITS))  # GRADER by default
        assert (await pool.exec(lease, "true", 30)).exit_code == 0
        await pool.release(lease)
    finally:
        await pool.close()
    assert [sandbox.host_uid for sandbox in made] == [FIRST_UID[backend]]  # the agent half


# --- every listed call, with real arguments ---------------------------------------------

# Keyed by probe; the value's first word is the call (its errno is the list's). Where the
# host allows the call unfiltered (io_uring, user-mode userfaultfd, keyctl, add_key,
# fanotify with FID reports, perf on oneself), the probe would succeed without the filter.
CALLS = _PRELUDE + """
out = {}
params = (ctypes.c_uint8 * 120)()
out["io_uring_setup"] = call("io_uring_setup", L(8), ctypes.byref(params))
out["io_uring_enter"] = call("io_uring_enter", L(-1), L(0), L(0), L(0), None, L(0))  # EBADF else
out["io_uring_register"] = call("io_uring_register", L(-1), L(0), None, L(0))  # EBADF else
out["userfaultfd"] = call("userfaultfd", L(os.O_CLOEXEC | os.O_NONBLOCK | 1))  # USER_MODE_ONLY
out["keyctl"] = call("keyctl", L(1), S(b"sluice-probe"))
out["add_key"] = call("add_key", S(b"user"), S(b"probe"), S(b"x"), L(1), L(-3))
out["request_key"] = call("request_key", S(b"user"), S(b"probe"), None, L(0))
attr = (ctypes.c_uint8 * 128)()  # PERF_TYPE_SOFTWARE, TASK_CLOCK, this process, user only
struct.pack_into("=IIQ", attr, 0, 1, 128, 1)
struct.pack_into("=Q", attr, 40, (1 << 0) | (1 << 5) | (1 << 6))
out["perf_event_open"] = call("perf_event_open", ctypes.byref(attr), L(0), L(-1), L(-1), L(0))
battr = (ctypes.c_uint8 * 72)()  # BPF_MAP_CREATE of a one-entry array
struct.pack_into("=IIII", battr, 0, 2, 4, 4, 1)
out["bpf"] = call("bpf", L(0), ctypes.byref(battr), L(72))
out["fanotify_init"] = call("fanotify_init", L(0x200), L(os.O_RDONLY))  # FAN_REPORT_FID
handle = (ctypes.c_uint8 * 136)()
struct.pack_into("=I", handle, 0, 128)
out["open_by_handle_at"] = call("open_by_handle_at", L(-100), ctypes.byref(handle), L(0))
out["syslog"] = call("syslog", L(10), None, L(0))  # SYSLOG_ACTION_SIZE_BUFFER
out["kexec_load"] = call("kexec_load", L(0), L(0), None, L(0))
out["kexec_file_load"] = call("kexec_file_load", L(-1), L(-1), L(0), None, L(0))
try:
    os.close(os.open("/dev/userfaultfd", os.O_RDWR))
    out["dev_userfaultfd"] = [0, 0]
except OSError as e:
    out["dev_userfaultfd"] = [-1, e.errno]
print(json.dumps(out))
"""


async def test_every_listed_call_fails_with_its_errno(make_sandbox: MakeSandbox) -> None:
    if MACHINE not in seccomp.SYSCALL_NUMBERS:
        pytest.skip(f"no system call table for {MACHINE}")
    sandbox = await make_sandbox()
    assert sandbox.capabilities().denied_syscalls == seccomp.denied_names()
    r = await sandbox.exec(python(CALLS), 30)
    results = _results(r.stdout)
    expected = {d.name: [-1, d.errno] for d in seccomp.DENIED_SYSCALLS}
    assert set(expected) <= set(results), "a listed call has no probe here"
    wrong = {name: got for name, got in results.items()
             if name in expected and got != expected[name]}
    assert wrong == {}, f"not denied as listed (rc, errno): {wrong}"
    # The device form of userfaultfd is no way around it: the sandboxes have no such node.
    assert results["dev_userfaultfd"][0] == -1


# --- calls the numbers above do not cover ----------------------------------------------

# keyctl(JOIN_SESSION_KEYRING, NULL) by the i386 entry (int 0x80, number 288): machine
# code in an executable page, called from Python (rbx saved: the ABI keeps it).
I386_KEYCTL = """
import ctypes, mmap
code = bytes.fromhex("53" "b820010000" "bb01000000" "31c9" "cd80" "5b" "c3")
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
print("i386 keyctl", fn(), flush=True)
"""


async def test_32_bit_and_x32_calls_are_no_way_around_the_filter(make_sandbox: MakeSandbox,
                                                                 backend: str) -> None:
    if MACHINE != "x86_64":
        pytest.skip("the i386 and x32 entries exist on x86_64 only")
    sandbox = await make_sandbox()
    r = await sandbox.exec(python(I386_KEYCTL), 30)
    if backend == "local":
        assert r.exit_code == 128 + 31, r  # SIGSYS: the filter kills foreign-arch calls
        assert "i386 keyctl" not in r.stdout
    else:
        # The engine's libseccomp filters each architecture by its own numbers.
        assert r.stdout.strip() == "i386 keyctl -1", r
    # keyctl(GET_KEYRING_ID, session) by its x32 number: ENOSYS from the local filter,
    # EPERM from the engine's x32 rules, ENOSYS from a kernel without x32.
    x32 = _PRELUDE + "print(json.dumps([libc.syscall(L(0x40000000 | NR['keyctl']), L(0), L(-3))]))"
    assert json.loads((await sandbox.exec(python(x32), 30)).stdout) == [-1]


# --- ordinary tool use still works ---------------------------------------------------

TOOL_USE = """
import asyncio, json, multiprocessing, os, subprocess, tempfile, threading
out = {"fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd"))}
t = threading.Thread(target=lambda: out.setdefault("thread", 1)); t.start(); t.join()
out["subprocess"] = subprocess.run(["echo", "ok"], capture_output=True, text=True).stdout.strip()
async def main():
    proc = await asyncio.create_subprocess_exec("true")
    return await proc.wait()
out["asyncio"] = asyncio.run(main())
with multiprocessing.Pool(2) as pool:
    out["multiprocessing"] = sum(pool.map(abs, [-1, -2, 3]))
with tempfile.NamedTemporaryFile() as f:
    out["tempfile"] = os.path.exists(f.name)
print(json.dumps(out))
"""


async def test_threads_processes_and_git_work_under_the_filter(make_sandbox: MakeSandbox) -> None:
    sandbox = await make_sandbox()
    r = await sandbox.exec(python(TOOL_USE), 60)
    out = _results(r.stdout)
    assert {k: out[k] for k in ("thread", "subprocess", "asyncio", "multiprocessing",
                                "tempfile")} == {"thread": 1, "subprocess": "ok", "asyncio": 0,
                                                 "multiprocessing": 6, "tempfile": True}, r
    # 0-2 and listdir's own: the filter's pipe does not reach the command.
    assert len(out["fds"]) == 4 and out["fds"][:3] == [0, 1, 2], out
    git = ("git init -q repo && cd repo && echo x > f && git add f && "
           "git -c user.email=a@b -c user.name=a commit -qm one && git log --oneline | wc -l")
    r = await sandbox.exec(git, 60)
    assert (r.exit_code, r.stdout.strip()) == (0, "1"), r
    files = await sandbox.exec("ls repo", 10)
    assert files.stdout.split() == ["f"] and Path(sandbox.workspace_dir, "repo", "f").exists()
