"""`HiddenTests`: the reward of test-graded tasks (bundled code tasks, SWE-style tasks).

The agent's final workspace is graded in a FRESH sandbox, never the one it worked in:

    task source --copy--> grading folder (host) <--changes-- WorkspaceChanges (agent's final state)
        protected paths reverted; then the test patch's result, hidden tests, sentinels
        among them, the grader's pytest config and the grading programs added
          |
          v  fresh sandbox (test files and their folders locked root-owned where the backend allows)
    driver (trusted, starts first) --runs--> boot -> pytest + recorder (runs the agent's code)
          |  streams authenticated records as tests run; kills everything else after;
          |  re-hashes protected files
          v
    one stdout line + report.xml + records.jsonl --> host: cross-check, verdict per test

Pass/fail per test comes only from the two accounts the driver vouches for (by hash on
its own stdout, which the agent's processes cannot reach): the recorder's stream and
pytest's JUnit report, which must agree (reward.grading.crosscheck), never from console output.
Both are written by the process that runs the agent's code, so neither is proof alone;
the mutation sentinels hidden among the tests (copies of real tests expecting changed
values, reward.grading.sentinels) must fail, and they are what holds against code that
lies from inside the run (what they leave open is in their module). Any disagreement or
tampering scores 0 (component `tamper_detected`) with its `hack_*` finding; the static
findings of the diff and the transcript (reward.grading.hacking) are added to every result, and
zero it under reward.hack_policy=zero. A workspace that could not be captured (over
envs.max_workspace_changes_mb, or the capture failed) is not graded: reward 0,
component `workspace_error`.

An image-only task (Task.workdir, e.g. /testbed) is graded the same way with its image's
repository as the base (read out on this node, envs.sandbox.images), the folder shown at
that path in a fresh container of the task's image, on the image's Python. A task graded
by its repository's own runner (GradingSpec.log_parser) runs that command through the driver's
command mode and swebench's parser instead of pytest (reward.grading.swebench_log). Components
`graded_by_<path>` and `graded_in_image` say which path graded it.

Which pytest: the sandbox Python's own where it imports a supported one (pytest 6.2 to 9
on Python 3.8 to 3.11: a task image's, with every protection above unchanged), else the
grader's bundled copy (reward.grading.runtime; pytest 9, Python >= 3.10). Component
`graded_with_image_pytest` and the detail's "graded with pytest X (image|bundled)" say
which; `use_image_pytest=False` forces the bundled one.
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
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from envs.sandbox.base import WORKSPACE_MOUNT, Sandbox, SandboxLimits, SandboxSpec
from envs.sandbox.images import task_source_dir
from envs.types import HIDDEN_TESTS_DIR, Task, Trajectory
from reward.base import RewardContext, RewardResult, SandboxFactory
from reward.grading.crosscheck import RunAccount, build_account, cross_check, restore_names
from reward.grading.prepare import (BOOT, DRIVER, GRADER_CONFIG, GRADER_DIR, OUT_DIR, RECORDER,
                            RUNTIME_ZIP, GradingLayout, build_grading_dir, config_names,
                            lock_protected)
from reward.grading.hacking import Finding, apply_findings, with_findings
from reward.grading.junit import MAX_REPORT_BYTES, JUnitReport, Outcome, junit_key, module_classname, \
    parse_junit
from reward.grading.runner_config import RUNNER_NAMES, shadow_names
from reward.grading import swebench_log
from reward.grading.runtime import runtime_preload
from reward.workspace import WorkspaceChanges

log = logging.getLogger(__name__)

GRADING_LIMITS = SandboxLimits(memory_mb=2048, max_processes=128, cpu_time_s=300,
                               file_size_mb=256, disk_mb=2048)
MAX_LISTED_FAILURES = 10
MAX_STREAM_BYTES = 64 << 20
GRADER_PATH = "pytest_driver"  # this grader's name in the graded_by_* component


@dataclass(frozen=True, slots=True)
class DriverResult:
    """What the driver reported on its stdout line."""

    exit_code: int | None  # pytest's exit code; None when it had to be killed
    timed_out: bool
    report_sha256: str | None
    changed_protected: tuple[str, ...]
    new_config_files: tuple[str, ...]
    log_tail: str  # the end of pytest's console output: for humans only, never parsed
    stream_sha256: str | None = None  # of out/records.jsonl, the recorder's verified records
    stream_problems: tuple[str, ...] = ()  # lines of the stream the driver did not accept
    log_sha256: str | None = None  # of out/log.txt, the runner's output (command mode)
    pytest_version: str | None = None  # the pytest that ran (None: command mode, no record)
    pytest_source: str | None = None  # 'image' (the sandbox Python's own) or 'bundled'


@dataclass(frozen=True, slots=True)
class GradingRun:
    """Everything the verdict is computed from."""

    driver: DriverResult | None  # None: the driver's line never came (killed, crashed)
    report: JUnitReport | None
    problem: str  # why the run could not be read ('' if it could)
    layout: GradingLayout
    locked: bool
    account: RunAccount = dataclasses.field(default_factory=RunAccount)
    in_image: bool = False  # graded in a container of the task's own image
    log: str | None = None  # the runner's output, for a log parser (GradingSpec.log_parser)
    # Wall seconds of the phases: the grading folder (base copy, changes, test patch), the
    # fresh sandbox's create (container start), the driver's run (the tests)
    prepare_s: float = 0.0
    start_s: float = 0.0
    tests_s: float = 0.0


class HiddenTests:
    """Reward 1.0 when every expected test passes in the grading sandbox (SWE-bench's
    "resolved"), else 0.0; with `partial_credit`, the fraction of tests that pass.
    Expected tests: `task.grading.expected_tests` (fail_to_pass + pass_to_pass), or when both are empty,
    everything collected under the hidden tests folder."""

    def __init__(self, *, partial_credit: bool = False, limits: SandboxLimits = GRADING_LIMITS,
                 python: str = "python3", setup_margin_s: float = 20.0,
                 visible_tests_dir: str = "visible_tests", use_image_pytest: bool = True) -> None:
        self.partial_credit = partial_credit
        # The sandbox Python's own pytest where it has a supported one, else the bundled.
        self.use_image_pytest = use_image_pytest
        self.visible_tests_dir = visible_tests_dir  # as the sandbox tools' setting of that name
        self.limits = limits
        # The sandbox's interpreter: Python 3.8 onwards with its own pytest 6.2 onwards,
        # or Python 3.10 onwards for the bundled pytest 9.
        self.python = python
        self.setup_margin_s = setup_margin_s  # time kept for copying, creating, releasing

    async def __call__(self, trajectory: Trajectory, task: Task,
                       ctx: RewardContext) -> RewardResult:
        if task.source_dir is None and task.grading.hidden_tests is None and task.workdir is None:
            raise ValueError(f"task {task.id!r} has neither source_dir nor hidden_tests; "
                             "reward.grading.hidden_tests:HiddenTests grades test-graded tasks only")
        if not (task.grading.expected_tests or task.grading.hidden_tests):
            raise ValueError(f"task {task.id!r} names no tests: set fail_to_pass/pass_to_pass "
                             "or hidden_tests")
        if ctx.workspace is not None and ctx.workspace.problem:
            result = RewardResult(0.0, {"workspace_error": 1.0, "grading_error": 0.0,
                                        "tamper_detected": 0.0, "tests_passed_frac": 0.0,
                                        "all_passed": 0.0},
                                  f"not graded: {ctx.workspace.problem}")
        else:
            task = await asyncio.to_thread(with_image_source, task)
            run = await self.grade(task, ctx.workspace or WorkspaceChanges(), ctx)
            result = score_run(task, run, self.partial_credit)
            if result.components["tamper_detected"]:
                log.warning("task %s: %s", task.id, result.detail)
        # Parsing the agent's code reads files: off the event loop, as the folder work is.
        return await asyncio.to_thread(with_findings, result, task, ctx, self.visible_tests_dir)

    async def grade(self, task: Task, changes: WorkspaceChanges,
                    ctx: RewardContext) -> GradingRun:
        create = ctx.create_sandbox or _local_sandbox_factory()
        run_s = max(5.0, ctx.timeout_s - self.setup_margin_s)
        limits = dataclasses.replace(self.limits, cpu_time_s=math.ceil(run_s) + 1)
        # An image-only task: its base is the image's repository (read out on this node);
        # the grading folder is built from it and shown at the same path in a fresh
        # container of the image, whose Python and dependencies run the tests.
        task = await asyncio.to_thread(with_image_source, task)
        workdir = task.workdir or WORKSPACE_MOUNT
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="sluice-grade-") as tmp:
            dest = os.path.join(tmp, "workspace")
            os.mkdir(dest)
            layout = await asyncio.to_thread(build_grading_dir, task, changes, dest,
                                             self.visible_tests_dir, workdir=workdir)
            prepared = time.monotonic()
            sandbox = await create(SandboxSpec(source_dir=dest, image=task.image, limits=limits,
                                               workdir=workdir))
        started = time.monotonic()
        in_image = task.image is not None and sandbox.capabilities().backend != "local"
        phases = {"prepare_s": prepared - start, "start_s": started - prepared}
        try:
            locked = await asyncio.to_thread(lock_protected, sandbox, layout.protected)
            nonce = secrets.token_hex(8)
            settings = (driver_settings(layout, nonce, run_s - 3.0, workdir,
                                        self.use_image_pytest)
                        if task.grading.log_parser is None else
                        swebench_log.command_settings(task, layout, nonce, run_s - 3.0, workdir))
            result = await sandbox.exec([self.python, "-I", "-B", f"{workdir}/{DRIVER}"],
                                        run_s, stdin=json.dumps(settings))
            phases["tests_s"] = result.duration_s
            driver = parse_driver_line(result.stdout, nonce)
            if driver is None:
                problem = ("grading timed out" if result.timed_out else
                           f"the grading driver did not report (exit {result.exit_code}, "
                           f"oom_killed={result.oom_killed}): {result.stderr[-500:]}")
                return GradingRun(None, None, problem, layout, locked, in_image=in_image,
                                  **phases)
            if task.grading.log_parser is not None:
                data, problem = await _read_verified(sandbox, "log.txt", driver.log_sha256)
                log_text = None if data is None else data.decode("utf-8", "replace")
                return GradingRun(driver, None, problem, layout, locked, in_image=in_image,
                                  log=log_text, **phases)
            report, problem = await _read_report(sandbox, driver)
            account, stream_problem = await _read_stream(sandbox, driver)
            account, report = restore_names(account, report, layout.renamed)
            return GradingRun(driver, report, problem or stream_problem, layout, locked, account,
                              in_image=in_image, **phases)
        finally:
            await sandbox.release()


def with_image_source(task: Task) -> Task:
    """`task` with source_dir set to its image's repository (read out on this node) when
    it is image-only; unchanged otherwise."""
    source = task_source_dir(task)
    return task if source == task.source_dir else dataclasses.replace(task, source_dir=source)


def driver_settings(layout: GradingLayout, nonce: str, timeout_s: float,
                    workdir: str = WORKSPACE_MOUNT,
                    use_image_pytest: bool = True) -> dict[str, Any]:
    """What the driver gets on stdin: the pytest command line (the grader's own config,
    the folders it must not look above; every option in it exists from pytest 6.2 on),
    the programs, and what to check afterwards. `workdir` is where the grading sandbox
    shows the workspace."""
    config_dir = layout.source_config.rel_dir if layout.source_config else ""
    args = ["-c", f"{workdir}/{GRADER_CONFIG}", f"--rootdir={workdir}",
            f"--confcutdir={workdir}/{config_dir}".rstrip("/"), "-p", "no:cacheprovider",
            "--continue-on-collection-errors", "-q", "-o", "junit_logging=no"]
    if not layout.has_conftest:
        args.append("--noconftest")  # none in the source: any conftest.py is the agent's
    rules = layout.rules
    allowed = sorted(rules.source_modules & shadow_names()) if rules else []
    return {"nonce": nonce, "workspace": workdir,
            "runtime": f"{workdir}/{RUNTIME_ZIP}", "boot": f"{workdir}/{BOOT}",
            "recorder": f"{workdir}/{RECORDER}",
            "recorder_module": f"_grading_{secrets.token_hex(4)}",
            "preload": list(runtime_preload()), "shadow_allowed": allowed,
            "runner_names": sorted(RUNNER_NAMES), "use_image_pytest": use_image_pytest,
            # For a sandbox Python older than 3.10 (no sys.stdlib_module_names).
            "stdlib_names": sorted(sys.stdlib_module_names),
            "pytest_args": [*args, *layout.test_args], "timeout_s": max(1.0, timeout_s),
            "out_dir": OUT_DIR, "max_report_bytes": MAX_REPORT_BYTES,
            "max_stream_bytes": MAX_STREAM_BYTES, "protected": dict(layout.protected),
            "config_names": list(config_names()),
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
        runner = raw.get("pytest") or {}
        return DriverResult(exit_code=raw["exit_code"], timed_out=bool(raw["timed_out"]),
                            report_sha256=raw["report_sha256"],
                            changed_protected=tuple(raw["changed_protected"]),
                            new_config_files=tuple(raw["new_config_files"]),
                            log_tail=str(raw["log_tail"]),
                            stream_sha256=raw.get("stream_sha256"),
                            stream_problems=tuple(raw.get("stream_problems", ())),
                            log_sha256=raw.get("log_sha256"),
                            pytest_version=runner.get("version"),
                            pytest_source=runner.get("source"))
    except (ValueError, KeyError, TypeError):
        return None


async def _read_verified(sandbox: Sandbox, name: str,
                         digest: str | None) -> tuple[bytes | None, str]:
    if digest is None:
        return None, f"the driver wrote no {name}"
    try:
        data = await sandbox.read_file(f"{OUT_DIR}/{name}")
    except (FileNotFoundError, ValueError) as exc:
        return None, f"{name} could not be read: {exc}"
    if hashlib.sha256(data).hexdigest() != digest:
        return None, f"{name} does not match the hash the driver reported"
    return data, ""


async def _read_report(sandbox: Sandbox, driver: DriverResult) -> tuple[JUnitReport | None, str]:
    if driver.report_sha256 is None:
        return None, "pytest wrote no JUnit report (it crashed, exited early or was killed)"
    data, problem = await _read_verified(sandbox, "report.xml", driver.report_sha256)
    if data is None:
        return None, problem
    try:
        return parse_junit(data), ""
    except ValueError as exc:
        return None, str(exc)


async def _read_stream(sandbox: Sandbox, driver: DriverResult) -> tuple[RunAccount, str]:
    data, problem = await _read_verified(sandbox, "records.jsonl", driver.stream_sha256)
    if data is None:
        return RunAccount(), problem
    try:
        return build_account(json.loads(line) for line in data.splitlines() if line), ""
    except ValueError as exc:
        return RunAccount(), f"the driver's records are malformed: {exc}"


def expected_tests(task: Task, report: JUnitReport | None,
                   sentinel_ids: tuple[str, ...] = ()) -> list[tuple[str, Outcome]]:
    """(test, outcome) for every expected test; tests absent from the report count as
    missing (failed). Sentinels are never expected tests."""
    ids = list(task.grading.expected_tests)
    if ids:
        return [(i, report.outcome(i) if report else Outcome.MISSING) for i in ids]
    if report is None:
        return []
    sentinel_keys = {junit_key(i) for i in sentinel_ids}
    # A parametrized sentinel's cases carry their parameters after its name.
    return [(f"{c}::{n}" if c else n, report.cases[(c, n)])
            for c, n in report.keys_under(module_classname(HIDDEN_TESTS_DIR))
            if (c, n.partition("[")[0]) not in sentinel_keys]


def run_findings(run: GradingRun) -> list[Finding]:
    """What the run's own accounts show of tampering (reward.grading.crosscheck, the driver)."""
    assert run.driver is not None
    found = [] if run.log is not None else cross_check(
        run.account, run.report, run.driver.exit_code, run.driver.stream_problems,
        run.layout.sentinels)
    if run.log is not None and run.driver.stream_problems:
        found.append(Finding("report_disagreed", "the runner's output could not be captured "
                             f"whole: {list(run.driver.stream_problems)}"))
    if run.driver.changed_protected:
        found.append(Finding("files_tampered", "protected files changed during the run: "
                             f"{list(run.driver.changed_protected)}"))
    if run.driver.new_config_files:
        found.append(Finding("files_tampered", "config/startup files appeared during the "
                             f"run: {list(run.driver.new_config_files)}"))
    return found


