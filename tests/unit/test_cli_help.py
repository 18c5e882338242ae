"""`--help` of every command the docs tell users to run (`python -m <module>` in README.md,
launch/README.md and docs/) prints its usage and exits 0. In-process (runpy, as `python -m`
runs a module), so the whole list costs one import of each; one real `python -m` run
checks the interpreter's exit status too."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OWN_PACKAGES = ("trainer", "rollout", "buffer", "reward", "envs", "launch")
DOCS = [ROOT / "README.md", ROOT / "launch" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Named in the docs, not as a command to run: docs/tasks.md says this name (the one an
# issue used) is `python -m reward.validate`.
NOT_COMMANDS = {"envs.tasks.validate"}


def documented_modules() -> list[str]:
    """The project's own modules that the docs run with `python -m`."""
    found = {m for doc in DOCS if doc.is_file()
             for m in re.findall(r"python -m ([A-Za-z_][\w.]*)", doc.read_text(encoding="utf-8"))}
    return sorted(m for m in {m.rstrip(".") for m in found}
                  if m.split(".")[0] in OWN_PACKAGES and m not in NOT_COMMANDS)


MODULES = documented_modules()


def test_the_docs_name_the_main_commands():
    assert {"trainer.main", "launch.doctor", "launch.plan", "launch.simulate"} <= set(MODULES)


# runpy's note when the module was imported before (by an earlier case): harmless here.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package")
@pytest.mark.parametrize("module", MODULES)
def test_help_prints_usage_and_exits_0(module: str, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    environ = dict(os.environ)  # an entry point may set variables for the processes it starts
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0  # returned without exiting
    except SystemExit as exc:
        code = exc.code
    finally:
        os.environ.clear()
        os.environ.update(environ)
    out = capsys.readouterr()
    assert code in (0, None), f"python -m {module} --help exited {code!r}: {out.err[-2000:]}"
    assert "usage" in (out.out + out.err).lower(), f"python -m {module} --help printed no usage"


def test_doctor_help_exits_0_from_the_interpreter():
    done = subprocess.run([sys.executable, "-m", "launch.doctor", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()
