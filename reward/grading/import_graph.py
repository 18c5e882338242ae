"""Test-support modules outside the test folders: the workspace modules that the trusted
test files import (directly, or through other test files and support modules) and that
are test helpers rather than the code under test, the way pandas keeps `pandas/_testing`
and scikit-learn `sklearn/utils/_testing.py`. reward.grading.prepare protects them like
test files (the task source's version grades; an agent's change is dropped and reported
as `hack_test_files`), since a no-op `assert_equal` there would pass every test.

Which modules: the import graph of the trusted test files (the hidden tests, the
expected tests' files as the test patch leaves them, the source's conftest.py files),
parsed with ast on the host and resolved against the task source at the import roots
(the workspace root, the config's `pythonpath`, and each test file's own first folder
without `__init__.py`, as pytest's default import mode puts it on sys.path); relative
imports resolve within the importing package. A module reached that way is support
when its own path says so (a folder or file named `testing`, `_testing`, `testutils`,
`test_helpers`, ...), or when it defines `assert_*` functions and imports a test
framework itself. Everything else the tests import (the package under test, its
`__init__`) is the code under test and is never protected, and the graph is not
followed through it.

What this does not know: which modules the task's fix touches (no gold patch reaches
grading). A row whose fix edits a support module would have its fix dropped: its gold
check (`python -m reward.validate`) then fails, which is where such a row is found. A
helper named like code and without `assert_*` functions is not found.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Callable, Mapping

from envs.types import HIDDEN_TESTS_DIR, Task
from reward.grading.patch import patched_files

# A path component (folder or file stem) that names test support.
SUPPORT_NAME = re.compile(r"(?:^|_)(?:tests?|testing|testutils?|testhelpers?|testlib|tester)"
                          r"(?:_|$)")
TEST_FRAMEWORKS = frozenset({"pytest", "unittest", "numpy.testing", "hypothesis", "nose"})
MAX_FILES = 2000  # a bound on the graph walk of one task


def trusted_test_files(task: Task) -> dict[str, str]:
    """The test files grading trusts, path -> text: the hidden tests, the expected tests'
    files as the test patch leaves them, and the source's conftest.py files above them."""
    found: dict[str, str] = {}
    if task.grading.hidden_tests is not None and os.path.isdir(task.grading.hidden_tests):
        for dirpath, _, names in os.walk(task.grading.hidden_tests):
            for name in names:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, task.grading.hidden_tests).replace(os.sep, "/")
                text = read_source(full) if name.endswith(".py") else None
                if text is not None:
                    found[f"{HIDDEN_TESTS_DIR}/{rel}"] = text
    if task.source_dir is None or task.grading.log_parser is not None:
        return found
    patched = patched_files(task)
    files = dict.fromkeys(i.split("::", 1)[0] for i in task.grading.expected_tests)
    for rel in files:
        if rel in patched:
            result = patched[rel]
            text = None if result is None else result.data.decode("utf-8", "replace")
        else:
            text = read_source(os.path.join(task.source_dir, rel))
        if text is not None:
            found[rel] = text
        folder = rel
        while folder:
            folder = os.path.dirname(folder)
            conftest = f"{folder}/conftest.py" if folder else "conftest.py"
            text = read_source(os.path.join(task.source_dir, conftest))
            if text is not None:
                found[conftest] = text
    return found


def support_modules(source_dir: str | None, trusted: Mapping[str, str],
                    import_roots: tuple[str, ...],
                    is_test_file: Callable[[str], bool] = lambda _: False) -> frozenset[str]:
    """Workspace paths of the support modules reached from the `trusted` files (path ->
    text); `import_roots` are the workspace folders on sys.path. Test files reached
    (`is_test_file(path)`: named or placed like tests) are walked too, not returned."""
    if source_dir is None:
        return frozenset()
    is_test = is_test_file
    found: set[str] = set()
    visited = set(trusted)
    queue = list(trusted.items())
    while queue and len(visited) < MAX_FILES:
        path, text = queue.pop()
        for module, level in imported_modules(text):
            for rel in resolve(source_dir, path, module, level, import_roots):
                if rel in visited:
                    continue
                visited.add(rel)
                code = read_source(os.path.join(source_dir, rel))
                if code is None:
                    continue
                if is_test(rel):
                    queue.append((rel, code))
                elif is_support(rel, code):
                    found.add(rel)
                    queue.append((rel, code))
    return frozenset(found)


def imported_modules(text: str) -> list[tuple[str, int]]:
    """(dotted name, relative level) of every import in `text`, at any depth; for
    `from a import b` both `a` and `a.b` (b may be a module)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            out.append((base, node.level))
            out += [(f"{base}.{alias.name}" if base else alias.name, node.level)
                    for alias in node.names if alias.name != "*"]
    return out


def resolve(source_dir: str, importer: str, module: str, level: int,
            import_roots: tuple[str, ...]) -> list[str]:
    """Workspace files (source files, package `__init__.py`s) that importing `module`
    from `importer` may load, every package on the way included."""
    if level:
        package = importer.split("/")[:-1]
        if level > 1:
            package = package[:-(level - 1)] if level - 1 <= len(package) else None
        if package is None:
            return []
        bases = ["/".join(package)]
        parts = module.split(".") if module else []
    else:
        bases = [*import_roots, _first_folder_without_init(source_dir, importer)]
        parts = module.split(".")
    found = []
    for base in dict.fromkeys(bases):
        prefix = f"{base}/" if base else ""
        for i in range(1, len(parts) + 1):
            stem = prefix + "/".join(parts[:i])
            for rel in (f"{stem}.py", f"{stem}/__init__.py"):
                if os.path.isfile(os.path.join(source_dir, rel)):
                    found.append(rel)
    return found


def _first_folder_without_init(source_dir: str, path: str) -> str:
    """The folder pytest's default (prepend) import mode puts on sys.path for a test
    file: the first one upwards that is not a package."""
    folder = os.path.dirname(path)
    while folder and os.path.isfile(os.path.join(source_dir, folder, "__init__.py")):
        folder = os.path.dirname(folder)
    return folder


def is_support(path: str, text: str) -> bool:
    """A module that is test support by its path, or by defining assertion helpers while
    importing a test framework."""
    parts = path.split("/")
    stems = [*parts[:-1], parts[-1].rsplit(".", 1)[0]]
    if any(SUPPORT_NAME.search(s) for s in stems if s != "__init__"):
        return True
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    asserts = any(isinstance(n, ast.FunctionDef) and n.name.startswith("assert")
                  for n in tree.body)
    frameworks = {m for m, _ in imported_modules(text)} & TEST_FRAMEWORKS
    return asserts and bool(frameworks)


def read_source(path: str) -> str | None:
    """A text file's contents, or None where it cannot be read as UTF-8."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None
