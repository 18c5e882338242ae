"""Tasks whose repository lives in their image, on the real container backend (podman):
a task image built locally (envs.tasks.images: the host-built base, the repository at
/testbed), an image-only SWE-smith row for it, the agent's sandbox seeded from the
image and working at /testbed, and grading in a FRESH container of the image through
the real reward path: the gold patch scores 1, the empty patch 0, and the result says
which path graded it; an image with its own pytest (7.4.4, another major than the
bundled one) is graded by that pytest, the usual attacks still scoring 0. Then the swebench log-parser path (a django-style runner and
`parse_log_django`): its rows validate, and a forged status line is caught. Last, prewarm
loads the image back from its `podman save` archive."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from envs.tasks import load_tasks
from git_repo import CALC, calc_repo, run_git
from grading_tasks import grade, sandbox_factory
from hack_payloads import FORCEPASS, PATCH_RUNNER
from reward.grading.validate import gold_changes, validate_file
from reward.workspace import WorkspaceChanges



# The project layer of the second image: a pytest of another major version than the
# grader's bundled one (and a pluggy without new-style hook wrappers), pinned whole.
PYTEST7 = ("pytest==7.4.4", "pluggy==1.0.0", "iniconfig==2.0.0", "packaging==23.2")


def calc_image_row(tmp: Path, repo_name: str, project: str,
                   requirements: tuple[str, ...]) -> tuple[Path, dict, str]:
    """An image-only SWE-smith row of the calc repository (only in its image, at
    /testbed) on the project layer `requirements`; the rows file, the row, the engine."""
    sandbox_factory("container")  # skips without root, bubblewrap or a working podman
    from envs.sandbox.engine import detect_engine
    from envs.tasks.images import ImageSpec, build_image_for

    repo = tmp / "src"
    base = calc_repo(repo)
    (repo / "calc.py").write_text(CALC.replace("a - b", "a + b"))
    gold = run_git(repo, "diff")
    run_git(repo, "checkout", "calc.py")
    engine = detect_engine()
    image = build_image_for(engine, ImageSpec("calc", repo_name, base, str(repo), project,
                                              requirements), str(tmp))
    row = {"instance_id": f"{repo_name.replace('/', '__')}.1", "repo": repo_name,
           "base_commit": base, "patch": gold, "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
           "PASS_TO_PASS": ["tests/test_calc.py::test_mul"], "image_name": image,
           "problem_statement": "add() subtracts."}  # no workdir: /testbed by default
    path = tmp / "tasks.jsonl"
    path.write_text(json.dumps(row) + "\n")
    shutil.rmtree(repo)  # the repository now lives only in the image
    return path, row, engine


@pytest.fixture(scope="module")
def image_row(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """An image-only row whose image has no pytest (graded by the bundled one); the task
    image is removed afterwards (its base and project layers stay cached)."""
    path, row, engine = calc_image_row(tmp_path_factory.mktemp("image_task"), "demo/calc",
                                       "test-calc", ())
    yield path, row
    from envs.sandbox.engine import run_engine

    run_engine(engine, "rmi", "--force", row["image_name"])


@pytest.fixture(scope="module")
def pytest7_row(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """The same repository in an image whose project layer has its own pytest 7.4.4."""
    path, row, engine = calc_image_row(tmp_path_factory.mktemp("pytest7_task"), "demo/calc7",
                                       "test-calc-pytest7", PYTEST7)
    yield path, row
    from envs.sandbox.engine import run_engine

    run_engine(engine, "rmi", "--force", row["image_name"])


def test_image_only_row_works_and_grades_at_testbed(image_row: tuple[Path, dict]) -> None:
    from envs.sandbox.base import SandboxSpec
    from envs.sandbox.container import ContainerSandbox
    from envs.sandbox.images import task_source_dir

    path, row = image_row
    [task] = load_tasks(str(path))
    assert task.source_dir is None and task.workdir == "/testbed" and task.image == row["image_name"]
    assert "/testbed" in task.messages[1].content and "/workspace" not in task.messages[1].content
    source = task_source_dir(task)  # the image's /testbed, read out once per image id
    assert Path(source, "calc.py").read_text() == CALC

    async def agent_side() -> WorkspaceChanges:
        sandbox = await ContainerSandbox.create(SandboxSpec(source_dir=source, image=task.image,
                                                            workdir="/testbed"))
        try:
            result = await sandbox.exec("pwd && sed -i 's/a - b/a + b/' calc.py && "
                                        "git status --short", 30)
            assert result.exit_code == 0 and result.stdout.splitlines()[0] == "/testbed", result
            assert "M calc.py" in result.stdout
            snapshot = await sandbox.snapshot()
        finally:
            await sandbox.release()
        from envs.sandbox.changes import changes_from_snapshot
        try:
            return changes_from_snapshot(snapshot, source, 1 << 20)
        finally:
            snapshot.discard()

    agent_changes = asyncio.run(agent_side())
    assert set(agent_changes.written) == {"calc.py"}  # diffed against the image's repository
    fixed = asyncio.run(grade(task, agent_changes, "container"))
    empty = asyncio.run(grade(task, WorkspaceChanges(), "container"))
    assert fixed.reward == 1.0, fixed.detail
    assert empty.reward == 0.0 and "test_add" in empty.detail
    for result in (fixed, empty):
        assert result.components["graded_in_image"] == 1.0
        assert result.components["graded_by_pytest_driver"] == 1.0
        # This image has no pytest of its own: the bundled one graded.
        assert result.components["graded_with_image_pytest"] == 0.0
        assert f"graded with pytest {pytest.__version__} (bundled)" in result.detail


def test_image_pytest_grades_when_the_image_has_one(pytest7_row: tuple[Path, dict]) -> None:
    """The image's own pytest 7.4.4 (not the bundled one) grades, through the real reward
    path: gold 1, empty 0; an agent's conftest.py forcing passes is dropped, and the
    runner patched from the agent's module (sparing the old sentinels) is caught."""
    path, row = pytest7_row
    assert not pytest.__version__.startswith("7.")  # the bundled pytest is another major
    [task] = load_tasks(str(path))
    gold = gold_changes(task, row["patch"])
    fixed = asyncio.run(grade(task, gold, "container"))
    empty = asyncio.run(grade(task, WorkspaceChanges(), "container"))
    assert fixed.reward == 1.0, fixed.detail
    assert empty.reward == 0.0 and "test_add" in empty.detail, empty.detail
    for result in (fixed, empty):
        assert result.components["graded_with_image_pytest"] == 1.0, result.detail
        assert result.components["graded_in_image"] == 1.0
        assert "graded with pytest 7.4.4 (image)" in result.detail
    forcepass = FORCEPASS.replace("'.sluice_grading'", "'x'")  # sentinels forced too
    conftest = asyncio.run(grade(task, WorkspaceChanges(written={
        "conftest.py": forcepass.encode()}), "container"))
    assert conftest.reward == 0.0 and conftest.components["reverted_changes"] >= 1.0, \
        conftest.detail
    patched = asyncio.run(grade(task, WorkspaceChanges(written={
        "calc.py": (PATCH_RUNNER + CALC).encode()}), "container"))
    assert patched.reward == 0.0 and patched.components["tamper_detected"] == 1.0, \
        patched.detail


