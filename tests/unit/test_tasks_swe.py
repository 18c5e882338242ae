"""The SWE-bench adapter: rows become Tasks whose source is the base commit's exact tree as
a fresh one-commit repository (no later commit, object or ref reachable), and malformed
rows are rejected with the row and field named."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from envs.tasks import load_tasks
from envs.tasks.swe import export_base_snapshot, is_git_repo
from git_repo import run_git




@pytest.fixture
def upstream(tmp_path: Path) -> tuple[Path, str, str]:
    """A repository with a base commit and a later fix commit: (path, base, fix)."""
    repo = tmp_path / "repos" / "demo__calc"
    (repo / "pkg").mkdir(parents=True)
    run_git(repo, "init", "-q", "-b", "main")
    (repo / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (repo / ".gitignore").write_text("build/\n*.log\n")
    (repo / ".gitattributes").write_text("pkg/mod.py export-ignore\n")  # must not drop it
    (repo / "run.log").write_text("tracked despite .gitignore\n")
    run_git(repo, "add", "-A", "-f")
    run_git(repo, "commit", "-q", "-m", "base")
    base = run_git(repo, "rev-parse", "HEAD").strip()
    (repo / "pkg" / "mod.py").write_text("VALUE = 2  # the fix\n")
    run_git(repo, "commit", "-q", "-am", "fix")
    run_git(repo, "tag", "v1")
    return repo, base, run_git(repo, "rev-parse", "HEAD").strip()


def swe_row(base: str, **over: object) -> dict:
    row = {"instance_id": "demo__calc-7", "repo": "demo/calc", "base_commit": base,
           "problem_statement": "VALUE should be 2.",
           "test_patch": "diff --git a/t/test_v.py b/t/test_v.py\n",
           "FAIL_TO_PASS": json.dumps(["t/test_v.py::test_value"]), "PASS_TO_PASS": "[]",
           "patch": "the gold patch, never used", "hints_text": "", "version": "1.0"}
    row.update(over)
    return row


def test_row_becomes_task_on_a_fresh_single_commit_repo(tmp_path: Path,
                                                         upstream: tuple[Path, str, str]) -> None:
    repo, base, fix = upstream
    (tmp_path / "swe.jsonl").write_text(json.dumps(swe_row(base)) + "\n")
    [task] = load_tasks(str(tmp_path / "swe.jsonl"), cache_dir=str(tmp_path / "cache"))
    src = Path(task.source_dir or "")
    assert task.id == "demo__calc-7" and task.reward_fn == "reward.grading.hidden_tests:HiddenTests"
    assert task.grading.fail_to_pass == ("t/test_v.py::test_value",) and task.grading.pass_to_pass == ()
    assert "VALUE should be 2." in task.messages[-1].content
    assert "gold patch" not in "".join(m.content for m in task.messages)
    assert (src / "pkg" / "mod.py").read_text() == "VALUE = 1\n"  # export-ignore ignored
    assert (src / "run.log").exists()  # tracked files stay, even if ignored
    assert is_git_repo(str(src))
    assert run_git(src, "rev-list", "--all").split() == [run_git(src, "rev-parse", "HEAD").strip()]
    assert run_git(src, "tag") == "" and run_git(src, "remote") == ""
    assert run_git(src, "status", "--porcelain") == ""
    with pytest.raises(subprocess.CalledProcessError):
        run_git(src, "cat-file", "-e", fix)
    with pytest.raises(subprocess.CalledProcessError):
        run_git(src, "cat-file", "-e", base)  # a new commit: not even the base's id leaks
    everything = run_git(src, "log", "--all", "-p") + "".join(
        p.read_text(errors="replace") for p in src.rglob("*") if p.is_file() and ".git" not in p.parts)
    assert "the fix" not in everything


def test_same_commit_is_exported_once(tmp_path: Path, upstream: tuple[Path, str, str]) -> None:
    repo, base, _ = upstream
    first = export_base_snapshot(str(repo), base, str(tmp_path / "c"), "x")
    assert export_base_snapshot(str(repo), base[:10], str(tmp_path / "c"), "x") == first


def test_plain_snapshot_folder_is_copied_without_its_git(tmp_path: Path) -> None:
    snap = tmp_path / "snap"
    (snap / "a").mkdir(parents=True)
    (snap / "a" / "x.py").write_text("X = 1\n")
    dest = export_base_snapshot(str(snap), None, str(tmp_path / "c"), "plain")
    assert (Path(dest) / "a" / "x.py").read_text() == "X = 1\n"
    assert len(run_git(Path(dest), "rev-list", "--all").split()) == 1


@pytest.mark.parametrize("over, message", [
    ({"base_commit": "0" * 40}, r"field 'base_commit': '0+' is not a commit of .*demo__calc; fetch it"),
    ({"base_commit": None}, r"field 'repo_dir': .* give the base_commit"),
    ({"FAIL_TO_PASS": "[]"}, r"field 'FAIL_TO_PASS': is empty"),
    ({"FAIL_TO_PASS": "not json"}, r"field 'FAIL_TO_PASS': must be a list"),
    ({"FAIL_TO_PASS": '["test_v.py"]'}, r"not a pytest node id"),
    ({"problem_statement": ""}, r"field 'problem_statement': must be a non-empty string"),
    ({"test_patch": None}, r"field 'test_patch': is required"),
    ({"repo_dir": "elsewhere"}, r"field 'repo_dir': folder .* does not exist"),
])
def test_bad_swe_rows(tmp_path: Path, upstream: tuple[Path, str, str], over: dict,
                      message: str) -> None:
    _, base, _ = upstream
    path = tmp_path / "swe.jsonl"
    path.write_text(json.dumps(swe_row(base, **over)) + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_tasks(str(path), "swe", cache_dir=str(tmp_path / "cache"))
    assert "swe.jsonl row 1" in str(info.value)
