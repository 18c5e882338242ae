"""The host side of the repository-runner path (rows graded by their own runner's output,
reward.grading.swebench_log): which workspace files the test command runs, so grading
protects them, and the mutation sentinels planted among the runner's tests.

Runner files: the scripts the command names (`tests/runtests.py`, `bin/test`,
`./runtests.py`, `python -m pkg.runner`, also after a `cd`), the module paths beside a
script that it imports (whether the source has them or not: one the agent adds there
would shadow), and the repository modules with a test-like name (`test`, `tests`,
`testing`, `runtests`, `runner` in the dotted name) the scripts import: the agent's
versions are dropped and the files hashed before and after the run
(reward.grading.prepare). One level of imports only: a runner's deeper imports are the
code under test itself (django's runtests.py imports django), which the agent must be
able to change; a runner that finds its modules by computed names or after changing
sys.path to other folders is protected only as far as those static imports show.

Mutation sentinels: reward.grading.sentinels' mutation sentinels, planted in the files of
the expected tests (unittest methods; the fail-to-pass ones first): each chosen test
becomes a group of itself and copies expecting a changed value, every member renamed
afresh, the original at a random place; ids are kept in the runner's form
(`name (module.Class)`), and the renamed originals are mapped back to the row's ids when
the output is read. A copy must fail wherever its original passes, so a run that reports
one passing (or skipped or missing while its original ran) was tampered with, whatever
the agent's code does to equality, the caller's assertion, the result class or the
runner's stream.

Where no expected test has an assertion to change, the pytest path's constant sentinels
(an always-false check of constants after a copied body) stand in: they catch a blanket
forgery, not one that reads each test's last assertion.

What remains: code that reads the test files sees the groups but not which member is
real (names and values are drawn alike), so a forgery that must pass the originals and
fail the copies guesses right with 1/(k+1) per group; none are planted where the command
names single tests (renaming would deselect them) or in a file whose test class another
test class derives from (renaming would rename the inherited tests), and only methods of
TestCase classes are copied (a sympy-style runner's test functions get none); tests in
other modules that inherit from an expected module's classes are not looked for.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import random
import re
import shlex
from collections.abc import Iterator

from envs.types import Task
from reward.grading.runner_log import unittest_key
from reward.grading.sentinels import (MUTANTS_PER_TASK, Collection, Planted, last_name,
                                      plant_mutation_sentinels, plant_sentinels)

_TEST_WORDS = frozenset({"test", "tests", "testing", "runtests", "runner", "testrunner"})
_SHELL_OPERATORS = frozenset({"&&", "||", ";", "|", "&"})
_PYTHONS = re.compile(r"^(?:.*/)?(?:python[\d.]*|coverage|env)$")


# --- the files the command runs --------------------------------------------------------

def runner_files(task: Task) -> frozenset[str]:
    """Workspace paths of the scripts `task.grading.test_command` runs and of the runner modules
    they import (see the module docstring); empty for a task without a command."""
    if task.grading.test_command is None:
        return frozenset()
    source = task.source_dir
    found: set[str] = set()
    for script in _command_scripts(task.grading.test_command, task.workdir or "/workspace"):
        found.add(script)
        if source is not None:
            found.update(_imported_runner_modules(source, script))
    return frozenset(found)


def _command_scripts(command: str, workdir: str) -> Iterator[str]:
    """Workspace-relative paths of the files the command names: arguments that look like
    paths, and the modules of `-m`, with the folder `cd` moved to."""
    for line in command.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # an unbalanced quote: the command fails the same way when run
        cwd, previous = "", ""
        for word in words:
            if word in _SHELL_OPERATORS:
                previous = ""
                continue
            if previous == "cd":
                cwd = _relative(word, cwd, workdir) or ""
            elif previous == "-m":
                yield _join(cwd, word.replace(".", "/") + ".py")
                yield _join(cwd, word.replace(".", "/") + "/__main__.py")
            elif ("/" in word or word.endswith(".py")) and not word.startswith("-") \
                    and not _PYTHONS.match(word):
                path = _relative(word.split("=", 1)[-1], cwd, workdir)
                if path:
                    yield path
            previous = word


def _relative(word: str, cwd: str, workdir: str) -> str | None:
    if word.startswith("/"):
        if not word.startswith(workdir.rstrip("/") + "/"):
            return None  # a system path (/usr/bin/python3): not the workspace's
        word = word[len(workdir.rstrip("/")) + 1:]
    path = os.path.normpath(_join(cwd, word))
    return None if path.startswith("..") or path == "." else path


def _join(cwd: str, *parts: str) -> str:
    return os.path.normpath(os.path.join(cwd, *parts)) if cwd else os.path.normpath(
        os.path.join(*parts))


def _imported_runner_modules(source: str, script: str) -> set[str]:
    """The runner modules `script` imports: beside it (a module the agent adds there
    would be imported in place of a missing one, so those paths count even where the
    source has no file), or test-named anywhere in the repository."""
    full = os.path.join(source, script)
    if not os.path.isfile(full) or os.path.islink(full):
        return set()
    try:
        with open(full, "rb") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, ValueError, OSError):
        return set()  # not Python (a shell script), or unreadable: itself protected only
    folder = os.path.dirname(script)
    found = set()
    for module in _imported_modules(tree):
        parts = module.split(".")
        if folder:  # a script at the top sits beside the code under test: not there
            found |= {_join(folder, *parts[:-1], f"{parts[-1]}.py"),
                      _join(folder, *parts, "__init__.py")}
        if _TEST_WORDS & set(parts) or any(p.startswith("test") for p in parts):
            rel = _module_file(source, os.path.join(*parts))
            found |= {rel} if rel else {os.path.join(*parts[:-1], f"{parts[-1]}.py")}
    return found


def _imported_modules(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names if a.name != "*")


def _module_file(source: str, dotted_path: str) -> str | None:
    for rel in (f"{dotted_path}.py", os.path.join(dotted_path, "__init__.py")):
        full = os.path.join(source, rel)
        if os.path.isfile(full) and not os.path.islink(full):
            return os.path.normpath(rel)
    return None


# --- mutation sentinels ------------------------------------------------------------------

def plant_runner_sentinels(task: Task, dest: str, rng: random.Random) -> Planted:
    """Mutation sentinels (reward.grading.sentinels.plant_mutation_sentinels) in the files
    of the task's expected unittest tests in the folder `dest`, with every id in the
    runner's form (`name (module.Class)`): the sentinels, and the real tests renamed
    beside them (runner id in the folder -> the row's id). None where the command names
    single tests (renaming would deselect them) or no expected test is a unittest one."""
    modules = _test_modules(task, dest)
    command = task.grading.test_command or ""
    if not modules or any(_method_of(i)[1] in command
                          for i in task.grading.expected_tests
                          if unittest_key(i) is not None):
        return Planted()
    paths = _without_base_classes(dest, {path: module for module, path in modules.items()})
    if not paths:
        return Planted()
    preferred = frozenset(f"{modules[m]}::{c}::{n}" for m, c, n in
                          map(_parts, task.grading.fail_to_pass) if m in modules)
    seen = {path: text for path in paths if (text := _text(task.source_dir, path)) is not None}
    # unittest runs the methods of TestCase classes only: no module-level functions.
    collection = Collection(functions=(), classes=())
    planted = plant_mutation_sentinels(dest, sorted(paths), rng, MUTANTS_PER_TASK,
                                       collection, preferred, seen)
    if not planted.sentinels:
        # No assertion to change: the constant sentinels, beside tests of those classes
        # only (one in a new file would not be run by the command's labels).
        constant = plant_sentinels(dest, sorted(paths), rng, rng.choice((2, 3)), collection)
        planted = Planted(tuple(c for c in constant if c.template_id is not None))
    runner_id = functools.partial(_runner_id, paths)
    return Planted(tuple(dataclasses.replace(s, node_id=runner_id(s.node_id),
                                             template_id=runner_id(s.template_id or ""))
                         for s in planted.sentinels),
                   {runner_id(new): _row_id(task, runner_id(old))
                    for new, old in planted.renamed.items()})


def _parts(test_id: str) -> tuple[str, str, str]:
    """(module, class, method) of a unittest description ('', '', '' if it is none)."""
    key = unittest_key(test_id)
    if key is None:
        return "", "", ""
    name, where = key[:-1].split(" (", 1)
    module, _, cls = where.rpartition(".")
    return module, cls, name


def _method_of(test_id: str) -> tuple[str, str]:
    return _parts(test_id)[1:]


def _test_modules(task: Task, dest: str) -> dict[str, str]:
    """Module -> its file in `dest`, for the modules of the expected tests (the shortest
    path ending like the module: runners put their test folder on sys.path)."""
    wanted = {m for m, _, _ in map(_parts, task.grading.expected_tests) if m}
    if not wanted:
        return {}
    files = _python_files(dest)
    found = {}
    for module in wanted:
        suffix = module.replace(".", "/") + ".py"
        matches = sorted((f for f in files if f == suffix or f.endswith("/" + suffix)), key=len)
        if matches:
            found[module] = matches[0]
    return found


def _without_base_classes(dest: str, paths: dict[str, str]) -> dict[str, str]:
    """`paths` less the files defining a class another test class derives from: renaming
    its test (beside its sentinels) would rename the inherited tests too, under ids the
    row does not know."""
    defined: dict[str, set[str]] = {}
    bases: set[str] = set()
    for path in paths:
        try:
            with open(os.path.join(dest, path), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            defined[path] = set()
            continue
        classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        defined[path] = {c.name for c in classes}
        bases |= {last_name(b) for c in classes for b in c.bases}
    return {p: m for p, m in paths.items() if not defined[p] & bases}


def _python_files(dest: str) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(dest):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel = os.path.relpath(dirpath, dest)
        found += [n if rel == "." else f"{rel}/{n}" for n in filenames if n.endswith(".py")]
    return found


def _text(source_dir: str | None, rel: str) -> str | None:
    full = os.path.join(source_dir or "", rel)
    if source_dir is None or not os.path.isfile(full):
        return None  # the test patch adds it: the agent never saw it
    try:
        with open(full, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _runner_id(paths: dict[str, str], node_id: str) -> str:
    """`path::Class::name` as the runner describes it: `name (module.Class)`."""
    path, cls, name = node_id.split("::")
    return f"{name} ({paths[path]}.{cls})"


def _row_id(task: Task, runner_id: str) -> str:
    """The row's own id of the test `runner_id` names (the row may use either form)."""
    key = unittest_key(runner_id)
    return next((i for i in task.grading.expected_tests if unittest_key(i) == key),
                runner_id)
