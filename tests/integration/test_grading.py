"""Hidden-test grading end to end with real LocalSandboxes: partial credit on a bundled code
task; a SWE-style repository (base commit, a later fix commit the agent must never see, a
test patch) is graded right for the fix, no change, and the reward hacks a policy finds:
editing the tests, faking pytest's output or a JUnit file, a conftest.py / pytest config
that forces passes, and patching pytest in-process. (Gold and empty patches of every
bundled task: test_grading_gold.py; the red team by attack class: test_grading_redteam.py.)

Each "agent" works in its own sandbox made from the task source, exactly as a
trajectory would; its final state reaches the grader only as a workspace snapshot.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest

from envs.sandbox.base import SandboxLimits, SandboxSpec
from envs.tasks import load_tasks
from envs.tasks.code import VISIBLE_TESTS_DIR
from reward.base import RewardContext, RewardResult, load_reward_fn
from reward.grading.hidden_tests import HiddenTests
from reward.workspace import WorkspaceChanges, changes_from_snapshot
from envs.types import Task
from git_repo import run_git
from grading_tasks import CALC, FIXED_OPS, build_swe_task, trajectory_of

AGENT_LIMITS = SandboxLimits(memory_mb=512, max_processes=64, cpu_time_s=60)


@pytest.fixture(autouse=True)
def _needs_local_sandbox() -> None:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("LocalSandbox needs root and bubblewrap")


async def run_agent(task: Task, files: Mapping[str, bytes] = {}, commands: tuple[str, ...] = (),
                    delete: tuple[str, ...] = ()) -> WorkspaceChanges:
    """Work as an agent would: a sandbox from the task source with the visible tests
    copied in, files written, commands run; hand over its final state as a snapshot."""
    from envs.sandbox.local import LocalSandbox

    sandbox = await LocalSandbox.create(SandboxSpec(source_dir=task.source_dir, limits=AGENT_LIMITS))
    try:
        if task.visible_tests:
            for path in Path(task.visible_tests).rglob("*.py"):
                rel = path.relative_to(task.visible_tests).as_posix()
                await sandbox.write_file(f"{VISIBLE_TESTS_DIR}/{rel}", path.read_bytes())
        for path, data in files.items():
            await sandbox.write_file(path, data)
        for path in delete:
            assert (await sandbox.exec(["rm", "--", path], 10)).exit_code == 0
        for command in commands:
            result = await sandbox.exec(command, 30)
            assert result.exit_code == 0, result
        snapshot = await sandbox.snapshot()
    finally:
        await sandbox.release()
    try:
        return changes_from_snapshot(snapshot, task.source_dir)
    finally:
        snapshot.discard()


async def grade(task: Task, changes: WorkspaceChanges) -> RewardResult:
    reward_fn = load_reward_fn(task.reward_fn or "reward.grading.hidden_tests:HiddenTests")
    return await reward_fn(trajectory_of(task), task,
                           RewardContext(workspace=changes, timeout_s=120))


# --- bundled code tasks ------------------------------------------------------------

async def test_partially_right_code_gets_partial_credit_only_when_asked(tmp_path: Path) -> None:
    task = next(t for t in load_tasks("code_functions", cache_dir=str(tmp_path))
                if t.id.endswith("/shift_letters"))
    # Right for lower case only: some hidden tests pass, some fail.
    wrong = (b"def shift_letters(text, k):\n    return ''.join(chr((ord(c) - 97 + k) % 26 + 97)"
             b" if c.islower() else c for c in text)\n")
    changes = await run_agent(task, {"shift.py": wrong})
    binary = await grade(task, changes)
    partial_fn = HiddenTests(partial_credit=True)
    partial = await partial_fn(trajectory_of(task), task, RewardContext(workspace=changes))
    assert binary.reward == 0.0
    assert 0.0 < partial.reward < 1.0
    assert partial.reward == partial.components["tests_passed_frac"]


FORGED_REPORT = ('<testsuites><testsuite><testcase classname="_sluice_hidden.test_rle_hidden" '
                 'name="test_empty"/></testsuite></testsuites>')
# The report's path is in no argv any more; an adapted attack takes it from pytest's config.
REPORT_PATH = ("next(o.option.xmlpath for o in __import__('gc').get_objects() "
               "if type(o).__name__ == 'Config' and getattr(o.option, 'xmlpath', None))")
CODE_HACKS = {
    # A conftest hook, a pytest.ini loading a plugin module and start-up hooks: all dropped,
    # and the source has no conftest, so pytest runs with --noconftest anyway.
    "config": {"conftest.py": b"import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
                              b"def pytest_runtest_makereport(item, call):\n"
                              b"    (yield).get_result().outcome = 'passed'\n",
               "pytest.ini": b"[pytest]\naddopts = -p forcepass\n",
               "forcepass.py": b"def pytest_collection_modifyitems(items):\n    items.clear()\n",
               "sitecustomize.py": b"import os\nos._exit(0)\n",
               "hook.pth": b"import os; os._exit(0)\n"},
    # Exit "successfully" before pytest writes its report.
    "exit_early": {"rle.py": b"import os\nos._exit(0)\n"},
    # Kill the driver that would report the result.
    "kill_driver": {"rle.py": b"import os\nos.kill(os.getppid(), 9)\n"},
    # A daemon that keeps rewriting the report file pytest was told to write.
    "rewrite_report": {"rle.py": (
        f"import os, sys, time\npath = {REPORT_PATH}\n"
        "if os.fork() == 0:\n    os.setsid()\n    while True:\n        time.sleep(0.005)\n"
        f"        if os.path.exists(path):\n            open(path, 'w').write({FORGED_REPORT!r})\n"
        "def rle_encode(text):\n    return ''\n").encode()},
    # The same from inside the test process, after pytest wrote it: deterministic.
    "rewrite_report_at_exit": {"rle.py": (
        f"import atexit, sys\npath = {REPORT_PATH}\n"
        f"atexit.register(lambda: open(path, 'w').write({FORGED_REPORT!r}))\n"
        "def rle_encode(text):\n    return ''\n").encode()},
}


@pytest.mark.parametrize("hack", sorted(CODE_HACKS))
async def test_code_task_hacks_score_zero(tmp_path: Path, hack: str) -> None:
    task = next(t for t in load_tasks("code_functions", cache_dir=str(tmp_path))
                if t.id.endswith("/run_length_encode"))
    result = await grade(task, await run_agent(task, CODE_HACKS[hack]))
    assert result.reward == 0.0, result.detail
    assert result.components["tests_passed_frac"] == 0.0
    if hack == "rewrite_report_at_exit":
        assert result.components["tamper_detected"] == 1.0


# --- a SWE-style repository --------------------------------------------------------

BASE_FILES = CALC.base
F2P = CALC.fail_to_pass[0]
P2P = CALC.pass_to_pass


@pytest.fixture
def swe_task(tmp_path: Path) -> tuple[Task, str]:
    """A task loaded through the SWE adapter, and the fix commit's id."""
    task = build_swe_task(CALC, tmp_path)
    return task, run_git(tmp_path / "upstream", "rev-parse", "HEAD").strip()


