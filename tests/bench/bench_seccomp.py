"""Benchmark of what the kernel-channel denials cost on the local backend, run by hand
(needs root and bubblewrap):

    .venv/bin/python tests/bench/bench_seccomp.py [--rounds 40]

One sandbox; each command is launched exactly as `exec` launches it, once with the
seccomp filter (`bwrap --seccomp FD`) and once without, alternating, so both sides see
the same machine load. Commands: `true` (the start-up cost of installing the filter),
`python3 -c pass`, and a loop of 200,000 getppid calls (the filter's cost per system
call). Also the keyring clearing a uid gets when it is leased and released. Prints one
table; nothing is asserted, numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time

from envs.sandbox import bwrap, seccomp
from envs.sandbox.base import SandboxLimits, SandboxSpec
from envs.sandbox.hostuid import clear_keyrings_of_uid
from envs.sandbox.local import LocalSandbox
from sandbox_bench_inputs import percentile

COMMANDS = {
    "true": ["true"],
    "python3 -c pass": ["python3", "-c", "pass"],
    "200k getppid": ["python3", "-c", "import os\nfor _ in range(200_000): os.getppid()"],
}


def run_once(sandbox: LocalSandbox, argv: list[str], filtered: bool) -> float:
    fd = seccomp.filter_pipe() if filtered else None
    try:
        start = time.perf_counter()
        done = subprocess.run(sandbox.launcher_argv(argv, fd), env=bwrap.LAUNCHER_ENV,
                              pass_fds=(fd,) if fd is not None else (),
                              capture_output=True, check=False, timeout=120)
        elapsed = time.perf_counter() - start
    finally:
        if fd is not None:
            os.close(fd)
    if done.returncode != 0:
        raise SystemExit(f"{argv} failed ({done.returncode}): {done.stderr.decode()[-300:]}")
    return elapsed


def row(name: str, samples: list[float]) -> str:
    ms = [s * 1000 for s in samples]
    return (f"{name:<34} {len(ms):>4} {statistics.median(ms):>9.2f} {percentile(ms, 0.9):>9.2f} "
            f"{statistics.mean(ms):>9.2f}")


async def main(rounds: int) -> None:
    sandbox = await LocalSandbox.create(SandboxSpec(limits=SandboxLimits(memory_mb=512)))
    lines = [f"{'case':<34} {'n':>4} {'p50 ms':>9} {'p90 ms':>9} {'mean ms':>9}"]
    try:
        for name, argv in COMMANDS.items():
            run_once(sandbox, argv, True)  # warm the page cache
            run_once(sandbox, argv, False)
            with_filter, without = [], []
            for i in range(rounds):
                # Alternate which side goes first, so neither always runs warmer.
                order = (True, False) if i % 2 == 0 else (False, True)
                for filtered in order:
                    (with_filter if filtered else without).append(
                        await asyncio.to_thread(run_once, sandbox, argv, filtered))
            lines.append(row(f"{name}, no filter", without))
            lines.append(row(f"{name}, filter", with_filter))
            diff = statistics.median(with_filter) - statistics.median(without)
            lines.append(f"{'  filter - no filter (p50)':<34} {'':>4} {diff * 1000:>9.2f}")
        clears = []
        for _ in range(rounds):
            start = time.perf_counter()
            clear_keyrings_of_uid(sandbox.host_uid)
            clears.append(time.perf_counter() - start)
        lines.append(row("keyring clear (each release)", clears))
    finally:
        await sandbox.release()
    print(f"seccomp filter: {len(seccomp.build_filter())} bytes, "
          f"{len(seccomp.DENIED_SYSCALLS)} calls denied, {os.cpu_count()} cores")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    asyncio.run(main(parser.parse_args().rounds))
