"""The swebench log-parser grading path: tasks whose tests are not pytest node ids
(Task.test_command + Task.log_parser: django's runtests.py, sympy's bin/test, a
unittest-style runner) are graded the way SWE-bench grades them upstream, by the
`swebench` package's parser of the runner's output, inside the same hardened set-up as
the pytest path (reward.grading.hidden_tests):

    grading folder (base, protected paths reverted, test patch, agent's changes) in a
    fresh sandbox of the task's image, test files root-owned
      -> driver (command mode): runs the test command; its stdout+stderr are one pipe the
         driver drains as it comes, so no line can be edited or removed afterwards; kills
         everything else; re-hashes protected files
      -> out/log.txt (hash on the driver's line) -> swebench parser -> test -> Outcome

What the parser reads is what the runner's processes printed, which includes whatever
the agent's code prints while the tests call it: the output is produced where the
agent cannot edit it after the fact or add hooks (test files, runner, config and
start-up files are reverted and hashed), but a print from inside a called function
lands in the same stream. Two checks catch forged lines: a test reported with both a
passing and a failing status (a fake "... ok" next to the real "... FAIL"), and a
non-zero exit with no failing test in the log (swebench's own cross-check). Both score
0 with `tamper_detected`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable

from envs.types import Task
from reward.grading.prepare import GRADER_DIR, OUT_DIR, GradingLayout, config_names
from reward.grading.hacking import Finding
from reward.grading.junit import Outcome

GRADER_PATH = "swebench_log"  # this grader's name in the graded_by_* component
MAX_LOG_BYTES = 32 << 20
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
                    repo="", version="", FAIL_TO_PASS=list(task.fail_to_pass),
                    PASS_TO_PASS=list(task.pass_to_pass), log_parser=task.log_parser or "")


def command_settings(task: Task, layout: GradingLayout, nonce: str, timeout_s: float,
                     workdir: str) -> dict[str, Any]:
    """The driver's settings in command mode (see reward.grading.driver)."""
    assert task.test_command is not None
    return {"nonce": nonce, "workspace": workdir, "command": ["bash", "-c", task.test_command],
            "timeout_s": max(1.0, timeout_s), "out_dir": OUT_DIR,
            "max_log_bytes": MAX_LOG_BYTES, "protected": dict(layout.protected),
            "config_names": list(config_names()),
            "known_config_files": list(layout.config_files),
            "skip_top_dirs": [".git", GRADER_DIR]}


def parse_statuses(task: Task, log: str) -> tuple[dict[str, Outcome], list[Finding]]:
    """test -> Outcome as swebench's parser reads `log`, and the forged-line findings
    (a test both passing and failing, line by line)."""
    assert task.log_parser is not None
    parse = log_parser(task.log_parser)
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
