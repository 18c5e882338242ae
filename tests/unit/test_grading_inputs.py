"""What grading builds before any test runs, without a sandbox: the grader's pytest config
carried from the task source (reward.grading.runner_config), the test patch applied away from the
agent's files (reward.grading.patch), the sentinels planted among the tests (reward.grading.sentinels),
and the driver's check of the record stream (reward.grading.driver.verify_stream)."""

from __future__ import annotations

import ast
import hashlib
import hmac
import json
import random
import subprocess
from pathlib import Path

import pytest

from envs.types import GradingSpec, Message, Task
from reward.grading import patch as patch_module
from reward.grading.driver import verify_stream
from reward.grading.patch import patched_files
from reward.grading.runner_config import (find_source_config, grading_addopts, pytest_config_names,
                                  render_grader_config, top_level_modules)
from reward.grading.sentinels import Collection, plant_sentinels


def test_config_names_come_from_pytest_itself() -> None:
    from _pytest.config.findpaths import CONFIG_LOADERS_BY_NAME

    assert set(CONFIG_LOADERS_BY_NAME) <= set(pytest_config_names())
    assert {"pytest.toml", ".pytest.toml", ".pytest.ini"} <= set(pytest_config_names())


@pytest.mark.parametrize("name, text, mode, values", [
    ("setup.cfg", "[metadata]\nname = x\n\n[tool:pytest]\nfilterwarnings = error\n", "ini",
     {"filterwarnings": "error"}),
    ("pyproject.toml", "[tool.pytest.ini_options]\npythonpath = ['src']\naddopts = '-x -q'\n",
     "ini", {"pythonpath": ["src"], "addopts": "-x -q"}),
    ("pyproject.toml", "[tool.pytest]\nxfail_strict = true\nmarkers = ['slow']\n", "toml",
     {"xfail_strict": True, "markers": ["slow"]}),
    ("pytest.toml", "[pytest]\nminversion = '9.0'\n", "toml", {"minversion": "9.0"}),
    ("tox.ini", "[tox]\nenvlist = py3\n\n[pytest]\naddopts = -m 'not slow'\n", "ini",
     {"addopts": "-m 'not slow'"}),
])
def test_the_source_config_is_found_and_read(tmp_path: Path, name: str, text: str, mode: str,
                                             values: dict) -> None:
    (tmp_path / name).write_text(text)
    config = find_source_config(str(tmp_path), "tests")
    assert config is not None and (config.rel_dir, config.file_name) == ("", name)
    assert config.mode == mode and config.values == values


