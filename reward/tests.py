"""`HiddenTests`: the reward of test-graded tasks (bundled code tasks, SWE-style tasks).

The agent's final workspace is graded in a FRESH sandbox, never the one it worked in:

    task source --copy--> grading folder (host) <--changes-- WorkspaceChanges (agent's final state)
        test-related paths reverted, test_patch applied, hidden tests + sentinel + driver added
          |
          v  fresh sandbox (test files and their folders locked root-owned where the backend allows)
    driver (trusted, starts first) --runs--> pytest child (runs the agent's code)
          |  kills everything else, copies the JUnit report, re-hashes protected files
          v
    one stdout line + report.xml --> host: verdict per expected node id

Pass/fail per test comes only from the JUnit XML that the driver vouches for (by hash on
its own stdout, which the agent's processes cannot reach) and never from pytest's
console output; swebench's log parser is not needed. Two must-fail sentinel tests run
in the same process: if they pass, the agent's code tampered with pytest and the
reward is 0. A workspace that could not be captured (over envs.max_workspace_changes_mb,
or the capture failed) is not graded: reward 0, component `workspace_error`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import os
import secrets
import tempfile
from dataclasses import dataclass
from typing import Any

from envs.sandbox.base import WORKSPACE_MOUNT, Sandbox, SandboxLimits, SandboxSpec
from reward.base import RewardContext, RewardResult, SandboxFactory
from reward.grading import (CONFIG_NAMES, DRIVER, GRADER_DIR, OUT_DIR, RUNTIME_ZIP, GradingLayout,
                            Sentinel, build_grading_dir, lock_protected)
from reward.junit import MAX_REPORT_BYTES, JUnitReport, Outcome, module_classname, parse_junit
from reward.workspace import WorkspaceChanges
from envs.types import HIDDEN_TESTS_DIR, Task, Trajectory

log = logging.getLogger(__name__)

GRADING_LIMITS = SandboxLimits(memory_mb=2048, max_processes=128, cpu_time_s=300,
                               file_size_mb=256, disk_mb=2048)
MAX_LISTED_FAILURES = 10


@dataclass(frozen=True, slots=True)
class DriverResult:
    """What the driver reported on its stdout line."""

    exit_code: int | None  # pytest's exit code; None when it had to be killed
    timed_out: bool
    report_sha256: str | None
    changed_protected: tuple[str, ...]
    new_config_files: tuple[str, ...]
    log_tail: str  # the end of pytest's console output: for humans only, never parsed


@dataclass(frozen=True, slots=True)
class GradingRun:
    """Everything the verdict is computed from."""

    driver: DriverResult | None  # None: the driver's line never came (killed, crashed)
    report: JUnitReport | None
    problem: str  # why the run could not be read ('' if it could)
    layout: GradingLayout
    locked: bool


class HiddenTests:
    """Reward 1.0 when every expected test passes in the grading sandbox (SWE-bench's
    "resolved"), else 0.0; with `partial_credit`, the fraction of tests that pass.
    Expected tests: `task.fail_to_pass` + `task.pass_to_pass`, or when both are empty,
    everything collected under the hidden tests folder."""

    def __init__(self, *, partial_credit: bool = False, limits: SandboxLimits = GRADING_LIMITS,
                 python: str = "python3", setup_margin_s: float = 20.0,
                 visible_tests_dir: str = "visible_tests") -> None:
        self.partial_credit = partial_credit
        self.visible_tests_dir = visible_tests_dir  # as the sandbox tools' setting of that name
        self.limits = limits
        self.python = python  # the sandbox's interpreter; must run pytest 9 (python >= 3.10)
        self.setup_margin_s = setup_margin_s  # time kept for copying, creating, releasing

    async def __call__(self, trajectory: Trajectory, task: Task,
                       ctx: RewardContext) -> RewardResult:
        if task.source_dir is None and task.hidden_tests is None:
            raise ValueError(f"task {task.id!r} has neither source_dir nor hidden_tests; "
                             "reward.tests:HiddenTests grades test-graded tasks only")
        if not (task.fail_to_pass or task.pass_to_pass or task.hidden_tests):
            raise ValueError(f"task {task.id!r} names no tests: set fail_to_pass/pass_to_pass "
                             "or hidden_tests")
        if ctx.workspace is not None and ctx.workspace.problem:
            return RewardResult(0.0, {"workspace_error": 1.0, "grading_error": 0.0,
                                      "tamper_detected": 0.0, "tests_passed_frac": 0.0,
                                      "all_passed": 0.0},
                                f"not graded: {ctx.workspace.problem}")
        sentinel = Sentinel.new()
        run = await self.grade(task, ctx.workspace or WorkspaceChanges(), ctx, sentinel)
        result = score_run(task, run, sentinel, self.partial_credit)
        if result.components["tamper_detected"]:
            log.warning("task %s: %s", task.id, result.detail)
        return result

    async def grade(self, task: Task, changes: WorkspaceChanges, ctx: RewardContext,
                    sentinel: Sentinel) -> GradingRun:
        create = ctx.create_sandbox or _local_sandbox_factory()
        run_s = max(5.0, ctx.timeout_s - self.setup_margin_s)
        limits = dataclasses.replace(self.limits, cpu_time_s=math.ceil(run_s) + 1)
        with tempfile.TemporaryDirectory(prefix="sluice-grade-") as tmp:
            dest = os.path.join(tmp, "workspace")
            os.mkdir(dest)
            layout = await asyncio.to_thread(build_grading_dir, task, changes, dest, sentinel,
                                             self.visible_tests_dir)
            sandbox = await create(SandboxSpec(source_dir=dest, image=task.image, limits=limits))
        try:
            locked = await asyncio.to_thread(lock_protected, sandbox, layout.protected)
            nonce = secrets.token_hex(8)
            settings = self._driver_settings(layout, nonce, run_s - 3.0)
            result = await sandbox.exec([self.python, "-I", "-B", f"{WORKSPACE_MOUNT}/{DRIVER}"],
                                        run_s, stdin=json.dumps(settings))
            driver = parse_driver_line(result.stdout, nonce)
            if driver is None:
                problem = ("grading timed out" if result.timed_out else
                           f"the grading driver did not report (exit {result.exit_code}, "
                           f"oom_killed={result.oom_killed}): {result.stderr[-500:]}")
                return GradingRun(None, None, problem, layout, locked)
            report, problem = await _read_report(sandbox, driver)
            return GradingRun(driver, report, problem, layout, locked)
        finally:
            await sandbox.release()

    def _driver_settings(self, layout: GradingLayout, nonce: str,
                         timeout_s: float) -> dict[str, Any]:
        args = ["-p", "no:cacheprovider", f"--rootdir={WORKSPACE_MOUNT}",
                "--continue-on-collection-errors", "-q", "-o", "junit_logging=no"]
        if not layout.has_conftest:
            args.append("--noconftest")  # none in the source: any conftest.py is the agent's
        return {"nonce": nonce, "workspace": WORKSPACE_MOUNT,
                "runtime": f"{WORKSPACE_MOUNT}/{RUNTIME_ZIP}",
                "pytest_args": [*args, *layout.test_args], "timeout_s": max(1.0, timeout_s),
                "out_dir": OUT_DIR, "max_report_bytes": MAX_REPORT_BYTES,
                "protected": dict(layout.protected), "config_names": list(CONFIG_NAMES),
                "known_config_files": list(layout.config_files),
                "skip_top_dirs": [".git", GRADER_DIR]}


def _local_sandbox_factory() -> SandboxFactory:
    from envs.sandbox.local import LocalSandbox

    return LocalSandbox.create


def parse_driver_line(stdout: str, nonce: str) -> DriverResult | None:
    """The driver's result from its stdout; None if its line is absent or malformed."""
    prefix = f"SLUICE-GRADE {nonce} "
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    if len(lines) != 1:
        return None
    try:
        raw = json.loads(lines[0][len(prefix):])
        return DriverResult(exit_code=raw["exit_code"], timed_out=bool(raw["timed_out"]),
                            report_sha256=raw["report_sha256"],
                            changed_protected=tuple(raw["changed_protected"]),
                            new_config_files=tuple(raw["new_config_files"]),
                            log_tail=str(raw["log_tail"]))
    except (ValueError, KeyError, TypeError):
        return None


