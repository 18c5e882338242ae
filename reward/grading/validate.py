"""Validate SWE-style task rows through the hardened grading path before training on them.

    python -m reward.validate FILE [--workers N] [--repeat K] [--out VALID.jsonl]
                                   [--state STATE.jsonl] [--timeout-s S]
                                   [--sandbox-backend auto|local|container]

For each row (SWE-bench, SWE-Gym, SWE-smith, R2E-Gym fields; JSONL, parquet or a
`datasets` folder, read by envs.tasks): the gold `patch` must make every FAIL_TO_PASS
and PASS_TO_PASS test pass, and the empty patch must leave every FAIL_TO_PASS test
failing and every PASS_TO_PASS test passing, each run K times (a test whose outcome
changes between runs is flaky and makes its row invalid). Both patches are graded the
way a trajectory is: reward.grading.hidden_tests.HiddenTests in a fresh sandbox, the trusted driver
running the repository's pytest. Prints one progress line per finished row, then a
table; writes the valid rows, as they were read, to --out; records each finished row
in the state file so a rerun skips it (resumable).

It lives in `reward` rather than `envs.tasks` because it grades, and envs imports
nothing above it (so the issue's `python -m envs.tasks.validate` is spelled
`python -m reward.validate`). Rows whose repository lives in their image (image-only:
`workdir`, /testbed by default) are graded in a fresh container of that image
(--sandbox-backend auto picks the container backend for them, local for the rest). The
grader column says which path graded a row: `pytest-driver` (pytest node ids, the
trusted driver) or `swebench-log` (the repository's own runner, read by the swebench
parser the row names), with `@image` when it ran in the task's image; the pytest column
says which pytest ran on the pytest path (`7.4.4 (image)`: the image's own; `9.0.2
(bundled)`: the grader's copy, where the image has none).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from envs.cache import default_cache_dir
from envs.sandbox.changes import changes_from_dir
from envs.tasks.rows import read_rows
from envs.tasks.swe import is_swe_row, swe_task_from_row
from envs.types import Task
from reward.base import RewardContext, SandboxFactory
from reward.grading.junit import Outcome
from reward.grading.hidden_tests import (HiddenTests, grading_path, pytest_label, run_results, score_run,
                          with_image_source)
from reward.workspace import WorkspaceChanges

GRADER = "pytest-driver"  # until a run says which path graded the row


@dataclass(slots=True)
class RowVerdict:
    """The outcome of validating one row (one line of the state file)."""

    instance_id: str
    valid: bool
    reason: str  # why it is invalid ('' if valid)
    repeat: int
    gold_passed: int = 0  # gold runs with every expected test passing
    empty_failed: int = 0  # empty runs with every FAIL_TO_PASS failing, PASS_TO_PASS passing
    flaky_tests: list[str] = field(default_factory=list)  # outcome changed between runs
    num_f2p: int = 0
    num_p2p: int = 0
    grader: str = GRADER
    pytest: str = "-"  # which pytest graded it: "7.4.4 (image)", "9.0.2 (bundled)"
    seconds: float = 0.0
    grade_s: list[float] = field(default_factory=list)  # each grading run's wall time


def gold_changes(task: Task, patch: str, origin: str = "field 'patch'") -> WorkspaceChanges:
    """The workspace after `git apply` of the gold patch (or any `patch`, named by
    `origin` in errors) on a copy of the task's source (an image-only task's: the image's
    repository)."""
    task = with_image_source(task)
    assert task.source_dir is not None
    with tempfile.TemporaryDirectory(prefix="sluice-gold-") as tmp:
        tree = os.path.join(tmp, "tree")
        shutil.copytree(task.source_dir, tree, symlinks=True)
        proc = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "apply",
                               "--whitespace=nowarn", "-"], cwd=tree, input=patch, text=True,
                              capture_output=True, check=False,
                              env={"PATH": "/usr/bin:/bin", "HOME": tmp,
                                   "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull})
        if proc.returncode != 0:
            raise ValueError(f"task {task.id!r}: {origin} does not apply to the base "
                             f"commit: {proc.stderr.strip()[:300]}; fix the patch or the row's "
                             "base_commit")
        return changes_from_dir(tree, task.source_dir)


async def _outcomes(task: Task, changes: WorkspaceChanges, ctx: RewardContext,
                    ) -> tuple[dict[str, Outcome] | None, str, float, str, str]:
    """Expected test -> outcome of one grading run, or None and why it did not complete;
    its wall time, the grading path that graded it and which pytest ran."""
    start = time.monotonic()
    run = await HiddenTests().grade(task, changes, ctx)
    scored = score_run(task, run, partial_credit=True)
    elapsed = time.monotonic() - start
    grader = grading_path(task).replace("_", "-") + ("@image" if run.in_image else "")
    runner = pytest_label(run.driver).removeprefix("pytest ")
    if scored.components["grading_error"] or scored.components["tamper_detected"]:
        return None, scored.detail.splitlines()[0], elapsed, grader, runner
    return dict(run_results(task, run)[0]), "", elapsed, grader, runner


async def validate_row(task: Task, patch: str, repeat: int, ctx: RewardContext) -> RowVerdict:
    """Grade the gold and the empty patch `repeat` times each (see the module docstring)."""
    verdict = RowVerdict(task.id, False, "", repeat, num_f2p=len(task.grading.fail_to_pass),
                         num_p2p=len(task.grading.pass_to_pass))
    start = time.monotonic()
    try:
        gold = await asyncio.to_thread(gold_changes, task, patch)
    except ValueError as exc:
        verdict.reason = str(exc)
        return verdict
    seen: dict[tuple[str, str], set[Outcome]] = {}  # (patch, test) -> outcomes over runs
    problems: list[str] = []
    for name, changes in (("gold", gold), ("empty", WorkspaceChanges())):
        for _ in range(repeat):
            outcomes, problem, elapsed, verdict.grader, verdict.pytest = await _outcomes(
                task, changes, ctx)
            verdict.grade_s.append(round(elapsed, 2))
            if outcomes is None:
                problems.append(f"{name} run: {problem}")
                continue
            for test, outcome in outcomes.items():
                seen.setdefault((name, test), set()).add(outcome)
            if name == "gold":
                verdict.gold_passed += all(o is Outcome.PASSED for o in outcomes.values())
            else:
                verdict.empty_failed += (
                    all(outcomes[t] is not Outcome.PASSED for t in task.grading.fail_to_pass)
                    and all(outcomes[t] is Outcome.PASSED for t in task.grading.pass_to_pass))
    verdict.flaky_tests = sorted({f"{t} ({p})" for (p, t), o in seen.items() if len(o) > 1})
    verdict.seconds = round(time.monotonic() - start, 2)
    if problems:
        verdict.reason = problems[0]
    elif verdict.gold_passed < repeat:
        failing = sorted(t for (p, t), o in seen.items() if p == "gold" and o != {Outcome.PASSED})
        verdict.reason = f"gold patch leaves tests not passing: {failing[:5]}"
    elif verdict.empty_failed < repeat:
        wrong = sorted(t for (p, t), o in seen.items() if p == "empty" and (
            (t in task.grading.fail_to_pass) == (Outcome.PASSED in o)))
        verdict.reason = f"without the fix these tests have the wrong outcome: {wrong[:5]}"
    verdict.valid = not verdict.reason
    return verdict


def read_swe_rows(path: str, cache_dir: str,
                  ) -> list[tuple[Mapping[str, Any], Task | None, str]]:
    """(row, task or None, why not) for every row of `path`."""
    out: list[tuple[Mapping[str, Any], Task | None, str]] = []
    for ref, row in read_rows(path):
        if not is_swe_row(row):
            out.append((row, None, f"row {ref.row} is not a SWE-style row (needs instance_id "
                        "and problem_statement)"))
            continue
        try:
            task = swe_task_from_row(ref, row, cache_dir)
        except ValueError as exc:
            out.append((row, None, f"unsupported: {exc}"))
            continue
        patch = row.get("patch")
        if not isinstance(patch, str) or not patch.strip():
            out.append((row, None, f"{ref.source} row {ref.row}, field 'patch': the gold patch "
                        "is required to validate; add it"))
        else:
            out.append((row, task, ""))
    return out


def _load_state(path: str, repeat: int) -> dict[str, RowVerdict]:
    done: dict[str, RowVerdict] = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    verdict = RowVerdict(**json.loads(line))
                    if verdict.repeat == repeat:
                        done[verdict.instance_id] = verdict
    return done


def default_state_path(path: str, out: str | None) -> str:
    """Beside --out; without one, in the cache, keyed by the rows' absolute path: never
    beside the rows, whose folder may be read-only (a shared dataset)."""
    if out is not None:
        return f"{out}.state.jsonl"
    rows = os.path.abspath(path)
    key = hashlib.sha256(rows.encode()).hexdigest()[:12]
    folder = default_cache_dir() / "validate"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / f"{os.path.basename(rows.rstrip(os.sep))}-{key}.state.jsonl")


async def validate_file(path: str, *, workers: int = 1, repeat: int = 1,
                        out: str | None = None, state: str | None = None,
                        timeout_s: float = 300.0, cache_dir: str | None = None,
                        create_sandbox: SandboxFactory | None = None, backend: str = "auto",
                        progress: TextIO | None = None) -> list[RowVerdict]:
    """Validate every row of `path`; returns one verdict per row, in file order. Progress
    lines go to `progress` (None: stderr)."""
    progress = progress or sys.stderr
    if workers < 1 or repeat < 1:
        raise ValueError(f"--workers={workers} and --repeat={repeat} must both be >= 1")
    rows = await asyncio.to_thread(read_swe_rows, path, cache_dir or str(default_cache_dir()))
    state = state or default_state_path(path, out)
    print(f"finished rows are recorded in {state} (a rerun skips them)", file=progress, flush=True)
    done = _load_state(state, repeat)
    gate = asyncio.Semaphore(workers)
    total, finished = len(rows), 0

    async def one(row: Mapping[str, Any], task: Task | None, why: str) -> RowVerdict:
        nonlocal finished
        row_id = str(row.get("instance_id") or row.get("docker_image") or "?")
        if task is None:
            verdict = RowVerdict(row_id, False, why, repeat, grader="none")
        elif task.id in done:
            verdict = done[task.id]
        else:
            ctx = RewardContext(create_sandbox=create_sandbox or sandbox_factory(task, backend),
                                timeout_s=timeout_s)
            async with gate:
                verdict = await validate_row(task, row["patch"], repeat, ctx)
            with open(state, "a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(verdict)) + "\n")
        finished += 1
        print(f"[{finished}/{total}] {verdict.instance_id}: "
              f"{'valid' if verdict.valid else 'INVALID ' + verdict.reason[:120]} "
              f"({verdict.seconds:.1f}s)", file=progress, flush=True)
        return verdict

    verdicts = list(await asyncio.gather(*(one(*r) for r in rows)))
    if out is not None:
        with open(out, "w", encoding="utf-8") as f:
            for (row, _, _), verdict in zip(rows, verdicts):
                if verdict.valid:
                    f.write(json.dumps(dict(row), default=str) + "\n")
    return verdicts


def sandbox_factory(task: Task, backend: str) -> SandboxFactory:
    """The grading sandboxes' backend: `container` for a task whose repository lives in
    its image (auto), else `local`; or the one named."""
    if backend not in ("auto", "local", "container"):
        raise ValueError(f"--sandbox-backend={backend!r}: use auto, local or container")
    if backend == "container" or (backend == "auto" and task.workdir is not None):
        from envs.sandbox.container import ContainerSandbox

        return ContainerSandbox.create
    from envs.sandbox.local import LocalSandbox

    return LocalSandbox.create


def format_table(verdicts: list[RowVerdict]) -> str:
    head = ("instance_id", "valid", "F2P", "P2P", "gold ok", "empty ok", "flaky", "grader",
            "pytest", "seconds")
    lines = [head] + [(v.instance_id, "yes" if v.valid else "NO", str(v.num_f2p),
                       str(v.num_p2p), f"{v.gold_passed}/{v.repeat}",
                       f"{v.empty_failed}/{v.repeat}", str(len(v.flaky_tests)), v.grader,
                       v.pytest, f"{v.seconds:.1f}") for v in verdicts]
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in lines]
    num_valid = sum(v.valid for v in verdicts)
    text.append(f"{num_valid}/{len(verdicts)} valid; flaky rows: "
                f"{sum(bool(v.flaky_tests) for v in verdicts)}")
    text.extend(f"  {v.instance_id}: {v.reason}" for v in verdicts if not v.valid)
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="JSONL, parquet or datasets folder of SWE-style rows")
    parser.add_argument("--workers", type=int, default=1, help="rows graded at once")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each patch (flakes)")
    parser.add_argument("--out", help="where the valid rows are written (JSONL)")
    parser.add_argument("--state", help="finished rows, for resuming (default: OUT.state.jsonl, "
                        "or under the cache without --out; never beside the rows)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per grading run")
    parser.add_argument("--sandbox-backend", default="auto", choices=("auto", "local", "container"),
                        help="auto: container for rows whose repository is in their image")
    args = parser.parse_args(argv)
    verdicts = asyncio.run(validate_file(args.file, workers=args.workers, repeat=args.repeat,
                                         out=args.out, state=args.state,
                                         timeout_s=args.timeout_s, backend=args.sandbox_backend))
    print(format_table(verdicts))
    return 0 if verdicts and all(v.valid for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