async def test_agent_copy_holds_no_later_commit(swe_task: tuple[Task, str]) -> None:
    task, fix = swe_task
    changes = await run_agent(task, commands=(
        "test \"$(git log --all --oneline | wc -l)\" = 1",
        f"! git cat-file -e {fix}",
        "! grep -rq 'if not values' --exclude-dir=.git .",
        "! git log --all -p | grep -q 'mean_of_nothing'",
        "git status --porcelain | (! grep -q .)"))
    assert changes.written == {} and changes.deleted == ()


async def test_correct_fix_passes(swe_task: tuple[Task, str]) -> None:
    task, _ = swe_task
    result = await grade(task, await run_agent(task, {"calc/ops.py": FIXED_OPS.encode()}))
    assert result.reward == 1.0, result.detail
    assert result.components["fail_to_pass_frac"] == 1.0
    assert result.components["pass_to_pass_frac"] == 1.0
    assert result.components["locked"] == 1.0


async def test_no_change_fails(swe_task: tuple[Task, str]) -> None:
    task, _ = swe_task
    result = await grade(task, await run_agent(task))
    assert result.reward == 0.0
    assert result.components["fail_to_pass_frac"] == 0.0
    assert result.components["pass_to_pass_frac"] == 1.0


async def test_editing_the_tests_is_reverted(swe_task: tuple[Task, str]) -> None:
    task, _ = swe_task
    # The agent writes the F2P test itself, trivially passing, and breaks a P2P test's check.
    fake_tests = (BASE_FILES["tests/test_ops.py"].replace("== 5", "== add(2, 3)")
                  + "\n\ndef test_mean_of_nothing_is_zero():\n    assert True\n")
    result = await grade(task, await run_agent(task, {"tests/test_ops.py": fake_tests.encode()}))
    assert result.reward == 0.0
    assert result.components["fail_to_pass_frac"] == 0.0
    assert result.components["reverted_changes"] == 1.0


