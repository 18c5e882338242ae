"""The task row format: one JSON object per JSONL line (or per parquet row) -> Task.

    {"id": "t1",
     "prompt": "..." | "messages": [{"role": "system"|"user"|"assistant", "content": "..."}],
     "system": "...",                       # only with "prompt": a system message before it
     "tools": ["bash", "run_tests"],       "answer": "42",
     "source_dir": "repo/",  "image": null, "visible_tests": "tests/", "hidden_tests": "hidden/",
     "test_patch": "diff --git ...",        "fail_to_pass": ["t.py::test_a"], "pass_to_pass": [],
     "reward_fn": "reward.grading.hidden_tests:HiddenTests", "agent_loop": "pkg.mod:Loop"}

Only "id" and one of "prompt"/"messages" are required. The test fields stay flat in the
row; in memory they are the task's GradingSpec (`Task.grading`). Relative folders are
resolved against the file's folder and must exist. Every mistake is a ValueError naming the
file, the row, the field and the fix.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from envs.types import GradingSpec, Message, Task

# One task row as read: a JSON object (or a parquet row), every value checked by the
# get_* readers below before it reaches a Task.
Row = Mapping[str, object]

FIELDS = ("id", "prompt", "messages", "system", "tools", "answer", "agent_loop", "source_dir",
          "image", "visible_tests", "hidden_tests", "test_patch", "fail_to_pass",
          "pass_to_pass", "reward_fn")
FOLDER_FIELDS = ("source_dir", "visible_tests", "hidden_tests")
MESSAGE_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class RowRef:
    """Where a row came from, for error messages."""

    source: str  # the file
    row: int  # 1-based line (JSONL) or row number (parquet)

    @property
    def base_dir(self) -> str:
        return os.path.dirname(os.path.abspath(self.source))

    def error(self, field: str | None, problem: str) -> ValueError:
        where = f"{self.source} row {self.row}" + (f", field {field!r}" if field else "")
        return ValueError(f"{where}: {problem}")


def read_rows(path: str, on_error: Callable[[ValueError], None] | None = None,
              ) -> Iterator[tuple[RowRef, Row]]:
    """The rows of a .jsonl / .json (one object per line) or .parquet file, or of a folder
    written by `datasets`' save_to_disk. A line that is not a JSON object raises, or with
    `on_error` is handed to it and skipped."""
    if os.path.isdir(path):
        yield from _dataset_folder_rows(path)
        return
    if not os.path.isfile(path):
        raise ValueError(f"task file {path!r} does not exist; pass a .jsonl/.parquet path, "
                         "a datasets folder or a built-in set name")
    if path.endswith(".parquet"):
        yield from _parquet_rows(path)
        return
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            ref = RowRef(path, line_no)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                problem = ref.error(None, f"not valid JSON ({exc.msg} at column {exc.colno}); "
                                    "write one JSON object per line")
            else:
                if isinstance(row, dict):
                    yield ref, _present(row)
                    continue
                problem = ref.error(None, f"is a JSON {type(row).__name__}, not an object")
            if on_error is None:
                raise problem
            on_error(problem)


def _parquet_rows(path: str) -> Iterator[tuple[RowRef, Row]]:
    try:
        import datasets  # deferred: heavy, and only parquet sources need it
    except ImportError as exc:
        raise ValueError(f"reading {path} needs the `datasets` package; install it "
                         "(pip install datasets) or convert the file to JSONL") from exc
    table = datasets.Dataset.from_parquet(path)
    for i, row in enumerate(table, 1):
        assert isinstance(row, dict)  # a Dataset yields one dict per row
        yield RowRef(path, i), _present(row)


def _dataset_folder_rows(path: str) -> Iterator[tuple[RowRef, Row]]:
    try:
        import datasets  # deferred: heavy, and only datasets folders need it
    except ImportError as exc:
        raise ValueError(f"reading the datasets folder {path} needs the `datasets` package; "
                         "install it (pip install datasets) or export the rows to JSONL") from exc
    try:
        loaded = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"folder {path!r} is not a datasets save_to_disk folder ({exc}); "
                         "pass such a folder or a .jsonl/.parquet file") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(str(name) for name in loaded)
        if len(splits) != 1:
            raise ValueError(f"datasets folder {path!r} holds the splits {splits}; pass "
                             f"one split's folder, e.g. {os.path.join(path, splits[0])}")
        loaded = next(iter(loaded.values()))
    for i, row in enumerate(loaded, 1):
        assert isinstance(row, dict)  # a Dataset yields one dict per row
        yield RowRef(path, i), _present(row)


def _present(row: Mapping[str, object]) -> dict[str, object]:
    """The row without null fields: a null is an absent field (parquet gives every row
    every column, null where a row has none)."""
    return {k: v for k, v in row.items() if v is not None}


def check_fields(ref: RowRef, row: Row, allowed: tuple[str, ...]) -> None:
    unknown = [k for k in row if k not in allowed]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid fields: {', '.join(allowed)}"
        raise ref.error(key, f"unknown field; {hint}")


def get_str(ref: RowRef, row: Row, field: str, required: bool = False) -> str | None:
    value = row.get(field)
    if value is None:
        if required:
            raise ref.error(field, "is required; add it as a non-empty string")
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        raise ref.error(field, f"must be a non-empty string, got {value!r}")
    return value


def get_str_list(ref: RowRef, row: Row, field: str) -> tuple[str, ...]:
    """A list of strings; a JSON-encoded list inside a string (SWE-bench's form) too."""
    value = row.get(field)
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ref.error(field, "must be a list of strings (or a JSON list in a "
                            "string)") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ref.error(field, f"must be a list of strings, got {value!r}")
    return tuple(value)


def get_folder(ref: RowRef, row: Row, field: str) -> str | None:
    value = get_str(ref, row, field)
    if value is None:
        return None
    path = value if os.path.isabs(value) else os.path.join(ref.base_dir, value)
    if not os.path.isdir(path):
        raise ref.error(field, f"folder {path!r} does not exist; paths are relative to the "
                        "task file's folder")
    return os.path.abspath(path)


def get_messages(ref: RowRef, row: Row) -> tuple[Message, ...]:
    if ("prompt" in row) == ("messages" in row):
        raise ref.error(None, "give exactly one of 'prompt' (a string) or 'messages' (a list)")
    if "prompt" in row:
        prompt = get_str(ref, row, "prompt", required=True)
        system = get_str(ref, row, "system")
        assert prompt is not None
        return ((Message("system", system),) if system else ()) + (Message("user", prompt),)
    if "system" in row:
        raise ref.error("system", "only goes with 'prompt'; put a system message in 'messages'")
    raw = row["messages"]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ref.error("messages", "must be a non-empty list of {role, content} objects")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping) or set(m) - {"role", "content"} \
                or m.get("role") not in MESSAGE_ROLES or not isinstance(m.get("content"), str):
            raise ref.error("messages", f"entry {i} must be {{'role': one of {MESSAGE_ROLES}, "
                            f"'content': str}}, got {m!r}")
        messages.append(Message(m["role"], m["content"]))
    return tuple(messages)


