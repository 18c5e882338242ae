"""Host-side preparation of a grading workspace: the task source plus the agent's changes,
with every test-related path reverted to the source's version, then, independently of
those changes, the test patch's result, the hidden tests, the sentinels among them, the
grader's own pytest config and the grading programs (driver, start-up, recorder, runtime).

Nothing here runs the agent's code or any program in the folder: it only writes files,
on this host, into a fresh folder that a fresh sandbox is then created from (the test
patch is applied elsewhere, by reward.grading.patch). Which paths count as protected
(`ProtectionRules`) is the first line of hack resistance: the agent's versions of them
are dropped, so editing a test, adding a conftest.py or any file pytest reads config
from, planting bytecode, a native module or a module named like the standard library or
the runner, or pre-planting files where the hidden tests go has no effect on grading.
Test helpers beside the code that the trusted tests import (`pkg/_testing.py`, found by
reward.grading.import_graph) are protected the same way; the code under test never is.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import random
import shutil
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from envs.sandbox.base import WORKSPACE_MOUNT, Sandbox
from envs.sandbox.workspace import HostWorkspaceSandbox
from envs.types import HIDDEN_TESTS_DIR, Task
from reward.grading import boot as boot_module
from reward.grading import driver as driver_module
from reward.grading import recorder as recorder_module
from reward.grading.import_graph import support_modules, trusted_test_files
from reward.grading.patch import patched_files, patched_paths
from reward.grading.runner_config import (STARTUP_NAMES, SourceConfig, find_source_config,
                                  pytest_config_names, render_grader_config, shadow_names,
                                  source_module_names, top_level_modules)
from reward.grading.runner_tests import plant_runner_sentinels, runner_files
from reward.grading.runtime import pytest_runtime_zip
from reward.grading.sentinels import (MUTANTS_PER_TASK, Collection, Planted, Sentinel,
                                      plant_mutation_sentinels, plant_sentinels)
from reward.workspace import WorkspaceChanges

GRADER_DIR = ".sluice_grading"  # grader-owned folder in the grading workspace
OUT_DIR = f"{GRADER_DIR}/out"  # where the driver leaves the report (sandbox-writable)
RUNTIME_ZIP = f"{GRADER_DIR}/pytest-runtime.zip"
DRIVER = f"{GRADER_DIR}/driver.py"
BOOT = f"{GRADER_DIR}/boot.py"
RECORDER = f"{GRADER_DIR}/recorder.py"
GRADER_CONFIG = f"{GRADER_DIR}/pytest-grader.toml"  # the only config file pytest reads
# Every file below a folder of one of these names is a test file (helpers included: a
# patched `assert_close` in tests/helpers.py would pass any test).
TEST_DIR_NAMES = frozenset({"tests", "test", "testing"})
# Bytecode, native modules and .pth files: each can stand in for (or hook) a module whose
# source looks untouched, so the agent's are never applied.
SHADOW_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".pth")
_SYSTEM_RANDOM = random.SystemRandom()


@functools.cache
def config_names() -> tuple[str, ...]:
    """Files that configure pytest or run code at interpreter or pytest start-up."""
    return (*pytest_config_names(), *STARTUP_NAMES)


@dataclass(frozen=True, slots=True)
class ProtectionRules:
    """Which workspace paths are protected; the agent's changes to them are dropped."""

    visible_tests_dir: str  # workspace folder the agent's tools copy the visible tests to
    patched: frozenset[str]  # files the test patch touches
    import_roots: tuple[str, ...] = ("",)  # workspace folders on sys.path in the test run
    source_modules: frozenset[str] = frozenset()  # top-level modules the source defines there
    # Scripts a runner-graded task's command runs, and their runner modules
    # (reward.grading.runner_tests.runner_files): protected like tests.
    runner_files: frozenset[str] = frozenset()
    # Test helpers beside the code that the trusted tests import (reward.grading.import_graph)
    support: frozenset[str] = frozenset()

    def is_test_path(self, path: str) -> bool:
        """Tests, their helpers and data, and the folders of the visible and hidden tests
        and of the grader."""
        *folders, name = path.split("/")
        if path in self.patched or path in self.runner_files or path in self.support:
            return True
        if folders and folders[0] in (GRADER_DIR, HIDDEN_TESTS_DIR, self.visible_tests_dir):
            return True
        if any(f in TEST_DIR_NAMES for f in folders):
            return True
        return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))

    def shadows(self, path: str) -> bool:
        """A module named like the standard library or the runner, at an import root,
        that the task source does not itself define."""
        names = top_level_modules(path, self.import_roots) - self.source_modules
        return bool(names & shadow_names())

    def is_protected(self, path: str) -> bool:
        *folders, name = path.split("/")
        # Bytecode caches and installed-package metadata (whose entry_points.txt could
        # register a pytest plugin) count too.
        if any(f == "__pycache__" or f.endswith((".dist-info", ".egg-info")) for f in folders):
            return True
        return self.is_test_path(path) or name in config_names() \
            or name.endswith(SHADOW_SUFFIXES) or self.shadows(path)


