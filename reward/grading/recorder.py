"""The recorder: a pytest plugin the grading start-up (reward.grading.boot) loads before any
workspace file is importable. It streams what happens, as it happens, to reward.grading.driver
over an inherited pipe, one authenticated record per line:

    <json> <mac>     json = {"s": seq, "k": kind, ...}; mac = HMAC-SHA256(key, json)[:32]

kinds: `runner` (first, from reward.grading.boot before any workspace file is importable: which
pytest runs, its version and whether it is the image's own or the grader's bundled one),
`item` (each collected test, in run order, with its kind), `collect_error`,
`begin`/`end` (around each test's protocol), `report` (each setup/call/teardown report),
`call` (around the test function's own call: was it called, did it raise, is it the
function defined in the test's file), `finish` (the exit status).

A record cannot be taken back once written, so rewriting results after the fact (the
JUnit file at exit, a daemon) disagrees with the stream; the key keeps code that merely
finds the pipe from writing records the driver accepts; the `call` record is observed
beneath every hook, so a report forced to "passed" over a raising test disagrees with
it. Code that runs in this process can still find the key in memory, wrap `_emit`
through the plugin manager or call the recorder itself, and so forge a consistent
stream: the stream is a tripwire, not proof; see reward.grading.crosscheck and
reward.grading.sentinels for what holds.

It runs under whichever pytest grades (the image's own, 6.2 to 9, on Python 3.8 to 3.11,
or the bundled one): old-style hook wrappers (`hookwrapper=True`, pluggy 0.12 onwards;
new-style `wrapper=True` needs pluggy 1.2), the test's file from `path` or, before pytest
7, `fspath`, and no syntax or standard-library API newer than Python 3.8.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import os
from collections.abc import Generator
from typing import Any

import pytest

MAC_HEX = 32


def item_kind(item: pytest.Item) -> str:
    """'function' for plain pytest functions (whose call the recorder observes),
    'unittest' for unittest.TestCase methods, 'other' for anything else."""
    from _pytest.unittest import TestCaseFunction

    if isinstance(item, TestCaseFunction):
        return "unittest"
    return "function" if isinstance(item, pytest.Function) else "other"


def item_path(item: pytest.Item) -> object:
    """The item's file: `path` (pytest 7 onwards) or `fspath` (before)."""
    path = getattr(item, "path", None)
    return path if path is not None else item.fspath


def defined_in_file(function: Any, path: str) -> bool:
    """Whether `function` (through its decorators' __wrapped__) is code of file `path`."""
    try:
        code = inspect.unwrap(function).__code__
    except (AttributeError, ValueError):
        return False
    return os.path.realpath(code.co_filename) == os.path.realpath(path)


class Recorder:
    """The plugin object (see the module docstring)."""

    def __init__(self, fd: int, key: bytes) -> None:
        self._fd = fd
        self._key = key
        self._seq = 0

    def _emit(self, record_kind: str, **fields: Any) -> None:
        body = json.dumps({"s": self._seq, "k": record_kind, **fields}, separators=(",", ":"))
        self._seq += 1
        mac = hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()[:MAC_HEX]
        data = f"{body} {mac}\n".encode()
        while data:
            data = data[os.write(self._fd, data):]

    def runner(self, version: str, source: str) -> None:
        """The first record: which pytest runs (reward.grading.boot, before the workspace is
        importable)."""
        self._emit("runner", version=version, source=source)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            self._emit("item", id=item.nodeid, kind=item_kind(item))

    @pytest.hookimpl(tryfirst=True)
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._emit("collect_error", id=report.nodeid)

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, Any, None]:
        self._emit("begin", id=item.nodeid)
        try:
            yield
        finally:
            self._emit("end", id=item.nodeid)

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> Generator[None, Any, None]:
        """Innermost around the call: the test function is wrapped so its own call is
        seen, whatever the hooks above report."""
        original = pyfuncitem.obj
        called = []

        def observed(*args: Any, **kwargs: Any) -> Any:
            called.append(True)
            return original(*args, **kwargs)

        pyfuncitem.obj = observed
        raised = True
        try:
            # An old-style wrapper gets the outcome (its exception, if any) from the yield.
            outcome = yield
            raised = outcome.excinfo is not None
        finally:
            pyfuncitem.obj = original
            self._emit("call", id=pyfuncitem.nodeid, called=bool(called), raised=raised,
                       own=defined_in_file(original, str(item_path(pyfuncitem))))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._emit("report", id=report.nodeid, when=report.when, outcome=report.outcome)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
        self._emit("finish", status=int(exitstatus))
