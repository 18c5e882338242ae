"""Shared fixtures, the marker policy and how parallel workers (pytest-xdist) share out the
suite.

Markers: tests under integration/ and gpu/ are marked by folder, so `pytest tests/unit`
stays fast and `-m "not integration"` works anywhere. The `system` tier (SYSTEM_TIER, and
every test of the container backend) is what `make test-system` runs and `make test`
leaves out: whole-system starts through the CLI or a multi-node cluster, and the second
sandbox backend's copy of each red-team matrix. Each costs a Python process tree of
torch, transformers and vLLM imports on 2 cores; CI runs both tiers (.ci/run).

Parallel runs (`make test`: `-n 2 --dist loadfile`): each file is one unit of work, so its
module-scoped fixtures (a vLLM engine, a Ray cluster, a whole run several checks read)
start once, on one worker; checks that share a fixture live in one file. Not `loadgroup`:
with pytest 9.2 (a structured node id), pytest-xdist 3.8's `xdist_group` suffix is never
seen and every test is scheduled alone. Files start slowest first (SLOW_FIRST), so that
the long whole-system runs do not start last and set the wall time alone. Each worker gets
a Ray temp folder of its own: `ray.cluster_utils.Cluster` writes its cluster's address
there, and a plain `ray.init()` in another worker would otherwise join that cluster."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# The system tier: one whole-system start each (the CLI's own process tree, a multi-node
# cluster, a TP=2 engine). The in-process whole run (test_async_loop) stays in `make test`.
SYSTEM_TIER = (
    "integration/test_stop_and_resume.py",  # two trainer.main starts: SIGKILL, resume, Ctrl-C
    "integration/test_example_my_agent_run.py",  # trainer.main on a user's package, then export
    "integration/test_multinode.py",  # a 4-node cluster's run: placement, gloo push, hacks
    "integration/test_launch_doctor.py",  # the doctor on a 4-node cluster
    "integration/test_engine_tp.py",  # a TP=2 engine in a placement group
    "integration/test_vision_toy_run.py",  # trainer.main on the vision recipe (its own warm start)
    "integration/test_engine_vision_resets.py",  # a vision engine killed by a push without cache resets
)
# The sandbox and grading matrices run on the local backend in `make test` and on the
# container backend (`backend` fixture parameter) in the system tier.
SYSTEM_BACKEND = "container"

# Files by their last measured duration (s, 2 workers, warm caches), longest first; the
# rest follow in collection order. Only the order of starting depends on this list.
SLOW_FIRST = (
    "integration/test_async_loop.py",  # 296: 20 steps, two evals, faults, its report
    "integration/test_stop_and_resume.py",  # 259: two real trainer.main starts
    "integration/test_rollout_e2e.py",  # ~130
    "integration/test_grading_redteam_inprocess.py",  # ~125
    "integration/test_engine_tp.py",  # 97
    "integration/test_grading_gold.py",  # ~90
    "integration/test_sandbox_redteam.py",  # ~85
    "integration/test_grading_redteam.py",  # ~85
    "integration/test_multinode.py",  # 80 (now also the hack-metrics run of before)
    "integration/test_example_my_agent_run.py",  # 80
    "integration/test_judge.py",  # ~60
    "integration/test_checkpoint_resume.py",  # 41
)


def _file_of(item: pytest.Item) -> str:
    """The file of `item` relative to tests/ (a posix path)."""
    return Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()


def _in_system_tier(item: pytest.Item, path: str) -> bool:
    params = item.callspec.params if isinstance(item, pytest.Function) and hasattr(item, "callspec") else {}
    return path in SYSTEM_TIER or params.get("backend") == SYSTEM_BACKEND


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = _file_of(item)
        if path.startswith("integration/"):
            item.add_marker(pytest.mark.integration)
        elif path.startswith("gpu/"):
            item.add_marker(pytest.mark.gpu)
        if _in_system_tier(item, path):
            item.add_marker(pytest.mark.system)
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    # sort is stable: within a file (and among unlisted files) collection order stays
    items.sort(key=lambda item: rank.get(_file_of(item), len(rank)))


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and "RAY_TMPDIR" not in os.environ:
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "run")[:8]
        # Short: Ray's socket paths under it are capped at 107 characters.
        folder = os.path.join(tempfile.gettempdir(), f"sluice-ray-{run}-{worker}")
        os.makedirs(folder, exist_ok=True)
        os.environ["RAY_TMPDIR"] = folder
        config.stash[_RAY_TMPDIR] = folder


_RAY_TMPDIR = pytest.StashKey[str]()


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_RAY_TMPDIR, None)
    if folder is not None:  # this worker's clusters are shut down: only their logs are left
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The cached tiny model (built on first use; workers that need it meanwhile wait)."""
    from trainer.run.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    """The tiny model's tokenizer (a module may define its own `tokenizer`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def chat(tokenizer):
    """The tiny model's continuity builder (rollout.chat), no reasoning parser."""
    from rollout.chat import build_continuity_builder

    return build_continuity_builder(tokenizer, "tiny", reasoning_parser="none")