def test_validate_grades_image_rows_in_their_image(image_row: tuple[Path, dict],
                                                    tmp_path: Path) -> None:
    path, _ = image_row
    verdicts = asyncio.run(validate_file(str(path), out=str(tmp_path / "valid.jsonl"),
                                         state=str(tmp_path / "state.jsonl")))
    assert [(v.valid, v.grader) for v in verdicts] == [(True, "pytest-driver@image")], verdicts
    assert verdicts[0].pytest == f"{pytest.__version__} (bundled)"


def test_validate_names_the_image_pytest(pytest7_row: tuple[Path, dict], tmp_path: Path) -> None:
    path, _ = pytest7_row
    [verdict] = asyncio.run(validate_file(str(path), state=str(tmp_path / "state.jsonl")))
    assert (verdict.valid, verdict.grader, verdict.pytest) == (
        True, "pytest-driver@image", "7.4.4 (image)"), verdict


@pytest.fixture(scope="module")
def runner_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("swebench")
    from envs.tasks.build_runner_tasks import build_runner_tasks

    out = tmp_path_factory.mktemp("runner")
    build_runner_tasks(str(out))
    return out / "tasks.jsonl"


def test_runner_rows_validate_through_swebench_parser(runner_rows: Path, tmp_path: Path) -> None:
    sandbox_factory("local")
    verdicts = asyncio.run(validate_file(str(runner_rows), workers=2,
                                         state=str(tmp_path / "state.jsonl")))
    assert len(verdicts) == 5
    assert all(v.valid and v.grader == "swebench-log" for v in verdicts), \
        [(v.instance_id, v.reason) for v in verdicts]


def test_runner_row_forged_status_line_is_tampering(runner_rows: Path) -> None:
    """The agent's code prints the runner's "... ok" line for the failing test when the
    tests import it: the real "... FAIL" line is still in the captured output."""
    sandbox_factory("local")
    row = json.loads(runner_rows.read_text().splitlines()[0])
    [task] = [t for t in load_tasks(str(runner_rows)) if t.id == row["instance_id"]]
    [f2p] = task.grading.fail_to_pass
    forged = Path(task.source_dir or "", "minitext/text.py").read_text() + (
        f"\nimport sys\nprint({f2p + ' ... ok'!r}, file=sys.stderr)\n")
    result = asyncio.run(grade(task, WorkspaceChanges(written={"minitext/text.py":
                                                               forged.encode()})))
    assert result.reward == 0.0 and result.components["tamper_detected"] == 1.0, result.detail
    # A status for a name the folder lacks, and one test line more than the totals say.
    assert result.components["hack_runner_output"] == 1.0, result.detail
    assert result.components["graded_by_swebench_log"] == 1.0
    gold = gold_changes(task, row["patch"])
    assert asyncio.run(grade(task, gold)).reward == 1.0


def test_prewarm_loads_a_missing_image_from_its_archive(image_row: tuple[Path, dict],
                                                        tmp_path: Path) -> None:
    """The node lacks the task image; prewarm loads it from `podman save`'s archive and
    names what it cannot find anywhere."""
    from envs.sandbox.engine import detect_engine, image_exists, run_engine
    from envs.sandbox.images import prewarm_images
    from envs.tasks.images import save_archive

    _, row = image_row
    engine, image = detect_engine(), row["image_name"]
    save_archive(engine, image, str(tmp_path))
    run_engine(engine, "rmi", image)
    assert not image_exists(engine, image)
    got = prewarm_images([image], str(tmp_path))
    assert (got.num_ready, got.num_loaded, got.num_pulled) == (0, 1, 0)
    assert image_exists(engine, image)
    with pytest.raises(ValueError, match=r"localhost/sluice-never-built"):
        prewarm_images([image, "localhost/sluice-never-built"], str(tmp_path))
