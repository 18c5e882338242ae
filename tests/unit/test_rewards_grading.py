"""Hidden-test grading without a sandbox: which paths count as test-related, how the
grading folder is assembled from the source and the agent's changes, how the driver's
line is read, and how a run becomes a reward (tampering and broken runs score 0)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from reward.grading import (DRIVER, GRADER_DIR, OUT_DIR, RUNTIME_ZIP, GradingLayout,
                            ProtectionRules, Sentinel, build_grading_dir, patched_paths)
from reward.junit import parse_junit
from reward.tests import DriverResult, GradingRun, parse_driver_line, score_run
from reward.workspace import WorkspaceChanges
from envs.types import HIDDEN_TESTS_DIR, Message, Task

PATCH = """diff --git a/tests/test_core.py b/tests/test_core.py
--- a/tests/test_core.py
+++ b/tests/test_core.py
@@ -1,2 +1,5 @@
 def test_old():
     assert True
+
+def test_new():
+    assert False
"""


@pytest.mark.parametrize("path, protected", [
    ("pkg/core.py", False), ("README.md", False), ("pkg/testing_utils.py", False),
    ("pkg/testing/asserts.py", True), ("pkg/tests.py", False),
    ("tests/helpers.py", True), ("pkg/test/data.json", True), ("test_x.py", True),
    ("pkg/x_test.py", True), ("conftest.py", True), ("deep/a/conftest.py", True),
    ("pytest.ini", True), ("pyproject.toml", True), ("setup.cfg", True), ("tox.ini", True),
    ("sitecustomize.py", True), ("x.pth", True), ("pkg/__pycache__/core.cpython-311.pyc", True),
    ("pkg/core.cpython-311-x86_64-linux-gnu.so", True), ("pkg/core.pyc", True),
    ("site/evil-1.0.dist-info/entry_points.txt", True), (f"{HIDDEN_TESTS_DIR}/test_h.py", True),
    (f"{GRADER_DIR}/out/report.xml", True), ("visible_tests/test_v.py", True),
    ("other/patched.py", True),
])
def test_protected_paths(path: str, protected: bool) -> None:
    rules = ProtectionRules(visible_tests_dir="visible_tests",
                            patched=frozenset({"other/patched.py"}))
    assert rules.is_protected(path) is protected


def test_patched_paths() -> None:
    assert patched_paths(PATCH) == {"tests/test_core.py"}
    plain = "--- a/x.py\t2020\n+++ b/y.py\n--- /dev/null\n+++ b/new.py\n"
    assert patched_paths(plain) == {"x.py", "y.py", "new.py"}
    assert patched_paths(None) == frozenset()


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "tests").mkdir()
    (src / "pkg" / "core.py").write_text("X = 1\n")
    (src / "tests" / "test_core.py").write_text("def test_old():\n    assert True\n")
    (src / "tests" / "helpers.py").write_text("def check(x):\n    assert x\n")
    (src / "conftest.py").write_text("# repo conftest\n")
    os.symlink("/etc", src / "etc_link")  # a source symlink pointing out of the tree
    return src


def make_task(source: Path, hidden: Path | None = None, **over: object) -> Task:
    fields = dict(source_dir=str(source), test_patch=PATCH,
                  fail_to_pass=("tests/test_core.py::test_new",),
                  pass_to_pass=("tests/test_core.py::test_old",))
    if hidden is not None:
        fields["hidden_tests"] = str(hidden)
    fields.update(over)
    return Task("t", (Message("user", "fix"),), **fields)  # type: ignore[arg-type]


def test_grading_dir_reverts_tests_and_applies_patch(tmp_path: Path, source: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_h.py").write_text("def test_h():\n    pass\n")
    changes = WorkspaceChanges(
        written={"pkg/core.py": b"X = 2\n", "pkg/new.py": b"N = 1\n",
                 "tests/test_core.py": b"def test_new():\n    assert True\n",
                 "conftest.py": b"# hooked\n", "pkg/conftest.py": b"# new\n",
                 "pkg/__pycache__/core.cpython-311.pyc": b"\x00",
                 f"{HIDDEN_TESTS_DIR}/test_h.py": b"def test_h():\n    pass  # planted\n",
                 f"{GRADER_DIR}/out/report.xml": b"<fake/>",
                 "etc_link/passwd": b"root::0:0::/:/bin/sh\n"},
        deleted=("pkg/gone.py", "tests/test_core.py", "etc_link/hosts"))
    dest = tmp_path / "dest"
    dest.mkdir()
    sentinel = Sentinel("abc123")
    layout = build_grading_dir(make_task(source, hidden), changes, str(dest), sentinel)
    assert (dest / "pkg" / "core.py").read_text() == "X = 2\n"
    assert (dest / "pkg" / "new.py").read_text() == "N = 1\n"
    patched = (source / "tests" / "test_core.py").read_text() + "\ndef test_new():\n    assert False\n"
    assert (dest / "tests" / "test_core.py").read_text() == patched
    assert (dest / "conftest.py").read_text() == "# repo conftest\n"
    assert not (dest / "pkg" / "conftest.py").exists() and not (dest / "pkg" / "__pycache__").exists()
    assert (dest / HIDDEN_TESTS_DIR / "test_h.py").read_text() == "def test_h():\n    pass\n"
    assert not (dest / OUT_DIR / "report.xml").exists()
    assert os.path.islink(dest / "etc_link")  # nothing was written or deleted through it
    assert layout.not_applied == ("etc_link/hosts", "etc_link/passwd")
    assert layout.num_reverted == 7
    assert layout.test_args == ("tests/test_core.py", sentinel.path)
    assert layout.has_conftest and layout.config_files == ("conftest.py",)
    assert set(layout.protected) == {"tests/test_core.py", "tests/helpers.py", sentinel.path,
                                     "conftest.py", f"{HIDDEN_TESTS_DIR}/test_h.py", DRIVER,
                                     RUNTIME_ZIP}
    for rel, digest in layout.protected.items():
        assert hashlib.sha256((dest / rel).read_bytes()).hexdigest() == digest
    assert "assert 11256099 == 11256100" in (dest / sentinel.path).read_text()


def test_grading_dir_without_test_ids_runs_the_hidden_folder(tmp_path: Path, source: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_h.py").write_text("def test_h():\n    pass\n")
    task = make_task(source, hidden, test_patch=None, fail_to_pass=(), pass_to_pass=())
    dest = tmp_path / "dest"
    dest.mkdir()
    layout = build_grading_dir(task, WorkspaceChanges(), str(dest), Sentinel("00ff"))
    assert layout.test_args == (HIDDEN_TESTS_DIR, Sentinel("00ff").path)
    assert f"{HIDDEN_TESTS_DIR}/test_h.py" in layout.protected


def test_a_test_patch_that_does_not_apply_is_a_task_error(tmp_path: Path, source: Path) -> None:
    task = make_task(source, test_patch=PATCH.replace("assert True\n+", "assert Maybe\n+"))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(ValueError, match="test_patch does not apply"):
        build_grading_dir(task, WorkspaceChanges(), str(dest), Sentinel("01"))


# --- from a run to a reward ---------------------------------------------------------

SENTINEL = Sentinel("0a0b0c")
LAYOUT = GradingLayout(test_args=(), protected={}, config_files=(), has_conftest=False,
                       num_reverted=2, not_applied=())


def junit(cases: dict[str, str]) -> bytes:
    """A report from node id -> passed/failed/error/skipped."""
    from reward.junit import junit_key

    body = ""
    for node_id, outcome in cases.items():
        classname, name = junit_key(node_id)
        child = "" if outcome == "passed" else f"<{'failure' if outcome == 'failed' else outcome}/>"
        body += f'<testcase classname="{classname}" name="{name}">{child}</testcase>'
    return f"<testsuites><testsuite>{body}</testsuite></testsuites>".encode()


def run_of(cases: dict[str, str], sentinel: str = "failed", exit_code: int | None = 1,
           **driver: object) -> GradingRun:
    cases = {**cases, **{i: sentinel for i in SENTINEL.node_ids}}
    fields = dict(exit_code=exit_code, timed_out=False, report_sha256="x", changed_protected=(),
                  new_config_files=(), log_tail="tail")
    fields.update(driver)
    driver_result = DriverResult(**fields)  # type: ignore[arg-type]
    return GradingRun(driver_result, parse_junit(junit(cases)), "", LAYOUT, True)


TASK = Task("t", (Message("user", "x"),), source_dir="/s", fail_to_pass=("a.py::f1", "a.py::f2"),
            pass_to_pass=("a.py::p1",))


def test_all_passing_scores_one() -> None:
    result = score_run(TASK, run_of({"a.py::f1": "passed", "a.py::f2": "passed",
                                     "a.py::p1": "passed"}), SENTINEL, partial_credit=False)
    assert result.reward == 1.0
    assert result.components == {"tamper_detected": 0.0, "grading_error": 0.0, "locked": 1.0,
                                 "reverted_changes": 2.0, "tests_passed_frac": 1.0,
                                 "all_passed": 1.0, "num_tests": 3.0, "fail_to_pass_frac": 1.0,
                                 "pass_to_pass_frac": 1.0}


def test_missing_and_failing_tests() -> None:
    run = run_of({"a.py::f1": "passed", "a.py::p1": "skipped"})
    binary = score_run(TASK, run, SENTINEL, partial_credit=False)
    partial = score_run(TASK, run, SENTINEL, partial_credit=True)
    assert binary.reward == 0.0 and partial.reward == pytest.approx(1 / 3)
    assert binary.components["fail_to_pass_frac"] == 0.5
    assert binary.components["pass_to_pass_frac"] == 0.0
    assert "a.py::f2 (missing)" in binary.detail and "a.py::p1 (skipped)" in binary.detail


@pytest.mark.parametrize("run, why", [
    (run_of({"a.py::f1": "passed"}, sentinel="passed"), "sentinel test was reported passed"),
    (run_of({"a.py::f1": "passed"}, sentinel="skipped"), "sentinel test was reported skipped"),
    (run_of({"a.py::f1": "passed"}, exit_code=0), "exited 0"),
    (run_of({}, changed_protected=("tests/t.py",)), "protected files changed"),
    (run_of({}, new_config_files=("pkg/conftest.py",)), "config/startup files appeared"),
    (GradingRun(run_of({}).driver, parse_junit(junit({"a.py::f1": "passed"})), "", LAYOUT, True),
     "sentinel tests are missing from the report of a completed run"),
])
def test_tampering_scores_zero(run: GradingRun, why: str) -> None:
    all_pass = {"a.py::f1": "passed", "a.py::f2": "passed", "a.py::p1": "passed"}
    assert score_run(TASK, run_of(all_pass), SENTINEL, True).reward == 1.0
    result = score_run(TASK, run, SENTINEL, partial_credit=True)
    assert result.reward == 0.0 and result.components["tamper_detected"] == 1.0
    assert why in result.detail


def test_broken_runs_score_zero_as_grading_errors() -> None:
    ok = {"a.py::f1": "passed", "a.py::f2": "passed", "a.py::p1": "passed"}
    interrupted = GradingRun(run_of(ok, exit_code=2).driver, parse_junit(junit(ok)), "", LAYOUT,
                             True)  # e.g. KeyboardInterrupt before the sentinels ran
    runs = [GradingRun(None, None, "grading timed out", LAYOUT, True),
            run_of(ok, timed_out=True), run_of(ok, exit_code=2), interrupted,
            GradingRun(run_of(ok).driver, None, "pytest wrote no JUnit report", LAYOUT, False)]
    for run in runs:
        result = score_run(TASK, run, SENTINEL, partial_credit=True)
        assert result.reward == 0.0 and result.components["grading_error"] == 1.0, result.detail


def test_hidden_folder_mode_counts_collection_errors() -> None:
    task = Task("t", (Message("user", "x"),), hidden_tests="/h")
    cases = {f"{HIDDEN_TESTS_DIR}/test_a.py::test_1": "passed"}
    report = junit({**cases, **{i: "failed" for i in SENTINEL.node_ids}}).replace(
        b"</testsuite>", f'<testcase classname="" name="{HIDDEN_TESTS_DIR}.test_b">'
        f'<error message="collection failure"/></testcase></testsuite>'.encode())
    run = GradingRun(run_of({}).driver, parse_junit(report), "", LAYOUT, True)
    result = score_run(task, run, SENTINEL, partial_credit=True)
    assert result.reward == 0.5 and result.components["num_tests"] == 2.0


def test_driver_line_parsing() -> None:
    payload = {"exit_code": 1, "timed_out": False, "report_sha256": "ab", "changed_protected": [],
               "new_config_files": [], "log_tail": "x", "undumpable": True, "seconds": 0.1}
    line = f"SLUICE-GRADE n1 {json.dumps(payload)}"
    assert parse_driver_line(f"noise\n{line}\n", "n1") == DriverResult(1, False, "ab", (), (), "x")
    assert parse_driver_line(line, "other-nonce") is None
    assert parse_driver_line(f"{line}\n{line}", "n1") is None  # exactly one line is trusted
    assert parse_driver_line("SLUICE-GRADE n1 {not json", "n1") is None
