"""Mutation sentinels (reward.grading.mutation, reward.grading.sentinels): on every bundled
code task the reference solution passes every renamed original and fails every copy;
what counts as a changeable assertion and what does not; the copies' values are of the
original's type and style and the original sits anywhere in its group; the host maps
renamed tests back (reward.grading.crosscheck.restore_names); and the test-support
modules the trusted tests import are found by their import graph and protected
(reward.grading.import_graph, reward.grading.prepare)."""

from __future__ import annotations

import ast
import random
import sys
import types
from pathlib import Path

import pytest

from envs.tasks.code import all_specs
from envs.types import HIDDEN_TESTS_DIR, GradingSpec, Message, Task
from reward.grading.crosscheck import build_account, restore_names
from reward.grading.hacking import static_findings
from reward.grading.junit import JUnitReport, Outcome, junit_key
from reward.grading.mutation import mutation_sites, variants
from reward.grading.prepare import build_grading_dir
from reward.grading.sentinels import MUTATION, plant_mutation_sentinels
from reward.workspace import WorkspaceChanges


def run_test_functions(path: Path, module_name: str, module_source: str) -> dict[str, bool]:
    """name -> passed, for every top-level test function of the file at `path`, run with
    `module_source` importable as `module_name` (no pytest: plain asserts)."""
    module = types.ModuleType(module_name)
    exec(compile(module_source, f"{module_name}.py", "exec"), module.__dict__)
    saved = sys.modules.get(module_name)
    sys.modules[module_name] = module
    try:
        namespace: dict[str, object] = {}
        exec(compile(path.read_text(), str(path), "exec"), namespace)
        outcomes = {}
        for name, func in namespace.items():
            if name.startswith("test") and callable(func):
                try:
                    for kwargs in parametrizations(func):
                        func(**kwargs)  # type: ignore[operator]
                    outcomes[name] = True
                except AssertionError:
                    outcomes[name] = False
        return outcomes
    finally:
        if saved is None:
            sys.modules.pop(module_name, None)
        else:
            sys.modules[module_name] = saved


