"""Hardened grading still grades right: on every bundled code task (every third one on
the container backend) and on SWE-style tasks of several layouts (conftest fixtures, src
layout on pyproject's pythonpath, unittest classes in a `test` package, pytest.toml,
tox.ini whose addopts would deselect and stop early, a test patch that adds and deletes
test files), the gold patch scores 1 and the empty patch 0, on the local and the
container backend, and honest work raises no hacking finding."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from grading_tasks import GRADING_BACKENDS, SWE_CASES, SweCase, build_swe_task, grade, hacks

from envs.tasks import load_tasks
from envs.tasks.code import spec_by_name
from envs.types import Task
from reward.workspace import WorkspaceChanges

CONTAINER_STRIDE = 3


@pytest.fixture(params=GRADING_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


async def test_every_code_task_reference_passes_and_stub_fails(tmp_path: Path,
                                                                backend: str) -> None:
    tasks = load_tasks("code_functions", cache_dir=str(tmp_path))
    assert len(tasks) >= 30
    if backend == "container":
        # What a task's tests and reference do is graded the same on either backend (the
        # local run covers every task); the container backend differs in how the files
        # reach the image and back, which a spread of every CONTAINER_STRIDE-th task covers
        # at a third of the cost.
        tasks = tasks[::CONTAINER_STRIDE]
    limit = asyncio.Semaphore(3)

    async def check(task: Task) -> list[str]:
        spec = spec_by_name(task.id)
        gold = WorkspaceChanges(written={spec.module: spec.reference.encode()})
        async with limit:
            solved = await grade(task, gold, backend)
            unsolved = await grade(task, WorkspaceChanges(), backend)
        problems = []
        if solved.reward != 1.0 or solved.components["tests_passed_frac"] != 1.0 or hacks(solved):
            problems.append(f"{task.id} reference: {solved.detail}")
        if unsolved.reward != 0.0 or unsolved.components["tests_passed_frac"] != 0.0 \
                or unsolved.components["tamper_detected"] or hacks(unsolved):
            problems.append(f"{task.id} stub: {unsolved.detail}")
        return problems

    results = await asyncio.gather(*(check(t) for t in tasks))
    assert [p for problems in results for p in problems] == []


@pytest.mark.parametrize("case", SWE_CASES, ids=lambda c: c.name)
async def test_swe_gold_patch_passes_and_empty_patch_fails(tmp_path: Path, backend: str,
                                                           case: SweCase) -> None:
    task = build_swe_task(case, tmp_path)
    solved = await grade(task, case.gold(), backend)
    assert solved.reward == 1.0, solved.detail
    assert solved.components["num_tests"] == len(case.fail_to_pass) + len(case.pass_to_pass)
    assert hacks(solved) == set() and solved.components["tamper_detected"] == 0.0
    unsolved = await grade(task, WorkspaceChanges(), backend)
    assert unsolved.reward == 0.0, unsolved.detail
    assert unsolved.components["fail_to_pass_frac"] == 0.0, unsolved.detail
    assert unsolved.components["tamper_detected"] == 0.0 and hacks(unsolved) == set()
    if case.pass_to_pass:
        assert unsolved.components["pass_to_pass_frac"] == 1.0, unsolved.detail
