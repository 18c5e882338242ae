"""Published SWE row variants (SWE-bench / SWE-Gym, SWE-smith, R2E-Gym) from JSONL, parquet
and a `datasets` folder become the same Tasks, and the gold patch never reaches one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from envs.tasks import load_tasks
from git_repo import run_git

GOLD_MARK = "GOLD_FIX_7f3a"  # only in the gold patch: must appear nowhere in a Task


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str]:
    """repos/demo__calc with one commit: (task folder, base commit)."""
    path = tmp_path / "repos" / "demo__calc"
    path.mkdir(parents=True)
    run_git(path, "init", "-q", "-b", "main")
    (path / "calc.py").write_text("VALUE = 1\n")
    run_git(path, "add", "-A")
    run_git(path, "commit", "-q", "-m", "base")
    return tmp_path, run_git(path, "rev-parse", "HEAD").strip()


def gold_patch() -> str:
    return (f"diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n"
            f"-VALUE = 1\n+VALUE = 2  # {GOLD_MARK}\n")


def swebench_row(base: str, lists_as_json: bool) -> dict:
    f2p, p2p = ["t/test_v.py::test_value"], ["t/test_v.py::test_other"]
    return {"instance_id": "demo__calc-1", "repo": "demo/calc", "base_commit": base,
            "patch": gold_patch(), "test_patch": "diff --git a/t/test_v.py b/t/test_v.py\n",
            "FAIL_TO_PASS": json.dumps(f2p) if lists_as_json else f2p,
            "PASS_TO_PASS": json.dumps(p2p) if lists_as_json else p2p, "version": "1.0",
            "environment_setup_commit": base, "hints_text": f"hint {GOLD_MARK}",
            "created_at": "2020-01-01", "problem_statement": "VALUE should be 2."}


def assert_no_gold(task: object) -> None:
    assert GOLD_MARK not in repr(dataclasses.asdict(task))  # type: ignore[call-overload]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("lists_as_json", [True, False])
def test_swebench_row_lists_or_json_strings(repo: tuple[Path, str], lists_as_json: bool) -> None:
    folder, base = repo
    path = write_jsonl(folder / "swe.jsonl", [swebench_row(base, lists_as_json)])
    [task] = load_tasks(path, cache_dir=str(folder / "cache"))
    assert task.grading.fail_to_pass == ("t/test_v.py::test_value",)
    assert task.grading.pass_to_pass == ("t/test_v.py::test_other",)
    assert task.image is None and (Path(task.source_dir or "") / "calc.py").read_text() == "VALUE = 1\n"
    assert_no_gold(task)
    source = Path(task.source_dir or "")
    assert all(GOLD_MARK not in p.read_text(errors="replace")
               for p in source.rglob("*") if p.is_file())


def test_parquet_and_datasets_folder_read_like_jsonl(repo: tuple[Path, str]) -> None:
    datasets = pytest.importorskip("datasets")
    folder, base = repo
    row = swebench_row(base, lists_as_json=True)
    from_jsonl = load_tasks(write_jsonl(folder / "swe.jsonl", [row]), cache_dir=str(folder / "c"))
    table = datasets.Dataset.from_list([row])
    table.to_parquet(str(folder / "swe.parquet"))
    table.save_to_disk(str(folder / "swe_hf"))
    datasets.DatasetDict({"test": table}).save_to_disk(str(folder / "swe_dict"))
    for source in ("swe.parquet", "swe_hf", "swe_dict"):
        assert load_tasks(str(folder / source), cache_dir=str(folder / "c")) == from_jsonl, source
    datasets.DatasetDict({"a": table, "b": table}).save_to_disk(str(folder / "two"))
    with pytest.raises(ValueError, match=r"holds the splits \['a', 'b'\]; pass one split"):
        load_tasks(str(folder / "two"), cache_dir=str(folder / "c"))


def test_swe_smith_row_names_its_image_and_needs_no_test_patch(tmp_path: Path) -> None:
    row = {"instance_id": "demo__calc.abc123.func_pm_op_swap__x1", "repo": "demo/calc",
           "base_commit": "demo__calc.abc123.func_pm_op_swap__x1", "patch": gold_patch(),
           "FAIL_TO_PASS": ["t/test_v.py::test_value"], "PASS_TO_PASS": [],
           "image_name": "jyangballin/swesmith.x86_64.demo_1776_calc.abc123",
           "problem_statement": "VALUE is wrong.", "created_at": "2025-01-01"}
    [task] = load_tasks(write_jsonl(tmp_path / "smith.jsonl", [row]))
    assert task.image == "jyangballin/swesmith.x86_64.demo_1776_calc.abc123"
    assert task.source_dir is None and task.grading.test_patch is None  # the repo is in the image
    assert_no_gold(task)


def test_r2e_gym_row_with_a_local_repo(repo: tuple[Path, str]) -> None:
    folder, base = repo
    row = {"repo_name": "demo/calc", "commit_hash": base, "docker_image": "namanjain12/calc:" + base,
           "problem_statement": "VALUE should be 2.", "patch": gold_patch(),
           "test_patch": "diff --git a/t/test_v.py b/t/test_v.py\n",
           "FAIL_TO_PASS": ["t/test_v.py::test_value"], "PASS_TO_PASS": []}
    [task] = load_tasks(write_jsonl(folder / "r2e.jsonl", [row]), cache_dir=str(folder / "c"))
    assert task.id == task.image == "namanjain12/calc:" + base
    assert (Path(task.source_dir or "") / "calc.py").read_text() == "VALUE = 1\n"
    assert_no_gold(task)


def test_local_row_without_test_patch_must_say_so(repo: tuple[Path, str]) -> None:
    folder, base = repo
    row = swebench_row(base, lists_as_json=True)
    del row["test_patch"]
    with pytest.raises(ValueError, match=r"row 1, field 'test_patch': is required"):
        load_tasks(write_jsonl(folder / "a.jsonl", [row]), cache_dir=str(folder / "c"))
    row["test_patch"] = ""  # the repository's own tests grade it (SWE-smith style)
    [task] = load_tasks(write_jsonl(folder / "b.jsonl", [row]), cache_dir=str(folder / "c"))
    assert task.grading.test_patch is None


def test_documented_example_rows_load() -> None:
    example = Path(__file__).parents[2] / "docs" / "examples" / "swe_rows.jsonl"
    smith, r2e = load_tasks(str(example))
    assert smith.image and smith.grading.test_patch is None and smith.grading.pass_to_pass
    assert r2e.id == r2e.image == "r2e.demo_calc:5e6f7a8b" and r2e.grading.test_patch


def test_documented_image_rows_load_as_image_only_tasks() -> None:
    """docs/examples/swe_image_rows.jsonl: a SWE-smith row of the bundled set and a
    SWE-bench (5.x) row of the runner-graded minitext repository, both image-only."""
    example = Path(__file__).parents[2] / "docs" / "examples" / "swe_image_rows.jsonl"
    smith, runner = load_tasks(str(example))
    for task in (smith, runner):
        assert task.source_dir is None and task.workdir == "/testbed" and task.image
        assert "/testbed" in task.messages[0].content and "/testbed" in task.messages[1].content
        assert_no_gold(task)
    assert smith.grading.log_parser is None and smith.grading.test_command is None
    assert runner.grading.log_parser == "parse_log_django"
    # The command between SWE-bench's markers, not the reset and patch lines around it.
    assert runner.grading.test_command == ("python3 tests/runtests.py --verbosity 2 "
                                   "text_tests.tests text_tests.test_regressions")
    assert runner.grading.fail_to_pass[0].startswith("test_strips_edges (text_tests.")


def test_runner_row_needs_its_command_and_a_parser(tmp_path: Path) -> None:
    row = {"instance_id": "x-1", "repo": "someone/unknown", "base_commit": "abc",
           "image_name": "localhost/x", "problem_statement": "p", "test_patch": "",
           "FAIL_TO_PASS": ["test_a (m.C.test_a)"], "test_cmd": "python3 run.py"}
    with pytest.raises(ValueError, match=r"field 'log_parser': is (required|not given)"):
        load_tasks(write_jsonl(tmp_path / "a.jsonl", [row]))
    row["eval_script"], row["log_parser"] = "echo no markers", "parse_log_django"
    del row["test_cmd"]
    with pytest.raises(ValueError, match=r"field 'eval_script': has no test command"):
        load_tasks(write_jsonl(tmp_path / "b.jsonl", [row]))
    row["eval_script"] = ": '>>>>> Start Test Output'\npython3 run.py\n: '>>>>> End Test Output'"
    [task] = load_tasks(write_jsonl(tmp_path / "c.jsonl", [row]))
    assert task.grading.test_command == "python3 run.py" and task.grading.fail_to_pass == ("test_a (m.C.test_a)",)
    row["workdir"] = "relative"
    with pytest.raises(ValueError, match=r"field 'workdir': is the absolute path"):
        load_tasks(write_jsonl(tmp_path / "d.jsonl", [row]))