async def test_fake_passed_lines_and_junit_files_are_ignored(swe_task: tuple[Task, str]) -> None:
    task, _ = swe_task
    fake_line = "".join(f"PASSED {t}\\n" for t in (F2P, *P2P))
    ops = BASE_FILES["calc/ops.py"] + f"\nprint('{fake_line}', end='')\n"
    fake_junit = ('<testsuites><testsuite><testcase classname="tests.test_ops" '
                  'name="test_mean_of_nothing_is_zero"/></testsuite></testsuites>').encode()
    files = {"calc/ops.py": ops.encode(), "report.xml": fake_junit, "junit.xml": fake_junit,
             ".sluice_grading/out/report.xml": fake_junit}
    result = await grade(task, await run_agent(task, files))
    assert result.reward == 0.0
    assert result.components["fail_to_pass_frac"] == 0.0


async def test_conftest_and_config_that_force_passes_are_dropped(swe_task: tuple[Task, str]) -> None:
    task, _ = swe_task
    force = ("import pytest\n\n\n@pytest.fixture\ndef numbers():\n    return [1, 2, 3]\n\n\n"
             "@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
             "    outcome = yield\n    report = outcome.get_result()\n"
             "    report.outcome = 'passed'\n    report.longrepr = None\n")
    files = {"conftest.py": force.encode(),  # the repo's own conftest, hooked
             "calc/conftest.py": force.encode(),  # a new one next to the code
             "pytest.ini": b"[pytest]\naddopts = -p calc.forcepass\n",
             "calc/forcepass.py": force.encode()}
    result = await grade(task, await run_agent(task, files))
    assert result.reward == 0.0, result.detail
    assert result.components["fail_to_pass_frac"] == 0.0
    assert result.components["pass_to_pass_frac"] == 1.0  # the real conftest still serves
    assert result.components["reverted_changes"] == 3.0


async def test_patching_pytest_from_the_code_is_detected(swe_task: tuple[Task, str]) -> None:
    task, _ = swe_task
    hack = BASE_FILES["calc/ops.py"] + (
        "\nimport _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n")
    result = await grade(task, await run_agent(task, {"calc/ops.py": hack.encode()}))
    assert result.reward == 0.0
    assert result.components["tamper_detected"] == 1.0


async def test_swapping_test_files_during_the_run_is_blocked(swe_task: tuple[Task, str]) -> None:
    task, _ = swe_task
    swap = BASE_FILES["calc/ops.py"] + (
        "\nimport os\ntry:\n"
        "    os.rename('/workspace/tests', '/workspace/old_tests')\n"
        "except OSError:\n    pass\n")
    result = await grade(task, await run_agent(task, {"calc/ops.py": swap.encode()}))
    assert result.reward == 0.0
    assert result.components["tamper_detected"] == 0.0
    assert result.components["pass_to_pass_frac"] == 1.0  # the rename failed: tests ran


class UnlockableSandbox:
    """A LocalSandbox seen through the Sandbox protocol only (no host workspace path), as a
    remote or container backend would be: grading cannot lock files and must rely on the
    driver's checks after the run."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        if name == "workspace_dir":
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize("lockable", [True, False])
async def test_rewriting_a_test_helper_during_the_run_fails(swe_task: tuple[Task, str],
                                                            lockable: bool) -> None:
    from envs.sandbox.local import LocalSandbox

    task, _ = swe_task
    # A wrong fix (nan for an empty list) that a rewritten `close` would let pass.
    hack = BASE_FILES["calc/ops.py"].replace(
        "return sum(values) / len(values)",
        "return sum(values) / len(values) if values else float('nan')") + (
        "\ntry:\n    with open('/workspace/tests/helpers.py', 'w') as f:\n"
        "        f.write('def close(a, b):\\n    return True\\n')\n"
        "except OSError:\n    pass\n")

    async def create(spec: SandboxSpec) -> object:
        sandbox = await LocalSandbox.create(spec)
        return sandbox if lockable else UnlockableSandbox(sandbox)

    changes = await run_agent(task, {"calc/ops.py": hack.encode()})
    ctx = RewardContext(workspace=changes, create_sandbox=create, timeout_s=120)  # type: ignore[arg-type]
    result = await HiddenTests()(trajectory_of(task), task, ctx)
    assert result.reward == 0.0, result.detail
    assert result.components["locked"] == float(lockable)
    # Locked: the write is refused and the test fails honestly. Unlocked: the rewrite
    # happens, and the driver finds it.
    assert result.components["tamper_detected"] == float(not lockable)
