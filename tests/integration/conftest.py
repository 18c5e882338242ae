"""Fixtures shared by integration modules: real vLLM engines on the tiny model, and
`own_tmpdir`, a system temp folder of the test's own for the sandboxes of the runs it
starts.

`shared_engine` is one engine per test worker (the tiny model's whole 4,096-token context:
black-box harness prompts are long) for the modules that only read from it, never pushing
weights or resetting its cache: one engine start instead of one per module. Their tests
and fixtures run on the session's event loop, the one it was started on. `engine` is a
module's own (1,024 tokens), for a module that changes it (test_engine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from run_faults import own_temp_folder

from rollout.engine import EngineSpec, VLLMEngine


async def _tiny_engine(tiny_model_path, max_model_len: int):
    eng = VLLMEngine(EngineSpec(model_path=str(tiny_model_path), max_model_len=max_model_len,
                                kv_cache_memory_bytes=64 << 20, enforce_eager=True, kv_events=True))
    await eng.start()
    return eng


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_model_path):
    eng = await _tiny_engine(tiny_model_path, 1024)
    yield eng
    eng.shutdown()


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def shared_engine(tiny_model_path):
    eng = await _tiny_engine(tiny_model_path, 4096)
    yield eng
    eng.shutdown()


@pytest.fixture
def own_tmpdir() -> Iterator[Path]:
    """A system temp folder of the test's own for the sandboxes of the runs it starts
    (run_faults.own_temp_folder)."""
    with own_temp_folder() as folder:
        yield folder
