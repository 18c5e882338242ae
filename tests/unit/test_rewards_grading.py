"""Hidden-test grading without a sandbox: which paths count as test-related, how the
grading folder is assembled from the source and the agent's changes, how the driver's
line is read, and how a run (the JUnit report and the recorder's stream) becomes a reward:
tampering, disagreeing accounts and broken runs score 0."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import pytest

from reward.grading.crosscheck import build_account
from reward.grading.prepare import (BOOT, DRIVER, GRADER_CONFIG, GRADER_DIR, OUT_DIR, RECORDER,
                            RUNTIME_ZIP, GradingLayout, ProtectionRules, build_grading_dir)
from reward.grading.junit import parse_junit
from reward.grading.patch import patched_paths
from reward.grading.sentinels import Sentinel
from reward.grading.hidden_tests import DriverResult, GradingRun, parse_driver_line, score_run
from reward.workspace import WorkspaceChanges
from envs.types import HIDDEN_TESTS_DIR, GradingSpec, Message, Task

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
    ("other/patched.py", True), ("pytest.toml", True), (".pytest.toml", True),
    (".pytest.ini", True), ("json.py", True), ("faulthandler.py", True), ("xml/__init__.py", True),
    ("pluggy/__init__.py", True), ("_pytest/runner.py", True), ("pkg/json.py", False),
    ("src/json.py", True), ("mine.py", False), ("types_extra.py", False), ("calendar.py", False),
])
def test_protected_paths(path: str, protected: bool) -> None:
    # The source defines a top-level `calendar` module itself; src/ is on sys.path.
    rules = ProtectionRules(visible_tests_dir="visible_tests",
                            patched=frozenset({"other/patched.py"}), import_roots=("", "src"),
                            source_modules=frozenset({"calendar"}))
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
    """A task on `source` whose grading spec has `over` in place of the defaults below."""
    fields = dict(test_patch=PATCH, fail_to_pass=("tests/test_core.py::test_new",),
                  pass_to_pass=("tests/test_core.py::test_old",))
    if hidden is not None:
        fields["hidden_tests"] = str(hidden)
    fields.update(over)
    return Task("t", (Message("user", "fix"),), source_dir=str(source),
                grading=GradingSpec(**fields))  # type: ignore[arg-type]


def test_grading_dir_reverts_tests_and_applies_patch(tmp_path: Path, source: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_h.py").write_text("def test_h():\n    pass\n")
    changes = WorkspaceChanges(
        written={"pkg/core.py": b"X = 2\n", "pkg/new.py": b"N = 1\n",
                 "tests/test_core.py": b"def test_new():\n    assert True\n",
                 "conftest.py": b"# hooked\n", "pkg/conftest.py": b"# new\n",
                 "pkg/__pycache__/core.cpython-311.pyc": b"\x00",
                 "pytest.toml": b"[pytest]\naddopts = ['-p', 'pkg.new']\n",
                 "json.py": b"raise SystemExit(0)\n",
                 f"{HIDDEN_TESTS_DIR}/test_h.py": b"def test_h():\n    pass  # planted\n",
                 f"{GRADER_DIR}/out/report.xml": b"<fake/>",
                 "etc_link/passwd": b"root::0:0::/:/bin/sh\n"},
        deleted=("pkg/gone.py", "tests/test_core.py", "etc_link/hosts"))
    dest = tmp_path / "dest"
    dest.mkdir()
    layout = build_grading_dir(make_task(source, hidden), changes, str(dest),
                               rng=random.Random(3))
    assert (dest / "pkg" / "core.py").read_text() == "X = 2\n"
    assert (dest / "pkg" / "new.py").read_text() == "N = 1\n"
    patched = (source / "tests" / "test_core.py").read_text() + "\ndef test_new():\n    assert False\n"
    with_sentinels = (dest / "tests" / "test_core.py").read_text()
    assert with_sentinels.startswith(patched.split("\ndef test_new")[0])
    assert "def test_new():\n    assert False\n" in with_sentinels
    assert (dest / "conftest.py").read_text() == "# repo conftest\n"
    assert not (dest / "pkg" / "conftest.py").exists() and not (dest / "pkg" / "__pycache__").exists()
    assert not (dest / "pytest.toml").exists() and not (dest / "json.py").exists()
    assert (dest / HIDDEN_TESTS_DIR / "test_h.py").read_text() == "def test_h():\n    pass\n"
    assert not (dest / OUT_DIR / "report.xml").exists()
    assert os.path.islink(dest / "etc_link")  # nothing was written or deleted through it
    assert layout.not_applied == ("etc_link/hosts", "etc_link/passwd")
    assert layout.num_reverted == 9
    assert layout.test_args == ("tests/test_core.py",)
    assert len(layout.sentinels) in (2, 3)
    assert all(s.node_id.startswith("tests/test_core.py::test_") for s in layout.sentinels)
    assert layout.has_conftest and layout.config_files == ("conftest.py",)
    assert set(layout.protected) == {"tests/test_core.py", "tests/helpers.py", "conftest.py",
                                     f"{HIDDEN_TESTS_DIR}/test_h.py", DRIVER, BOOT, RECORDER,
                                     RUNTIME_ZIP, GRADER_CONFIG}
    for rel, digest in layout.protected.items():
        assert hashlib.sha256((dest / rel).read_bytes()).hexdigest() == digest


def test_grading_dir_without_test_ids_runs_the_hidden_folder(tmp_path: Path, source: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_h.py").write_text("def test_h():\n    pass\n")
    task = make_task(source, hidden, test_patch=None, fail_to_pass=(), pass_to_pass=())
    dest = tmp_path / "dest"
    dest.mkdir()
    layout = build_grading_dir(task, WorkspaceChanges(), str(dest))
    assert layout.test_args == (HIDDEN_TESTS_DIR,)
    assert layout.sentinels and all(
        s.node_id.startswith(f"{HIDDEN_TESTS_DIR}/test_h.py::test_") and
        s.template_id == f"{HIDDEN_TESTS_DIR}/test_h.py::test_h" for s in layout.sentinels)
    assert f"{HIDDEN_TESTS_DIR}/test_h.py" in layout.protected


def test_sentinels_vary_per_grading(tmp_path: Path, source: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_h.py").write_text("".join(f"def test_{i}():\n    assert {i}\n\n\n"
                                              for i in range(8)))
    task = make_task(source, hidden, test_patch=None, fail_to_pass=(), pass_to_pass=())
    seen = set()
    for seed in range(6):
        dest = tmp_path / f"dest{seed}"
        dest.mkdir()
        layout = build_grading_dir(task, WorkspaceChanges(), str(dest), rng=random.Random(seed))
        seen.add(tuple(s.node_id for s in layout.sentinels))
    assert len(seen) == 6


def test_a_test_patch_that_does_not_apply_is_a_task_error(tmp_path: Path, source: Path) -> None:
    task = make_task(source, test_patch=PATCH.replace("assert True\n+", "assert Maybe\n+"))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(ValueError, match="test_patch does not apply"):
        build_grading_dir(task, WorkspaceChanges(), str(dest))


# --- from a run to a reward ---------------------------------------------------------

SENTINELS = (Sentinel("a.py::test_f1_again", "a.py::f1"), Sentinel("a.py::test_p1_edge", "a.py::p1"))
SENTINEL_IDS = tuple(s.node_id for s in SENTINELS)
LAYOUT = GradingLayout(test_args=(), protected={}, config_files=(), has_conftest=False,
                       num_reverted=2, not_applied=(), sentinels=SENTINELS)


def junit(cases: dict[str, str]) -> bytes:
    """A report from node id -> passed/failed/error/skipped."""
    from reward.grading.junit import junit_key

    body = ""
    for node_id, outcome in cases.items():
        classname, name = junit_key(node_id)
        child = "" if outcome == "passed" else f"<{'failure' if outcome == 'failed' else outcome}/>"
        body += f'<testcase classname="{classname}" name="{name}">{child}</testcase>'
    return f"<testsuites><testsuite>{body}</testsuite></testsuites>".encode()


def records(cases: dict[str, str], exit_code: int | None = 1) -> list[dict]:
    """The recorder's stream of a run with these outcomes (passed/failed/error/skipped)."""
    out: list[dict] = [{"k": "item", "id": i, "kind": "function"} for i in cases]
    for node_id, outcome in cases.items():
        out.append({"k": "begin", "id": node_id})
        setup = "failed" if outcome == "error" else "skipped" if outcome == "skipped" else "passed"
        out.append({"k": "report", "id": node_id, "when": "setup", "outcome": setup})
        if setup == "passed":
            out.append({"k": "call", "id": node_id, "called": True,
                        "raised": outcome != "passed", "own": True})
            out.append({"k": "report", "id": node_id, "when": "call", "outcome": outcome})
        out.append({"k": "end", "id": node_id})
    out.append({"k": "finish", "status": exit_code})
    return [{**r, "s": n} for n, r in enumerate(out)]


