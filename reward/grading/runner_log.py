"""A strict reader of a repository runner's own output (the swebench log path): the
grammar unittest's verbose runner writes (django's `tests/runtests.py`, `python -m unittest
-v`, any TextTestRunner with verbosity 2), read line by line into statuses, the failure
headers and the runner's own totals, and every way those disagree.

swebench's parsers are lenient by design (a status anywhere a line ends, a failure header
keyed by the bare method name); the test process runs the agent's code and writes to the
same stream, so leniency is what a forger uses. Here only well-formed lines count:

    <name> (<module.Class[.name]>) ... <status>     (or the name line, then the docstring
                                                    line ending in ' ... <status>')
        output the test printed may come between ' ... ' and the status
    ======  FAIL|ERROR: <full description>  ------  traceback          (the error list)
    ------
    Ran N tests in T.TTTs
    OK | FAILED (failures=k, errors=m, skipped=s, expected failures=x, unexpected successes=u)

Problems (each makes the run tampered, reward.grading.swebench_log):
- output: a test reported twice or with two statuses (a printed `ok` before the real
  `FAIL`), a grammar line holding control or escape characters, status lines after the
  totals, a failure header without the matching status (keyed by the full description);
- totals: no `Ran N tests` line or no result line after it, more than one, or counts
  (N, failures, errors, skipped, expected failures, unexpected successes, django's
  `Found N test(s).`) that disagree with the status lines read.

What it cannot see: a consistent forgery from the first byte to the last (the agent's
code prints a whole plausible run and exits, or redirects the real stream): the grammar
and the totals agree with themselves; the mutation sentinels (reward.grading.runner_tests)
are what such a forgery must get right without knowing which tests they are.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from reward.grading.junit import Outcome

SEPARATOR1, SEPARATOR2 = "=" * 70, "-" * 70
MAX_NAMED = 5  # tests named per problem
_DESC = r"(?P<name>[A-Za-z_]\w*) \((?P<where>[A-Za-z_][\w.]*)\)"
_START = re.compile(rf"^(?P<sub>  )?{_DESC}(?P<params> \(.*?\))? \.\.\. (?P<rest>.*)$")
_NAME_LINE = re.compile(rf"^{_DESC}$")
_STATUS = re.compile(r"(?:ok|FAIL|ERROR|skipped (?:'.*'|\".*\")|expected failure|"
                     r"unexpected success)")
_GLUED = re.compile(rf"(?P<status>{_STATUS.pattern})$")
_HEADER = re.compile(rf"^(?P<flavour>FAIL|ERROR|UNEXPECTED SUCCESS): {_DESC}"
                     r"(?P<params> \(.*\))?$")
_RAN = re.compile(r"^Ran (?P<n>\d+) tests? in \d+\.\d+s$")
_RESULT = re.compile(r"^(?:(?P<word>OK|FAILED)(?: \((?P<infos>[^()]*)\))?|NO TESTS RAN)$")
_FOUND = re.compile(r"^Found (?P<n>\d+) test\(s\)\.$")
# C0 controls but tab and newline, DEL, C1 controls: a runner never writes them into its
# own lines; terminal escapes placed before a status hide it from a line-based parser.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")
_FIXTURES = frozenset({"setUpClass", "tearDownClass", "setUpModule", "tearDownModule"})
# An expected failure is no pass (swebench's django parser does not count it as one; code
# that marks a failing test as expected to fail gains nothing).
_OUTCOMES = {"ok": Outcome.PASSED, "FAIL": Outcome.FAILED, "ERROR": Outcome.ERROR,
             "expected failure": Outcome.SKIPPED, "unexpected success": Outcome.FAILED}
_INFO_KEYS = ("failures", "errors", "skipped", "expected failures", "unexpected successes")


def unittest_key(description: str) -> str | None:
    """`name (module.Class)` for a test description in either of unittest's forms
    (`name (module.Class.name)` from Python 3.11, `name (module.Class)` before); None if
    it is not one."""
    m = _NAME_LINE.match(description.strip())
    return None if m is None else _key(m["name"], m["where"])


def _key(name: str, where: str) -> str:
    return f"{name} ({where.removesuffix('.' + name) if where != name else where})"


def outcome_of(status: str) -> Outcome:
    return Outcome.SKIPPED if status.startswith("skipped") else _OUTCOMES[status]


@dataclass(slots=True)
class _Test:
    """One top-level test as its status lines show it."""

    key: str
    statuses: list[str] = field(default_factory=list)
    last_output: str = ""  # its last line of printed output (a status may end it)
    subtests: list[tuple[str, str]] = field(default_factory=list)  # (params, status)


@dataclass(frozen=True, slots=True)
class RunnerLog:
    """What a runner's output says, read strictly."""

    statuses: Mapping[str, Outcome]  # unittest_key -> outcome, from well-formed lines only
    output_problems: tuple[str, ...]  # malformed, duplicated or contradictory lines
    totals_problems: tuple[str, ...]  # totals missing, repeated or disagreeing
    failed: bool | None  # the result line says FAILED (None: no result line was read)


