"""Grade one final workspace against one task row, as training would score it:

    python -m reward.grade ROW_ID --tasks ROWS.jsonl --workspace DIR_OR_PATCH
                           [--sandbox-backend auto|local|container] [--timeout-s S]

ROW_ID is the row's `instance_id` (R2E-Gym: its `docker_image`). The workspace is a folder
(the repository as an agent left it) or a patch file against the row's base commit. The
row's own reward function (a SWE row's: reward.grading.hidden_tests:HiddenTests) grades it
in a fresh grading sandbox, with the hacking findings of the diff, and the command prints
the reward, every component and the detail: a user's way to test their rows and their
grader before training on them. Exit 0 when graded (whatever the reward), 2 for bad input.

The trajectory a reward function gets here is empty (no model turns): a function that
reads the model's text sees none. Test-graded rows only read the workspace.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import numpy as np

from envs.cache import default_cache_dir
from envs.sandbox.changes import changes_from_dir
from envs.tasks.rows import read_rows
from envs.tasks.swe import is_swe_row, swe_task_from_row
from envs.types import Task, TerminationReason, Trajectory
from reward.base import RewardContext, RewardResult, load_reward_fn, reward_fn_name
from reward.grading.hidden_tests import with_image_source
from reward.grading.validate import gold_changes, sandbox_factory
from reward.workspace import WorkspaceChanges

DEFAULT_FN = "hidden_tests"


def find_task(rows_path: str, row_id: str) -> Task:
    """The task of the row named `row_id`; ValueError naming the ids there are."""
    ids = []
    for ref, row in read_rows(rows_path):
        name = str(row.get("instance_id") or row.get("docker_image") or "")
        if name == row_id:
            if not is_swe_row(row):
                raise ValueError(f"{ref.source} row {ref.row} ({row_id!r}) is not a SWE-style "
                                 "row (needs instance_id and problem_statement)")
            return swe_task_from_row(ref, row, str(default_cache_dir()))
        ids.append(name)
    shown = ", ".join(repr(i) for i in ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
    raise ValueError(f"no row {row_id!r} in {rows_path} (its rows: {shown or 'none'})")


def workspace_changes(task: Task, workspace: str) -> WorkspaceChanges:
    """A folder compared with the task's source, or a patch applied to a copy of it."""
    path = Path(workspace)
    if path.is_dir():
        source = with_image_source(task).source_dir
        return changes_from_dir(str(path), source)
    if path.is_file():
        return gold_changes(task, path.read_text(), origin=f"the patch {workspace}")
    raise ValueError(f"--workspace {workspace}: neither a folder nor a patch file")


def empty_trajectory(task: Task) -> Trajectory:
    """The trajectory handed to the reward function: no model turns."""
    none = np.zeros(0)
    return Trajectory(task.id, "grade", 0, np.zeros(1, np.int32), none, none, none, none,
                      TerminationReason.FINISHED)


async def grade(task: Task, changes: WorkspaceChanges, *, backend: str = "auto",
                timeout_s: float = 300.0) -> RewardResult:
    fn = load_reward_fn(reward_fn_name(task, DEFAULT_FN))
    ctx = RewardContext(workspace=changes, create_sandbox=sandbox_factory(task, backend),
                        timeout_s=timeout_s)
    return await fn(empty_trajectory(task), task, ctx)


def format_result(task: Task, result: RewardResult) -> str:
    lines = [f"task {task.id}: reward {result.reward:g} "
             f"({reward_fn_name(task, DEFAULT_FN)})"]
    lines += [f"  {name} = {value:g}" for name, value in sorted(result.components.items())]
    if result.detail:
        lines.append("detail:\n  " + result.detail.strip().replace("\n", "\n  "))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("row_id", help="the row's instance_id (R2E-Gym: docker_image)")
    parser.add_argument("--tasks", required=True, help="JSONL, parquet or datasets folder of rows")
    parser.add_argument("--workspace", required=True,
                        help="the final workspace: a folder, or a patch file against base_commit")
    parser.add_argument("--sandbox-backend", default="auto", choices=("auto", "local", "container"),
                        help="auto: container for rows whose repository is in their image")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="the grading run's limit")
    args = parser.parse_args(argv)
    try:
        task = find_task(os.fspath(args.tasks), args.row_id)
        changes = workspace_changes(task, args.workspace)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = asyncio.run(grade(task, changes, backend=args.sandbox_backend,
                               timeout_s=args.timeout_s))
    print(format_result(task, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
