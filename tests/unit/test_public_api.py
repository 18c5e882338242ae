"""The public API for plug-ins (rollout.api): its names are snapshotted, each imports from
a package outside the repository as a user's would, a name that leaves it stays
reachable behind a warning, the old `rollout.types` path still works, and the guide and
the example package import from nowhere else."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rollout.api as api

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = Path(__file__).with_name("public_api.txt")
# What a plug-in may import besides rollout.api: the standard library, its own modules, and
# PIL (a dependency of sluice) to draw the images a tool returns.
ALLOWED_ROOTS = {"__future__", "asyncio", "dataclasses", "json", "re", "typing", "collections",
                 "examples", "rollout.api", "PIL"}


def test_the_public_names_are_the_snapshot():
    names = sorted({*api.__all__, *api.MOVED})
    assert names == SNAPSHOT.read_text().split(), (
        "rollout.api's names changed. A new name: add it to tests/unit/public_api.txt. A "
        "name that moved or was renamed: keep it in rollout.api.MOVED (a shim) for a release.")


def test_every_public_name_imports_in_a_package_outside_the_repository(tmp_path):
    package = tmp_path / "userplug"
    package.mkdir()
    names = SNAPSHOT.read_text().split()
    (package / "__init__.py").write_text(
        f"from rollout.api import {', '.join(names)}\n"
        f"assert all(x is not None for x in ({', '.join(names)},))\n")
    probe = textwrap.dedent("""
        import warnings
        import userplug
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from rollout.types import Task, Trajectory  # last round's path
        from rollout.api import Task as public
        assert Task is public
        assert [str(w.message).split(":")[0] for w in caught] == ["rollout.types moved"], caught
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_moved_name_is_served_with_one_warning(monkeypatch):
    monkeypatch.setitem(api.MOVED, "OldTask", "envs.types:Task")
    monkeypatch.setattr(api, "_warned", set())
    with pytest.warns(DeprecationWarning, match="rollout.api.OldTask moved to envs.types.Task"):
        old = api.OldTask  # type: ignore[attr-defined]
    assert old is api.Task
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        api.Missing  # type: ignore[attr-defined]  # noqa: B018


def _imported_modules(source: str) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(a.name for a in node.names)
    return modules


def _allowed(module: str) -> bool:
    return any(module == root or module.startswith(root + ".") for root in ALLOWED_ROOTS)


def test_the_guide_and_the_example_package_import_only_the_public_api():
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "examples").rglob("*.py")}
    guide = (ROOT / "docs" / "custom_agent.md").read_text()
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", guide, re.S)):
        sources[f"docs/custom_agent.md python block {i + 1}"] = block
    outside = {name: sorted(m for m in _imported_modules(src) if not _allowed(m))
               for name, src in sources.items()}
    assert {k: v for k, v in outside.items() if v} == {}
