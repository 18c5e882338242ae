"""The grading driver: a standalone script (standard library only) that the grader copies
into a fresh grading sandbox and starts there, before any of the agent's code runs:

    python3 -I -B <workspace>/.sluice_grading/driver.py   (settings as JSON on stdin)

The test process necessarily runs the agent's code with the sandbox's uid, so it can
write anything that uid can. The driver keeps its verdict out of that process's reach:

1. it makes itself non-dumpable, so same-uid processes can neither ptrace it nor open its
   file descriptors (its stdout, the only channel to the host) through /proc;
2. it runs pytest in a child whose stdin/stdout/stderr are a log file, never its own;
3. when the child ends or its time is up, it SIGKILLs every other process it can signal
   (kill(-1): daemons the agent's code left behind, still able to rewrite files);
4. only then it copies the JUnit report into out/, hashes it, re-hashes the protected
   files, looks for pytest config files that were not there before, and
5. prints one line, `SLUICE-GRADE <nonce> <json>`, and exits 0.

The host trusts that line only together with the report whose hash it names.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

PR_SET_DUMPABLE = 4
LOG_TAIL_BYTES = 4096
MAX_LISTED = 50  # paths named per finding

# Run in the child as `python3 -I -B -c BOOT runtime workspace pytest-args...`: -I ignores
# PYTHON* variables, the user site and the current folder; the pytest runtime is put on
# the path, imported, and only then the workspace (the agent's modules) is added.
BOOT = ("import sys\n"
        "runtime, workspace = sys.argv[1], sys.argv[2]\n"
        "if runtime:\n"
        "    sys.path.insert(0, runtime)\n"
        "import pytest\n"
        "sys.path.insert(0, workspace)\n"
        "sys.exit(pytest.main(sys.argv[3:]))\n")


def make_undumpable() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def run_pytest(settings: dict, tmp: str, report: str, log_path: str) -> tuple[int | None, bool]:
    """Exit code of the pytest child (None if it had to be killed) and whether it timed out."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": tmp,
           "TMPDIR": tmp, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONHASHSEED": "0"}
    argv = [sys.executable, "-I", "-B", "-c", BOOT, settings["runtime"] or "",
            settings["workspace"], *settings["pytest_args"], f"--junitxml={report}"]
    with open(log_path, "wb") as log:
        child = subprocess.Popen(argv, cwd=settings["workspace"], env=env, stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT, close_fds=True,
                                 start_new_session=True)
        try:
            return child.wait(timeout=settings["timeout_s"]), False
        except subprocess.TimeoutExpired:
            return None, True


def kill_everything_else() -> None:
    """SIGKILL every process this uid can signal in this PID namespace except ourselves
    and init, then reap our own children."""
    for _ in range(3):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nobody else left
        time.sleep(0.05)
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def read_regular(path: str, limit: int) -> bytes | None:
    """Content of a regular file (never through a symlink), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def clear_folder(folder: str) -> None:
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def changed_protected(workspace: str, protected: dict) -> list:
    changed = []
    for rel, digest in sorted(protected.items()):
        data = read_regular(os.path.join(workspace, rel), 1 << 30)
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            changed.append(rel)
    return changed


def new_config_files(workspace: str, names: list, known: list, skip_top: list) -> list:
    """Files named like pytest configuration or startup hooks that were not there before."""
    found = []
    wanted, known_set = set(names), set(known)
    for dirpath, dirnames, filenames in os.walk(workspace):
        rel_dir = os.path.relpath(dirpath, workspace)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in skip_top]
        for name in filenames:
            rel = name if rel_dir == "." else os.path.join(rel_dir, name)
            if (name in wanted or name.endswith(".pth")) and rel not in known_set:
                found.append(rel)
    return sorted(found)


def main() -> int:
    settings = json.loads(sys.stdin.read())
    undumpable = make_undumpable()
    tmp = tempfile.mkdtemp(prefix="grade-")
    report, log_path = os.path.join(tmp, "report.xml"), os.path.join(tmp, "pytest.log")
    start = time.monotonic()
    exit_code, timed_out = run_pytest(settings, tmp, report, log_path)
    kill_everything_else()
    workspace = settings["workspace"]
    out_dir = os.path.join(workspace, settings["out_dir"])
    clear_folder(out_dir)
    data = read_regular(report, settings["max_report_bytes"])
    digest = None
    if data is not None and len(data) <= settings["max_report_bytes"]:
        with open(os.path.join(out_dir, "report.xml"), "wb") as f:
            f.write(data)
        digest = hashlib.sha256(data).hexdigest()
    log_tail = (read_regular(log_path, 1 << 26) or b"")[-LOG_TAIL_BYTES:]
    changed = changed_protected(workspace, settings["protected"])
    new_configs = new_config_files(workspace, settings["config_names"],
                                   settings["known_config_files"], settings["skip_top_dirs"])
    # Lists are cut so the line stays far below the exec's output cap.
    result = {"exit_code": exit_code, "timed_out": timed_out, "report_sha256": digest,
              "undumpable": undumpable, "seconds": round(time.monotonic() - start, 3),
              "changed_protected": changed[:MAX_LISTED],
              "new_config_files": new_configs[:MAX_LISTED],
              "log_tail": log_tail.decode("utf-8", "replace")}
    sys.stdout.write(f"SLUICE-GRADE {settings['nonce']} {json.dumps(result)}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
