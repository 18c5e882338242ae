"""Host-side preparation of a grading workspace: the task source plus the agent's changes,
with every test-related path reverted to the source's version, the test patch applied,
the hidden tests, a must-fail sentinel test and the grading driver added.

Nothing here runs the agent's code; it only writes files, on this host, into a fresh
folder that a fresh sandbox is then created from. Which paths count as test-related
(`is_protected`) is the core of hack resistance: the agent's versions of them are
dropped, so editing a test, adding a conftest.py or pytest config, planting bytecode or
a native module that would shadow a test module, or pre-planting files where the
hidden tests go has no effect on grading.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from envs.sandbox.base import Sandbox
from reward import driver as driver_module
from reward.runtime import pytest_runtime_zip
from reward.workspace import WorkspaceChanges
from envs.types import HIDDEN_TESTS_DIR, Task

GRADER_DIR = ".sluice_grading"  # grader-owned folder in the grading workspace
OUT_DIR = f"{GRADER_DIR}/out"  # where the driver leaves the report (sandbox-writable)
RUNTIME_ZIP = f"{GRADER_DIR}/pytest-runtime.zip"
DRIVER = f"{GRADER_DIR}/driver.py"
# Every file below a folder of one of these names is a test file (helpers included: a
# patched `assert_close` in tests/helpers.py would pass any test).
TEST_DIR_NAMES = frozenset({"tests", "test", "testing"})
# Files that configure pytest or run code at interpreter or pytest start-up.
CONFIG_NAMES = ("conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg",
                "pyproject.toml", "sitecustomize.py", "usercustomize.py")
# Bytecode, native modules and .pth files: each can stand in for (or hook) a module whose
# source looks untouched, so the agent's are never applied.
SHADOW_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".pth")


@dataclass(frozen=True, slots=True)
class ProtectionRules:
    """Which workspace paths are test-related; the agent's changes to them are dropped."""

    visible_tests_dir: str  # workspace folder the agent's tools copy the visible tests to
    patched: frozenset[str]  # files the test patch touches

    def is_protected(self, path: str) -> bool:
        *folders, name = path.split("/")
        if path in self.patched or (folders and folders[0] in (
                GRADER_DIR, HIDDEN_TESTS_DIR, self.visible_tests_dir)):
            return True
        # Test folders, bytecode caches, and installed-package metadata (whose
        # entry_points.txt could register a pytest plugin).
        if any(f in TEST_DIR_NAMES or f == "__pycache__" or f.endswith((".dist-info", ".egg-info"))
               for f in folders):
            return True
        is_test_file = name.endswith(".py") and (name.startswith("test_")
                                                 or name.endswith("_test.py"))
        return is_test_file or name in CONFIG_NAMES or name.endswith(SHADOW_SUFFIXES)


@dataclass(frozen=True, slots=True)
class Sentinel:
    """Two tests that must fail in every grading run: if the report says otherwise, the
    agent's code tampered with the test process. Names are random per run."""

    nonce: str

    @classmethod
    def new(cls) -> Sentinel:
        return cls(secrets.token_hex(6))

    @property
    def path(self) -> str:
        return f"{GRADER_DIR}/sentinel/test_g{self.nonce}.py"

    @property
    def node_ids(self) -> tuple[str, str]:
        return (f"{self.path}::test_a{self.nonce}", f"{self.path}::test_b{self.nonce}")

    def source(self) -> str:
        value = int(self.nonce, 16)
        return (f"def test_a{self.nonce}():\n    assert {value} == {value + 1}\n\n\n"
                f"def test_b{self.nonce}():\n    raise LookupError('{self.nonce}')\n")


@dataclass(frozen=True, slots=True)
class GradingLayout:
    """What the prepared folder holds, for the driver's checks and the lock."""

    test_args: tuple[str, ...]  # files or folders handed to pytest (sentinel last)
    protected: Mapping[str, str]  # path -> sha256 of files the test run must leave alone
    config_files: tuple[str, ...]  # config/start-up files present before the run
    has_conftest: bool
    num_reverted: int  # agent changes to protected paths that were dropped
    not_applied: tuple[str, ...]  # agent changes that could not be applied (through links)


def patched_paths(test_patch: str | None) -> frozenset[str]:
    """Files a unified diff touches (both sides of renames)."""
    found = set()
    for line in (test_patch or "").splitlines():
        if line.startswith("diff --git "):
            for token in line.split()[2:4]:
                found.add(token[2:] if token[:2] in ("a/", "b/") else token)
        elif line.startswith(("--- ", "+++ ")):
            token = line[4:].split("\t")[0].strip()
            if token != "/dev/null":
                found.add(token[2:] if token[:2] in ("a/", "b/") else token)
    return frozenset(found)