def run_results(task: Task, run: GradingRun) -> tuple[list[tuple[str, Outcome]], list[Finding]]:
    """(test, outcome) of every expected test and the tampering findings of a run that
    completed: from the JUnit report (pytest path) or swebench's parser of the runner's
    output (log path)."""
    found = run_findings(run)
    if run.log is None:
        return expected_tests(task, run.report, tuple(s.node_id for s in run.layout.sentinels)), found
    assert run.driver is not None
    statuses, forged = swebench_log.verify_log(task, run.log, run.driver.exit_code,
                                               run.layout.sentinels, run.layout.renamed)
    return list(statuses.items()), found + forged


def grading_path(task: Task) -> str:
    """Which grader grades `task` (the graded_by_<path> component)."""
    return GRADER_PATH if task.grading.log_parser is None else swebench_log.GRADER_PATH


def score_run(task: Task, run: GradingRun, partial_credit: bool) -> RewardResult:
    """The reward and its components from a grading run (see HiddenTests)."""
    base = {"tamper_detected": 0.0, "grading_error": 0.0, "locked": float(run.locked),
            "reverted_changes": float(run.layout.num_reverted),
            # Which grading path graded it (counted in reward/graded_by_*).
            f"graded_by_{grading_path(task)}": 1.0, "graded_in_image": float(run.in_image)}
    if run.log is None and run.driver is not None:
        base["graded_with_image_pytest"] = float(run.driver.pytest_source == "image")
    failed = {"tests_passed_frac": 0.0, "all_passed": 0.0}
    problem = run.problem
    if not problem and run.driver is not None and run.driver.timed_out:
        problem = "the tests did not finish in time"
    if problem or run.driver is None or (run.report is None and run.log is None):
        tail = run.driver.log_tail[-1500:] if run.driver else ""
        return RewardResult(0.0, {**base, "grading_error": 1.0, **failed},
                            f"grading error: {problem}\n{tail}".strip())
    results, tampered = run_results(task, run)
    if tampered:
        result = RewardResult(0.0, {**base, "tamper_detected": 1.0, **failed},
                              "tampering detected")
        return apply_findings(result, tampered, "report")
    if run.log is None and run.driver.exit_code != 1:
        # Interrupted, an internal error, or a crash before the sentinels ran.
        return RewardResult(0.0, {**base, "grading_error": 1.0, **failed},
                            f"grading error: the test run did not complete (pytest exit code "
                            f"{run.driver.exit_code})\n{run.driver.log_tail[-1500:]}")
    scored = _score_tests(task, results, base, partial_credit)
    if run.log is None:
        scored = dataclasses.replace(scored, detail=f"{scored.detail}; graded with "
                                     f"{pytest_label(run.driver)}")
    return scored


def pytest_label(driver: DriverResult | None) -> str:
    """'pytest 7.4.4 (image)', 'pytest 9.0.2 (bundled)', or '-' where no pytest ran."""
    if driver is None or driver.pytest_version is None:
        return "-"
    return f"pytest {driver.pytest_version} ({driver.pytest_source})"


def _score_tests(task: Task, results: list[tuple[str, Outcome]], base: dict[str, float],
                 partial_credit: bool) -> RewardResult:
    passed = [t for t, o in results if o is Outcome.PASSED]
    failed = [(t, o) for t, o in results if o is not Outcome.PASSED]
    frac = len(passed) / len(results) if results else 0.0
    all_passed = bool(results) and not failed
    components = {**base, "tests_passed_frac": frac, "all_passed": float(all_passed),
                  "num_tests": float(len(results))}
    outcome = dict(results)
    for name, ids in (("fail_to_pass", task.grading.fail_to_pass), ("pass_to_pass", task.grading.pass_to_pass)):
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
