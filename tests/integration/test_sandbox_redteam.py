"""Red-team tests of the sandbox backends that run on this host (local; container where an
engine works): each test is a small program a reward-seeking policy might write, and
asserts the concrete outcome on the host (limits, network, host visibility, sparse files
that would amplify what the host stores, nested user namespaces). The limit tests run
first (pytest keeps file order, each test for every backend), and the bombs further down
refuse to run for a backend whose process and memory limits have not been seen to hold in
this session."""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Protocol

import pytest
from sandbox_probes import live_processes_of_uid, skip_without_container_engine

from envs.sandbox.base import Sandbox, SandboxLimits, SandboxSpec

# Small limits: a bomb that escaped them would still be survivable for the host.
LIMITS = SandboxLimits(memory_mb=256, max_processes=64, cpu_time_s=30, file_size_mb=8,
                       open_files=128, max_output_bytes=65_536)


class HostSandbox(Sandbox, Protocol):
    """A backend whose commands run as a leased host uid in a workspace on this host."""

    @property
    def host_uid(self) -> int: ...

    @property
    def workspace_dir(self) -> str: ...


MakeSandbox = Callable[..., Awaitable[HostSandbox]]
# Backends whose limits held in this session (limit tests add them); bombs need it.
PROCESS_LIMIT_HELD: set[str] = set()
MEMORY_LIMIT_HELD: set[str] = set()


def _local_create() -> Callable[[SandboxSpec], Awaitable[HostSandbox]]:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the local sandbox needs root and bubblewrap")
    from envs.sandbox.local import LocalSandbox

    return LocalSandbox.create


def _container_create() -> Callable[[SandboxSpec], Awaitable[HostSandbox]]:
    skip_without_container_engine()
    from envs.sandbox.container import ContainerSandbox

    return ContainerSandbox.create


BACKENDS = {"local": _local_create, "container": _container_create}


def _config(backend: str, snapshot_dir: str) -> object:
    if backend == "local":
        from envs.sandbox.local import LocalSandboxConfig

        return LocalSandboxConfig(snapshot_dir=snapshot_dir)
    from envs.sandbox.container import ContainerSandboxConfig

    return ContainerSandboxConfig(snapshot_dir=snapshot_dir)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def require_held(held: set[str], backend: str, what: str) -> None:
    if backend not in held:
        pytest.fail(f"the {what} limit of the {backend} backend was not seen to hold in this "
                    f"session (run the whole module); the bomb is not run")


