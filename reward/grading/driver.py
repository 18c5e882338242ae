"""The grading driver: a standalone script (standard library only) that the grader copies
into a fresh grading sandbox and starts there, before any of the agent's code runs:

    python3 -I -B <workspace>/.sluice_grading/driver.py   (settings as JSON on stdin)

The test process necessarily runs the agent's code with the sandbox's uid, so it can
write anything that uid can. The driver keeps its verdict out of that process's reach:

1. it makes itself non-dumpable, so same-uid processes can neither ptrace it nor open its
   file descriptors (its stdout, the only channel to the host) through /proc;
2. it runs the tests in a child (reward.grading.boot, then pytest) whose stdout/stderr are a log
   file, never its own, with a fresh random key and a pipe: the child's recorder plugin
   streams one authenticated record per event (reward.grading.recorder), which this process
   reads as it comes, so no record can be changed after the fact;
3. when the child ends or its time is up, it SIGKILLs every other process it can signal
   (kill(-1): daemons the agent's code left behind, still able to rewrite files), which
   also closes every write end of the pipe;
4. only then it checks the stream (authentication, sequence, nothing after the end),
   copies the JUnit report and the verified records into out/, hashes both, re-hashes
   the protected files, looks for pytest config files that were not there before, and
5. prints one line, `SLUICE-GRADE <nonce> <json>`, and exits 0.

The host trusts that line only together with the files whose hashes it names, and
cross-checks the two accounts of the run (reward.grading.crosscheck). Both accounts are
written by the test process, where the agent's code runs and can reach the key and the
pipe; what this process guarantees is that nothing is changed after the fact and that
the line is its own. Against code that lies from inside the run, the verdict rests on
the mutation sentinels (reward.grading.sentinels).

The pytest that runs is the sandbox Python's own where it has a supported one, else the
grader's bundled copy (reward.grading.boot chooses, before any workspace file is importable, and
says which in the stream's first record); the line names it (`pytest`), from that
record only. This file and boot run on the sandbox's Python, 3.8 to 3.11: no syntax or
standard-library API newer than 3.8 (annotations are never evaluated).

Command mode (settings["command"], tasks graded by the repository's own runner and a
swebench log parser): step 2 runs that command instead, its stdout and stderr one pipe
that this process drains as the output comes (so nothing written can be edited or
truncated afterwards, as a log file the same uid can open could be); after step 3 the
captured output goes to out/log.txt and its hash onto the line; no report or records.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

PR_SET_DUMPABLE = 4
LOG_TAIL_BYTES = 4096
MAX_LISTED = 50  # paths or problems named per finding
MAC_HEX = 32  # as reward.grading.recorder


def make_undumpable() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class PipeReader:
    """Drains the read end of the record pipe in a thread, keeping at most `limit` bytes
    (the child must never block on a full pipe)."""

    def __init__(self, fd: int, limit: int) -> None:
        self.data = bytearray()
        self.overflow = False
        self._fd, self._limit = fd, limit
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while chunk := os.read(self._fd, 1 << 16):
            if len(self.data) + len(chunk) <= self._limit:
                self.data += chunk
            else:
                self.overflow = True

    def finish(self, timeout_s: float) -> bool:
        """Wait for end of file (every writer gone); False if it did not come."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def record_fd() -> int:
    """A descriptor number for the record pipe in the child, different per grading and
    below the open-files limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(16, min(soft if soft > 0 else 1024, 1024) - 8)
    return random.SystemRandom().randrange(10, top)


def run_tests(settings: dict, tmp: str, report: str, log_path: str,
              key: bytes) -> tuple[int | None, bool, PipeReader]:
    """Exit code of the test child (None if it had to be killed), whether it timed out,
    and the reader of its record pipe."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": tmp,
           "TMPDIR": tmp, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONHASHSEED": "0"}
    read_end, write_end = os.pipe()
    boot = {"key": key.hex(), "fd_in": write_end, "fd": record_fd(),
            "runtime": settings["runtime"], "workspace": settings["workspace"],
            "recorder": settings["recorder"], "recorder_module": settings["recorder_module"],
            "preload": settings["preload"], "shadow_allowed": settings["shadow_allowed"],
            "runner_names": settings["runner_names"],
            "stdlib_names": settings.get("stdlib_names", []),
            "use_image_pytest": settings.get("use_image_pytest", True),
            "pytest_args": [*settings["pytest_args"], f"--junitxml={report}"]}
    reader = PipeReader(read_end, settings["max_stream_bytes"])
    with open(log_path, "wb") as log:
        child = subprocess.Popen([sys.executable, "-I", "-B", settings["boot"]],
                                 cwd=settings["workspace"], env=env, stdin=subprocess.PIPE,
                                 stdout=log, stderr=subprocess.STDOUT, close_fds=True,
                                 pass_fds=(write_end,), start_new_session=True)
    os.close(write_end)  # from now on only the child (and what it starts) can write
    try:
        assert child.stdin is not None
        child.stdin.write(json.dumps(boot).encode())
        child.stdin.close()
    except BrokenPipeError:
        pass  # the child died at once; its exit code says so
    try:
        return child.wait(timeout=settings["timeout_s"]), False, reader
    except subprocess.TimeoutExpired:
        return None, True, reader


