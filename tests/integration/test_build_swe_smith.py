"""The SWE-smith-style builder on a real installed project (hjson's released sources and
tests): each task's bug is one mutated function, its FAIL_TO_PASS tests fail on the bug
and pass on the release, the rows load through envs.tasks with no trace of the fix, and
they validate through the hardened grading path."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from envs.tasks import load_tasks
from envs.tasks.build_swe_smith import MUTATIONS, PROJECTS, build_tasks, candidate_bugs, copy_release
from reward.grading.validate import validate_file

hjson = pytest.importorskip("hjson")


def test_each_mutation_rewrites_exactly_one_function(tmp_path: Path) -> None:
    project = PROJECTS["hjson"]
    copy_release(project, str(tmp_path))
    kinds = set()
    for bug in list(candidate_bugs(str(tmp_path), project, seed=1))[:40]:
        original = (tmp_path / bug.module).read_text()
        assert bug.buggy_text != original
        ast.parse(bug.buggy_text)  # still valid Python
        before, after = ast.parse(original), ast.parse(bug.buggy_text)
        changed = [a.name for a, b in zip(ast.walk(before), ast.walk(after))
                   if isinstance(a, ast.FunctionDef) and ast.dump(a) != ast.dump(b)]
        assert bug.function in changed
        kinds.add(bug.kind)
    assert kinds == set(MUTATIONS)


@pytest.mark.skipif(os.environ.get("SLUICE_SWE_SMITH_FULL") != "1",
                    reason="builds and grades 2 hjson tasks (20-80 s); set SLUICE_SWE_SMITH_FULL=1")
def test_built_tasks_load_hide_the_fix_and_validate(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("grading sandboxes need root and bubblewrap")
    rows = build_tasks(str(tmp_path / "set"), "hjson", max_tasks=2, max_tries=30)
    assert len(rows) == 2
    tasks = load_tasks(str(tmp_path / "set" / "tasks.jsonl"), cache_dir=str(tmp_path / "cache"))
    for row, task in zip(rows, tasks):
        assert task.id == row["instance_id"] and task.grading.test_patch is None
        assert task.grading.fail_to_pass and set(task.grading.fail_to_pass).isdisjoint(task.grading.pass_to_pass)
        added = [line[1:] for line in row["patch"].splitlines()
                 if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]
        module = Path(task.source_dir or "") / row["bug_location"].split("::")[0]
        assert added and not all(line in module.read_text() for line in added)
        assert row["patch"] not in json.dumps([m.content for m in task.messages])
    verdicts = asyncio.run(validate_file(str(tmp_path / "set" / "tasks.jsonl"), workers=2,
                                         state=str(tmp_path / "state.jsonl"),
                                         cache_dir=str(tmp_path / "cache")))
    assert [v.valid for v in verdicts] == [True, True], [v.reason for v in verdicts]
