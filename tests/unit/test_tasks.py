"""Task loading: the row format (good rows, and bad rows rejected with the file, row, field
and fix named), built-in sets, the toy generator's determinism and the bundled code
tasks' layout (the reference never lands where an agent or grader could see it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envs.tasks import BUILTIN_SETS, load_tasks
from envs.tasks.code import all_specs, hidden_test_names
from envs.tasks.toy import build_toy_arithmetic
from envs.tools.calculator import evaluate_arithmetic
from envs.types import HIDDEN_TESTS_DIR, GradingSpec, Message, Task


def write_rows(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_good_rows_become_tasks(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    (tmp_path / "hidden").mkdir()
    path = write_rows(tmp_path / "tasks.jsonl", [
        {"id": "a", "prompt": "What is 2+2?", "system": "Be brief.", "answer": 4,
         "tools": ["calculator"]},
        "",  # blank lines are skipped
        {"id": "b", "messages": [{"role": "user", "content": "Fix it."}], "source_dir": "repo",
         "hidden_tests": "hidden", "fail_to_pass": ["_sluice_hidden/test_x.py::test_a"],
         "reward_fn": "reward.grading.hidden_tests:HiddenTests", "image": None},
    ])
    a, b = load_tasks(path)
    assert a.messages == (Message("system", "Be brief."), Message("user", "What is 2+2?"))
    assert (a.answer, a.tools, a.source_dir) == ("4", ("calculator",), None)
    assert b.source_dir == str(tmp_path / "repo") and b.grading.hidden_tests == str(tmp_path / "hidden")
    assert b.grading.fail_to_pass == ("_sluice_hidden/test_x.py::test_a",)
    assert b.reward_fn == "reward.grading.hidden_tests:HiddenTests" and b.image is None


@pytest.mark.parametrize("row, message", [
    ("{not json", r"row 1: not valid JSON"),
    ("[1, 2]", r"row 1: is a JSON list, not an object"),
    ({"prompt": "x"}, r"row 1, field 'id': is required"),
    ({"id": "t", "promt": "x"}, r"field 'promt': unknown field; did you mean 'prompt'\?"),
    ({"id": "t"}, r"exactly one of 'prompt'"),
    ({"id": "t", "prompt": "x", "messages": []}, r"exactly one of 'prompt'"),
    ({"id": "t", "messages": [{"role": "robot", "content": "x"}]}, r"field 'messages': entry 0"),
    ({"id": "t", "prompt": "x", "tools": "bash"}, r"field 'tools': must be a list"),
    ({"id": "t", "prompt": "x", "answer": [1]}, r"field 'answer': must be a string or number"),
    ({"id": "t", "prompt": "x", "source_dir": "nope"}, r"field 'source_dir': folder .* does not exist"),
    ({"id": "t", "prompt": "x", "hidden_tests": "nope"}, r"field 'hidden_tests': folder"),
    ({"id": "t", "prompt": "x", "fail_to_pass": ["test_x.py"]}, r"not a pytest node id"),
    ({"id": "t", "prompt": "x", "fail_to_pass": ["../x.py::t"]}, r"relative path"),
    ({"id": "t", "prompt": "x", "fail_to_pass": ["a.py::t"]}, r"no source_dir, image or hidden_tests"),
    ({"id": "t", "prompt": "x", "reward_fn": "reward.rules.ExactMatch"}, r"nor an import string"),
])
def test_bad_rows_name_row_field_and_fix(tmp_path: Path, row: object, message: str) -> None:
    path = write_rows(tmp_path / "tasks.jsonl", [row])
    with pytest.raises(ValueError, match=message) as info:
        load_tasks(path)
    assert str(info.value).startswith(path)


def test_later_bad_row_reports_its_line(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "t.jsonl", [{"id": "a", "prompt": "x"}, "", {"id": "b"}])
    with pytest.raises(ValueError, match=r"t\.jsonl row 3"):
        load_tasks(path)


def test_file_level_mistakes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_tasks(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="neither a built-in set"):
        load_tasks("no_such_set")
    with pytest.raises(ValueError, match="task format 'yaml' is unknown"):
        load_tasks("toy_arithmetic", "yaml")
    with pytest.raises(ValueError, match="built-in 'toy' set"):
        load_tasks("toy_arithmetic", "swe")
    with pytest.raises(ValueError, match="set envs.tasks to 'code_functions'"):
        load_tasks("x.jsonl", "code")
    with pytest.raises(ValueError, match="holds no rows"):
        load_tasks(write_rows(tmp_path / "empty.jsonl", [""]))
    dup = write_rows(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(ValueError, match="'a' appears twice"):
        load_tasks(dup)


def test_parquet_rows_load_like_jsonl(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"id": "a", "prompt": "hi", "answer": "1", "messages": None},
            {"id": "b", "prompt": None, "answer": None,
             "messages": [{"role": "user", "content": "yo"}]}]
    path = str(tmp_path / "tasks.parquet")
    datasets.Dataset.from_list(rows).to_parquet(path)
    a, b = load_tasks(path)
    assert a.messages == (Message("user", "hi"),) and a.answer == "1"
    assert b.messages == (Message("user", "yo"),) and b.answer is None


def test_task_validates_test_fields() -> None:
    msgs = (Message("user", "x"),)
    # Lists are accepted and normalised to tuples (rows arrive as JSON lists).
    grading = GradingSpec(fail_to_pass=["a.py::t1"], pass_to_pass=["a.py::t2"])  # type: ignore[arg-type]
    task = Task("t", list(msgs), source_dir="/src", grading=grading)  # type: ignore[arg-type]
    assert task.messages == msgs and task.grading.fail_to_pass == ("a.py::t1",)
    assert task.grading.expected_tests == ("a.py::t1", "a.py::t2")
    with pytest.raises(ValueError, match="in both fail_to_pass and pass_to_pass"):
        GradingSpec(fail_to_pass=("a.py::t",), pass_to_pass=("a.py::t",))
    with pytest.raises(ValueError, match="lists a test twice"):
        GradingSpec(fail_to_pass=("a.py::t", "a.py::t"))
    with pytest.raises(ValueError, match="not a string"):
        GradingSpec(fail_to_pass="a.py::t")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="test_patch is empty"):
        GradingSpec(test_patch=" ")
    with pytest.raises(ValueError, match="names tests but has no source_dir"):
        Task("t", msgs, grading=GradingSpec(fail_to_pass=("a.py::t",)))
    with pytest.raises(ValueError, match="grading must be a GradingSpec"):
        Task("t", msgs, grading={"fail_to_pass": ["a.py::t"]})  # type: ignore[arg-type]


def test_toy_generator_is_deterministic_and_right() -> None:
    first, again, other = build_toy_arithmetic(50, seed=3), build_toy_arithmetic(50, seed=3), \
        build_toy_arithmetic(50, seed=4)
    assert first == again
    assert [t.messages for t in first] != [t.messages for t in other]
    assert len({t.id for t in first}) == 50
    for task in first:
        expression = task.messages[-1].content.split("What is ", 1)[1].split("?", 1)[0]
        assert task.answer == str(evaluate_arithmetic(expression))
        assert set(task.tools) == {"calculator", "python"}
        assert task.reward_fn == "reward.rules:ExactMatch"
    assert load_tasks("toy_arithmetic")[:50] == build_toy_arithmetic(50, seed=0)
    with pytest.raises(ValueError, match="num_tasks"):
        build_toy_arithmetic(0)


@pytest.mark.parametrize("name", ["toy_arithmetic", "toy_arithmetic_easy"])
def test_heldout_toy_sets_share_no_question_with_training(name: str) -> None:
    train, heldout = load_tasks(name), load_tasks(name + "_heldout")
    assert len(heldout) == len(train)
    assert not {t.messages[-1].content for t in train} & {t.messages[-1].content for t in heldout}
    assert {t.tools for t in heldout} == {t.tools for t in train}
    assert load_tasks(name + "_heldout") == heldout  # deterministic


def test_code_task_set_layout(tmp_path: Path) -> None:
    tasks = load_tasks("code_functions", cache_dir=str(tmp_path))
    specs = {s.name: s for s in all_specs()}
    assert len(tasks) == len(specs) >= 30
    assert set(BUILTIN_SETS) == {"toy_arithmetic", "toy_arithmetic_easy", "code_functions",
                                 "toy_arithmetic_heldout", "toy_arithmetic_easy_heldout",
                                 "swe_smith_hjson", "swe_smith_images", "toy_screens", "toy_screens_heldout"}
    for task in tasks:
        spec = specs[task.id.split("/", 1)[1]]
        assert task.reward_fn == "reward.grading.hidden_tests:HiddenTests"
        assert task.grading.fail_to_pass == tuple(f"{HIDDEN_TESTS_DIR}/{spec.hidden_file}::{t}"
                                          for t in hidden_test_names(spec.hidden_tests))
        folders = [Path(p) for p in (task.source_dir, task.visible_tests, task.grading.hidden_tests)]
        assert [sorted(p.name for p in f.iterdir()) for f in folders] == [
            [spec.module], [spec.visible_file], [spec.hidden_file]]
        assert (folders[0] / spec.module).read_text() == spec.stub
    written = "".join(p.read_text() for p in tmp_path.rglob("*.py"))
    for spec in specs.values():
        assert spec.reference not in written, f"{spec.name}: reference written out"
    # Content-addressed: loading again reuses the same folders.
    assert [t.source_dir for t in load_tasks("code_functions", cache_dir=str(tmp_path))] == \
        [t.source_dir for t in tasks]


def test_easy_toy_set_is_deterministic_two_operand_python_tasks() -> None:
    from envs.tasks.toy import build_toy_arithmetic_easy

    a, b = build_toy_arithmetic_easy(16, seed=3), build_toy_arithmetic_easy(16, seed=3)
    assert a == b and all(t.tools == ("python",) for t in a)
    for t in a:
        expression = t.messages[-1].content.split("What is ")[1].split("?")[0]
        left, op, right = expression.split(" ")
        assert op in "+-*" and 2 <= int(left) <= 99 and 2 <= int(right) <= 99
        assert int(t.answer) == eval(expression)  # noqa: S307 - test-generated arithmetic
