"""`code_functions`: the bundled code-with-tests task set, small Python functions written
for this project. Each task is a CodeTaskSpec in one of the topic modules below: a
prompt, the stub the agent starts from, visible tests (unittest classes, so they run
with pytest or plain `python -m unittest`), hidden tests (pytest) and a reference
solution.

`build_code_tasks` writes each task's files into the cache, in three separate folders:
source/ (the stub: the agent's workspace), visible/ (copied in by the agent's tools) and
hidden/ (copied only into grading sandboxes). The reference is never written there: it
lives only in this package, for the project's own tests.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
from dataclasses import dataclass

from envs.cache import build_once, default_cache_dir
from envs.types import HIDDEN_TESTS_DIR, GradingSpec, Message, Task

SET_NAME = "code_functions"
TOOLS = ("bash", "read_file", "write_file", "str_replace", "run_tests", "submit")
VISIBLE_TESTS_DIR = "visible_tests"  # where the sandbox tools copy the visible tests
SYSTEM_PROMPT = ("You are an expert Python programmer working in a sandbox; /workspace holds "
                 "the files of the task. Use the tools to read, edit and test code.")
PROMPT = ("{prompt}\n\nWrite your solution in /workspace/{module}, which now holds a stub. "
          "Tests you can run are in /workspace/" + VISIBLE_TESTS_DIR + "/ (the run_tests "
          "tool runs them); hidden tests also check edge cases described above. Do not edit "
          "the tests. Call submit when you are done.")
TOPIC_MODULES = ("strings", "numbers", "sequences", "parsing", "algorithms", "structures")


@dataclass(frozen=True, slots=True)
class CodeTaskSpec:
    """One task's content; every file is complete Python source."""

    name: str  # unique, lower_snake; the task id is code_functions/<name>
    module: str  # file the agent edits, e.g. "rle.py"; tests import from it
    prompt: str  # what to implement, with every rule the hidden tests check
    stub: str  # the module's initial content: signatures and docstrings only
    visible_tests: str  # unittest source the agent sees
    hidden_tests: str  # pytest source used only for grading
    reference: str  # a correct module, used only by the project's tests

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"code task name {self.name!r} must be lower_snake")
        if not re.fullmatch(r"[a-z][a-z0-9_]*\.py", self.module):
            raise ValueError(f"code task {self.name}: module {self.module!r} must be a "
                             "lower_snake .py file name")
        for field in ("stub", "visible_tests", "hidden_tests", "reference"):
            try:
                ast.parse(getattr(self, field))
            except SyntaxError as exc:
                raise ValueError(f"code task {self.name}: {field} is not valid "
                                 f"Python: {exc}") from exc
        if not hidden_test_names(self.hidden_tests):
            raise ValueError(f"code task {self.name}: hidden_tests defines no test_ function")

    @property
    def stem(self) -> str:
        return self.module.removesuffix(".py")

    @property
    def hidden_file(self) -> str:
        return f"test_{self.stem}_hidden.py"

    @property
    def visible_file(self) -> str:
        return f"test_{self.stem}.py"


def hidden_test_names(source: str) -> list[str]:
    """Top-level test functions of a pytest module, in source order."""
    return [node.name for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def all_specs() -> tuple[CodeTaskSpec, ...]:
    import importlib

    specs: list[CodeTaskSpec] = []
    for name in TOPIC_MODULES:
        specs.extend(importlib.import_module(f"envs.tasks.code.{name}").TASKS)
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"code tasks defined twice: {duplicates}")
    return tuple(specs)


def spec_by_name(name: str) -> CodeTaskSpec:
    for spec in all_specs():
        if spec.name == name or f"{SET_NAME}/{spec.name}" == name:
            return spec
    raise ValueError(f"no bundled code task {name!r}")


def _write_files(specs: tuple[CodeTaskSpec, ...], root: str) -> None:
    for spec in specs:
        files = {f"{spec.name}/source/{spec.module}": spec.stub,
                 f"{spec.name}/visible/{spec.visible_file}": spec.visible_tests,
                 f"{spec.name}/hidden/{spec.hidden_file}": spec.hidden_tests}
        for rel, text in files.items():
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)


def task_of(spec: CodeTaskSpec, root: str) -> Task:
    folder = os.path.join(root, spec.name)
    ids = tuple(f"{HIDDEN_TESTS_DIR}/{spec.hidden_file}::{t}"
                for t in hidden_test_names(spec.hidden_tests))
    return Task(id=f"{SET_NAME}/{spec.name}",
                messages=(Message("system", SYSTEM_PROMPT),
                          Message("user", PROMPT.format(prompt=_unwrap(spec.prompt),
                                                        module=spec.module))),
                tools=TOOLS, source_dir=os.path.join(folder, "source"),
                visible_tests=os.path.join(folder, "visible"),
                grading=GradingSpec(hidden_tests=os.path.join(folder, "hidden"), fail_to_pass=ids),
                reward_fn="reward.grading.hidden_tests:HiddenTests")


def _unwrap(text: str) -> str:
    """Paragraphs joined into single lines: the data wraps them at 90 columns for reading."""
    return "\n\n".join(" ".join(p.split()) for p in text.strip().split("\n\n"))


def build_code_tasks(cache_dir: str | None = None) -> list[Task]:
    """The bundled tasks, their files written once per content version under the cache."""
    specs = all_specs()
    digest = hashlib.sha256(repr([(s.name, s.module, s.stub, s.visible_tests, s.hidden_tests)
                                  for s in specs]).encode()).hexdigest()[:16]
    root = os.path.join(cache_dir or str(default_cache_dir()), SET_NAME, digest)
    build_once(root, lambda tmp: _write_files(specs, tmp))
    return [task_of(spec, root) for spec in specs]
