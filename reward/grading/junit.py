"""Per-test outcomes from a pytest JUnit XML report, keyed by pytest node id.

pytest names a test in JUnit as (classname, name): the node id's file path with '/' made
'.' and '.py' dropped, joined with its classes, and the function name with its
parameters. `junit_key` computes that pair for a node id, so the grader can look its
expected tests up. The report is written by a process that ran the agent's code, so it
is parsed defensively: bounded size, no DTD, malformed input is an error value.
"""

from __future__ import annotations

import enum
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass

MAX_REPORT_BYTES = 32 << 20


class Outcome(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"  # an assertion or exception in the test
    ERROR = "error"  # setup/teardown or collection error
    SKIPPED = "skipped"  # skipped or xfailed: not a pass
    MISSING = "missing"  # not in the report at all


_RANK = {Outcome.PASSED: 0, Outcome.SKIPPED: 1, Outcome.FAILED: 2, Outcome.ERROR: 3}


@dataclass(frozen=True, slots=True)
class JUnitReport:
    """Outcomes by (classname, name); a test reported more than once keeps its worst."""

    cases: Mapping[tuple[str, str], Outcome]

    def outcome(self, node_id: str) -> Outcome:
        """The test's outcome; a node id without parameters whose test is parametrized
        stands for all its parametrizations (the worst outcome of them)."""
        key = junit_key(node_id)
        if key in self.cases:
            return self.cases[key]
        if "[" in key[1]:
            return Outcome.MISSING
        variants = [o for (c, n), o in self.cases.items()
                    if c == key[0] and n.startswith(key[1] + "[")]
        return max(variants, key=_RANK.__getitem__) if variants else Outcome.MISSING

    def keys_under(self, classname_prefix: str) -> list[tuple[str, str]]:
        """Reported entries of the tests under a module path: tests whose classname starts
        with it, and the collection errors of its modules (reported with an empty
        classname and the module path as name), so a module that fails to import still
        counts as a failure."""
        def under(value: str) -> bool:
            return value == classname_prefix or value.startswith(classname_prefix + ".")
        return sorted(k for k in self.cases if under(k[0]) or (k[0] == "" and under(k[1])))


def junit_key(node_id: str) -> tuple[str, str]:
    """(classname, name) pytest's junitxml plugin writes for `node_id`."""
    path, _, tail = node_id.partition("::")
    # The parameters are split off the names first: they may contain '::' themselves.
    names_part, bracket, params = tail.partition("[")
    names = [re.sub(r"\.py$", "", path.replace("/", ".")), *names_part.split("::")]
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def module_classname(path: str) -> str:
    """The classname prefix of the tests of a test file or folder path."""
    return re.sub(r"\.py$", "", path.strip("/").replace("/", "."))


def parse_junit(data: bytes) -> JUnitReport:
    """Parse a report; ValueError for anything that is not a plain pytest JUnit XML."""
    if len(data) > MAX_REPORT_BYTES:
        raise ValueError(f"JUnit report of {len(data)} bytes is over {MAX_REPORT_BYTES}")
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        # pytest never writes a DTD; refusing one rules out entity-expansion bombs.
        raise ValueError("JUnit report holds a DTD, which pytest never writes")
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        raise ValueError(f"JUnit report is not well-formed XML: {exc}") from None
    cases: dict[tuple[str, str], Outcome] = {}
    for case in root.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        outcome = _case_outcome(case)
        previous = cases.get(key)
        if previous is None or _RANK[outcome] > _RANK[previous]:
            cases[key] = outcome
    return JUnitReport(cases)


def _case_outcome(case: ET.Element) -> Outcome:
    tags = {child.tag for child in case}
    if "error" in tags:
        return Outcome.ERROR
    if "failure" in tags:
        return Outcome.FAILED
    if "skipped" in tags:
        return Outcome.SKIPPED
    return Outcome.PASSED