def build_grading_dir(task: Task, changes: WorkspaceChanges, dest: str, sentinel: Sentinel,
                      visible_tests_dir: str = "visible_tests") -> GradingLayout:
    """Fill the empty folder `dest` with the grading workspace (see the module docstring).
    `visible_tests_dir` is where the agent's tools put the task's visible tests."""
    if task.source_dir is not None:
        if not os.path.isdir(task.source_dir):
            raise ValueError(f"task {task.id!r}: source_dir {task.source_dir!r} is not a folder")
        shutil.copytree(task.source_dir, dest, symlinks=True, dirs_exist_ok=True)
    rules = ProtectionRules(visible_tests_dir=visible_tests_dir.strip("/"),
                            patched=patched_paths(task.test_patch))
    given = _given_files(task.visible_tests, rules.visible_tests_dir)
    num_reverted, not_applied = _apply_changes(dest, changes, rules, given)
    if task.test_patch:
        _apply_patch(task, dest)
    hidden = os.path.join(dest, HIDDEN_TESTS_DIR)
    if os.path.lexists(hidden):
        _remove(hidden)
    if task.hidden_tests is not None:
        if not os.path.isdir(task.hidden_tests):
            raise ValueError(f"task {task.id!r}: hidden_tests {task.hidden_tests!r} is not a "
                             "folder")
        shutil.copytree(task.hidden_tests, hidden, symlinks=False)
    _write_grader_files(dest, sentinel)
    config_files = _config_files(dest)
    test_args = _test_args(task, dest) + (sentinel.path,)
    # Every test-related file, not only the ones run: a helper module the tests import
    # later (tests/helpers.py) must not be rewritten by code that ran earlier.
    protected = {rel: _sha256(os.path.join(dest, rel))
                 for rel in sorted(set(_files_of(dest, test_args)) | set(config_files)
                                   | _protected_files(dest, rules) | {DRIVER, RUNTIME_ZIP})}
    return GradingLayout(test_args=test_args, protected=protected, config_files=config_files,
                         has_conftest=any(p.endswith("conftest.py") for p in config_files),
                         num_reverted=num_reverted, not_applied=not_applied)


def _given_files(visible_tests: str | None, visible_dir: str) -> dict[str, bytes]:
    """The visible tests as the agent's tools copied them into its workspace: present in
    every final workspace without being a change of the agent's."""
    if visible_tests is None or not os.path.isdir(visible_tests):
        return {}
    given = {}
    for dirpath, _, filenames in os.walk(visible_tests):
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, visible_tests).replace(os.sep, "/")
            if stat.S_ISREG(os.lstat(full).st_mode):
                with open(full, "rb") as f:
                    given[f"{visible_dir}/{rel}"] = f.read()
    return given


def _apply_changes(dest: str, changes: WorkspaceChanges, rules: ProtectionRules,
                   given: Mapping[str, bytes]) -> tuple[int, tuple[str, ...]]:
    """Apply the agent's changes except those to protected paths; returns how many of
    those were dropped (the given visible tests, unchanged, do not count) and the
    changes that could not be applied."""
    reverted, not_applied = 0, []
    for path in changes.deleted:
        if rules.is_protected(path):
            reverted += 1
        elif not _delete_inside(dest, path):
            not_applied.append(path)
    for path, data in sorted(changes.written.items()):
        if rules.is_protected(path):
            reverted += given.get(path) != data
        elif not _write_inside(dest, path, data):
            not_applied.append(path)
    return reverted, tuple(not_applied)


def _real_parent(root: str, path: str, create: bool) -> str | None:
    """Host path of `path`'s parent folder inside `root` if every component is a real
    folder (never a symlink), creating missing ones when asked; else None."""
    current = root
    for part in path.split("/")[:-1]:
        current = os.path.join(current, part)
        if not os.path.lexists(current):
            if not create:
                return None
            os.mkdir(current, 0o755)
        elif not stat.S_ISDIR(os.lstat(current).st_mode):
            return None
    return current


def _write_inside(root: str, path: str, data: bytes) -> bool:
    parent = _real_parent(root, path, create=True)
    if parent is None:
        return False
    target = os.path.join(parent, path.rsplit("/", 1)[-1])
    if os.path.lexists(target):
        mode = os.lstat(target).st_mode
        if stat.S_ISDIR(mode):
            return False
        os.unlink(target)  # a link or file of the source: the agent's regular file replaces it
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True


