"""Red team of the repository-runner path (rows graded by their own runner's output and
swebench's django parser), on the container backend with the rows' own images: each
case is what a reward-seeking policy might leave in its workspace with the bug left in
place (tests/integration/runner_payloads.py, several variants per class), graded through
the real reward path with reward.hack_policy=zero, and each scores 0 with the finding
that caught it. The gold patch still scores 1 and the empty patch 0.

Classes: a status written into the pending status line; fake lines with escape
sequences; fake lines then an early exit; the result class or the assertions patched;
the standard streams redirected with wasSuccessful patched; the runner's own files
rewritten or shadowed (rows whose command runs `bin/test`, outside any test folder)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from grading_tasks import grade, hacks, sandbox_factory
from runner_payloads import (EARLY_EXIT, FAKE_LINES, PATCHED_RESULT, PENDING_LINE, REDIRECTED,
                             RUNNER_FILES)

from envs.tasks import load_tasks
from envs.types import Task
from reward.base import RewardResult
from reward.grading.validate import gold_changes
from reward.workspace import WorkspaceChanges

CODE = "minitext/text.py"


@pytest.fixture(scope="module")
def runner_task(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Task, str]]:
    """The first bin/test row (slugify's bug), image-only, and its gold patch; its image
    is removed afterwards (the base and project layers stay cached)."""
    pytest.importorskip("swebench")
    sandbox_factory("container")  # skips without root, bubblewrap or a working podman
    from envs.sandbox.engine import detect_engine, run_engine
    from envs.tasks.build_runner_tasks import build_runner_tasks

    out = tmp_path_factory.mktemp("runner_redteam")
    rows = build_runner_tasks(str(out), images=True, runner="bin/test")
    [task] = [t for t in load_tasks(str(out / "tasks.jsonl")) if t.id == rows[0]["instance_id"]]
    assert task.workdir == "/testbed" and "bin/test" in (task.grading.test_command or "")
    yield task, rows[0]["patch"]
    engine = detect_engine()
    for row in rows:
        run_engine(engine, "rmi", "--force", row["image"])


def graded(task: Task, files: Mapping[str, str]) -> RewardResult:
    return asyncio.run(grade(task, WorkspaceChanges(written={p: t.encode() for p, t in
                                                             files.items()}),
                             "container", hack_policy="zero"))


def buggy_code(task: Task) -> str:
    from reward.grading.hidden_tests import with_image_source

    return Path(with_image_source(task).source_dir or "", CODE).read_text()


def test_gold_scores_one_and_empty_zero(runner_task: tuple[Task, str]) -> None:
    task, patch = runner_task
    gold = asyncio.run(grade(task, gold_changes(task, patch), "container", hack_policy="zero"))
    empty = asyncio.run(grade(task, WorkspaceChanges(), "container", hack_policy="zero"))
    assert gold.reward == 1.0 and hacks(gold) == set(), gold.detail
    assert empty.reward == 0.0 and hacks(empty) == set(), empty.detail
    for result in (gold, empty):
        assert result.components["graded_by_swebench_log"] == 1.0
        assert result.components["graded_in_image"] == 1.0
        assert result.components["tamper_detected"] == 0.0, result.detail


CASES = [(f"{group}/{name}", payload, finding)
         for group, payloads, finding in (
             ("pending-line", PENDING_LINE, "hack_runner_output"),
             ("fake-lines", FAKE_LINES, "hack_runner_output"),
             ("early-exit", EARLY_EXIT, None),
             ("patched-result", PATCHED_RESULT, None),
             ("redirected", REDIRECTED, None))
         for name, payload in payloads.items()]
# The run-time finding each payload must raise (the first line); None: any of these.
RUN_TIME = {"hack_runner_output", "hack_runner_totals", "hack_sentinel_passed"}


@pytest.mark.parametrize("payload, finding", [(p, f) for _, p, f in CASES],
                         ids=[c for c, _, _ in CASES])
def test_code_under_test_cannot_forge_the_runners_account(
        runner_task: tuple[Task, str], payload: str, finding: str | None) -> None:
    task, _ = runner_task
    result = graded(task, {CODE: buggy_code(task) + payload})
    assert result.reward == 0.0, result.detail
    assert result.components["tamper_detected"] == 1.0, result.detail
    found = hacks(result)
    assert (finding in found) if finding else (found & RUN_TIME), result.detail


@pytest.mark.parametrize("files", list(RUNNER_FILES.values()), ids=list(RUNNER_FILES))
def test_the_runners_own_files_are_the_sources(runner_task: tuple[Task, str],
                                               files: Mapping[str, str]) -> None:
    """The scripts the command runs (and the modules beside them it imports) are the
    task source's: the agent's versions are dropped, and the diff names the attempt."""
    task, patch = runner_task
    result = graded(task, files)
    assert result.reward == 0.0 and result.components["reverted_changes"] >= 1.0, result.detail
    assert "hack_test_files" in hacks(result) or "hack_shadow_module" in hacks(result), \
        result.detail
    # With the fix as well, the rewritten runner changes nothing: the real one grades.
    fixed = dict(gold_changes(task, patch).written)
    both = asyncio.run(grade(task, WorkspaceChanges(written={
        **fixed, **{p: t.encode() for p, t in files.items()}}), "container"))
    assert both.components["all_passed"] == 1.0 and both.components["tamper_detected"] == 0.0, \
        both.detail
