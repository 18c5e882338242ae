"""The pytest runtime shipped into grading sandboxes: a zip of the grader's own pure-Python
pytest and its dependencies, with precompiled bytecode, importable by the sandbox's
python through zipimport.

It is the fallback: where the sandbox's Python imports a supported pytest of its own (a
task image's, 6.2 onwards), that one grades (reward.grading.boot). Sandboxes of the local
backend see only the host's read-only system runtime, which need not have pytest; the
shipped copy is the same in every grading run there, whatever the agent installed. Built
once per pytest version into the cache folder (the bytecode saves 0.3 s of pytest start-up;
a python of another minor version ignores it and compiles the sources).

Next to the zip, `preload.json` lists every standard-library module the runtime's code
imports anywhere (found in its syntax trees at build time): the sandbox's start-up
(reward.grading.boot) imports them all before the workspace becomes importable, so nothing the
runner loads later, lazily, can be taken from the agent's files.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import marshal
import os
import sys
import threading
import zipfile

from envs.cache import build_once, default_cache_dir

log = logging.getLogger(__name__)

# pytest 9's import-time dependencies (its terminal writer imports pygments at module
# level: a task image without pygments could not start the runner otherwise).
RUNTIME_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments")
RUNTIME_MODULES = ("py",)  # pytest's `py` compatibility shim, a single module
RUNTIME_NAME = "pytest-runtime.zip"
PRELOAD_NAME = "preload.json"
_FORMAT = 3  # bump when the folder's content changes


_lock = threading.Lock()  # gradings prepare their folders in threads


def pytest_runtime_zip(cache_dir: str | None = None) -> str:
    """Path of the runtime zip, built once per pytest version and bytecode format under
    the cache folder."""
    return os.path.join(_runtime_folder(cache_dir), RUNTIME_NAME)


def runtime_preload(cache_dir: str | None = None) -> tuple[str, ...]:
    """The standard-library modules the runtime imports (see the module docstring)."""
    with open(os.path.join(_runtime_folder(cache_dir), PRELOAD_NAME)) as f:
        return tuple(json.load(f))


def _runtime_folder(cache_dir: str | None) -> str:
    import pytest

    key = f"pytest-{pytest.__version__}-py{importlib.util.MAGIC_NUMBER.hex()}-v{_FORMAT}"
    folder = os.path.join(cache_dir or str(default_cache_dir()), "pytest-runtime", key)
    with _lock:
        build_once(folder, _build)
    return folder


def _build(folder: str) -> None:
    path = os.path.join(folder, RUNTIME_NAME)
    imported: set[str] = set()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in RUNTIME_PACKAGES:
            _add_package(zf, name, imported)
        for name in RUNTIME_MODULES:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                _add_source(zf, spec.origin, os.path.basename(spec.origin), imported)
    stdlib = sorted(m for m in imported if m.split(".")[0] in sys.stdlib_module_names)
    with open(os.path.join(folder, PRELOAD_NAME), "w") as f:
        json.dump(stdlib, f)
    os.chmod(path, 0o644)
    log.info("pytest runtime for grading sandboxes: %s (%d bytes)", path, os.path.getsize(path))


def _add_package(zf: zipfile.ZipFile, name: str, imported: set[str]) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"grading needs the package {name!r} in the grader's environment; "
                         "install the project's test extra (pytest)")
    root = list(spec.submodule_search_locations)[0]
    base = os.path.dirname(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for filename in sorted(filenames):
            if filename.endswith((".pyc", ".pyo")):
                continue
            full = os.path.join(dirpath, filename)
            arcname = os.path.relpath(full, base)
            if filename.endswith(".py"):
                _add_source(zf, full, arcname, imported)
            else:
                zf.write(full, arcname)  # py.typed, data files


def _add_source(zf: zipfile.ZipFile, full: str, arcname: str, imported: set[str]) -> None:
    with open(full, "rb") as f:
        source = f.read()
    zf.writestr(arcname, source)
    tree = ast.parse(source, arcname)
    imported.update(_absolute_imports(tree))
    code = compile(tree, arcname, "exec", dont_inherit=True)
    # Unchecked hash-based pyc (PEP 552): zipimport loads it without comparing the
    # source's mtime, and a python with another magic number falls back to the source.
    header = importlib.util.MAGIC_NUMBER + (0b01).to_bytes(4, "little") \
        + importlib.util.source_hash(source)
    zf.writestr(arcname[:-3] + ".pyc", header + marshal.dumps(code))


def _absolute_imports(tree: ast.AST) -> set[str]:
    """Modules a syntax tree imports by absolute name, at any depth (lazy imports in
    functions included)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found