def build_rules(task: Task, visible_tests_dir: str,
                source_config: SourceConfig | None) -> ProtectionRules:
    roots = tuple(dict.fromkeys(("", *(source_config.pythonpath_dirs if source_config else ()))))
    rules = ProtectionRules(visible_tests_dir=visible_tests_dir.strip("/"),
                            patched=patched_paths(task.grading.test_patch), import_roots=roots,
                            source_modules=source_module_names(task.source_dir, roots),
                            runner_files=runner_files(task))
    support = support_modules(task.source_dir, trusted_test_files(task), roots,
                              rules.is_test_path)
    return dataclasses.replace(rules, support=support)


@dataclass(frozen=True, slots=True)
class GradingLayout:
    """What the prepared folder holds, for the driver's checks and the lock."""

    test_args: tuple[str, ...]  # files or folders handed to pytest
    protected: Mapping[str, str]  # path -> sha256 of files the test run must leave alone
    config_files: tuple[str, ...]  # config/start-up files present before the run
    has_conftest: bool
    num_reverted: int  # agent changes to protected paths that were dropped
    not_applied: tuple[str, ...]  # agent changes that could not be applied (through links)
    sentinels: tuple[Sentinel, ...] = ()  # must-fail tests planted among the tests
    source_config: SourceConfig | None = None  # the source's pytest options, carried over
    rules: ProtectionRules | None = None
    # Real tests renamed in the folder (beside their mutation sentinels): folder node id
    # -> the test's own node id, mapped back when the run is read.
    renamed: Mapping[str, str] = field(default_factory=dict)


def build_grading_dir(task: Task, changes: WorkspaceChanges, dest: str,
                      visible_tests_dir: str = "visible_tests",
                      rng: random.Random = _SYSTEM_RANDOM,
                      workdir: str = WORKSPACE_MOUNT) -> GradingLayout:
    """Fill the empty folder `dest` with the grading workspace (see the module docstring).
    `visible_tests_dir` is where the agent's tools put the task's visible tests; `workdir`
    is where the grading sandbox will show `dest`."""
    if task.source_dir is not None:
        if not os.path.isdir(task.source_dir):
            raise ValueError(f"task {task.id!r}: source_dir {task.source_dir!r} is not a folder")
        shutil.copytree(task.source_dir, dest, symlinks=True, dirs_exist_ok=True)
    source_config = find_source_config(task.source_dir, tests_folder(task))
    rules = build_rules(task, visible_tests_dir, source_config)
    given = given_files(task.visible_tests, rules.visible_tests_dir)
    num_reverted, not_applied = _apply_changes(dest, changes, rules, given)
    _write_test_patch_result(task, dest)
    _copy_hidden_tests(task, dest)
    _write_grader_files(dest, render_grader_config(source_config, workdir))
    test_args = _test_args(task, dest)
    collection = Collection.from_options(source_config.values if source_config else {})
    # Must-fail sentinels; a task graded by its own runner's log gets its mutation
    # sentinels in the runner's id form (reward.grading.runner_tests).
    planted = plant_runner_sentinels(task, dest, rng) if task.grading.log_parser is not None else \
        _plant_sentinels(task, dest, _test_files(dest, test_args), rng, collection)
    sentinels = planted.sentinels
    test_args += tuple(dict.fromkeys(
        f for f in (s.node_id.split("::")[0] for s in sentinels if task.grading.log_parser is None)
        if not any(f == a or f.startswith(a.rstrip("/") + "/") for a in test_args)))
    config_files = _config_files(dest)
    # Every test-related file, not only the ones run: a helper module the tests import
    # later (tests/helpers.py) must not be rewritten by code that ran earlier.
    grader_files = {DRIVER, BOOT, RECORDER, RUNTIME_ZIP, GRADER_CONFIG}
    protected = {rel: _sha256(os.path.join(dest, rel))
                 for rel in sorted(set(_files_of(dest, test_args)) | set(config_files)
                                   | _protected_files(dest, rules) | grader_files)}
    return GradingLayout(test_args=test_args, protected=protected, config_files=config_files,
                         has_conftest=any(p.endswith("conftest.py") for p in config_files),
                         num_reverted=num_reverted, not_applied=not_applied,
                         sentinels=sentinels, source_config=source_config, rules=rules,
                         renamed=planted.renamed)


def _plant_sentinels(task: Task, dest: str, test_files: list[str], rng: random.Random,
                     collection: Collection) -> Planted:
    """Mutation sentinels (copies of the tests that must fail: reward.grading.sentinels),
    the fail-to-pass tests and the tests the agent never saw first; where no test has an
    assertion to change, 2 or 3 sentinels of constants instead."""
    seen = {f: text for f in test_files
            if (text := _source_text(task.source_dir, f)) is not None}
    preferred = frozenset(i.split("[", 1)[0] for i in task.grading.fail_to_pass)
    planted = plant_mutation_sentinels(dest, list(test_files), rng, MUTANTS_PER_TASK,
                                       collection, preferred, seen)
    if planted.sentinels:
        return planted
    return Planted(plant_sentinels(dest, test_files, rng, rng.choice((2, 3)), collection))


