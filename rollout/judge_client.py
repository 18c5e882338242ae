"""The judge model's side of the generative reward: `EngineJudgeClient` implements
reward.judge.JudgeClient over the vLLM engines of the judge pool (chat template in, greedy
tokens out, text back), and `start_judge` starts those engines from `reward.judge`.

Judge engines are a second model: they are never given to the rollout router, so weight
pushes never reach them. Calls go to the engine with the fewest judge calls in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rollout.chat import decode_text, encode, load_tokenizer, render_chat
from rollout.engine import EngineSpec, Sampling, TokenOutput
from envs.types import Message

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rollout.config import RolloutRecipe

log = logging.getLogger(__name__)


class JudgeEngine(Protocol):
    """What the judge client needs from an engine: the in-process VLLMEngine or a
    RayEngineClient."""

    async def generate(self, request_id: str, prompt_ids: np.ndarray | list[int],
                       sampling: Sampling) -> TokenOutput: ...
    async def abort(self, request_ids: list[str]) -> None: ...


class EngineJudgeClient:
    """reward.judge.JudgeClient over judge engines: renders the judge model's own chat
    template, samples greedily up to `max_new_tokens`, decodes without special tokens."""

    def __init__(self, engines: Mapping[str, JudgeEngine], tokenizer: PreTrainedTokenizerBase, *,
                 max_new_tokens: int, max_model_len: int) -> None:
        if not engines:
            raise ValueError("a judge client needs >= 1 engine; check reward.judge.num_engines")
        self.engines = dict(engines)
        self.tokenizer = tokenizer
        self.sampling = Sampling(max_new_tokens=max_new_tokens, temperature=0.0)
        self.max_model_len = max_model_len
        self._in_flight = {name: 0 for name in self.engines}
        self._turn = itertools.count()  # breaks ties between idle engines in turn
        self._ids = itertools.count()

    def _pick(self) -> str:
        names = list(self.engines)
        start = next(self._turn) % len(names)
        rotated = names[start:] + names[:start]
        return min(rotated, key=self._in_flight.__getitem__)

    async def complete(self, messages: Sequence[Message], *, prefill: str = "") -> str:
        text = render_chat(self.tokenizer, messages, None, add_generation_prompt=True) + prefill
        prompt_ids = encode(self.tokenizer, text)
        if len(prompt_ids) + self.sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"judge prompt of {len(prompt_ids)} tokens + reward.judge."
                             f"max_new_tokens={self.sampling.max_new_tokens} exceed the judge's "
                             f"context of {self.max_model_len} tokens; raise "
                             "model.max_context_tokens or lower reward.judge.max_new_tokens")
        name = self._pick()
        engine = self.engines[name]
        request_id = f"judge-{next(self._ids)}"
        self._in_flight[name] += 1
        try:
            out = await engine.generate(request_id, prompt_ids, self.sampling)
        except asyncio.CancelledError:
            # A timed-out reward cancels this call; a remote engine would go on generating.
            await _abort_quietly(engine, request_id)
            raise
        finally:
            self._in_flight[name] -= 1
        return decode_text(self.tokenizer, out.token_ids.tolist(), skip_special_tokens=True)


async def _abort_quietly(engine: JudgeEngine, request_id: str) -> None:
    try:
        await asyncio.shield(engine.abort([request_id]))
    except Exception:  # a failed abort must not hide the cancellation
        log.warning("could not abort judge request %s", request_id, exc_info=True)


def build_judge_spec(cfg: RolloutRecipe, model_path: str) -> EngineSpec:
    """The judge engines' spec: rollout's engine settings with reward.judge's parallelism,
    KV-cache size (rollout's when reward.judge.kv_cache_memory_bytes is null), context
    (reward.judge.max_model_len, else model.max_context_tokens) and RoPE scaling
    (reward.judge.rope_scaling; model.rope_scaling is the policy's, not the judge's)."""
    from rollout.rope import build_rope_overrides, read_config_json

    j = cfg.reward.judge
    spec = EngineSpec.from_config(cfg, model_path, policy=False)
    kv = spec.kv_cache_memory_bytes if j.kv_cache_memory_bytes is None else j.kv_cache_memory_bytes
    overrides = (build_rope_overrides(read_config_json(model_path), j.rope_scaling,
                                      "reward.judge.rope_scaling") if j.rope_scaling else {})
    return dataclasses.replace(spec, tp_size=j.tp_size, kv_cache_memory_bytes=kv,
                               max_model_len=j.max_model_len or cfg.model.max_context_tokens,
                               hf_overrides=overrides)


async def start_judge(cfg: RolloutRecipe, model_path: str,
                      placement_group: Any | None) -> EngineJudgeClient | None:
    """Start reward.judge.num_engines judge engines on the judge pool (one bundle each) and
    return their client; None when reward.judge.enabled is false. `model_path` is the
    judge's folder (the caller resolves reward.judge.model_path, e.g. 'tiny')."""
    j = cfg.reward.judge
    if not j.enabled:
        return None
    from rollout.engine_actor import start_engines

    spec = build_judge_spec(cfg, model_path)
    engines = await start_engines(spec, j.num_engines, placement_group)
    log.info("judge: %d engine(s) of %s", len(engines), model_path)
    return build_judge_client(cfg, model_path, engines)


def build_judge_client(cfg: RolloutRecipe, model_path: str,
                       engines: Mapping[str, JudgeEngine]) -> EngineJudgeClient:
    """The judge client over running judge engines (in the driver, or in each agent-loop
    worker from the engines' handles: judging happens where the group is scored)."""
    spec = build_judge_spec(cfg, model_path)
    return EngineJudgeClient(engines, load_tokenizer(model_path),
                             max_new_tokens=cfg.reward.judge.max_new_tokens,
                             max_model_len=spec.max_model_len)
