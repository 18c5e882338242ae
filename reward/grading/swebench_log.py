"""The swebench log-parser grading path: tasks whose tests are not pytest node ids
(GradingSpec.test_command + log_parser: django's runtests.py, sympy's bin/test, a
unittest-style runner) are graded the way SWE-bench grades them upstream, by the
runner's own output, inside the same hardened set-up as the pytest path
(reward.grading.hidden_tests):

    grading folder (base, protected paths reverted: tests, config, and the scripts the
    command runs with the runner modules they import (reward.grading.runner_tests);
    test patch; mutation sentinels among the expected tests; agent's changes) in a
    fresh sandbox of the task's image, test and runner files root-owned and hashed
      -> driver (command mode): runs the test command; its stdout+stderr are one pipe the
         driver drains as it comes, so no line can be edited or removed afterwards; kills
         everything else; re-hashes protected files
      -> out/log.txt (hash on the driver's line) -> strict reader -> test -> Outcome

The runner's process runs the agent's code, which writes to the same stream, so the
output is evidence, not a verdict. Where the format has a strict reader (unittest's
verbose output: parse_log_django; reward.grading.runner_log) statuses come only from
well-formed lines, and the run is tampered (score 0, `tamper_detected`) when
- a status line is malformed, repeated or holds control characters, a test has two
  statuses, or a failure header (keyed by its full description) has no matching status
  (`hack_runner_output`);
- the runner's totals (`Ran N tests`, the OK/FAILED line and its counts, django's
  `Found N test(s).`) are missing, repeated or disagree with the statuses, or a single
  command exited 0 under a FAILED result line (`hack_runner_totals`);
- a mutation sentinel passed, was skipped alone, or is missing while its original ran
  (`hack_sentinel_passed`).
Other parsers (sympy's, the pytest-output ones) keep swebench's statuses with two weaker
checks: a test reported both passing and failing, a non-zero exit with no failing test
(`hack_report_disagreed`), and no sentinels (their ids are not unittest descriptions).

What remains possible: a forgery consistent from the first line to the last (the agent's
code prints a whole plausible run and exits, or redirects the real stream and patches
the result) that also reports every sentinel failing, which needs telling the sentinels
from their originals (see reward.grading.runner_tests); the static detector
(reward.grading.hacking) is the second line there. Two runner invocations in one command
read as repeated totals (tampered): such rows need one command per run.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from envs.types import Task
from reward.grading.hacking import Finding
from reward.grading.junit import Outcome
from reward.grading.prepare import GRADER_DIR, OUT_DIR, GradingLayout, config_names
from reward.grading.runner_log import read_unittest_log, unittest_key
from reward.grading.sentinels import Sentinel

GRADER_PATH = "swebench_log"  # this grader's name in the graded_by_* component
MAX_LOG_BYTES = 32 << 20
# Parsers whose output reward.grading.runner_log reads strictly.
STRICT_PARSERS = frozenset({"parse_log_django"})
MAX_NAMED = 5
_STATUS = {"PASSED": Outcome.PASSED, "XFAIL": Outcome.PASSED, "FAILED": Outcome.FAILED,
           "ERROR": Outcome.ERROR, "SKIPPED": Outcome.SKIPPED}


@functools.cache
def log_parser(name: str) -> Callable[..., dict[str, str]]:
    """swebench's parser called `name`; ValueError naming the known ones."""
    try:
        from swebench.harness.log_parsers import PARSER_REGISTRY  # deferred: ~1.5 s
    except ImportError as exc:
        raise ValueError("grading with a log parser needs the swebench package: pip install "
                         "'swebench==5.0.2' (the `swe` extra)") from exc
    if name not in PARSER_REGISTRY:
        raise ValueError(f"log_parser {name!r} is not one of swebench's parsers; use one of "
                         f"{sorted(k for k in PARSER_REGISTRY if 'py' in k or 'django' in k)}")
    return PARSER_REGISTRY[name]


def _test_spec(task: Task) -> Any:
    from swebench.types import TestSpec

    return TestSpec(instance_id=task.id, image=task.image or "", eval_script_list=[],
                    repo="", version="", FAIL_TO_PASS=list(task.grading.fail_to_pass),
                    PASS_TO_PASS=list(task.grading.pass_to_pass), log_parser=task.grading.log_parser or "")


def command_settings(task: Task, layout: GradingLayout, nonce: str, timeout_s: float,
                     workdir: str) -> dict[str, Any]:
    """The driver's settings in command mode (see reward.grading.driver)."""
    assert task.grading.test_command is not None
    return {"nonce": nonce, "workspace": workdir, "command": ["bash", "-c", task.grading.test_command],
            "timeout_s": max(1.0, timeout_s), "out_dir": OUT_DIR,
            "max_log_bytes": MAX_LOG_BYTES, "protected": dict(layout.protected),
            "config_names": list(config_names()),
            "known_config_files": list(layout.config_files),
            "skip_top_dirs": [".git", GRADER_DIR]}