def run_command(settings: dict, tmp: str) -> tuple[int | None, bool, PipeReader]:
    """Exit code of the runner's command (None if it had to be killed), whether it timed
    out, and the reader of its output pipe (command mode)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": tmp,
           "TMPDIR": tmp, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    read_end, write_end = os.pipe()
    reader = PipeReader(read_end, settings["max_log_bytes"])
    child = subprocess.Popen(settings["command"], cwd=settings["workspace"], env=env,
                             stdin=subprocess.DEVNULL, stdout=write_end, stderr=write_end,
                             close_fds=True, start_new_session=True)
    os.close(write_end)  # from now on only the command (and what it starts) can write
    try:
        return child.wait(timeout=settings["timeout_s"]), False, reader
    except subprocess.TimeoutExpired:
        return None, True, reader


def command_main(settings: dict) -> int:
    undumpable = make_undumpable()
    tmp = tempfile.mkdtemp(prefix="grade-")
    start = time.monotonic()
    exit_code, timed_out, reader = run_command(settings, tmp)
    kill_everything_else()
    problems = [] if reader.finish(timeout_s=5.0) else [
        "the output pipe stayed open after every process was killed"]
    if reader.overflow:
        problems.append("the test output exceeded its size limit")
    workspace = settings["workspace"]
    out_dir = os.path.join(workspace, settings["out_dir"])
    clear_folder(out_dir)
    log = bytes(reader.data)
    result = {"exit_code": exit_code, "timed_out": timed_out, "report_sha256": None,
              "log_sha256": write_out(out_dir, "log.txt", log),
              "stream_problems": problems, "undumpable": undumpable,
              "seconds": round(time.monotonic() - start, 3),
              "changed_protected": changed_protected(workspace, settings["protected"])[:MAX_LISTED],
              "new_config_files": new_config_files(
                  workspace, settings["config_names"], settings["known_config_files"],
                  settings["skip_top_dirs"])[:MAX_LISTED],
              "log_tail": log[-LOG_TAIL_BYTES:].decode("utf-8", "replace")}
    sys.stdout.write(f"SLUICE-GRADE {settings['nonce']} {json.dumps(result)}\n")
    sys.stdout.flush()
    return 0


def verify_stream(data: bytes | bytearray, key: bytes, overflow: bool) -> tuple[list[dict], list[str]]:
    """The records whose authentication holds, in order, and every problem of the stream
    (a bad or unauthenticated line, a gap in the sequence, records after `finish`)."""
    records: list[dict] = []
    problems = ["the record stream exceeded its size limit"] if overflow else []
    finished = False
    for number, line in enumerate(bytes(data).split(b"\n")[:-1]):
        body, _, mac = line.rpartition(b" ")
        good = hmac.new(key, body, hashlib.sha256).hexdigest()[:MAC_HEX].encode()
        if not hmac.compare_digest(mac, good):
            problems.append(f"line {number} of the record stream fails authentication")
            continue
        record = json.loads(body)
        if record.get("s") != len(records):
            problems.append(f"record {record.get('s')} arrived as number {len(records)}")
        if finished:
            problems.append(f"record {record.get('s')} ({record.get('k')}) came after the end")
        finished = finished or record.get("k") == "finish"
        records.append(record)
    if data and not data.endswith(b"\n"):
        problems.append("the record stream ends inside a line")
    return records, problems


def runner_of(records: list) -> dict | None:
    """Which pytest ran: the stream's first record, written before any workspace file was
    importable (a later `runner` record, which the agent's code could forge, is ignored)."""
    if not records or records[0].get("k") != "runner":
        return None
    return {"version": str(records[0].get("version")), "source": str(records[0].get("source"))}


def kill_everything_else() -> None:
    """SIGKILL every process this uid can signal in this PID namespace except ourselves
    and init, then reap our own children."""
    for _ in range(3):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            break  # nobody else was left to signal
        time.sleep(0.05)  # a fork racing the kill gets another round
        _reap()
    _reap()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


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


def write_out(out_dir: str, name: str, data: bytes) -> str:
    with open(os.path.join(out_dir, name), "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def main() -> int:
    settings = json.loads(sys.stdin.read())
    if settings.get("command"):
        return command_main(settings)
    undumpable = make_undumpable()
    tmp = tempfile.mkdtemp(prefix="grade-")
    report, log_path = os.path.join(tmp, "report.xml"), os.path.join(tmp, "pytest.log")
    key = os.urandom(32)
    start = time.monotonic()
    exit_code, timed_out, reader = run_tests(settings, tmp, report, log_path, key)
    kill_everything_else()
    ended = reader.finish(timeout_s=5.0)
    records, stream_problems = verify_stream(reader.data, key, reader.overflow)
    if not ended:
        stream_problems.append("the record pipe stayed open after every process was killed")
    workspace = settings["workspace"]
    out_dir = os.path.join(workspace, settings["out_dir"])
    clear_folder(out_dir)
    data = read_regular(report, settings["max_report_bytes"])
    digest = None
    if data is not None and len(data) <= settings["max_report_bytes"]:
        digest = write_out(out_dir, "report.xml", data)
    stream = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
    log_tail = (read_regular(log_path, 1 << 26) or b"")[-LOG_TAIL_BYTES:]
    changed = changed_protected(workspace, settings["protected"])
    new_configs = new_config_files(workspace, settings["config_names"],
                                   settings["known_config_files"], settings["skip_top_dirs"])
    # Lists are cut so the line stays far below the exec's output cap.
    result = {"exit_code": exit_code, "timed_out": timed_out, "report_sha256": digest,
              "stream_sha256": write_out(out_dir, "records.jsonl", stream),
              "stream_problems": stream_problems[:MAX_LISTED],
              "undumpable": undumpable, "seconds": round(time.monotonic() - start, 3),
              "changed_protected": changed[:MAX_LISTED],
              "new_config_files": new_configs[:MAX_LISTED],
              "pytest": runner_of(records),
              "log_tail": log_tail.decode("utf-8", "replace")}
    sys.stdout.write(f"SLUICE-GRADE {settings['nonce']} {json.dumps(result)}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
