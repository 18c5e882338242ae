"""Start-up of the grading test process: reward.driver runs it in the grading sandbox as
`python3 -I -B boot.py`, with its settings as JSON on stdin (standard library only; the
pytest it imports comes from the runtime zip). The order is the point:

1. the settings (the record key among them) are read from stdin, which then becomes
   /dev/null: nothing the agent's code can read later holds them, nor does argv;
2. the record pipe is moved to the descriptor the driver picked for this grading and
   made non-inheritable, so the tests' own subprocesses never get it;
3. the runtime goes on sys.path, and pytest, every built-in plugin and every standard
   library module the runtime imports anywhere (reward.runtime's preload list) are
   imported: the runner is complete before any workspace file is importable;
4. a meta-path guard makes every top-level import of a standard-library or runner name
   resolve on the trusted path only (the task source's own modules of such names
   excepted), so a workspace `json.py` or `faulthandler.py` is never what loads;
5. the recorder plugin (reward.recorder) is loaded from its file under a name chosen
   per grading;
6. only then the workspace goes on sys.path and pytest runs, with the recorder.

What this cannot stop: once the agent's code runs (the tests import it), it can do
anything this process can, including undoing steps 4 and 5; reward.driver and
reward.crosscheck are the checks that hold after that.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from typing import Any


class ShadowGuard:
    """A meta-path finder placed before the path finder: the guarded top-level names are
    looked up on the trusted path alone, and are refused when not found there."""

    def __init__(self, names: frozenset[str], trusted_path: list[str]) -> None:
        self.names = names
        self.trusted_path = trusted_path

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if path is not None or name not in self.names:
            return None  # submodules resolve through their package's own (trusted) path
        spec = importlib.machinery.PathFinder.find_spec(name, self.trusted_path)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}: a workspace module may not "
                                      "take the name of a standard-library or test-runner "
                                      "module in grading", name=name)
        return spec


def install_guard(allowed: list[str], runner_names: list[str]) -> ShadowGuard:
    names = (frozenset(sys.stdlib_module_names) | frozenset(runner_names)) - frozenset(allowed)
    guard = ShadowGuard(names, list(sys.path))
    finders = sys.meta_path
    index = next((i for i, f in enumerate(finders) if f is importlib.machinery.PathFinder),
                 len(finders))
    finders.insert(index, guard)
    return guard


def preload(module_names: list[str]) -> None:
    import _pytest.config

    for plugin in (*_pytest.config.essential_plugins, *_pytest.config.default_plugins):
        importlib.import_module(f"_pytest.{plugin}")
    for name in module_names:
        try:
            importlib.import_module(name)
        except Exception:  # absent from this python's build (or platform): nothing to take
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
    sys.path.insert(0, settings["runtime"])
    import pytest

    preload(settings["preload"])
    install_guard(settings["shadow_allowed"], settings["runner_names"])
    recorder: Any = load_recorder(settings["recorder"], settings["recorder_module"])
    plugin = recorder.Recorder(settings["fd"], bytes.fromhex(settings["key"]))
    sys.path.insert(0, settings["workspace"])
    return int(pytest.main(settings["pytest_args"], plugins=[plugin]))


if __name__ == "__main__":
    sys.exit(main())
