"""docs/tasks.md's worked example of a plain unittest suite graded through swebench's
parser runs as written: its calc.py and tests/test_calc.py (the blocks marked
`<!-- unittest-example: ... -->`) become a git repository, the row's own command runs
before and after the fix, `parse_log_django` reads both logs, and the FAIL_TO_PASS /
PASS_TO_PASS that gives are the documented row's. Then the row is loaded as sluice loads
it and both logs are graded by sluice's strict reader: the same verdicts, no finding."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from envs.tasks import load_tasks
from envs.types import Task
from git_repo import run_git
from reward.grading.junit import Outcome
from reward.grading.swebench_log import verify_log

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "tasks.md"
BLOCK = re.compile(r"<!-- unittest-example: (?P<name>\S+) -->\n```\w*\n(?P<text>.*?)\n```", re.S)
FIX = ("    return abs(a) + abs(b)\n", "    return a + b\n")


def documented_blocks() -> dict[str, str]:
    return {m["name"]: m["text"] + "\n" for m in BLOCK.finditer(DOC.read_text(encoding="utf-8"))}


def run_tests(repo: Path, command: str) -> tuple[str, int]:
    """The row's command as the image runs it (`python3` is this interpreter here)."""
    argv = shlex.split(command)
    assert argv[0] == "python3", command
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=repo, capture_output=True,
                          text=True, timeout=60)
    return proc.stdout + proc.stderr, proc.returncode


@pytest.fixture
def documented_row(tmp_path: Path) -> tuple[Path, dict]:
    """The documented repository at its base commit, the row beside it; (rows file, row)."""
    blocks = documented_blocks()
    assert set(blocks) == {"calc.py", "tests/test_calc.py", "row"}, sorted(blocks)
    row = json.loads(blocks["row"])
    repo = tmp_path / "repos" / row["repo"].replace("/", "__")
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "__init__.py").write_text("")
    for name in ("calc.py", "tests/test_calc.py"):
        (repo / name).write_text(blocks[name])
    assert FIX[0] in blocks["calc.py"]
    run_git(repo, "init", "-q", "-b", "main")
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-q", "-m", "add drops the signs")
    row["base_commit"] = run_git(repo, "rev-parse", "HEAD").strip()  # the doc's is an example
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    return rows, row


def test_the_documented_row_is_what_the_parser_reads(documented_row: tuple[Path, dict]) -> None:
    from swebench.harness.log_parsers import PARSER_REGISTRY

    rows, row = documented_row
    repo = rows.parent / "repos" / "acme__calc"
    parse = PARSER_REGISTRY[row["log_parser"]]
    before_log, before_exit = run_tests(repo, row["test_cmd"])
    (repo / "calc.py").write_text((repo / "calc.py").read_text().replace(*FIX))
    after_log, after_exit = run_tests(repo, row["test_cmd"])
    assert (before_exit, after_exit) == (1, 0), before_log + after_log
    # swebench types the test spec as required; its django parser never reads it.
    before = parse(before_log, None)  # pyrefly: ignore[bad-argument-type]
    after = parse(after_log, None)  # pyrefly: ignore[bad-argument-type]
    passed = {t for t, s in after.items() if s == "PASSED"}
    assert sorted(t for t in passed if before.get(t) != "PASSED") == sorted(row["FAIL_TO_PASS"])
    assert sorted(t for t in passed if before.get(t) == "PASSED") == sorted(row["PASS_TO_PASS"])
    assert "add() of a negative number subtracts it." in row["FAIL_TO_PASS"]  # docstring-keyed

    # sluice's grader reads the same logs of the row as loaded: the same verdicts.
    [task] = load_tasks(str(rows))
    assert (task.grading.test_command, task.grading.log_parser) == (row["test_cmd"], "parse_log_django")
    outcomes, findings = verify_log(task, before_log, before_exit)
    assert findings == []
    assert outcomes == {**{t: Outcome.FAILED for t in row["FAIL_TO_PASS"]},
                        **{t: Outcome.PASSED for t in row["PASS_TO_PASS"]}}
    outcomes, findings = verify_log(task, after_log, after_exit)
    assert findings == [] and set(outcomes.values()) == {Outcome.PASSED}
    # A docstring-keyed test is also found under its name (either Python's form).
    named = replace_ids(task, ["test_negative (tests.test_calc.AddTests.test_negative)",
                               "test_negative (tests.test_calc.AddTests)"])
    assert set(verify_log(named, before_log, before_exit)[0].values()) == {Outcome.FAILED}


def replace_ids(task: Task, fail_to_pass: list[str]) -> Task:
    """`task` expecting exactly `fail_to_pass` to fail."""
    grading = dataclasses.replace(task.grading, fail_to_pass=tuple(fail_to_pass), pass_to_pass=())
    return dataclasses.replace(task, grading=grading)
