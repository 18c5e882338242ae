"""The static checks of the test command: ruff and pyrefly over the packages (their rules
in pyproject.toml) at zero findings, and every broad `except` saying on its line why it
must be broad (STYLE.md). A test rather than a Makefile step, so `make test-unit` runs it
too and, under pytest-xdist, it takes one worker for ~10 s beside the others instead of
running before the whole suite."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DENSITIES = REPO / "tests" / "bench" / "code_densities.py"


def _densities():
    spec = importlib.util.spec_from_file_location("code_densities", DENSITIES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing_in_the_packages():
    packages = _densities().PACKAGES
    done = _run(sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *packages)
    assert done.returncode == 0, f"ruff findings (fix them; rules in pyproject.toml):\n{done.stdout}{done.stderr}"


def test_pyrefly_finds_nothing_in_the_packages():
    # The packages come from [tool.pyrefly] project-includes; third-party types from this
    # interpreter's site-packages.
    done = _run(sys.executable, "-m", "pyrefly", "check", "--python-interpreter-path", sys.executable,
                "--output-format", "min-text", "--summary=none")
    findings = [line for line in done.stdout.splitlines() if line.lstrip().startswith(("ERROR", "WARN"))]
    assert done.returncode == 0 and not findings, (
        f"pyrefly findings (fix them; settings in pyproject.toml):\n{done.stdout}{done.stderr}")


def test_every_broad_except_says_why():
    densities = _densities()
    counts = densities.count_tree(REPO)
    assert counts.files > 0 and counts.broad_excepts > 0  # the scan saw the packages
    assert counts.unexplained == [], (
        "broad excepts without a reason on their line (say why it must be broad, or catch "
        "what can happen):\n" + "\n".join(counts.unexplained))
