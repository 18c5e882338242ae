"""Task formats: turn a recipe's `envs.tasks` / `envs.task_format` into a list of Tasks.

    load_tasks("toy_arithmetic")            bundled sets by name (BUILTIN_SETS); the
                                            toy sets have a `_heldout` twin for eval
    load_tasks("code_functions")
    load_tasks("data/tasks.jsonl")          rows of the task row format (envs.tasks.rows)
    load_tasks("data/swe.parquet", "swe")   SWE-bench-style instances (envs.tasks.swe)

With fmt="auto" a built-in name picks its set, and a file is read as SWE-bench rows when
its first row has `instance_id` and `problem_statement`, else as task rows. Parquet
files are read through `datasets`, imported only then.
"""

from __future__ import annotations

from collections.abc import Callable

from envs.cache import default_cache_dir
from envs.tasks.code import SET_NAME as CODE_SET
from envs.tasks.code import build_code_tasks
from envs.tasks.rows import read_rows, task_from_row
from envs.tasks.swe import is_swe_row, swe_task_from_row
from envs.tasks.toy import EASY_SET_NAME as TOY_EASY_SET
from envs.tasks.toy import HELDOUT_SUFFIX
from envs.tasks.toy import SET_NAME as TOY_SET
from envs.tasks.toy import build_heldout, build_toy_arithmetic, build_toy_arithmetic_easy
from envs.types import Task

# Built-in set name -> (its format, how it is built from a cache folder).
BUILTIN_SETS: dict[str, tuple[str, Callable[[str], list[Task]]]] = {
    TOY_SET: ("toy", lambda cache_dir: build_toy_arithmetic()),
    TOY_EASY_SET: ("toy", lambda cache_dir: build_toy_arithmetic_easy()),
    TOY_SET + HELDOUT_SUFFIX: ("toy", lambda cache_dir: build_heldout(TOY_SET)),
    TOY_EASY_SET + HELDOUT_SUFFIX: ("toy", lambda cache_dir: build_heldout(TOY_EASY_SET)),
    CODE_SET: ("code", build_code_tasks),
}
FORMATS = ("auto", "toy", "code", "swe", "jsonl", "parquet")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def load_tasks(source: str, fmt: str = "auto", *, cache_dir: str | None = None) -> list[Task]:
    """The tasks of `source` read as `fmt` (see the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"task format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    cache = cache_dir or str(default_cache_dir())
    if source in BUILTIN_SETS:
        set_fmt, build = BUILTIN_SETS[source]
        if fmt not in ("auto", set_fmt):
            raise ValueError(f"{source!r} is the built-in {set_fmt!r} set; set "
                             f"envs.task_format to 'auto' or {set_fmt!r}, not {fmt!r}")
        tasks = build(cache)
    elif fmt in ("toy", "code"):
        names = [n for n, (f, _) in BUILTIN_SETS.items() if f == fmt]
        raise ValueError(f"task format {fmt!r} is a built-in set: set envs.tasks to "
                         f"{names[0]!r} (got {source!r})")
    elif not source.endswith(FILE_SUFFIXES):
        raise ValueError(f"tasks {source!r} is neither a built-in set ({', '.join(BUILTIN_SETS)}) "
                         f"nor a file ending in {', '.join(FILE_SUFFIXES)}")
    else:
        tasks = _load_file(source, fmt, cache)
    _check_unique(source, tasks)
    return tasks


def _load_file(path: str, fmt: str, cache_dir: str) -> list[Task]:
    tasks: list[Task] = []
    swe: bool | None = None if fmt == "auto" else fmt == "swe"
    for ref, row in read_rows(path):
        if swe is None:
            swe = is_swe_row(row)
        tasks.append(swe_task_from_row(ref, row, cache_dir) if swe else task_from_row(ref, row))
    if not tasks:
        raise ValueError(f"task file {path!r} holds no rows; add one task per line")
    return tasks


def _check_unique(source: str, tasks: list[Task]) -> None:
    seen: set[str] = set()
    for task in tasks:
        if task.id in seen:
            raise ValueError(f"{source}: task id {task.id!r} appears twice; ids must be unique")
        seen.add(task.id)


__all__ = ["BUILTIN_SETS", "FORMATS", "load_tasks"]