async def _read_report(sandbox: Sandbox, driver: DriverResult) -> tuple[JUnitReport | None, str]:
    if driver.report_sha256 is None:
        return None, "pytest wrote no JUnit report (it crashed, exited early or was killed)"
    try:
        data = await sandbox.read_file(f"{OUT_DIR}/report.xml")
    except (FileNotFoundError, ValueError) as exc:
        return None, f"the JUnit report could not be read: {exc}"
    if hashlib.sha256(data).hexdigest() != driver.report_sha256:
        return None, "the JUnit report does not match the hash the driver reported"
    try:
        return parse_junit(data), ""
    except ValueError as exc:
        return None, str(exc)


def expected_tests(task: Task, report: JUnitReport | None) -> list[tuple[str, Outcome]]:
    """(test, outcome) for every expected test; tests absent from the report count as
    missing (failed)."""
    ids = [*task.fail_to_pass, *task.pass_to_pass]
    if ids:
        return [(i, report.outcome(i) if report else Outcome.MISSING) for i in ids]
    if report is None:
        return []
    return [(f"{c}::{n}" if c else n, report.cases[(c, n)])
            for c, n in report.keys_under(module_classname(HIDDEN_TESTS_DIR))]


def _tamper_findings(run: GradingRun, sentinel: Sentinel) -> list[str]:
    assert run.driver is not None and run.report is not None
    found = []
    outcomes = [run.report.outcome(node_id) for node_id in sentinel.node_ids]
    for outcome in outcomes:
        if outcome not in (Outcome.FAILED, Outcome.ERROR, Outcome.MISSING):
            found.append(f"the must-fail sentinel test was reported {outcome.value}")
    # pytest always collects and reports the sentinels; a report of a run that ended
    # normally without them was rewritten, or tests were deselected from inside.
    if Outcome.MISSING in outcomes and run.driver.exit_code in (0, 1):
        found.append("the sentinel tests are missing from the report of a completed run")
    if run.driver.exit_code == 0:
        found.append("pytest exited 0 although the sentinel tests fail")
    if run.driver.changed_protected:
        found.append("protected files changed during the run: "
                     f"{list(run.driver.changed_protected)}")
    if run.driver.new_config_files:
        found.append("config/startup files appeared during the run: "
                     f"{list(run.driver.new_config_files)}")
    return found


