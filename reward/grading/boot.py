"""Start-up of the grading test process: reward.grading.driver runs it in the grading sandbox as
`python3 -I -B boot.py`, with its settings as JSON on stdin (standard library only). The
pytest it runs is the sandbox Python's own when that Python can import one of the
supported versions (MIN_IMAGE_PYTEST onwards; a task image's pytest, whatever the agent
did: the workspace is not on sys.path yet), else the grader's bundled one from the
runtime zip (settings["use_image_pytest"] false forces the zip). The order is the point:

1. the settings (the record key among them) are read from stdin, which then becomes
   /dev/null: nothing the agent's code can read later holds them, nor does argv;
2. the record pipe is moved to the descriptor the driver picked for this grading and
   made non-inheritable, so the tests' own subprocesses never get it;
3. pytest is chosen and imported (the runtime goes first on sys.path for the bundled
   one), with every built-in plugin, every standard-library module the bundled runtime
   imports anywhere (reward.grading.runtime's preload list) and, for the image's pytest, the
   distributions it requires: the runner is complete before any workspace file is
   importable, and its first record says which pytest it is;
4. a meta-path guard makes every top-level import of a standard-library or runner name
   resolve on the trusted path only (the task source's own modules of such names
   excepted), so a workspace `json.py` or `faulthandler.py` is never what loads;
5. the recorder plugin (reward.grading.recorder) is loaded from its file under a name chosen
   per grading;
6. only then the workspace goes on sys.path and pytest runs, with the recorder.

Code here runs on the sandbox's Python, 3.8 to 3.11: no syntax or standard-library API
newer than 3.8 (sys.stdlib_module_names, 3.10, comes from the settings where absent;
annotations are never evaluated, `from __future__ import annotations`).

What this cannot stop: once the agent's code runs (the tests import it), it can do
anything this process can, including undoing steps 4 and 5, reading the record key
(this process's memory still holds the settings text) and the pipe, and swapping test
functions' code. Nothing here is trusted after that point: the mutation sentinels
(reward.grading.sentinels), whose verdict needs no honest process, are what hold.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import re
from collections.abc import Sequence
from types import ModuleType
from typing import Any

# The oldest pytest whose own copy grades (the recorder's hooks and the driver's command
# line hold from 6.2 on); an older one in the image is ignored for the bundled runtime.
MIN_IMAGE_PYTEST = (6, 2)


class ShadowGuard:
    """A meta-path finder placed before the path finder: the guarded top-level names are
    looked up on the trusted path alone, and are refused when not found there."""

    def __init__(self, names: frozenset[str], trusted_path: list[str]) -> None:
        self.names = names
        self.trusted_path = trusted_path

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if path is not None or name not in self.names:
            return None  # submodules resolve through their package's own (trusted) path
        spec = importlib.machinery.PathFinder.find_spec(name, self.trusted_path)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}: a workspace module may not "
                                      "take the name of a standard-library or test-runner "
                                      "module in grading", name=name)
        return spec


def install_guard(allowed: list[str], runner_names: list[str], stdlib_names: list[str],
                  workspace: str) -> ShadowGuard:
    stdlib = frozenset(getattr(sys, "stdlib_module_names", ())) | frozenset(stdlib_names)
    names = (stdlib | frozenset(runner_names)) - frozenset(allowed)
    # A .pth of the image (an editable install) may have put the workspace on sys.path
    # already: it is never a trusted place.
    guard = ShadowGuard(names, [p for p in sys.path if not inside(p, workspace)])
    finders = sys.meta_path
    index = next((i for i, f in enumerate(finders) if f is importlib.machinery.PathFinder),
                 len(finders))
    finders.insert(index, guard)
    return guard


def inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path or "."), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version)[:2])


def image_pytest(workspace: str) -> str | None:
    """The version of the pytest this Python imports without the runtime zip, when it is
    supported and not the workspace's; None otherwise (nothing is imported then)."""
    spec = importlib.util.find_spec("pytest")
    if spec is None or spec.origin is None or inside(spec.origin, workspace):
        return None
    version = _pytest_version(spec.origin)
    return version if version and version_tuple(version) >= MIN_IMAGE_PYTEST else None