@dataclass(slots=True)
class _Reader:
    tests: dict[str, _Test] = field(default_factory=dict)
    fixtures: list[tuple[str, str]] = field(default_factory=list)  # (key, status)
    headers: list[tuple[str, str]] = field(default_factory=list)  # (flavour, key + params)
    output: list[str] = field(default_factory=list)
    totals: list[str] = field(default_factory=list)
    found: list[int] = field(default_factory=list)
    ran: list[int] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    # A docstring's first line -> its test: swebench's parser names such tests by it.
    aliases: dict[str, str] = field(default_factory=dict)
    current: _Test | None = None

    def start(self, key: str, rest: str) -> None:
        self.close()
        name = key.split(" ", 1)[0]
        if name in _FIXTURES:
            if _STATUS.fullmatch(rest):
                self.fixtures.append((key, rest))
            else:
                self.output.append(f"class or module fixture {key} has no status on its line")
            return
        if key in self.tests:
            self.output.append(f"{key} is reported more than once")
        test = self.tests[key] = _Test(key)
        self.current = test
        if _STATUS.fullmatch(rest):
            test.statuses.append(rest)
        else:
            test.last_output = rest

    def body_line(self, line: str) -> None:
        if self.current is None:
            return
        if _STATUS.fullmatch(line):
            self.current.statuses.append(line)
        elif line:
            self.current.last_output = line

    def close(self) -> None:
        test, self.current = self.current, None
        if test is None or test.statuses:
            if test is not None and len(test.statuses) > 1:
                self.output.append(f"{test.key} has {len(test.statuses)} statuses "
                                   f"({', '.join(test.statuses)})")
            return
        glued = _GLUED.search(test.last_output)
        if glued:  # output without a final newline, then the status
            test.statuses.append(glued["status"])


def read_unittest_log(log: str, found_line: bool = True) -> RunnerLog:
    """The statuses and problems of unittest-verbose output (see the module docstring).
    `found_line`: check django's `Found N test(s).` against the totals where present."""
    reader = _Reader()
    lines = log.split("\n")
    section = "status"
    after_separator = False
    skip_next = False
    for number, raw in enumerate(lines):
        if skip_next:
            skip_next = False
            continue
        line = raw
        if _CONTROL.search(raw):
            clean = _CONTROL.sub("", _ESCAPE.sub("", raw))
            if " ... " in clean or _looks_like_grammar(clean):
                reader.output.append(f"line {number + 1} holds control characters: "
                                     f"{raw[:80]!r}")
                continue
        if section == "status":
            if line == SEPARATOR1:
                reader.close()
                section, after_separator = "errors", True
                continue
            if line == SEPARATOR2 and number + 1 < len(lines) and _RAN.match(lines[number + 1]):
                reader.close()
                section = "totals"
                continue
            if _FOUND.match(line):
                reader.found.append(int(_FOUND.match(line)["n"]))  # type: ignore[index]
                continue
            m = _START.match(line)
            if m and not m["sub"]:
                reader.start(_key(m["name"], m["where"]), m["rest"])
            elif m:
                _subtest(reader, _key(m["name"], m["where"]), m["params"] or "", m["rest"])
            elif (_NAME_LINE.match(line) and number + 1 < len(lines)
                  and " ... " in lines[number + 1]):
                doc = _NAME_LINE.match(line)
                assert doc is not None
                described, _, rest = lines[number + 1].partition(" ... ")
                reader.start(_key(doc["name"], doc["where"]), rest)
                reader.aliases.setdefault(described.strip(), _key(doc["name"], doc["where"]))
                skip_next = True
            elif _RAN.match(line) or _RESULT.match(line):
                reader.totals.append(f"line {number + 1} ({line!r}) is not where the totals go")
            else:
                reader.body_line(line)
        elif section == "errors":
            header = _HEADER.match(line)
            if header and (after_separator or line.startswith("UNEXPECTED SUCCESS")):
                reader.headers.append((header["flavour"],
                                       _key(header["name"], header["where"])
                                       + (header["params"] or "")))
            elif line == SEPARATOR2 and number + 1 < len(lines) and _RAN.match(lines[number + 1]):
                section = "totals"
            after_separator = line == SEPARATOR1
        else:
            _totals_line(reader, line, number)
    reader.close()
    return _verdict(reader, found_line)


def _looks_like_grammar(line: str) -> bool:
    text = line.strip()
    return bool(_STATUS.fullmatch(text) or _HEADER.match(text) or _RAN.match(text)
                or _RESULT.match(text) or _START.match(text))