def score_run(task: Task, run: GradingRun, sentinel: Sentinel,
              partial_credit: bool) -> RewardResult:
    """The reward and its components from a grading run (see HiddenTests)."""
    base = {"tamper_detected": 0.0, "grading_error": 0.0, "locked": float(run.locked),
            "reverted_changes": float(run.layout.num_reverted)}
    failed = {"tests_passed_frac": 0.0, "all_passed": 0.0}
    problem = run.problem
    if not problem and run.driver is not None and run.driver.timed_out:
        problem = "the tests did not finish in time"
    if problem or run.driver is None or run.report is None:
        tail = run.driver.log_tail[-1500:] if run.driver else ""
        return RewardResult(0.0, {**base, "grading_error": 1.0, **failed},
                            f"grading error: {problem}\n{tail}".strip())
    tampered = _tamper_findings(run, sentinel)
    if tampered:
        return RewardResult(0.0, {**base, "tamper_detected": 1.0, **failed},
                            "tampering detected: " + "; ".join(tampered))
    if run.driver.exit_code != 1 or any(
            run.report.outcome(i) is Outcome.MISSING for i in sentinel.node_ids):
        # Interrupted, an internal error, or a crash before the sentinels ran.
        return RewardResult(0.0, {**base, "grading_error": 1.0, **failed},
                            f"grading error: the test run did not complete (pytest exit code "
                            f"{run.driver.exit_code})\n{run.driver.log_tail[-1500:]}")
    return _score_tests(task, run, base, partial_credit)


def _score_tests(task: Task, run: GradingRun, base: dict[str, float],
                 partial_credit: bool) -> RewardResult:
    results = expected_tests(task, run.report)
    passed = [t for t, o in results if o is Outcome.PASSED]
    failed = [(t, o) for t, o in results if o is not Outcome.PASSED]
    frac = len(passed) / len(results) if results else 0.0
    all_passed = bool(results) and not failed
    components = {**base, "tests_passed_frac": frac, "all_passed": float(all_passed),
                  "num_tests": float(len(results))}
    outcome = dict(results)
    for name, ids in (("fail_to_pass", task.fail_to_pass), ("pass_to_pass", task.pass_to_pass)):
        if ids:
            components[f"{name}_frac"] = sum(outcome[i] is Outcome.PASSED for i in ids) / len(ids)
    reward = frac if partial_credit else float(all_passed)
    listed = ", ".join(f"{t} ({o.value})" for t, o in failed[:MAX_LISTED_FAILURES])
    num_unlisted = len(failed) - MAX_LISTED_FAILURES
    more = f" and {num_unlisted} more" if num_unlisted > 0 else ""
    detail = f"{len(passed)}/{len(results)} expected tests passed" + (
        f"; not passing: {listed}{more}" if failed else "") + (
        "" if results else "; no expected test was found")
    return RewardResult(reward, components, detail)
