"""Fixtures shared by integration modules: a real vLLM engine on the tiny model, one per
module (each module's tests run on one event loop with it); `long_engine` has the tiny
model's whole 4,096-token context (black-box harness prompts are long)."""

from __future__ import annotations

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
