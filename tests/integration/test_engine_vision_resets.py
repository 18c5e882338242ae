"""What a weight push does to a vision-language engine without its multimodal cache
resets (rollout.engine.VLLMEngine._reset_multimodal_caches): vLLM's in-place reload clears
the model runner's encoder cache but not its scheduler's record of it, so the next request
with an image seen before is scheduled without encoding it and the engine dies. This is
why test_engine_vision.py's push check fails without the resets; a system-tier test (it
starts an engine of its own, which it kills)."""

from __future__ import annotations

import pytest

from rollout.chat import build_continuity_builder, load_tokenizer
from rollout.engine import EngineSpec, Sampling, VLLMEngine
from rollout.vision import for_engine, load_image_expander
from test_engine_vision import _blob, _context, _model, _perturbed
from trainer.run.tiny_vl_model import ensure_tiny_vl_model


@pytest.mark.asyncio
async def test_without_the_resets_a_push_leaves_the_engine_unable_to_serve_a_cached_image(monkeypatch):
    from vllm.v1.engine.exceptions import EngineDeadError

    vl_path = ensure_tiny_vl_model()
    chat = build_continuity_builder(load_tokenizer(vl_path), "auto", images=load_image_expander(vl_path))
    engine = VLLMEngine(EngineSpec(model_path=str(vl_path), max_model_len=2048, enforce_eager=True,
                                   kv_cache_memory_bytes=128 << 20, max_num_seqs=8))
    await engine.start()
    try:
        context = _context(chat)
        sampling = Sampling(max_new_tokens=4, seed=5, stop_token_ids=())
        await engine.generate("warm", context, sampling, for_engine(context.images))
        monkeypatch.setattr(engine, "_reset_multimodal_caches", _no_reset)
        state = _perturbed(_model(vl_path), seed=1, prefix="model.vision_model.")
        await engine.update_weights(1, blob=_blob(state))
        with pytest.raises(EngineDeadError):
            await engine.generate("after", context, sampling, for_engine(context.images))
    finally:
        engine.shutdown()


async def _no_reset() -> None:
    return None