def _source_text(source_dir: str | None, rel: str) -> str | None:
    if source_dir is None or not os.path.isfile(os.path.join(source_dir, rel)):
        return None
    try:
        with open(os.path.join(source_dir, rel), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def tests_folder(task: Task) -> str:
    """Where the task's tests live (the common folder of the expected tests' files), from
    which pytest's config file is looked for upwards."""
    files = [i.split("::", 1)[0] for i in task.grading.expected_tests]
    if not files:
        return ""
    common = os.path.commonpath([os.path.dirname(f) or "." for f in files])
    return "" if common == "." else common


def given_files(visible_tests: str | None, visible_dir: str) -> dict[str, bytes]:
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


def _write_inside(root: str, path: str, data: bytes, mode: int = 0o644) -> bool:
    parent = _real_parent(root, path, create=True)
    if parent is None:
        return False
    target = os.path.join(parent, path.rsplit("/", 1)[-1])
    if os.path.lexists(target):
        if stat.S_ISDIR(os.lstat(target).st_mode):
            return False
        os.unlink(target)  # a link or file of the source: the agent's regular file replaces it
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
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


def _write_test_patch_result(task: Task, dest: str) -> None:
    """The test patch's files as reward.grading.patch computed them from the source, written over
    whatever is there (the agent's versions of these paths were dropped already)."""
    for rel, patched in patched_files(task).items():
        done = _delete_inside(dest, rel) if patched is None else _write_inside(
            dest, rel, patched.data, 0o755 if patched.executable else 0o644)
        if not done:
            raise ValueError(f"task {task.id!r}: test_patch touches {rel!r}, whose folder in "
                             "the task source is a symlink; test patches may only change "
                             "files in real folders")


def _copy_hidden_tests(task: Task, dest: str) -> None:
    hidden = os.path.join(dest, HIDDEN_TESTS_DIR)
    if os.path.lexists(hidden):
        _remove(hidden)
    if task.grading.hidden_tests is None:
        return
    if not os.path.isdir(task.grading.hidden_tests):
        raise ValueError(f"task {task.id!r}: hidden_tests {task.grading.hidden_tests!r} is not a folder")
    shutil.copytree(task.grading.hidden_tests, hidden, symlinks=False)


def _write_grader_files(dest: str, grader_config: str) -> None:
    grader = os.path.join(dest, GRADER_DIR)
    if os.path.lexists(grader):
        _remove(grader)
    os.makedirs(os.path.join(dest, OUT_DIR))
    for module, rel in ((driver_module, DRIVER), (boot_module, BOOT),
                        (recorder_module, RECORDER)):
        shutil.copyfile(module.__file__, os.path.join(dest, rel))  # type: ignore[arg-type]
    shutil.copyfile(pytest_runtime_zip(), os.path.join(dest, RUNTIME_ZIP))
    with open(os.path.join(dest, GRADER_CONFIG), "w") as f:
        f.write(grader_config)


def _test_args(task: Task, dest: str) -> tuple[str, ...]:
    """The test files of the expected node ids that exist (a missing file would make
    pytest refuse the whole run; its tests then count as missing), or the hidden folder."""
    ids = task.grading.expected_tests
    if task.grading.log_parser is not None:
        return ()  # the runner's ids are no paths; its command chooses what runs
    if not ids:
        return (HIDDEN_TESTS_DIR,) if task.grading.hidden_tests is not None else ()
    files = dict.fromkeys(node_id.split("::", 1)[0] for node_id in ids)
    return tuple(f for f in files if _real_parent(dest, f, create=False) is not None
                 and os.path.isfile(os.path.join(dest, f))
                 and not os.path.islink(os.path.join(dest, f)))


def _test_files(dest: str, test_args: tuple[str, ...]) -> list[str]:
    """The test modules pytest will collect from `test_args` (where sentinels may go):
    the files named, and the test_*.py files of the folders named."""
    found = []
    for arg in test_args:
        if os.path.isfile(os.path.join(dest, arg)):
            found.append(arg)
        else:
            found += [f for f in _files_of(dest, (arg,))
                      if f.rsplit("/", 1)[-1].startswith("test") and f.endswith(".py")]
    return sorted(set(found))


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
    names = set(config_names())
    for dirpath, dirnames, filenames in os.walk(dest):
        rel_dir = os.path.relpath(dirpath, dest)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in (".git", GRADER_DIR)]
        for name in filenames:
            if name in names or name.endswith(".pth"):
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
    a folder on this host (a HostWorkspaceSandbox: LocalSandbox, ContainerSandbox) and
    root; returns False where that is not the case, and grading then relies on the
    driver's post-run checks alone."""
    if not isinstance(sandbox, HostWorkspaceSandbox) or os.geteuid() != 0:
        return False
    workspace = sandbox.workspace_dir
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
