"""The test runner's configuration in grading: the grader writes its own pytest config file
and passes it explicitly (`-c`), so pytest never discovers one in the workspace; the
options a repository needs come from the task source's own config file, read here on the
host, never from the agent's workspace.

Also what the runner must not be shadowed by: the names of the standard library and of the
runner's own packages, which a workspace module may only take where the task source itself
defines one (a repository's `test/` package, say). The grading sandbox's start-up
(reward.grading.boot) enforces it; reward.grading.prepare drops the agent's new files of such names and
reward.grading.hacking reports them.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from envs.sandbox.base import WORKSPACE_MOUNT
from reward.grading.runtime import RUNTIME_MODULES, RUNTIME_PACKAGES

# pytest 9.2's discovery list, used only where pytest itself cannot be imported.
_KNOWN_PYTEST_CONFIG_NAMES = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini",
                              "pyproject.toml", "tox.ini", "setup.cfg")
# Code that runs at interpreter or pytest start-up, wherever it is found.
STARTUP_NAMES = ("conftest.py", "sitecustomize.py", "usercustomize.py")
RUNNER_NAMES = frozenset((*RUNTIME_PACKAGES, *RUNTIME_MODULES))
# Only these options are resolved relative to the config file's folder (pytest's "paths"
# type); the grader's file lives elsewhere, so they are made absolute.
_PATH_OPTIONS = ("pythonpath",)
# Options of a source's addopts that grading drops: the expected tests are named
# explicitly and every one of them (and every sentinel) must run, so nothing may stop the
# run early, deselect or ignore tests, or depend on the cache; the report is the grader's.
_DROPPED_FLAGS = frozenset({"-x", "--exitfirst", "--sw", "--stepwise", "--stepwise-skip",
                            "--lf", "--last-failed", "--ff", "--failed-first", "--nf",
                            "--new-first", "--pdb", "--trace"})
# Options of the source's config that grading does not carry: the plugins it requires are
# not in the grading runtime (plugin autoload is off), and the grader owns the report.
_DROPPED_OPTIONS = frozenset({"required_plugins", "junit_suite_name", "cache_dir"})
_DROPPED_WITH_VALUE = ("--maxfail", "-k", "-m", "--junitxml", "--junit-xml", "--deselect",
                       "--ignore", "--ignore-glob", "--basetemp")


def pytest_config_names() -> tuple[str, ...]:
    """Every file name the grader's pytest discovers configuration in, from pytest itself
    (the grading runtime ships this same pytest), so a pytest that reads more names than
    a list written here knows is still covered."""
    try:
        from _pytest.config.findpaths import CONFIG_LOADERS_BY_NAME
    except ImportError:
        return _KNOWN_PYTEST_CONFIG_NAMES
    return tuple(dict.fromkeys((*CONFIG_LOADERS_BY_NAME, *_KNOWN_PYTEST_CONFIG_NAMES)))


@dataclass(frozen=True, slots=True)
class SourceConfig:
    """The pytest options of the task source's config file."""

    rel_dir: str  # folder of the file in the workspace ("" for the root)
    file_name: str
    mode: str  # "ini" (str / list[str] values) or "toml" (native TOML values)
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def pythonpath_dirs(self) -> tuple[str, ...]:
        """The config's `pythonpath` entries as workspace-relative folders."""
        raw = self.values.get("pythonpath", [])
        # A TOML config's list may hold values of any type.
        entries: list[object] = list(shlex.split(raw) if isinstance(raw, str) else raw)
        out = []
        for entry in entries:
            rel = os.path.normpath(os.path.join(self.rel_dir, str(entry)))
            if not rel.startswith(".."):
                out.append("" if rel == "." else rel)
        return tuple(out)


def find_source_config(source_dir: str | None, start_rel_dir: str = "") -> SourceConfig | None:
    """The config file pytest would use for tests under `start_rel_dir` of the task source
    (searched from there up to the source's root, never above it), or None."""
    if source_dir is None:
        return None
    from _pytest.config.findpaths import load_config_dict_from_file
    from _pytest.outcomes import Failed

    rel = os.path.normpath(start_rel_dir) if start_rel_dir else "."
    while True:
        for name in pytest_config_names():
            path = os.path.join(source_dir, rel, name)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            try:
                loaded = load_config_dict_from_file(_as_path(path))
            except (Exception, Failed) as exc:  # pytest's loaders raise parse errors of several libraries, by version
                raise ValueError(f"the task source's {os.path.join(rel, name)} is not a valid "
                                 f"pytest config ({exc}); fix it in the task source") from None
            if loaded is not None:
                modes = {v.mode for v in loaded.values()} or {"ini"}
                return SourceConfig("" if rel == "." else rel, name, modes.pop(),
                                    {k: v.value for k, v in loaded.items()})
        if rel == ".":
            return None
        rel = os.path.dirname(rel) or "."