def _delete_inside(root: str, path: str) -> bool:
    parent = _real_parent(root, path, create=False)
    if parent is None:
        return False
    target = os.path.join(parent, path.rsplit("/", 1)[-1])
    if os.path.lexists(target) and not stat.S_ISDIR(os.lstat(target).st_mode):
        os.unlink(target)
    return True


def _apply_patch(task: Task, dest: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": dest, "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.abspath(dest))}
    proc = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=dest, env=env,
                          input=task.test_patch.encode() if task.test_patch else b"",
                          capture_output=True, check=False)
    if proc.returncode != 0:
        raise ValueError(f"task {task.id!r}: test_patch does not apply to the task source: "
                         f"{proc.stderr.decode(errors='replace').strip()}; regenerate it "
                         "against the base commit")


def _write_grader_files(dest: str, sentinel: Sentinel) -> None:
    grader = os.path.join(dest, GRADER_DIR)
    if os.path.lexists(grader):
        _remove(grader)
    os.makedirs(os.path.join(dest, OUT_DIR))
    os.makedirs(os.path.dirname(os.path.join(dest, sentinel.path)))
    shutil.copyfile(driver_module.__file__, os.path.join(dest, DRIVER))
    shutil.copyfile(pytest_runtime_zip(), os.path.join(dest, RUNTIME_ZIP))
    with open(os.path.join(dest, sentinel.path), "w") as f:
        f.write(sentinel.source())


def _test_args(task: Task, dest: str) -> tuple[str, ...]:
    """The test files of the expected node ids that exist (a missing file would make
    pytest refuse the whole run; its tests then count as missing), or the hidden folder."""
    ids = (*task.fail_to_pass, *task.pass_to_pass)
    if not ids:
        return (HIDDEN_TESTS_DIR,) if task.hidden_tests is not None else ()
    files = dict.fromkeys(node_id.split("::", 1)[0] for node_id in ids)
    return tuple(f for f in files if _real_parent(dest, f, create=False) is not None
                 and os.path.isfile(os.path.join(dest, f))
                 and not os.path.islink(os.path.join(dest, f)))


def _files_of(dest: str, args: Iterable[str]) -> list[str]:
    found = []
    for arg in args:
        full = os.path.join(dest, arg)
        if os.path.isfile(full):
            found.append(arg)
            continue
        for dirpath, _, filenames in os.walk(full):
            rel_dir = os.path.relpath(dirpath, dest)
            found += [f"{rel_dir}/{n}" for n in filenames
                      if stat.S_ISREG(os.lstat(os.path.join(dirpath, n)).st_mode)]
    return found


def _protected_files(dest: str, rules: ProtectionRules) -> set[str]:
    found = set()
    for dirpath, dirnames, filenames in os.walk(dest):
        rel_dir = os.path.relpath(dirpath, dest)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if rules.is_protected(rel) and not rel.startswith(OUT_DIR + "/") \
                    and stat.S_ISREG(os.lstat(os.path.join(dirpath, name)).st_mode):
                found.add(rel)
    return found


def _config_files(dest: str) -> tuple[str, ...]:
    found = []
    for dirpath, dirnames, filenames in os.walk(dest):
        rel_dir = os.path.relpath(dirpath, dest)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in (".git", GRADER_DIR)]
        for name in filenames:
            if name in CONFIG_NAMES or name.endswith(".pth"):
                found.append(name if rel_dir == "." else f"{rel_dir}/{name}")
    return tuple(sorted(found))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def lock_protected(sandbox: Sandbox, paths: Iterable[str]) -> bool:
    """Make `paths` and every folder above them root-owned and read-only for the sandbox's
    uid, so the test process can neither edit nor swap them (a folder's entries cannot be
    renamed or replaced without write access to it). Needs a backend whose workspace is
    a folder on this host (LocalSandbox) and root; returns False where that is not the
    case, and grading then relies on the driver's post-run checks alone."""
    workspace = getattr(sandbox, "workspace_dir", None)
    if not isinstance(workspace, str) or os.geteuid() != 0:
        return False
    folders = {""}
    for rel in paths:
        # Only through real folders: a source symlink must never lead a root chown outside.
        parent = _real_parent(workspace, rel, create=False)
        host = os.path.join(parent or "", rel.rsplit("/", 1)[-1])
        if parent is None or not os.path.lexists(host) or not stat.S_ISREG(os.lstat(host).st_mode):
            continue
        os.lchown(host, 0, 0)
        os.chmod(host, 0o444)
        parts = rel.split("/")[:-1]
        folders.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    for rel in folders:
        host = os.path.join(workspace, rel) if rel else workspace
        if stat.S_ISDIR(os.lstat(host).st_mode):
            os.lchown(host, 0, 0)
            os.chmod(host, 0o755)
    return True
