"""Tasks and helpers shared by the grading tests and the grading bench: SWE-style tasks
built from small git repositories (a base commit, a fix commit the agent never sees, the
test patch between them), loaded through the real SWE adapter, and grading calls on a
chosen sandbox backend."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from envs.sandbox.base import Sandbox, SandboxSpec
from envs.tasks import load_tasks
from envs.types import Task, Trajectory
from git_repo import run_git
from reward.base import RewardContext, RewardResult
from reward.grading.hidden_tests import HiddenTests
from reward.workspace import WorkspaceChanges

GRADING_BACKENDS = ("local", "container")


def sandbox_factory(backend: str) -> Callable[[SandboxSpec], Awaitable[Sandbox]]:
    """Grading sandboxes of `backend`; skips the test where it cannot run here."""
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("grading sandboxes need root and bubblewrap")
    if backend == "local":
        from envs.sandbox.local import LocalSandbox

        return LocalSandbox.create
    from sandbox_probes import skip_without_container_engine

    skip_without_container_engine()
    from envs.sandbox.container import ContainerSandbox

    return ContainerSandbox.create


def trajectory_of(task: Task) -> Trajectory:
    """A finished trajectory (its tokens do not matter to test grading)."""
    return Trajectory(task_id=task.id, group_id="g", index=0, prompt_ids=[1], response_ids=[2],
                      response_mask=[1], logprobs=[-0.5], versions=[0], termination="finished")


async def grade(task: Task, changes: WorkspaceChanges, backend: str = "local", *,
                transcript: str = "", hack_policy: str = "report",
                create: Callable[[SandboxSpec], Awaitable[Sandbox]] | None = None,
                timeout_s: float = 120.0) -> RewardResult:
    ctx = RewardContext(workspace=changes, create_sandbox=create or sandbox_factory(backend),
                        timeout_s=timeout_s, transcript=transcript,
                        hack_policy=hack_policy)  # type: ignore[arg-type]
    return await HiddenTests()(trajectory_of(task), task, ctx)


def hacks(result: RewardResult) -> set[str]:
    return {k for k, v in result.components.items() if k.startswith("hack_") and v}


@dataclass(frozen=True, slots=True)
class SweCase:
    """A repository at a base commit and the later commit that fixes it: `fix` holds the
    source files the gold patch writes, `tests_after` the test files as the fix commit
    has them (None deletes one)."""

    name: str
    base: Mapping[str, str]
    fix: Mapping[str, str]
    tests_after: Mapping[str, str | None]
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]

    def gold(self) -> WorkspaceChanges:
        return WorkspaceChanges(written={p: t.encode() for p, t in self.fix.items()})


def build_swe_task(case: SweCase, folder: Path) -> Task:
    """The case as a task loaded through the SWE adapter (envs.tasks.swe)."""
    repo = folder / "upstream"
    repo.mkdir(parents=True)
    run_git(repo, "init", "-q", "-b", "main")
    _write(repo, case.base)
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-q", "-m", "base")
    base = run_git(repo, "rev-parse", "HEAD").strip()
    _write(repo, {**case.fix, **case.tests_after})
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-q", "-m", "fix")
    fix = run_git(repo, "rev-parse", "HEAD").strip()
    test_paths = sorted(case.tests_after)
    row = {"instance_id": f"demo__{case.name}", "repo": f"demo/{case.name}",
           "repo_dir": "upstream", "base_commit": base, "problem_statement": "Fix the bug.",
           "test_patch": run_git(repo, "diff", base, fix, "--", *test_paths),
           "FAIL_TO_PASS": json.dumps(list(case.fail_to_pass)),
           "PASS_TO_PASS": json.dumps(list(case.pass_to_pass))}
    (folder / "swe.jsonl").write_text(json.dumps(row) + "\n")
    [task] = load_tasks(str(folder / "swe.jsonl"), cache_dir=str(folder / "cache"))
    return task


def _write(repo: Path, files: Mapping[str, str | None]) -> None:
    for rel, text in files.items():
        path = repo / rel
        if text is None:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# --- the SWE-style cases -------------------------------------------------------------

OPS = "def add(a, b):\n    return a + b\n\n\ndef mean(values):\n    return sum(values) / len(values)\n"
FIXED_OPS = ("def add(a, b):\n    return a + b\n\n\ndef mean(values):\n"
             "    if not values:\n        return 0.0\n    return sum(values) / len(values)\n")
OPS_TESTS = ("from calc.ops import add, mean\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
             "def test_mean(numbers):\n    assert mean(numbers) == 2\n")
NEW_TEST = ("\n\ndef test_mean_of_nothing_is_zero():\n    from tests.helpers import close\n\n"
            "    assert close(mean([]), 0.0)\n")

# A conftest fixture the tests need, a shared config file, a helper module in tests/.
CALC = SweCase(
    name="calc",
    base={"calc/__init__.py": "", "calc/ops.py": OPS, "tests/__init__.py": "",
          "tests/helpers.py": "def close(a, b):\n    return abs(a - b) < 1e-9\n",
          "tests/test_ops.py": OPS_TESTS,
          "conftest.py": "import pytest\n\n\n@pytest.fixture\ndef numbers():\n    return [1, 2, 3]\n",
          "setup.cfg": "[tool:pytest]\nfilterwarnings = error\n"},
    fix={"calc/ops.py": FIXED_OPS},
    tests_after={"tests/test_ops.py": OPS_TESTS + NEW_TEST},
    fail_to_pass=("tests/test_ops.py::test_mean_of_nothing_is_zero",),
    pass_to_pass=("tests/test_ops.py::test_add", "tests/test_ops.py::test_mean"))

STRINGS = "def shout(text):\n    return text.upper()\n"
UNITTESTS = ("import unittest\n\nfrom strutil import shout\n\n\n"
             "class TestShout(unittest.TestCase):\n    def test_upper(self):\n"
             "        self.assertEqual(shout('a'), 'A')\n")
# src layout on pyproject's pythonpath, unittest classes in a `test` package (a stdlib
# name the source itself defines), addopts that would stop at the first failure.
SRC_LAYOUT = SweCase(
    name="srclayout",
    base={"src/strutil.py": STRINGS, "test/__init__.py": "", "test/test_shout.py": UNITTESTS,
          "pyproject.toml": "[project]\nname = 'strutil'\n\n[tool.pytest.ini_options]\n"
                            "pythonpath = ['src']\naddopts = '-x -q'\n"},
    fix={"src/strutil.py": "def shout(text):\n    return text.upper() + '!'\n"},
    tests_after={"test/test_shout.py": UNITTESTS.replace("'A')", "'A!')") + (
        "\n    def test_empty(self):\n        self.assertEqual(shout(''), '!')\n")},
    fail_to_pass=("test/test_shout.py::TestShout::test_upper",
                  "test/test_shout.py::TestShout::test_empty"),
    pass_to_pass=())

PARSE = "def parse(text):\n    return [int(p) for p in text.split(',')]\n"
PARSE_TESTS = ("import pytest\n\nfrom parsing import parse\n\n\nclass TestParse:\n"
               "    def test_one(self):\n        assert parse('1') == [1]\n\n"
               "    @pytest.mark.parametrize('text, want', [('1,2', [1, 2]), ('3', [3])])\n"
               "    def test_many(self, text, want):\n        assert parse(text) == want\n")
# A dedicated TOML config (pytest 9's name), parametrized class tests; the test patch adds
# a new test file and deletes an old one.
TOML_CONFIG = SweCase(
    name="tomlconfig",
    base={"parsing.py": PARSE, "tests/test_parse.py": PARSE_TESTS,
          "tests/test_old.py": "def test_old():\n    assert True\n",
          "pytest.toml": "[pytest]\nxfail_strict = true\nmarkers = ['slow: slow tests']\n"},
    fix={"parsing.py": "def parse(text):\n    return [int(p) for p in text.split(',') if p.strip()]\n"},
    tests_after={"tests/test_old.py": None, "tests/test_blank.py": (
        "from parsing import parse\n\n\ndef test_blank():\n    assert parse('1,,2') == [1, 2]\n\n\n"
        "def test_trailing():\n    assert parse('4,') == [4]\n")},
    fail_to_pass=("tests/test_blank.py::test_blank", "tests/test_blank.py::test_trailing"),
    pass_to_pass=("tests/test_parse.py::TestParse::test_one", "tests/test_parse.py::TestParse::test_many"))

SLOW = "def twice(x):\n    return x * 3\n"
SLOW_TESTS = ("import pytest\n\nfrom twice import twice\n\n\n@pytest.mark.slow\n"
              "def check_big():\n    assert twice(10 ** 6) == 2 * 10 ** 6\n\n\n"
              "def check_small():\n    assert twice(2) == 4\n")
# tox.ini config whose tests are `check_*` functions, that deselects slow tests, stops
# early and requires a plugin the grading runtime does not have: graded all the same.
TOX = SweCase(
    name="tox",
    base={"twice.py": SLOW, "tests/test_twice.py": SLOW_TESTS.replace("twice(2) == 4", "True"),
          "tox.ini": "[tox]\nenvlist = py3\n\n[pytest]\naddopts = -m 'not slow' --maxfail=1\n"
                     "python_functions = check_*\nrequired_plugins = pytest-timeout>=2\n"
                     "markers =\n    slow: slow tests\n"},
    fix={"twice.py": SLOW.replace("x * 3", "x * 2")},
    tests_after={"tests/test_twice.py": SLOW_TESTS},
    fail_to_pass=("tests/test_twice.py::check_big", "tests/test_twice.py::check_small"),
    pass_to_pass=())

SWE_CASES = (CALC, SRC_LAYOUT, TOML_CONFIG, TOX)