def parametrizations(func: object) -> list[dict[str, object]]:
    """The keyword arguments of each case of a function's parametrize marks."""
    cases: list[dict[str, object]] = [{}]
    for mark in getattr(func, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = [v.values if hasattr(v, "values") else v for v in values]
        rows = [tuple(r) if len(names) > 1 else (r,) for r in rows]
        cases = [{**c, **dict(zip(names, r))} for c in cases for r in rows]
    return cases


@pytest.mark.parametrize("seed", [0])
def test_reference_passes_every_original_and_fails_every_copy(tmp_path: Path, seed: int) -> None:
    num_with_copies = 0
    for spec in all_specs():
        folder = tmp_path / spec.name
        folder.mkdir()
        (folder / "test_h.py").write_text(spec.hidden_tests)
        planted = plant_mutation_sentinels(str(folder), ["test_h.py"], random.Random(seed))
        outcomes = run_test_functions(folder / "test_h.py", spec.stem, spec.reference)
        copies = {s.node_id.split("::")[-1] for s in planted.sentinels}
        assert all(s.kind == MUTATION for s in planted.sentinels)
        failing = {name for name, ok in outcomes.items() if not ok}
        assert failing == copies, (spec.name, failing ^ copies)
        # Every original is still there, once, under a new name or its own.
        originals = {own.split("::")[-1] for own in planted.renamed.values()}
        assert originals <= set(_test_names(spec.hidden_tests))
        assert len(outcomes) == len(_test_names(spec.hidden_tests)) + len(copies)
        num_with_copies += bool(copies)
    assert num_with_copies == len(all_specs())


def _test_names(source: str) -> list[str]:
    return [n.name for n in ast.parse(source).body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]


def sites_of(source: str) -> list[str]:
    tree = ast.parse(source)
    func = tree.body[-1]
    assert isinstance(func, ast.FunctionDef)
    sites = mutation_sites(func, source.splitlines(keepends=True))
    return [s.text for s in sorted(sites, key=lambda s: (s.line, s.start))]


@pytest.mark.parametrize("source, texts", [
    ("def test():\n    assert f(1) == 'abc'\n", ["'abc'"]),
    ("def test():\n    assert 12 == f(1)\n", ["12"]),
    ("def test():\n    assert f() == [1, 'x']\n", ["1", "'x'"]),
    ("def test():\n    assert f() == 'a' * 3 + \"b\"\n", ["'a'", "3", '"b"']),
    ("def test(self):\n    self.assertEqual(f(2), 2.5)\n", ["2.5"]),
    ("def test():\n    assert f(1)\n", ["f(1)"]),
    ("def test():\n    assert not f(1)\n", ["not f(1)"]),
    ("def test(self):\n    self.assertIsNone(f(1))\n", ["assertIsNone"]),
    # Not changeable: a name on the expected side, approx, both sides constant, inside a
    # loop or a with block, an escaped or hex literal, a test that may return early.
    ("def test(want):\n    assert f(1) == want\n", []),
    ("def test():\n    assert f(1) == approx(2.0)\n", []),
    ("def test():\n    assert 1 + 1 == 2\n", []),
    ("def test():\n    for x in xs:\n        assert f(x) == 1\n", []),
    ("def test():\n    with ctx():\n        assert f(1) == 1\n", []),
    ("def test():\n    assert f(1) == 'a\\n'\n", []),
    ("def test():\n    assert f(1) == 0x10\n", []),
    ("def test():\n    if g():\n        return\n    assert f(1) == 1\n", []),
    ("def test():\n    assert f(1) is None\n", []),
])
def test_what_can_be_changed(source: str, texts: list[str]) -> None:
    assert sites_of(source) == texts


def test_copies_keep_type_and_style_and_change_the_value() -> None:
    source = ("def test():\n    assert f() == \"ab1\"\n    assert f() == 7\n"
              "    assert f() == 0.25\n    assert f() == 'x' * 0 + 'y'\n")
    func = ast.parse(source).body[0]
    assert isinstance(func, ast.FunctionDef)
    for site in mutation_sites(func, source.splitlines(keepends=True)):
        made = variants(site, 3, random.Random(0))
        if site.text == "'x'":
            assert made is None  # 'x' * 0 is '' whatever 'x' is: the value would not change
            continue
        assert made is not None
        texts, at = made
        assert texts[at] == site.text and len(set(texts)) == 4
        values = [ast.literal_eval(t) for t in texts]
        assert all(type(v) is type(site.value) for v in values)
        if isinstance(site.value, str):
            assert all(t[0] == site.text[0] and len(t) == len(site.text) for t in texts)
        if isinstance(site.value, float):
            assert all(len(t.split(".")[1]) == 2 for t in texts)


def test_the_original_takes_every_place_in_its_group() -> None:
    source = "def test():\n    assert f() == 'abc'\n    assert g() == 40\n"
    func = ast.parse(source).body[0]
    assert isinstance(func, ast.FunctionDef)
    for site in mutation_sites(func, source.splitlines(keepends=True)):
        places = set()
        for seed in range(60):
            made = variants(site, 2, random.Random(seed))
            assert made is not None
            places.add(made[1])
        assert places == {0, 1, 2}


def test_the_host_maps_renamed_tests_back() -> None:
    renamed = {"t.py::test_x_more": "t.py::test_x", "t.py::C::test_y_2": "t.py::C::test_y"}
    records = [{"k": "item", "id": "t.py::test_x_more[a-1]", "kind": "function"},
               {"k": "begin", "id": "t.py::test_x_more[a-1]"},
               {"k": "report", "id": "t.py::test_x_more[a-1]", "when": "call",
                "outcome": "passed"},
               {"k": "report", "id": "t.py::C::test_y_2", "when": "call", "outcome": "failed"}]
    report = JUnitReport({junit_key("t.py::test_x_more[a-1]"): Outcome.PASSED,
                          junit_key("t.py::C::test_y_2"): Outcome.FAILED,
                          junit_key("t.py::test_other"): Outcome.PASSED})
    account, restored = restore_names(build_account(records), report, renamed)
    assert account.items == (("t.py::test_x[a-1]", "function"),)
    assert account.outcomes == {"t.py::test_x[a-1]": Outcome.PASSED,
                                "t.py::C::test_y": Outcome.FAILED}
    assert restored is not None
    assert restored.outcome("t.py::test_x") is Outcome.PASSED
    assert restored.outcome("t.py::C::test_y") is Outcome.FAILED
    assert restored.outcome("t.py::test_other") is Outcome.PASSED


# --- test-support modules ----------------------------------------------------------------

HELPERS = {"calc/__init__.py": "", "calc/ops.py": "def add(a, b):\n    return a - b\n",
           "calc/_testing.py": "def assert_close(a, b):\n    assert abs(a - b) < 1e-9\n",
           "utils/__init__.py": "", "utils/testutils.py": "from calc._testing import *\n",
           "utils/checks.py": "import pytest\n\n\ndef assert_positive(x):\n    assert x > 0\n",
           "utils/unused_testing.py": "def assert_never(x):\n    pass\n",
           "tests/test_calc.py": ("from calc.ops import add\nfrom calc._testing import "
                                  "assert_close\nfrom utils import testutils\n"
                                  "from utils.checks import assert_positive\n\n\n"
                                  "def test_add():\n    assert_close(add(1, 2), 3)\n")}


@pytest.fixture
def helper_task(tmp_path: Path) -> Task:
    source = tmp_path / "src"
    for rel, text in HELPERS.items():
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        (source / rel).write_text(text)
    return Task("t", (Message("user", "fix add"),), source_dir=str(source),
                grading=GradingSpec(fail_to_pass=("tests/test_calc.py::test_add",)))


def test_support_modules_are_found_by_the_import_graph(helper_task: Task, tmp_path: Path) -> None:
    noop = b"def assert_close(a, b):\n    pass\n"
    changes = WorkspaceChanges(written={"calc/_testing.py": noop, "utils/checks.py": noop,
                                        "utils/testutils.py": noop,
                                        "utils/unused_testing.py": noop,
                                        "calc/ops.py": b"def add(a, b):\n    return a + b\n"})
    dest = tmp_path / "dest"
    dest.mkdir()
    layout = build_grading_dir(helper_task, changes, str(dest))
    assert layout.rules is not None
    # Imported by the tests and test support by name or by content; never the code under
    # test, never a module no trusted test imports.
    assert layout.rules.support == {"calc/_testing.py", "utils/testutils.py", "utils/checks.py"}
    for rel in layout.rules.support:
        assert (dest / rel).read_text() == HELPERS[rel] and rel in layout.protected
    assert (dest / "calc/ops.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert (dest / "utils/unused_testing.py").read_bytes() == noop
    assert layout.num_reverted == 3
    found = {(f.name, f.detail) for f in static_findings(helper_task, changes, "")}
    assert {("test_files", f"writes {rel}") for rel in layout.rules.support} <= found
    assert ("test_files", "writes calc/ops.py") not in found


def test_hidden_tests_reach_support_modules_too(helper_task: Task, tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_h.py").write_text("from utils.checks import assert_positive\n\n\n"
                                      "def test_h():\n    assert_positive(1)\n")
    task = Task("t", (Message("user", "x"),), source_dir=helper_task.source_dir,
                grading=GradingSpec(hidden_tests=str(hidden)))
    dest = tmp_path / "dest"
    dest.mkdir()
    layout = build_grading_dir(task, WorkspaceChanges(), str(dest))
    assert layout.rules is not None and layout.rules.support == {"utils/checks.py"}
    assert f"{HIDDEN_TESTS_DIR}/test_h.py" in layout.protected


def _run(cases: dict[str, str]) -> list:
    from reward.grading.junit import parse_junit

    records = [{"k": "report", "id": i, "when": "call", "outcome": o} for i, o in cases.items()]
    body = "".join(f'<testcase classname="{junit_key(i)[0]}" name="{junit_key(i)[1]}">'
                   f'{"" if o == "passed" else "<failure/>"}</testcase>' for i, o in cases.items())
    return [build_account(records), parse_junit(f"<testsuite>{body}</testsuite>".encode())]


@pytest.mark.parametrize("cases, tampered", [
    # A wrong implementation may return the value a copy expects: that copy passes alone.
    ({"t.py::test_a": "failed", "t.py::test_b": "passed", "t.py::test_c": "failed"}, False),
    ({"t.py::test_a": "passed", "t.py::test_b": "failed", "t.py::test_c": "failed"}, False),
    # Two members of a group passing: no value meets both expectations.
    ({"t.py::test_a": "passed", "t.py::test_b": "passed", "t.py::test_c": "failed"}, True),
    ({"t.py::test_a": "failed", "t.py::test_b": "passed", "t.py::test_c": "passed"}, True),
    # Parametrized: compared case by case.
    ({"t.py::test_a[1]": "passed", "t.py::test_a[2]": "failed", "t.py::test_b[1]": "failed",
      "t.py::test_b[2]": "passed", "t.py::test_c[1]": "failed", "t.py::test_c[2]": "failed"},
     False),
    ({"t.py::test_a[1]": "passed", "t.py::test_a[2]": "failed", "t.py::test_b[1]": "passed",
      "t.py::test_b[2]": "failed", "t.py::test_c[1]": "failed", "t.py::test_c[2]": "failed"},
     True),
    # A copy missing from a completed run.
    ({"t.py::test_a": "passed", "t.py::test_b": "failed"}, True),
])
def test_a_group_has_at_most_one_honest_pass(cases: dict[str, str], tampered: bool) -> None:
    from reward.grading.crosscheck import cross_check
    from reward.grading.sentinels import Sentinel

    sentinels = [Sentinel("t.py::test_b", "t.py::test_a", MUTATION),
                 Sentinel("t.py::test_c", "t.py::test_a", MUTATION)]
    account, report = _run(cases)
    found = [f for f in cross_check(account, report, None, (), sentinels)
             if f.name == "sentinel_passed"]
    missing = [f for f in cross_check(account, report, 1, (), sentinels)
               if "missing" in f.detail]
    assert bool(found or missing) is tampered, found + missing


def test_a_copy_missing_from_one_account_is_tampering() -> None:
    from reward.grading.crosscheck import cross_check
    from reward.grading.sentinels import Sentinel

    sentinels = [Sentinel("t.py::test_b", "t.py::test_a", MUTATION)]
    account, _ = _run({"t.py::test_a": "passed", "t.py::test_b": "failed"})
    _, rewritten = _run({"t.py::test_a": "passed"})  # the report rewritten without the copy
    found = cross_check(account, rewritten, 1, (), sentinels)
    assert any(f.name == "sentinel_passed" and "missing" in f.detail for f in found), found