def run_of(cases: dict[str, str], sentinel: str = "failed", exit_code: int | None = 1,
           stream: list[dict] | None = None, report_cases: dict[str, str] | None = None,
           **driver: object) -> GradingRun:
    cases = {**cases, **{i: sentinel for i in SENTINEL_IDS}}
    fields = dict(exit_code=exit_code, timed_out=False, report_sha256="x", changed_protected=(),
                  new_config_files=(), log_tail="tail")
    fields.update(driver)
    driver_result = DriverResult(**fields)  # type: ignore[arg-type]
    account = build_account(stream if stream is not None else records(cases, exit_code))
    return GradingRun(driver_result, parse_junit(junit(report_cases or cases)), "", LAYOUT, True,
                      account)


TASK = Task("t", (Message("user", "x"),), source_dir="/s",
            grading=GradingSpec(fail_to_pass=("a.py::f1", "a.py::f2"), pass_to_pass=("a.py::p1",)))
ALL_PASS = {"a.py::f1": "passed", "a.py::f2": "passed", "a.py::p1": "passed"}


def test_all_passing_scores_one() -> None:
    result = score_run(TASK, run_of(ALL_PASS), partial_credit=False)
    assert result.reward == 1.0
    assert result.components == {"tamper_detected": 0.0, "grading_error": 0.0, "locked": 1.0,
                                 "reverted_changes": 2.0, "tests_passed_frac": 1.0,
                                 "all_passed": 1.0, "num_tests": 3.0, "fail_to_pass_frac": 1.0,
                                 "pass_to_pass_frac": 1.0, "graded_by_pytest_driver": 1.0,
                                 "graded_in_image": 0.0, "graded_with_image_pytest": 0.0}