def test_the_nearest_config_wins_and_nothing_above_the_source_is_read(tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --from-above\n")
    assert find_source_config(str(source), "pkg/tests") is None
    (source / "setup.cfg").write_text("[tool:pytest]\naddopts = -q\n")
    (source / "pkg" / "pytest.ini").write_text("[pytest]\naddopts = -v\n")
    config = find_source_config(str(source), "pkg/tests")
    assert config is not None and config.rel_dir == "pkg" and config.values == {"addopts": "-v"}


@pytest.mark.parametrize("name, text", [
    ("pyproject.toml", "[tool.pytest.ini_options]\npythonpath = 'src lib'\n"
                       "addopts = '-x --maxfail=2 -k fast -q -m \"not slow\" -p no:warnings'\n"
                       "filterwarnings = ['error', 'ignore::UserWarning']\n"),
    ("pytest.toml", "[pytest]\npythonpath = ['src']\naddopts = ['-x', '-ra', '--deselect', 'a.py']\n"
                    "xfail_strict = true\ntimeout = 30\n\"odd-key\" = 'v\\u007f'\n"),
])
def test_the_grader_config_carries_the_source_options(tmp_path: Path, name: str, text: str) -> None:
    from _pytest.config.findpaths import load_config_dict_from_file

    (tmp_path / name).write_text(text)
    config = find_source_config(str(tmp_path))
    assert config is not None
    grader = tmp_path / "grader" / "pytest-grader.toml"
    grader.parent.mkdir()
    grader.write_text(render_grader_config(config))
    loaded = {k: v.value for k, v in (load_config_dict_from_file(grader) or {}).items()}
    assert {v.mode for v in (load_config_dict_from_file(grader) or {}).values()} == {config.mode}
    assert loaded["pythonpath"][0] == "/workspace/src"  # made absolute: the file moved
    addopts = loaded["addopts"]
    tokens = addopts.split() if isinstance(addopts, str) else addopts
    assert not {"-x", "--maxfail=2", "-k", "fast", "--deselect", "a.py"} & set(tokens)
    for key, value in config.values.items():
        if key not in ("pythonpath", "addopts"):
            assert loaded[key] == value


@pytest.mark.parametrize("given, kept", [
    ("-x -q", "-q"), ("--maxfail 3 -ra", "-ra"), ("-kfast -p no:x", "-p no:x"),
    ("-m 'not slow' --tb=short", "--tb=short"), ("--lf --sw --junitxml=r.xml -v", "-v"),
])
def test_grading_drops_options_that_stop_deselect_or_redirect(given: str, kept: str) -> None:
    assert grading_addopts(given) == kept
    assert grading_addopts(given.split()) == kept.split() or "'" in given


def test_the_grader_config_of_a_source_without_one_is_empty() -> None:
    assert "[" not in render_grader_config(None)


@pytest.mark.parametrize("path, roots, modules", [
    ("json.py", ("",), {"json"}), ("xml/etree/x.py", ("",), {"xml"}),
    ("src/json.py", ("", "src"), {"src", "json"}), ("calc/json.py", ("",), {"calc"}),
    ("json.cpython-311.so", ("",), {"json"}), ("README.md", ("",), set()),
    ("my-dir/x.py", ("",), set()),
])
def test_top_level_modules(path: str, roots: tuple[str, ...], modules: set[str]) -> None:
    assert top_level_modules(path, roots) == modules


# --- the test patch ----------------------------------------------------------------------

def _task_with_patch(tmp_path: Path) -> Task:
    source = tmp_path / "source"
    (source / "tests").mkdir(parents=True)
    (source / "tests" / "test_a.py").write_text("def test_a():\n    assert True\n")
    (source / "tests" / "test_gone.py").write_text("def test_gone():\n    pass\n")
    repo = tmp_path / "after"
    subprocess.run(["cp", "-a", str(source), str(repo)], check=True)
    (repo / "tests" / "test_a.py").write_text("def test_a():\n    assert False\n")
    (repo / "tests" / "test_gone.py").unlink()
    (repo / "tests" / "test_new.py").write_text("def test_new():\n    pass\n")
    diff = subprocess.run(["git", "diff", "--no-index", "--", "source", "after"], cwd=tmp_path,
                          capture_output=True, text=True).stdout
    diff = diff.replace("a/source/", "a/").replace("b/after/", "b/").replace(
        "a/after/", "a/").replace("b/source/", "b/")
    return Task("t", (Message("user", "x"),), source_dir=str(source),
                grading=GradingSpec(test_patch=diff, fail_to_pass=("tests/test_a.py::test_a",)))


def test_the_test_patch_result_comes_from_the_source_alone(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    task = _task_with_patch(tmp_path)
    result = patched_files(task)
    assert result["tests/test_a.py"] is not None
    assert result["tests/test_a.py"].data == b"def test_a():\n    assert False\n"
    assert result["tests/test_gone.py"] is None
    assert result["tests/test_new.py"] is not None and not result["tests/test_new.py"].executable
    # Computed once per task: a second grading runs no git at all.
    monkeypatch.setattr(patch_module.subprocess, "run", lambda *a, **k: pytest.fail("git ran"))
    assert patched_files(task) == result


def test_the_test_patch_ignores_the_callers_git_configuration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = _task_with_patch(tmp_path)
    # A HOME whose git config would run a filter on every file git reads.
    home = tmp_path / "home"
    home.mkdir()
    marker = tmp_path / "ran"
    (home / ".gitconfig").write_text(f'[filter "x"]\n\tclean = "sh -c \'touch {marker}; cat\'"\n'
                                     f'[core]\n\tattributesFile = {home}/attrs\n')
    (home / "attrs").write_text("* filter=x\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(home / ".gitconfig"))
    patch_module._cache.clear()
    assert patched_files(task)["tests/test_a.py"] is not None
    assert not marker.exists()
    # The same configuration does run the filter for a git that reads it (the test is real).
    subprocess.run(["git", "diff", "--no-index", "--", "source/tests/test_a.py",
                    "after/tests/test_a.py"], cwd=tmp_path, capture_output=True)
    assert marker.exists()


# --- sentinels ----------------------------------------------------------------------------

TEST_FILE = '''import unittest

import pytest


def test_plain():
    assert 1 + 1 == 2


@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    assert x


def test_early():
    return


class TestCaseStyle(unittest.TestCase):
    def test_method(self):
        self.assertEqual(2, 2)
'''


@pytest.mark.parametrize("seed", range(8))
def test_sentinels_are_valid_tests_of_the_file_that_must_fail(tmp_path: Path, seed: int) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(TEST_FILE)
    planted = plant_sentinels(str(tmp_path), ["tests/test_x.py"], random.Random(seed), 3)
    text = (tmp_path / "tests" / "test_x.py").read_text()
    tree = ast.parse(text)
    defined = {f"tests/test_x.py::{n.name}" for n in tree.body if isinstance(n, ast.FunctionDef)}
    defined |= {f"tests/test_x.py::{c.name}::{m.name}" for c in tree.body
                if isinstance(c, ast.ClassDef) for m in c.body if isinstance(m, ast.FunctionDef)}
    assert len({s.node_id for s in planted}) == 3 and {s.node_id for s in planted} <= defined
    assert all(s.template_id in defined for s in planted)
    for line in TEST_FILE.splitlines():
        assert line in text.splitlines()  # every original line kept
    for s in planted:
        name = s.node_id.rsplit("::", 1)[1]
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
        assert not node.decorator_list
        last = ast.unparse(node.body[-1])
        assert last.startswith(("assert ", "self.assertEqual(")), last
        assert not any(isinstance(n, ast.Return) for n in ast.walk(node))  # never left early
        # The last line is false whatever the code under test does.
        check = last.replace("self.assertEqual(", "(lambda a, b: a == b)(")
        assert eval(check.removeprefix("assert ")) is False, last


def test_sentinels_follow_the_sources_collection_patterns(tmp_path: Path) -> None:
    (tmp_path / "test_c.py").write_text(
        "import unittest\n\n\ndef check_one():\n    assert True\n\n\n"
        "class Checks:\n    def check_two(self):\n        assert True\n\n\n"
        "class Old(unittest.TestCase):\n    def test_three(self):\n        pass\n")
    collection = Collection.from_options({"python_functions": "check_*",
                                          "python_classes": ["Checks"]})
    for seed in range(6):
        planted = plant_sentinels(str(tmp_path), ["test_c.py"], random.Random(seed), 2, collection)
        for s in planted:
            name = s.node_id.rsplit("::", 1)[1]
            assert name.startswith("test" if "::Old::" in s.node_id else "check_"), s.node_id
    (tmp_path / "test_d.py").write_text("X = 1\n")
    [new] = plant_sentinels(str(tmp_path), ["test_d.py"], random.Random(0), 1, collection)
    assert new.node_id.rsplit("::", 1)[1].startswith("check_")


def test_a_file_without_tests_gets_a_new_test_module(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_empty.py").write_text("X = 1\n")
    targets = ["t/test_empty.py"]
    [sentinel] = plant_sentinels(str(tmp_path), targets, random.Random(1), 1)
    path = sentinel.node_id.split("::")[0]
    assert path.startswith("t/test_") and path != "t/test_empty.py" and path in targets
    assert sentinel.template_id is None


# --- the record stream, as the driver checks it ---------------------------------------------

KEY = b"k" * 32


def line(record: dict, key: bytes = KEY) -> bytes:
    body = json.dumps(record, separators=(",", ":")).encode()
    return body + b" " + hmac.new(key, body, hashlib.sha256).hexdigest()[:32].encode() + b"\n"


def test_a_clean_stream_is_accepted() -> None:
    data = line({"s": 0, "k": "item", "id": "a"}) + line({"s": 1, "k": "finish", "status": 1})
    records, problems = verify_stream(data, KEY, overflow=False)
    assert [r["k"] for r in records] == ["item", "finish"] and problems == []


@pytest.mark.parametrize("data, problem", [
    (line({"s": 0, "k": "item"}, key=b"x" * 32), "fails authentication"),
    (line({"s": 0, "k": "item"}) + line({"s": 2, "k": "item"}), "arrived as number 1"),
    (line({"s": 0, "k": "finish"}) + line({"s": 1, "k": "report"}), "came after the end"),
    (line({"s": 0, "k": "item"})[:-5], "ends inside a line"),
    (b'{"s":0,"k":"finish","status":0} 0000\n', "fails authentication"),
])
def test_forged_or_broken_streams_are_reported(data: bytes, problem: str) -> None:
    _, problems = verify_stream(data, KEY, overflow=False)
    assert any(problem in p for p in problems), problems


def test_an_overflowing_stream_is_reported() -> None:
    _, problems = verify_stream(b"", KEY, overflow=True)
    assert problems == ["the record stream exceeded its size limit"]


def test_the_validate_state_file_never_goes_beside_the_rows(tmp_path, monkeypatch):
    """A read-only dataset folder must not stop `python -m reward.validate`: the state
    file goes beside --out, or under the cache keyed by the rows' path."""
    from reward.grading.validate import default_state_path

    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    rows = tmp_path / "ro" / "rows.jsonl"
    assert default_state_path(str(rows), str(tmp_path / "valid.jsonl")) == f"{tmp_path}/valid.jsonl.state.jsonl"
    state = default_state_path(str(rows), None)
    assert state.startswith(f"{tmp_path}/cache/validate/rows.jsonl-") and state.endswith(".state.jsonl")
    assert default_state_path(str(tmp_path / "other" / "rows.jsonl"), None) != state
