"""Fixtures shared by integration modules: a real vLLM engine on the tiny model, one per
module (each module's tests run on one event loop with it); `long_engine` has the tiny
model's whole 4,096-token context (black-box harness prompts are long); `own_tmpdir`, a
system temp folder of the test's own for the sandboxes of the runs it starts."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from rollout.engine import EngineSpec, VLLMEngine


async def _tiny_engine(tiny_model_path, max_model_len: int):
    eng = VLLMEngine(EngineSpec(model_path=str(tiny_model_path), max_model_len=max_model_len,
                                kv_cache_memory_bytes=64 << 20, enforce_eager=True))
    await eng.start()
    return eng


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_model_path):
    eng = await _tiny_engine(tiny_model_path, 1024)
    yield eng
    eng.shutdown()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def long_engine(tiny_model_path):
    eng = await _tiny_engine(tiny_model_path, 4096)
    yield eng
    eng.shutdown()


@pytest.fixture
def own_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """TMPDIR for the Ray workers and processes this test starts: sandbox folders, their
    workspace mounts and snapshots go there, so the test can look at (or wipe) its own
    and never another test's or run's on this machine. Ray stays in its own folder
    (RAY_TMPDIR). Searchable by all (0711): sandbox uids pass through it."""
    folder = tempfile.mkdtemp(prefix="sluice-t-", dir=tempfile.gettempdir())
    os.chmod(folder, 0o711)
    monkeypatch.setenv("RAY_TMPDIR", os.environ.get("RAY_TMPDIR", tempfile.gettempdir()))
    monkeypatch.setenv("TMPDIR", folder)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
