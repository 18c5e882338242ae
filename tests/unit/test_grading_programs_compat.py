"""The grading programs that run on the sandbox's Python (reward.grading.driver, reward.grading.boot,
reward.grading.recorder) stay within Python 3.8 and pytest 6.2 (only 3.11 exists here, so this
is what can be checked without an old interpreter: the 3.8 grammar, no newer standard-
library API by name, no new-style hook wrappers), and boot's choice of pytest: the
sandbox Python's own from 6.2 on, never one inside the workspace."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from reward.grading import boot, driver, recorder

PROGRAMS = (boot, driver, recorder)
# Standard-library API newer than Python 3.8, by the name code would use (a name in a
# string, as getattr(sys, "stdlib_module_names", ()), is fine).
NEWER_ATTRIBUTES = frozenset({"stdlib_module_names", "removeprefix", "removesuffix", "pairwise",
                              "lcm", "cache", "bit_count", "is_relative_to", "with_stem",
                              "to_thread", "orig_argv", "platlibdir"})
NEWER_MODULES = frozenset({"zoneinfo", "graphlib", "tomllib"})
NEWER_KEYWORDS = frozenset({"strict", "kw_only", "slots", "usedforsecurity"})
NEWER_NAMES = frozenset({"aiter", "anext"})


def newer_api(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in NEWER_ATTRIBUTES:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in NEWER_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in NEWER_MODULES:
                found.append(str(node.module))
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name in NEWER_ATTRIBUTES]
        elif isinstance(node, ast.keyword) and node.arg in NEWER_KEYWORDS:
            found.append(f"keyword {node.arg}=")
        elif isinstance(node, ast.Name) and node.id in NEWER_NAMES:
            found.append(node.id)
    return found


@pytest.mark.parametrize("module", PROGRAMS, ids=lambda m: m.__name__)
def test_program_is_python38_code(module: object) -> None:
    source = Path(module.__file__).read_text()  # type: ignore[attr-defined]
    tree = ast.parse(source, feature_version=(3, 8))  # walrus ok; match, except* not
    # Annotations (builtin generics, `X | None`) are never evaluated.
    assert "from __future__ import annotations" in source
    assert newer_api(tree) == []


def test_newer_api_is_found() -> None:
    code = ("import sys, tomllib\nfrom functools import cache\nsys.stdlib_module_names\n"
            "'x'.removeprefix('y')\nzip([], [], strict=True)\ngetattr(sys, 'stdlib_module_names')\n")
    assert len(newer_api(ast.parse(code))) == 5


def test_recorder_uses_old_style_hook_wrappers() -> None:
    """New-style `wrapper=True` needs pluggy 1.2; pytest 6.2 comes with pluggy 0.13."""
    tree = ast.parse(Path(recorder.__file__).read_text())
    keywords = [k.arg for k in ast.walk(tree) if isinstance(k, ast.keyword)]
    assert "wrapper" not in keywords and keywords.count("hookwrapper") == 2


def fake_pytest(site: Path, version_line: str) -> None:
    (site / "pytest").mkdir(parents=True)
    (site / "pytest" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (site / "_pytest").mkdir()
    (site / "_pytest" / "_version.py").write_text(version_line)


def choice(site: Path, workspace: Path) -> str:
    """What boot.image_pytest says for a Python whose only pytest is in `site`."""
    code = (f"import sys; sys.path[:] = [p for p in sys.path if 'packages' not in p]; "
            f"sys.path.insert(0, {str(site)!r}); sys.path.insert(0, {str(Path(boot.__file__).parent)!r}); "
            f"import boot; print(boot.image_pytest({str(workspace)!r}))")
    return subprocess.run([sys.executable, "-I", "-B", "-c", code], capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.parametrize(("line", "expected"), [
    ("__version__ = version = '7.4.4'\n", "7.4.4"),
    ("__version__: str\nversion: str\n__version__ = version = '9.2.0'\n", "9.2.0"),
    ("version = '6.2.5'\n", "6.2.5"),
    ("__version__ = version = '6.1.2'\n", "None"),  # older than the recorder supports
    ("nothing here\n", "None"),
])
def test_boot_takes_the_pythons_own_supported_pytest(tmp_path: Path, line: str,
                                                     expected: str) -> None:
    fake_pytest(tmp_path / "site", line)
    (tmp_path / "ws").mkdir()
    assert choice(tmp_path / "site", tmp_path / "ws") == expected


def test_boot_never_takes_the_workspaces_pytest(tmp_path: Path) -> None:
    """A pytest inside the workspace (an editable install of pytest's own repository, or
    the agent's) is graded code, never the runner: the bundled one runs."""
    fake_pytest(tmp_path / "ws" / "src", "__version__ = version = '8.0.0'\n")
    assert choice(tmp_path / "ws" / "src", tmp_path / "ws") == "None"
    assert boot.inside(str(tmp_path / "ws" / "src"), str(tmp_path / "ws"))
    assert not boot.inside(str(tmp_path / "wsx"), str(tmp_path / "ws"))
    assert boot.version_tuple("6.2.0rc1") == (6, 2) and boot.version_tuple("10.0") == (10, 0)
