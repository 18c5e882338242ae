"""Fixtures shared by integration modules: a real vLLM engine on the tiny model, one per
module (each module's tests run on one event loop with it)."""

from __future__ import annotations

import pytest_asyncio

from rollout.engine import EngineSpec, VLLMEngine


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_model_path):
    eng = VLLMEngine(EngineSpec(model_path=str(tiny_model_path), max_model_len=1024,
                                kv_cache_memory_bytes=64 << 20, enforce_eager=True))
    await eng.start()
    yield eng
    eng.shutdown()
