"""`python -m reward.validate` through the real grading path (LocalSandbox, the trusted
driver): a good row is valid, a row whose gold patch fixes nothing and a row whose
FAIL_TO_PASS test already passes are not, the valid rows are written out, and a rerun
resumes from the state file without grading again."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from git_repo import CALC, calc_repo, run_git
from reward.grading.validate import format_table, main, validate_file

FIXED = CALC.replace("a - b", "a + b")
NOT_FIXED = CALC.replace("    return a * b", "    # a comment changes nothing\n    return a * b")


def diff_to(repo: Path, text: str) -> str:
    """The patch that turns calc.py at HEAD into `text`."""
    (repo / "calc.py").write_text(text)
    patch = run_git(repo, "diff")
    (repo / "calc.py").write_text(CALC)
    return patch


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("grading sandboxes need root and bubblewrap")
    repo = tmp_path / "repos" / "demo__calc"
    base = calc_repo(repo)

    def row(name: str, patch: str, f2p: str) -> dict:
        # SWE-smith's shape: the repository's own tests, no test patch.
        return {"instance_id": name, "repo": "demo/calc", "base_commit": base, "patch": patch,
                "test_patch": "", "FAIL_TO_PASS": json.dumps([f2p]),
                "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_mul"]
                                           if f2p.endswith("add") else []),
                "problem_statement": "add() subtracts."}

    fix, no_fix = diff_to(repo, FIXED), diff_to(repo, NOT_FIXED)
    rows = [row("good", fix, "tests/test_calc.py::test_add"),
            row("gold_fixes_nothing", no_fix, "tests/test_calc.py::test_add"),
            row("f2p_passes_already", fix, "tests/test_calc.py::test_mul")]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_validate_grades_gold_and_empty_patches_and_resumes(task_file: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str],
                                                            ) -> None:
    import asyncio

    out, state = tmp_path / "valid.jsonl", tmp_path / "state.jsonl"
    verdicts = asyncio.run(validate_file(str(task_file), workers=2, repeat=1, out=str(out),
                                         state=str(state), timeout_s=120,
                                         cache_dir=str(tmp_path / "cache")))
    by_id = {v.instance_id: v for v in verdicts}
    good = by_id["good"]
    assert good.valid and good.gold_passed == 1 and good.empty_failed == 1, good
    assert good.grader == "pytest-driver" and len(good.grade_s) == 2 and not good.flaky_tests
    assert not by_id["gold_fixes_nothing"].valid
    assert "gold patch leaves tests not passing" in by_id["gold_fixes_nothing"].reason
    assert "tests/test_calc.py::test_add" in by_id["gold_fixes_nothing"].reason
    assert not by_id["f2p_passes_already"].valid
    assert "wrong outcome" in by_id["f2p_passes_already"].reason
    assert [json.loads(line)["instance_id"] for line in out.read_text().splitlines()] == ["good"]
    progress = capsys.readouterr().err
    assert "[3/3]" in progress and "good: valid" in progress
    assert "1/3 valid" in format_table(verdicts)

    # Resume: every row is in the state file, so nothing is graded again (the exit code
    # says not all rows are valid).
    assert len(state.read_text().splitlines()) == 3
    assert main([str(task_file), "--state", str(state), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "1/3 valid" in printed and len(state.read_text().splitlines()) == 3


def test_unloadable_and_patchless_rows_are_reported_not_graded(tmp_path: Path) -> None:
    import asyncio

    rows = [{"instance_id": "django__django-1", "repo": "django/django", "patch": "x",
             "problem_statement": "p", "image_name": "img",
             "FAIL_TO_PASS": ["test_x (admin.tests.T)"]},
            {"instance_id": "smith-1", "repo": "a/b", "patch": "diff", "problem_statement": "p",
             "image_name": "img", "FAIL_TO_PASS": ["t.py::test_a"]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    verdicts = asyncio.run(validate_file(str(path), state=str(tmp_path / "s.jsonl"),
                                         cache_dir=str(tmp_path / "c")))
    assert [v.valid for v in verdicts] == [False, False]
    assert "unsupported" in verdicts[0].reason and "not a pytest node id" in verdicts[0].reason
    # An image-only row is graded in its image, which is nowhere here: the reason names it
    # (or says that no container engine runs here).
    assert "'img'" in verdicts[1].reason or "container engine" in verdicts[1].reason


def test_grade_scores_a_folder_or_a_patch_against_one_row(task_file: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m reward.grade ROW_ID --tasks ROWS --workspace DIR_OR_PATCH`: the row's own
    reward function in a fresh grading sandbox, reward and components printed."""
    from reward.grading.grade import main as grade_main

    repo = tmp_path / "repos" / "demo__calc"
    patch = tmp_path / "fix.diff"
    patch.write_text(diff_to(repo, FIXED))
    assert grade_main(["good", "--tasks", str(task_file), "--workspace", str(patch)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("task good: reward 1 (reward.grading.hidden_tests:HiddenTests)")
    assert "  all_passed = 1" in printed and "  tamper_detected = 0" in printed

    workspace = tmp_path / "left_as_is"
    shutil.copytree(repo, workspace, ignore=shutil.ignore_patterns(".git"))
    assert grade_main(["good", "--tasks", str(task_file), "--workspace", str(workspace)]) == 0
    assert capsys.readouterr().out.startswith("task good: reward 0 ")

    assert grade_main(["nope", "--tasks", str(task_file), "--workspace", str(patch)]) == 2
    assert "error: no row 'nope' in " in capsys.readouterr().err