def _subtest(reader: _Reader, key: str, params: str, rest: str) -> None:
    parent = reader.tests.get(key)
    if parent is None or not _STATUS.fullmatch(rest):
        reader.output.append(f"subtest line of {key}{params} is malformed or has no test")
        return
    if (params, rest) in parent.subtests:
        reader.output.append(f"subtest {key}{params} is reported more than once")
    parent.subtests.append((params, rest))


def _totals_line(reader: _Reader, line: str, number: int) -> None:
    if _RAN.match(line):
        reader.ran.append(int(_RAN.match(line)["n"]))  # type: ignore[index]
    elif _RESULT.match(line) and len(reader.results) < len(reader.ran):
        reader.results.append(line)
    elif line.strip() and not reader.results:
        reader.totals.append(f"line {number + 1} ({line[:60]!r}) comes between the totals")
    elif _START.match(line) or _HEADER.match(line) or _RESULT.match(line):
        reader.output.append(f"line {number + 1} ({line[:60]!r}) comes after the totals")


def _verdict(reader: _Reader, found_line: bool) -> RunnerLog:
    statuses: dict[str, Outcome] = {}
    reported: Counter[tuple[str, str]] = Counter()
    for test in reader.tests.values():
        outcomes = [outcome_of(s) for s in test.statuses[:1]]
        outcomes += [outcome_of(s) for _, s in test.subtests]
        failing = [o for o in outcomes if o in (Outcome.FAILED, Outcome.ERROR)]
        statuses[test.key] = (failing[0] if failing else outcomes[0] if outcomes
                              else Outcome.MISSING)
        for status in test.statuses[:1]:
            reported[(_flavour(status), test.key)] += 1
        for params, status in test.subtests:
            reported[(_flavour(status), test.key + params)] += 1
    for key, status in reader.fixtures:
        reported[(_flavour(status), key)] += 1
    for alias, key in reader.aliases.items():
        statuses.setdefault(alias, statuses[key])
    # Every FAIL/ERROR status has its header and the other way round; unexpected
    # successes are listed only from Python 3.11 on, so a listed one needs its status.
    headers = Counter(h for h in reader.headers if h[0] != "UNEXPECTED SUCCESS")
    listed = Counter({k: n for k, n in reported.items() if k[0] in ("FAIL", "ERROR")})
    unexpected = Counter(h for h in reader.headers if h[0] == "UNEXPECTED SUCCESS")
    output = list(reader.output)
    unmatched = sorted({f"{f}: {k}" for f, k in
                        (headers - listed) + (listed - headers) + (unexpected - reported)})
    if unmatched:
        output.append(f"failure headers and status lines disagree: {unmatched[:MAX_NAMED]}")
    totals = list(reader.totals)
    failed = None
    if len(reader.ran) != 1 or len(reader.results) != 1:
        totals.append(f"the runner's totals are missing or repeated ({len(reader.ran)} "
                      f"'Ran N tests' lines, {len(reader.results)} result lines)")
    else:
        failed, counted = _check_totals(reader, reported, totals)
        if found_line and any(n != counted for n in reader.found):
            totals.append(f"'Found {reader.found} test(s)' but {counted} tests reported")
    return RunnerLog(statuses, tuple(output), tuple(totals), failed)


def _flavour(status: str) -> str:
    return {"ok": "ok", "FAIL": "FAIL", "ERROR": "ERROR", "expected failure": "xfail",
            "unexpected success": "UNEXPECTED SUCCESS"}.get(status, "skipped")


def _check_totals(reader: _Reader, reported: Counter[tuple[str, str]],
                  totals: list[str]) -> tuple[bool, int]:
    """Whether the result line says FAILED, and the number of tests the status lines
    show; disagreements go to `totals`."""
    [ran], [result] = reader.ran, reader.results
    counted = len(reader.tests)
    if ran != counted:
        totals.append(f"'Ran {ran} tests' but {counted} tests have status lines")
    m = _RESULT.match(result)
    assert m is not None
    infos = dict(_info(part) for part in (m["infos"] or "").split(", ") if part)
    by_flavour = Counter(f for f, _ in reported.elements())
    want = {"failures": by_flavour["FAIL"], "errors": by_flavour["ERROR"],
            "skipped": by_flavour["skipped"], "expected failures": by_flavour["xfail"],
            "unexpected successes": by_flavour["UNEXPECTED SUCCESS"]}
    got = {k: infos.get(k, 0) for k in _INFO_KEYS}
    if got != want or any(k not in _INFO_KEYS for k in infos):
        totals.append(f"the result line {result!r} disagrees with the status lines {want}")
    failed = m["word"] == "FAILED"
    should_fail = bool(want["failures"] or want["errors"] or want["unexpected successes"])
    if m["word"] is not None and failed != should_fail:
        totals.append(f"the result line says {m['word']} but the status lines "
                      f"{'do' if should_fail else 'do not'} show failures")
    return failed, counted


def _info(part: str) -> tuple[str, int]:
    name, _, value = part.partition("=")
    return name, int(value) if value.isdigit() else -1