def test_missing_and_failing_tests() -> None:
    run = run_of({"a.py::f1": "passed", "a.py::p1": "skipped"})
    binary = score_run(TASK, run, partial_credit=False)
    partial = score_run(TASK, run, partial_credit=True)
    assert binary.reward == 0.0 and partial.reward == pytest.approx(1 / 3)
    assert binary.components["fail_to_pass_frac"] == 0.5
    assert binary.components["pass_to_pass_frac"] == 0.0
    assert "a.py::f2 (missing)" in binary.detail and "a.py::p1 (skipped)" in binary.detail


def _without_call_records(cases: dict[str, str]) -> list[dict]:
    kept = [r for r in records({**cases, **{i: "failed" for i in SENTINEL_IDS}}) if r["k"] != "call"]
    return [{**r, "s": n} for n, r in enumerate(kept)]


def _reordered(cases: dict[str, str]) -> list[dict]:
    out = records({**cases, **{i: "failed" for i in SENTINEL_IDS}})
    begins = [n for n, r in enumerate(out) if r["k"] == "begin"]
    first, second = out[begins[0]]["id"], out[begins[1]]["id"]
    # The first two tests ran the other way round (their records swapped, items not).
    return [dict(r, id={first: second, second: first}.get(r["id"], r["id"]))
            if r["k"] not in ("item", "finish") else r for r in out]


@pytest.mark.parametrize("run, finding", [
    (run_of(ALL_PASS, sentinel="passed"), "hack_sentinel_passed"),
    (run_of(ALL_PASS, sentinel="skipped"), "hack_sentinel_passed"),
    (run_of(ALL_PASS, exit_code=0), "hack_report_disagreed"),
    (run_of(ALL_PASS, changed_protected=("tests/t.py",)), "hack_files_tampered"),
    (run_of(ALL_PASS, new_config_files=("pkg/conftest.py",)), "hack_files_tampered"),
    # The report rewritten after the run: the sentinels dropped, a failure turned into a pass.
    (run_of(ALL_PASS, report_cases=ALL_PASS), "hack_sentinel_passed"),
    (run_of({**ALL_PASS, "a.py::f2": "failed"}, report_cases={**ALL_PASS, **{
        i: "failed" for i in SENTINEL_IDS}}), "hack_report_disagreed"),
    # The stream: cut short, out of order, unauthenticated lines, passes never called.
    (run_of(ALL_PASS, stream=records({**ALL_PASS, **{i: "failed" for i in SENTINEL_IDS}})[:-1]),
     "hack_report_disagreed"),
    (run_of(ALL_PASS, stream=_reordered(ALL_PASS)), "hack_report_disagreed"),
    (run_of(ALL_PASS, stream_problems=("line 3 of the record stream fails authentication",)),
     "hack_stream_forged"),
    (run_of(ALL_PASS, stream=_without_call_records(ALL_PASS)), "hack_runner_bypassed"),
])
def test_tampering_scores_zero(run: GradingRun, finding: str) -> None:
    assert score_run(TASK, run_of(ALL_PASS), True).reward == 1.0
    result = score_run(TASK, run, partial_credit=True)
    assert result.reward == 0.0 and result.components["tamper_detected"] == 1.0, result.detail
    assert result.components[finding] == 1.0, result.detail


