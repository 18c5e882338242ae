"""`python -m envs.tasks.images build ROWS.jsonl` for real: one user row (a local git
repository, its base commit, no requirements) built into its task image with the real
container engine, the written rows loading as an image-only task whose image holds the
repository at the base commit at /testbed; a second run reuses every layer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from envs.tasks import load_tasks
from envs.tasks.images import swe_smith_image_name
from git_repo import CALC, calc_repo, run_git
from sandbox_probes import skip_without_container_engine

ROOT = Path(__file__).resolve().parents[2]
REPO = "demo/calc-images-cli"


@pytest.fixture
def user_rows(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A rows file with one row of a repository whose work tree has moved on past the
    base commit; (rows file, base commit). The task image is removed afterwards (the base
    and project layers stay cached)."""
    skip_without_container_engine()
    repo = tmp_path / "src" / "calc"
    base = calc_repo(repo)
    (repo / "calc.py").write_text(CALC.replace("a - b", "a + b"))
    run_git(repo, "commit", "-q", "-am", "fix")  # must not reach the image
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"instance_id": "calc-1", "repo": REPO, "base_commit": base,
                                "repo_dir": "src/calc", "problem_statement": "add() subtracts.",
                                "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
                                "PASS_TO_PASS": ["tests/test_calc.py::test_mul"],
                                "test_patch": "", "requirements": []}) + "\n")
    yield rows, base
    from envs.sandbox.engine import detect_engine, run_engine

    run_engine(detect_engine(), "rmi", "--force", "--ignore", swe_smith_image_name(REPO, base))


def build(rows: Path, out: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "envs.tasks.images", "build", str(rows),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    return proc, time.monotonic() - start


def test_one_row_builds_its_image_and_loads_as_an_image_only_task(
        user_rows: tuple[Path, str], tmp_path: Path) -> None:
    from envs.sandbox.images import image_workdir_source

    rows, base = user_rows
    out = tmp_path / "out"
    proc, first_s = build(rows, out)
    assert proc.returncode == 0, proc.stderr
    assert f"rows with their images: {out / 'tasks.jsonl'}" in proc.stdout
    image = swe_smith_image_name(REPO, base)
    [task] = load_tasks(str(out / "tasks.jsonl"))
    assert (task.id, task.image, task.workdir, task.source_dir) == ("calc-1", image, "/testbed", None)
    testbed = Path(image_workdir_source(image, "/testbed", str(tmp_path / "cache")))
    assert (testbed / "calc.py").read_text() == CALC  # the base commit, not the fix
    assert (testbed / "tests" / "test_calc.py").is_file()

    proc, again_s = build(rows, out)  # every layer exists: nothing is rebuilt
    assert proc.returncode == 0, proc.stderr
    assert "building" not in proc.stderr, proc.stderr
    print(f"one-row image build: {first_s:.1f} s, again {again_s:.1f} s")