def _as_path(path: str) -> Any:
    from pathlib import Path

    return Path(path)


def render_grader_config(config: SourceConfig | None, workdir: str = WORKSPACE_MOUNT) -> str:
    """The grader's own config file (a TOML file pytest reads from `-c`): the source's
    options in the same mode, with folder-relative paths made absolute (under `workdir`,
    where the grading sandbox shows the workspace)."""
    lines = ["# Written by the grader; the only pytest configuration this run reads."]
    if config is None or not config.values:
        return "\n".join(lines) + "\n"
    table = "tool.pytest.ini_options" if config.mode == "ini" else "tool.pytest"
    lines.append(f"[{table}]")
    for key, value in sorted(config.values.items()):
        if key in _DROPPED_OPTIONS:
            continue
        if key in _PATH_OPTIONS:
            value = [f"{workdir}/{d}".rstrip("/") for d in config.pythonpath_dirs]
        elif key == "addopts":
            value = grading_addopts(value)
        lines.append(f"{_toml_key(key)} = {_toml_value(key, value)}")
    return "\n".join(lines) + "\n"


def grading_addopts(value: Any) -> Any:
    """A source's addopts (a string in INI mode, a list in TOML mode) without the options
    grading drops (see _DROPPED_FLAGS)."""
    tokens = shlex.split(value) if isinstance(value, str) else [str(t) for t in value]
    kept, skip_next = [], False
    for token in tokens:
        if skip_next:
            skip_next = False
            continue
        name = token.split("=", 1)[0]
        if token in _DROPPED_FLAGS:
            continue
        if name in _DROPPED_WITH_VALUE:
            skip_next = "=" not in token
            continue
        if any(token.startswith(short) and len(token) > 2 for short in ("-k", "-m")):
            continue  # -kEXPR, -mEXPR
        kept.append(token)
    return shlex.join(kept) if isinstance(value, str) else kept


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else _toml_string(key)


def _toml_string(text: str) -> str:
    # JSON's escapes are all valid in a TOML basic string; DEL is the one control
    # character JSON leaves raw and TOML refuses.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("nan" if math.isnan(value) else "inf" if value > 0 else "-inf") \
            if not math.isfinite(value) else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(key, v) for v in value) + "]"
    raise ValueError(f"pytest option {key!r} of the task source's config has a value of type "
                     f"{type(value).__name__}, which the grader cannot carry; use a string, "
                     "number, boolean or list")


def shadow_names() -> frozenset[str]:
    """Top-level module names a workspace file must not take: the standard library's and
    the runner's."""
    return frozenset(sys.stdlib_module_names) | RUNNER_NAMES


def top_level_modules(path: str, import_roots: tuple[str, ...]) -> set[str]:
    """The top-level module names `path` defines, one per import root (a workspace folder
    on sys.path) that holds it directly: `json.py`, `json/...` (a package or namespace
    package) or a compiled `json.cpython-311.so`."""
    names = set()
    for root in import_roots:
        prefix = f"{root}/" if root else ""
        if not path.startswith(prefix):
            continue
        first, _, rest = path[len(prefix):].partition("/")
        stem = first if rest else first.split(".", 1)[0]
        if stem.isidentifier() and (rest or first.endswith((".py", ".pyc", ".so", ".pyd"))):
            names.add(stem)
    return names


def source_module_names(source_dir: str | None, import_roots: tuple[str, ...]) -> frozenset[str]:
    """Top-level module names the task source itself defines at the import roots."""
    if source_dir is None:
        return frozenset()
    names = set()
    for root in import_roots:
        folder = os.path.join(source_dir, root)
        if not os.path.isdir(folder):
            continue
        for entry in os.listdir(folder):
            rel = f"{root}/{entry}" if root else entry
            if os.path.isdir(os.path.join(folder, entry)):
                rel += "/__init__.py"  # a package (or namespace package) of that name
            names |= top_level_modules(rel, (root,))
    return frozenset(names)