def assert_nothing_runs(sandbox: HostSandbox) -> None:
    deadline = time.monotonic() + 3.0
    while (pids := live_processes_of_uid(sandbox.host_uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids == [], f"processes of the sandbox survived the command: {pids}"


def host_can_fork() -> bool:
    return subprocess.run(["true"], timeout=10).returncode == 0


@pytest.fixture
async def make_sandbox(backend: str) -> AsyncIterator[MakeSandbox]:
    create = BACKENDS[backend]()
    made: list[HostSandbox] = []

    async def make(limits: SandboxLimits = LIMITS, snapshot_dir: str | None = None) -> HostSandbox:
        spec = SandboxSpec(limits=limits)
        # Both backends' create take their config as the second argument.
        sandbox = await (create(spec, _config(backend, snapshot_dir))  # type: ignore[call-arg]
                         if snapshot_dir else create(spec))
        made.append(sandbox)
        return sandbox

    yield make
    for sandbox in made:
        await sandbox.release()


def python(code: str) -> list[str]:
    return ["python3", "-c", code]


# --- limits, proven before any bomb -------------------------------------------------

BOUNDED_SPAWN = """
import os, time
n = 0
try:
    while n < 500:
        if os.fork() == 0:
            time.sleep(20)
            os._exit(0)
        n += 1
except OSError as e:
    print("capped", n, e.errno)
"""


async def test_process_limit_caps_a_bounded_spawn(make_sandbox: MakeSandbox, backend: str) -> None:
    sb = await make_sandbox()
    caps = sb.capabilities()
    assert caps.unprivileged_uid and "NPROC" in caps.rlimits
    r = await sb.exec(python(BOUNDED_SPAWN), 30)
    assert r.stdout.startswith("capped"), r
    assert int(r.stdout.split()[1]) < LIMITS.max_processes
    assert_nothing_runs(sb)
    PROCESS_LIMIT_HELD.add(backend)


async def test_memory_limit_stops_one_big_allocation(make_sandbox: MakeSandbox,
                                                     backend: str) -> None:
    sb = await make_sandbox()
    r = await sb.exec(python("b = b'x' * (600 << 20); print('allocated')"), 30)
    assert "allocated" not in r.stdout
    assert r.exit_code == 137 or "MemoryError" in r.stderr, r
    MEMORY_LIMIT_HELD.add(backend)


async def test_rlimits_alone_hold_on_a_host_without_cgroups(make_sandbox: MakeSandbox,
                                                            backend: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The host is real; only cgroup detection is forced to find nothing, as on a host
    # whose cgroupfs is read-only. Then RLIMIT_NPROC and RLIMIT_AS must do the job.
    if backend != "local":
        pytest.skip("container engines need cgroups; only the local backend runs without")
    from envs.sandbox import cgroups

    monkeypatch.setattr(cgroups, "detect_cgroup_host", lambda: cgroups.CgroupHost(None, ()))
    sb = await make_sandbox()
    assert sb.capabilities().cgroup_controllers == ()
    r = await sb.exec(python(BOUNDED_SPAWN), 30)
    assert r.stdout.startswith("capped") and int(r.stdout.split()[1]) < LIMITS.max_processes
    assert_nothing_runs(sb)
    r = await sb.exec(python("b = []\nwhile True:\n    b.append(b'x' * (16 << 20))"), 30)
    assert "MemoryError" in r.stderr and not r.oom_killed


# --- networking -------------------------------------------------------------------

async def test_tcp_to_a_host_loopback_server_fails(make_sandbox: MakeSandbox) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    sb = await make_sandbox()
    waiter = threading.Thread(target=accept)
    waiter.start()
    code = (f"import socket\ns = socket.socket(); s.settimeout(3)\n"
            f"try:\n    s.connect(('127.0.0.1', {port})); print('connected')\n"
            f"except OSError as e:\n    print('failed', e)")
    r = await sb.exec(python(code), 20)
    waiter.join()
    server.close()
    assert r.stdout.startswith("failed") and accepted == []
    interfaces = await sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1", 10)
    assert interfaces.stdout.split() == ["lo"]


async def test_dns_lookup_fails(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    r = await sb.exec(python("import socket\ntry:\n    print(socket.getaddrinfo('pypi.org', 443))\n"
                             "except OSError as e:\n    print('failed', type(e).__name__)"), 20)
    assert r.stdout.startswith("failed"), r


# --- resource bombs ---------------------------------------------------------------

async def test_fork_bomb_is_capped_and_cleaned_up(make_sandbox: MakeSandbox, backend: str) -> None:
    require_held(PROCESS_LIMIT_HELD, backend, "process")
    sb = await make_sandbox()
    bystander = await make_sandbox()
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(live_processes_of_uid(sb.host_uid)))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    r = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 30", 3.0)
    watcher.cancel()
    assert r.timed_out or r.exit_code != 0
    assert peak <= LIMITS.max_processes + 2, peak  # local: + bwrap's monitor and init
    assert_nothing_runs(sb)
    assert host_can_fork()
    assert (await bystander.exec("echo fine", 10)).stdout == "fine\n"
    assert (await sb.exec("echo recovered", 10)).stdout == "recovered\n"


async def test_memory_bomb_is_killed(make_sandbox: MakeSandbox, backend: str) -> None:
    require_held(MEMORY_LIMIT_HELD, backend, "memory")
    sb = await make_sandbox()
    r = await sb.exec(python("b = []\nwhile True:\n    b.append(b'x' * (16 << 20))"), 30)
    assert r.exit_code != 0 and not r.timed_out
    if "memory" in sb.capabilities().cgroup_controllers:
        assert r.exit_code == 137 and r.oom_killed
    else:
        assert r.exit_code == 137 or "MemoryError" in r.stderr


async def test_memory_spread_over_processes_is_still_bounded(make_sandbox: MakeSandbox,
                                                             backend: str) -> None:
    # Each child stays under RLIMIT_AS; only a limit on the whole tree stops the sum.
    require_held(MEMORY_LIMIT_HELD, backend, "memory")
    sb = await make_sandbox()
    if "memory" not in sb.capabilities().cgroup_controllers:
        pytest.skip("no memory cgroup on this host: only per-process limits apply")
    code = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
            "        b = b'x' * (120 << 20); time.sleep(2); os._exit(0)\n"
            "for _ in range(4):\n    os.wait()\nprint('survived')")
    r = await sb.exec(python(code), 30)
    assert r.oom_killed and not r.timed_out
    assert_nothing_runs(sb)


async def test_cpu_spin_is_killed_by_the_timeout(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    r = await sb.exec(python("while True: pass"), 1.5)
    assert r.timed_out and r.exit_code == 137 and r.duration_s < 5
    assert_nothing_runs(sb)


async def test_cpu_spin_is_killed_by_rlimit_cpu(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox(SandboxLimits(memory_mb=256, cpu_time_s=1))
    r = await sb.exec(python("while True: pass"), 30)
    assert not r.timed_out
    assert r.exit_code in (128 + 24, 137)  # SIGXCPU at the soft limit, SIGKILL at the hard one
    assert r.duration_s < 10


async def test_infinite_output_is_truncated_in_bounded_memory(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = await sb.exec("yes spam; cat /dev/zero >&2", 3.0)
    rss_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb) / 1024
    assert r.timed_out and r.output_truncated
    assert len(r.stdout.encode()) + len(r.stderr.encode()) <= LIMITS.max_output_bytes + 200
    assert r.stdout.startswith("spam\nspam\n")
    assert rss_growth_mb < 64, rss_growth_mb


async def test_huge_file_write_fails(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    r = await sb.exec("head -c 20M /dev/zero > big.bin", 20)
    assert r.exit_code == 128 + 25  # SIGXFSZ
    code = ("import signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "try:\n    open('big2.bin', 'wb').write(b'0' * (20 << 20))\n"
            "except OSError as e:\n    print('refused', e.errno)")
    r2 = await sb.exec(python(code), 20)
    assert r2.stdout.split() == ["refused", "27"]  # EFBIG
    for name in ("big.bin", "big2.bin"):
        assert os.path.getsize(os.path.join(sb.workspace_dir, name)) <= LIMITS.file_size_mb << 20


async def test_filling_the_disk_stops_at_the_workspace_cap(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox(SandboxLimits(memory_mb=256, file_size_mb=8, disk_mb=32))
    if sb.capabilities().disk_limit_mb is None:
        pytest.skip("the workspace cannot be size-capped on this host")
    r = await sb.exec("i=0; while head -c 4M /dev/zero > f$i; do i=$((i+1)); done; "
                      "echo stopped at $i", 30)
    assert "No space left" in r.stderr and not r.timed_out
    used = sum(e.stat().st_size for e in os.scandir(sb.workspace_dir))
    assert used <= 32 << 20
    assert (await sb.exec("rm f*; echo freed > ok.txt && cat ok.txt", 10)).stdout == "freed\n"


# --- filesystem and host visibility -----------------------------------------------

async def test_another_sandboxs_workspace_is_not_reachable(make_sandbox: MakeSandbox) -> None:
    victim, attacker = await make_sandbox(), await make_sandbox()
    await victim.write_file("answer.txt", b"42")
    target = os.path.join(victim.workspace_dir, "answer.txt")
    r = await attacker.exec(f"cat {target}; ls {os.path.dirname(victim.workspace_dir)}", 10)
    assert r.exit_code != 0 and "42" not in r.stdout
    search = await attacker.exec("grep -rl 42 /tmp /workspace /dev/shm 2>/dev/null; "
                                 "find / -name answer.txt -not -path '/proc/*' 2>/dev/null", 60)
    assert search.stdout == ""


async def test_hidden_tests_on_the_host_are_not_mounted(make_sandbox: MakeSandbox,
                                                        tmp_path: Path) -> None:
    hidden = tmp_path / "hidden_tests"
    hidden.mkdir()
    (hidden / "test_solution.py").write_text("EXPECTED = 'secret-answer'\n")
    sb = await make_sandbox()
    for path in (hidden / "test_solution.py", hidden, Path("/work"), Path("/root")):
        r = await sb.exec(["test", "-e", str(path)], 10)
        assert r.exit_code == 1, path
    grep = await sb.exec("grep -rs secret-answer / --exclude-dir=proc --exclude-dir=usr "
                         "--exclude-dir=sys", 60)
    assert grep.stdout == ""


async def test_host_environment_is_not_readable(make_sandbox: MakeSandbox,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "canary-key-999")
    sb = await make_sandbox()
    code = ("import os\nprint(dict(os.environ))\nfor p in os.listdir('/proc'):\n"
            "    try: print(open(f'/proc/{p}/environ', 'rb').read())\n    except OSError: pass")
    r = await sb.exec(python(code), 10)
    assert "canary-key-999" not in r.stdout + r.stderr
    assert "AWS_SECRET" not in r.stdout


async def test_host_processes_are_invisible(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    r = await sb.exec("ls /proc | grep -c '^[0-9]'", 10)
    assert int(r.stdout) <= 4  # init, sh, ls, grep of this command only
    assert (await sb.exec(f"kill -0 {os.getpid()}", 10)).exit_code != 0


async def test_daemon_does_not_outlive_the_command(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(2)\n        open('/workspace/daemon-was-here', 'w').write('x')\n"
            "        time.sleep(60)\n    os._exit(0)\nprint('detached')")
    r = await sb.exec(python(code), 20)
    assert r.stdout == "detached\n" and r.duration_s < 5
    assert_nothing_runs(sb)
    await asyncio.sleep(3)
    with pytest.raises(FileNotFoundError):
        await sb.read_file("daemon-was-here")


async def test_symlink_out_of_the_workspace(make_sandbox: MakeSandbox, tmp_path: Path) -> None:
    host_secret = tmp_path / "host-secret.txt"
    host_secret.write_text("host only")
    sb = await make_sandbox()
    r = await sb.exec(f"ln -s {host_secret} leak; ln -s /etc/shadow shadow; cat leak shadow", 10)
    assert r.exit_code != 0 and "host only" not in r.stdout
    for name in ("leak", "shadow"):
        with pytest.raises(ValueError, match="outside the workspace"):
            await sb.read_file(name)
    snap = await sb.snapshot()  # links travel as links, never as their targets' content
    try:
        assert b"host only" not in Path(snap.tar_path).read_bytes()
    finally:
        snap.discard()


@pytest.mark.parametrize("cmd", [["sh", "-c", "kill -9 $PPID; echo still-here"],
                                 python("import os, signal; os.kill(os.getppid(), signal.SIGKILL); "
                                        "print('still-here')"),
                                 ["sh", "-c", "kill -9 -1; echo after"]])
async def test_killing_its_parent(make_sandbox: MakeSandbox, cmd: list[str]) -> None:
    sb = await make_sandbox()
    r = await sb.exec(cmd, 10)
    assert not r.timed_out
    assert (await sb.exec("echo usable", 10)).stdout == "usable\n"
    assert_nothing_runs(sb)


@pytest.mark.parametrize("path", ["/usr/evil", "/usr/bin/python3", "/etc/evil", "/etc/passwd",
                                  "/evil", "/proc/sys/kernel/hostname"])
async def test_system_paths_are_read_only(make_sandbox: MakeSandbox, path: str) -> None:
    sb = await make_sandbox()
    r = await sb.exec(["sh", "-c", f"echo x >> {path}"], 10)
    assert r.exit_code != 0
    assert not os.path.exists("/usr/evil") and not os.path.exists("/evil")


async def test_no_privileges_inside(make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    status = (await sb.exec("grep -E '^(CapEff|NoNewPrivs)' /proc/self/status", 10)).stdout
    assert "CapEff:\t0000000000000000" in status and "NoNewPrivs:\t1" in status
    if sb.capabilities().nested_userns_blocked:
        assert (await sb.exec("unshare -r true", 10)).exit_code != 0
    cgroupfs = await sb.exec("ls -A /sys/fs/cgroup", 10)  # its limits are not in reach:
    assert cgroupfs.exit_code != 0 or cgroupfs.stdout == ""  # absent (local) or masked


# --- sparse files: what the host stores for a sandbox is bounded by its own cap -------

SPARSE_LIMITS = SandboxLimits(memory_mb=256, max_processes=64, file_size_mb=1024, disk_mb=32)
# Layout -> (command, a file over the cap by itself, if any).
SPARSE_LAYOUTS = {
    "one_file_far_over_the_cap": ("truncate -s 900M big", "big"),
    "many_files_each_under_the_cap": ("for i in $(seq 40); do truncate -s 30M f$i; done", None),
    "deep_in_folders": ("mkdir -p a/b/c/d && truncate -s 600M a/b/c/d/big && truncate -s 1M top",
                        "a/b/c/d/big"),
    "one_byte_written_far_out": ("printf x | dd of=big bs=1 seek=700000000 2>/dev/null", "big"),
}


@pytest.mark.parametrize("layout", sorted(SPARSE_LAYOUTS))
async def test_sparse_files_never_amplify_a_snapshot(make_sandbox: MakeSandbox, layout: str,
                                                     tmp_path: Path) -> None:
    sb = await make_sandbox(SPARSE_LIMITS, snapshot_dir=str(tmp_path))
    if sb.capabilities().disk_limit_mb is None:
        pytest.skip("the workspace cannot be size-capped on this host")
    command, over_cap = SPARSE_LAYOUTS[layout]
    r = await sb.exec(command + " && echo done", 30)
    assert r.stdout.endswith("done\n"), r  # the tmpfs takes them: they hold (almost) no blocks
    with pytest.raises(ValueError, match="apparent size"):
        await sb.snapshot()
    assert list(tmp_path.iterdir()) == []  # not even a partial tar is left
    if over_cap is not None:
        with pytest.raises(ValueError, match="apparent size"):
            await sb.read_file(over_cap)
    assert (await sb.exec("rm -rf big a f* && echo kept > k.txt", 10)).exit_code == 0
    snap = await sb.snapshot()
    try:
        assert snap.num_bytes <= SPARSE_LIMITS.disk_mb << 20
        await sb.restore(snap)
        assert await sb.read_file("k.txt") == b"kept\n"
    finally:
        snap.discard()


async def test_hard_links_count_once_and_snapshots_stay_within_the_cap(
        make_sandbox: MakeSandbox, tmp_path: Path) -> None:
    sb = await make_sandbox(SPARSE_LIMITS, snapshot_dir=str(tmp_path))
    r = await sb.exec("head -c 20M /dev/urandom > f && for i in $(seq 60); do ln f l$i; done "
                      "&& echo linked", 30)
    assert r.stdout == "linked\n", r  # 61 names of 20 MB each: 1.2 GB by name, 20 MB stored
    snap = await sb.snapshot()
    try:
        assert snap.num_bytes <= SPARSE_LIMITS.disk_mb << 20
    finally:
        snap.discard()


async def test_a_snapshot_of_a_larger_sandbox_is_not_restored_into_a_smaller_one(
        make_sandbox: MakeSandbox, tmp_path: Path) -> None:
    large = await make_sandbox(SandboxLimits(memory_mb=256, file_size_mb=64, disk_mb=96),
                               snapshot_dir=str(tmp_path))
    assert (await large.exec("head -c 50M /dev/zero > f", 30)).exit_code == 0
    snap = await large.snapshot()
    try:
        small = await make_sandbox(SPARSE_LIMITS)
        with pytest.raises(ValueError, match="apparent size"):
            await small.restore(snap)
    finally:
        snap.discard()


# --- nested user namespaces ------------------------------------------------------------

CLONE_NEWUSER = 0x10000000
_LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
USERNS_ATTEMPTS = {
    "unshare_user": ["unshare", "-U", "true"],
    "unshare_map_root": ["unshare", "-r", "id"],
    "unshare_then_mount": ["unshare", "-rm", "sh", "-c", "mount -t tmpfs x /tmp && echo mounted"],
    "unshare_syscall": python(_LIBC + f"rc = libc.unshare({CLONE_NEWUSER})\n"
                              "print('entered' if rc == 0 else 'refused', ctypes.get_errno())\n"
                              "raise SystemExit(rc != 0)"),
    # Raw clone(CLONE_NEWUSER | SIGCHLD): a child that returns 0 exits at once.
    "clone_syscall": python(_LIBC + f"rc = libc.syscall(56, {CLONE_NEWUSER | 17}, 0, 0, 0, 0)\n"
                            "if rc == 0:\n    os._exit(0)\n"
                            "print('cloned' if rc > 0 else 'refused', ctypes.get_errno())\n"
                            "raise SystemExit(rc <= 0)"),
    # clone3 takes its flags in memory, where seccomp cannot look: it must fail outright.
    "clone3_syscall": python(_LIBC + "args = (ctypes.c_uint64 * 11)()\n"
                             f"args[0] = {CLONE_NEWUSER}\nargs[4] = 17\n"
                             "rc = libc.syscall(435, ctypes.byref(args), ctypes.sizeof(args))\n"
                             "if rc == 0:\n    os._exit(0)\n"
                             "print('cloned' if rc > 0 else 'refused', ctypes.get_errno())\n"
                             "raise SystemExit(rc <= 0)"),
}


@pytest.mark.parametrize("attempt", sorted(USERNS_ATTEMPTS))
async def test_nested_user_namespaces_are_blocked(make_sandbox: MakeSandbox,
                                                  attempt: str) -> None:
    sb = await make_sandbox()
    assert sb.capabilities().nested_userns_blocked
    r = await sb.exec(USERNS_ATTEMPTS[attempt], 20)
    assert r.exit_code != 0, r
    assert "mounted" not in r.stdout and "uid=0" not in r.stdout and "cloned" not in r.stdout
    assert "entered" not in r.stdout


async def test_threads_and_subprocesses_still_work_without_user_namespaces(
        make_sandbox: MakeSandbox) -> None:
    sb = await make_sandbox()
    code = ("import subprocess, threading\nout = []\n"
            "t = threading.Thread(target=out.append, args=('thread',))\nt.start()\nt.join()\n"
            "out.append(subprocess.run(['echo', 'child'], capture_output=True, text=True,"
            " check=True).stdout.strip())\nprint(*out)")
    r = await sb.exec(python(code), 20)
    assert r.stdout == "thread child\n", r