def _pytest_version(origin: str) -> str | None:
    """pytest's version from its `_pytest/_version.py` (written by setuptools_scm since
    pytest 3.x), read without importing pytest."""
    path = os.path.join(os.path.dirname(os.path.dirname(origin)), "_pytest", "_version.py")
    try:
        with open(path) as f:
            found = re.search(r"""\bversion\s*=\s*['"]([^'"]+)['"]""", f.read())
    except OSError:
        return None
    return found.group(1) if found else None


def runner_requirements(workspace: str) -> list[str]:
    """Top-level module names of the distributions the installed pytest requires
    (pluggy, iniconfig, packaging, tomli, exceptiongroup, attrs, py, ...), except those
    the workspace provides (a task of that very project: its code is graded, not trusted)."""
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8
        return []
    names = []
    try:
        requires = metadata.distribution("pytest").requires or []
    except (ImportError, OSError, ValueError):  # PackageNotFoundError (an ImportError): no metadata beside it
        return []
    for requirement in requires:
        if "extra ==" in requirement:
            continue  # the testing extra
        found = re.match(r"[A-Za-z0-9._-]+", requirement)
        if not found:
            continue
        try:
            top = (metadata.distribution(found.group(0)).read_text("top_level.txt") or "").split()
        except (ImportError, OSError, ValueError):  # PackageNotFoundError: not installed (a marker excludes it here)
            continue
        names += top or [found.group(0).replace("-", "_").lower()]
    return [n for n in dict.fromkeys(names) if n.isidentifier() and not _in_workspace(n, workspace)]


def _in_workspace(name: str, workspace: str) -> bool:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return True  # unresolvable: neither preloaded nor guarded
    if spec is None:
        return True
    places = [spec.origin or "", *(spec.submodule_search_locations or [])]
    return any(os.path.isabs(p) and inside(p, workspace) for p in places)


def import_runner(settings: dict) -> tuple[Any, str, list[str]]:
    """pytest, where it comes from ('image' or 'bundled') and the extra runner module
    names to preload and guard (see the module docstring)."""
    version = image_pytest(settings["workspace"]) if settings.get("use_image_pytest", True) \
        else None
    if version is None:
        sys.path.insert(0, settings["runtime"])
    import pytest

    if version is None:
        return pytest, "bundled", []
    return pytest, "image", runner_requirements(settings["workspace"])


def preload(module_names: list[str]) -> None:
    import _pytest.config

    for plugin in (*_pytest.config.essential_plugins, *_pytest.config.default_plugins):
        importlib.import_module(f"_pytest.{plugin}")
    for name in module_names:
        try:
            importlib.import_module(name)
        except (ImportError, OSError):  # absent from this python's build (or platform): nothing to take
            pass


def take_record_pipe(fd_in: int, fd: int) -> None:
    if fd_in != fd:
        os.dup2(fd_in, fd, inheritable=False)
        os.close(fd_in)
    os.set_inheritable(fd, False)


def load_recorder(path: str, module_name: str) -> object:
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    settings = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    take_record_pipe(settings["fd_in"], settings["fd"])
    pytest, source, requirements = import_runner(settings)
    preload([*settings["preload"], *requirements])
    install_guard(settings["shadow_allowed"], [*settings["runner_names"], *requirements],
                  settings.get("stdlib_names", []), settings["workspace"])
    recorder: Any = load_recorder(settings["recorder"], settings["recorder_module"])
    plugin = recorder.Recorder(settings["fd"], bytes.fromhex(settings["key"]))
    plugin.runner(str(pytest.__version__), source)
    sys.path.insert(0, settings["workspace"])
    return int(pytest.main(settings["pytest_args"], plugins=[plugin]))


if __name__ == "__main__":
    sys.exit(main())