def parse_statuses(task: Task, log: str) -> tuple[dict[str, Outcome], list[Finding]]:
    """test -> Outcome as swebench's parser reads `log`, and the forged-line findings
    (a test both passing and failing, line by line)."""
    assert task.grading.log_parser is not None
    parse = log_parser(task.grading.log_parser)
    spec = _test_spec(task)
    statuses = {t: _STATUS.get(s, Outcome.FAILED) for t, s in parse(log, spec).items()}
    seen: dict[str, set[Outcome]] = {}
    for line in log.splitlines():
        if " ... " in line or line.startswith(("FAIL:", "ERROR:", "PASSED", "FAILED")):
            for test, status in parse(line, spec).items():
                seen.setdefault(test, set()).add(_STATUS.get(status, Outcome.FAILED))
    both = sorted(t for t, s in seen.items()
                  if Outcome.PASSED in s and s & {Outcome.FAILED, Outcome.ERROR})
    findings = [Finding("report_disagreed", f"tests reported both passing and failing in "
                        f"the runner's output: {both[:10]}")] if both else []
    return statuses, findings


def exit_code_finding(statuses: Mapping[str, Outcome], exit_code: int | None) -> list[Finding]:
    """swebench's cross-check: a runner that exits non-zero has a failing test in its log."""
    if exit_code not in (None, 0) and statuses and not any(
            o in (Outcome.FAILED, Outcome.ERROR) for o in statuses.values()):
        return [Finding("report_disagreed", f"the test command exited {exit_code} but its "
                        "output reports no failing test")]
    return []


def verify_log(task: Task, log: str, exit_code: int | None,
               sentinels: Iterable[Sentinel] = (),
               renamed: Mapping[str, str] | None = None) -> tuple[dict[str, Outcome], list[Finding]]:
    """test -> Outcome of every expected test, and the tampering findings of the run's
    output (see the module docstring). `renamed`: the real tests renamed in the grading
    folder beside their sentinels (runner id there -> the row's id)."""
    expected = task.grading.expected_tests
    if task.grading.log_parser not in STRICT_PARSERS:
        statuses, found = parse_statuses(task, log)
        found += exit_code_finding(statuses, exit_code)
        return {i: statuses.get(i, Outcome.MISSING) for i in expected}, found
    read = read_unittest_log(log)
    problems = list(read.output_problems)
    own = {unittest_key(new): unittest_key(old) for new, old in (renamed or {}).items()}
    ghosts = sorted(k for k in own.values() if k in read.statuses)
    if ghosts:  # the folder has no test of that name: someone printed the row's ids
        problems.append(f"tests reported under names the grading folder does not have: "
                        f"{ghosts[:MAX_NAMED]}")
    found = [Finding("runner_output", "; ".join(problems[:MAX_NAMED]))] if problems else []
    totals = list(read.totals_problems)
    if read.failed and exit_code == 0 and _single_command(task.grading.test_command or ""):
        totals.append("the test command exited 0 but the runner's result line says FAILED")
    if totals:
        found.append(Finding("runner_totals", "; ".join(totals[:MAX_NAMED])))
    statuses = {k: o for k, o in read.statuses.items() if k not in own.values()}
    statuses.update({old: read.statuses.get(new or "", Outcome.MISSING)
                     for new, old in own.items() if old is not None})

    def outcome(test_id: str) -> Outcome:
        return statuses.get(unittest_key(test_id) or test_id, Outcome.MISSING)

    found += sentinel_findings(sentinels, outcome)
    return {i: outcome(i) for i in expected}, found


def _single_command(command: str) -> bool:
    """One command line without shell operators: its exit status is the runner's."""
    return "\n" not in command.strip() and re.search(r"[;&|]", command) is None


def sentinel_findings(sentinels: Iterable[Sentinel],
                      outcome: Callable[[str], Outcome]) -> list[Finding]:
    """A mutation sentinel fails wherever its original passes; one that did not, while
    its original passed (or ran at all, for a missing or skipped one), means tampering.
    Beside an original that failed, a passing copy is the implementation's own wrong
    value (the reward already holds that failure)."""
    wrong = []
    for sentinel in sentinels:
        got = outcome(sentinel.node_id)
        original = outcome(sentinel.template_id) if sentinel.template_id else Outcome.PASSED
        if got in (Outcome.FAILED, Outcome.ERROR) or original in (Outcome.FAILED, Outcome.ERROR):
            continue
        if got in (Outcome.MISSING, Outcome.SKIPPED) and original is got:
            continue
        wrong.append(f"{sentinel.node_id} {got.value} (its original {original.value})")
    return [Finding("sentinel_passed", "mutation sentinels (copies of real tests expecting "
                    f"a changed value) did not fail: {wrong[:MAX_NAMED]}")] if wrong else []
