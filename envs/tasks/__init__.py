"""Task formats: turn a recipe's `envs.tasks` / `envs.task_format` into a list of Tasks.

    load_tasks("toy_arithmetic")            bundled sets by name (BUILTIN_SETS); the
                                            toy sets have a `_heldout` twin for eval
    load_tasks("toy_screens")               (the visual one: envs.tasks.screens)
    load_tasks("code_functions")
    load_tasks("data/tasks.jsonl")          rows of the task row format (envs.tasks.rows)
    load_tasks("data/swe.parquet", "swe")   SWE-bench-style instances (envs.tasks.swe)
    load_tasks("data/swe_hf/")              a `datasets` save_to_disk folder of either

With fmt="auto" a built-in name picks its set, and a file is read as SWE-bench rows when
its first row has `instance_id` and `problem_statement`, else as task rows. Parquet
files are read through `datasets`, imported only then.

`load_tasks` stops at the first problem; `read_tasks` reads on past bad rows and returns
every problem with the tasks that are fine (start-up validation lists them all at once).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from envs.cache import default_cache_dir
from envs.tasks.build_swe_smith import IMAGES_SET_NAME as SWE_IMAGES_SET
from envs.tasks.build_swe_smith import SET_NAME as SWE_SMITH_SET
from envs.tasks.build_swe_smith import (build_bundled_image_set, build_bundled_set,
                                        bundled_image_set_dir, bundled_set_dir)
from envs.tasks.code import SET_NAME as CODE_SET
from envs.tasks.code import build_code_tasks
from envs.tasks.rows import read_rows, task_from_row
from envs.tasks.screens import HELDOUT_SET_NAME as SCREENS_HELDOUT_SET
from envs.tasks.screens import SET_NAME as SCREENS_SET
from envs.tasks.screens import build_toy_screens, build_toy_screens_heldout
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
    # What colour is the square on the screen: the screenshot tool's images (vision-language models).
    SCREENS_SET: ("toy", lambda cache_dir: build_toy_screens()),
    SCREENS_HELDOUT_SET: ("toy", lambda cache_dir: build_toy_screens_heldout()),
    CODE_SET: ("code", build_code_tasks),
    # SWE-smith-style bugs in hjson, built once into the cache (about 2 minutes).
    SWE_SMITH_SET: ("swe", lambda cache_dir: _read_bundled_swe(build_bundled_set(cache_dir),
                                                               cache_dir)),
    # The same kind of bugs in hjson and referencing, each task in its own podman image
    # (repository at /testbed); needs envs.sandbox_backend=container (a few minutes once).
    SWE_IMAGES_SET: ("swe", lambda cache_dir: _read_bundled_swe(
        build_bundled_image_set(cache_dir), cache_dir)),
}
# Built-in sets whose first build takes minutes: name -> (their folder under the cache
# root, what the build does and about how long it takes; swe_smith_images measured 243 s
# on 2 cores at load average 6-8, the base image present).
SLOW_SETS: dict[str, tuple[Callable[[str], str], str]] = {
    SWE_SMITH_SET: (bundled_set_dir, "about 2 min: each mutation's tests run to keep only "
                                     "real bugs"),
    SWE_IMAGES_SET: (bundled_image_set_dir, "about 5 min on 2 cores, more under load: each "
                                            "mutation's tests run to keep only real bugs, then "
                                            "one podman image a task"),
}
FORMATS = ("auto", "toy", "code", "swe", "jsonl", "parquet")


def unbuilt_set_note(source: str, cache_dir: str | None = None) -> str | None:
    """What to say instead of building `source` when it is a built-in set whose first build
    takes minutes and is not built yet (a dry run checks without building); else None."""
    if source not in SLOW_SETS:
        return None
    folder, takes = SLOW_SETS[source]
    where = folder(cache_dir or str(default_cache_dir()))
    if os.path.isdir(where):
        return None
    return (f"the task set {source} is not built yet: the first run builds it ({takes}) into "
            f"{where}")

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def load_tasks(source: str, fmt: str = "auto", *, cache_dir: str | None = None) -> list[Task]:
    """The tasks of `source` read as `fmt` (see the module docstring)."""
    tasks, problems = read_tasks(source, fmt, cache_dir=cache_dir, max_problems=1)
    if problems:
        raise ValueError(problems[0])
    return tasks


def read_tasks(source: str, fmt: str = "auto", *, cache_dir: str | None = None,
               max_problems: int | None = None) -> tuple[list[Task], list[str]]:
    """Every task of `source` that reads cleanly, and one message per problem (a bad row,
    a duplicate id, a missing file); stops after `max_problems` problems (None: never)."""
    if fmt not in FORMATS:
        return [], [f"task format {fmt!r} is unknown; use one of {', '.join(FORMATS)}"]
    cache = cache_dir or str(default_cache_dir())
    if source in BUILTIN_SETS:
        set_fmt, build = BUILTIN_SETS[source]
        if fmt not in ("auto", set_fmt):
            return [], [f"{source!r} is the built-in {set_fmt!r} set; set envs.task_format to "
                        f"'auto' or {set_fmt!r}, not {fmt!r}"]
        tasks, problems = build(cache), []
    elif fmt in ("toy", "code"):
        names = [n for n, (f, _) in BUILTIN_SETS.items() if f == fmt]
        return [], [f"task format {fmt!r} is a built-in set: set envs.tasks to {names[0]!r} "
                    f"(got {source!r})"]
    elif not source.endswith(FILE_SUFFIXES) and not os.path.isdir(source):
        return [], [f"tasks {source!r} is neither a built-in set ({', '.join(BUILTIN_SETS)}) "
                    f"nor a file ending in {', '.join(FILE_SUFFIXES)} nor a datasets folder"]
    else:
        tasks, problems = _read_file(source, fmt, cache, max_problems)
    problems += _duplicate_ids(source, tasks)
    return tasks, problems[:max_problems]


def _read_file(path: str, fmt: str, cache_dir: str,
               max_problems: int | None) -> tuple[list[Task], list[str]]:
    tasks: list[Task] = []
    problems: list[str] = []
    swe: bool | None = None if fmt == "auto" else fmt == "swe"
    try:
        for ref, row in read_rows(path, on_error=lambda exc: problems.append(str(exc))):
            if max_problems is not None and len(problems) >= max_problems:
                break
            if swe is None:
                swe = is_swe_row(row)
            try:
                tasks.append(swe_task_from_row(ref, row, cache_dir) if swe
                             else task_from_row(ref, row))
            except ValueError as exc:
                problems.append(str(exc))
    except ValueError as exc:  # the file itself: missing, or parquet that cannot be read
        problems.append(str(exc))
    if not tasks and not problems:
        problems.append(f"task file {path!r} holds no rows; add one task per line")
    return tasks, problems


def _read_bundled_swe(path: str, cache_dir: str) -> list[Task]:
    tasks, problems = _read_file(path, "swe", cache_dir, 1)
    if problems:
        raise ValueError(f"the bundled set {SWE_SMITH_SET!r} at {path} is broken ({problems[0]}); "
                         "delete its folder to rebuild it")
    return tasks


def _duplicate_ids(source: str, tasks: list[Task]) -> list[str]:
    seen: set[str] = set()
    problems = []
    for task in tasks:
        if task.id in seen:
            problems.append(f"{source}: task id {task.id!r} appears twice; ids must be unique")
        seen.add(task.id)
    return problems


__all__ = ["BUILTIN_SETS", "FORMATS", "SLOW_SETS", "load_tasks", "read_tasks", "unbuilt_set_note"]