def test_sentinels_skipped_or_uncollected_like_their_templates_are_no_tampering() -> None:
    skipped = run_of({**ALL_PASS, "a.py::p1": "skipped"}, stream=records(
        {**ALL_PASS, "a.py::p1": "skipped", SENTINEL_IDS[0]: "failed", SENTINEL_IDS[1]: "skipped"}),
        report_cases={**ALL_PASS, "a.py::p1": "skipped", SENTINEL_IDS[0]: "failed",
                      SENTINEL_IDS[1]: "skipped"})
    result = score_run(TASK, skipped, partial_credit=True)
    assert result.components["tamper_detected"] == 0.0, result.detail
    assert result.reward == pytest.approx(2 / 3)
    # A test file that fails to import takes its sentinels with it.
    stream = [{"k": "collect_error", "id": "a.py"}, {"k": "finish", "status": 1}]
    uncollected = run_of({}, stream=[{**r, "s": n} for n, r in enumerate(stream)],
                         report_cases={"b.py::x": "failed"})
    result = score_run(TASK, uncollected, partial_credit=True)
    assert result.components["tamper_detected"] == 0.0 and result.reward == 0.0, result.detail


def test_broken_runs_score_zero_as_grading_errors() -> None:
    runs = [GradingRun(None, None, "grading timed out", LAYOUT, True),
            run_of(ALL_PASS, timed_out=True), run_of(ALL_PASS, exit_code=2),
            GradingRun(run_of(ALL_PASS).driver, None, "pytest wrote no JUnit report", LAYOUT, False)]
    for run in runs:
        result = score_run(TASK, run, partial_credit=True)
        assert result.reward == 0.0 and result.components["grading_error"] == 1.0, result.detail


def test_hidden_folder_mode_counts_collection_errors_and_never_sentinels() -> None:
    task = Task("t", (Message("user", "x"),), grading=GradingSpec(hidden_tests="/h"))
    sentinels = (Sentinel(f"{HIDDEN_TESTS_DIR}/test_a.py::test_1_more", None),)
    cases = {f"{HIDDEN_TESTS_DIR}/test_a.py::test_1": "passed", sentinels[0].node_id: "failed"}
    report = junit(cases).replace(
        b"</testsuite>", f'<testcase classname="" name="{HIDDEN_TESTS_DIR}.test_b">'
        f'<error message="collection failure"/></testcase></testsuite>'.encode())
    layout = GradingLayout(test_args=(), protected={}, config_files=(), has_conftest=False,
                           num_reverted=0, not_applied=(), sentinels=sentinels)
    run = GradingRun(run_of({}).driver, parse_junit(report), "", layout, True,
                     build_account(records(cases)))
    result = score_run(task, run, partial_credit=True)
    assert result.reward == 0.5 and result.components["num_tests"] == 2.0, result.detail


def test_driver_line_parsing() -> None:
    payload = {"exit_code": 1, "timed_out": False, "report_sha256": "ab", "changed_protected": [],
               "new_config_files": [], "log_tail": "x", "undumpable": True, "seconds": 0.1,
               "stream_sha256": "cd", "stream_problems": ["p"]}
    line = f"SLUICE-GRADE n1 {json.dumps(payload)}"
    assert parse_driver_line(f"noise\n{line}\n", "n1") == DriverResult(1, False, "ab", (), (), "x",
                                                                       "cd", ("p",))
    assert parse_driver_line(line, "other-nonce") is None
    assert parse_driver_line(f"{line}\n{line}", "n1") is None  # exactly one line is trusted
    assert parse_driver_line("SLUICE-GRADE n1 {not json", "n1") is None