def task_from_row(ref: RowRef, row: Row) -> Task:
    """A Task from a row of the format in the module docstring."""
    check_fields(ref, row, FIELDS)
    task_id = get_str(ref, row, "id", required=True)
    answer = row.get("answer")
    if answer is not None and (isinstance(answer, bool)
                               or not isinstance(answer, (str, int, float))):
        raise ref.error("answer", f"must be a string or number, got {answer!r}")
    try:
        return Task(id=str(task_id), messages=get_messages(ref, row),
                    tools=get_str_list(ref, row, "tools"),
                    answer=None if answer is None else str(answer),
                    agent_loop=get_str(ref, row, "agent_loop"),
                    source_dir=get_folder(ref, row, "source_dir"), image=get_str(ref, row, "image"),
                    visible_tests=get_folder(ref, row, "visible_tests"),
                    grading=GradingSpec(hidden_tests=get_folder(ref, row, "hidden_tests"),
                                        test_patch=get_str(ref, row, "test_patch"),
                                        fail_to_pass=get_str_list(ref, row, "fail_to_pass"),
                                        pass_to_pass=get_str_list(ref, row, "pass_to_pass")),
                    reward_fn=get_str(ref, row, "reward_fn"))
    except ValueError as exc:
        if str(exc).startswith(ref.source):
            raise
        raise ref.error(None, str(exc)) from None
