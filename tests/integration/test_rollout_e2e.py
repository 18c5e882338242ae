"""Rollout end to end on real vLLM engines (Ray actors) with the tiny model: token
continuity over many multi-turn trajectories, engine logprobs vs a transformers forward,
versions across a weight update between turns, sticky vs round-robin prefix-cache hits
from vLLM's counters, a cancelled call aborting its request in the engine, and losing an
engine mid-run without losing a trajectory."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch

from envs.tools.base import ToolResult, function_schema
from envs.trajectory_env import EnvBuilder
from reward.base import RewardResult
from reward.loop import RewardLoop
from rollout.agent_loop import LoopSettings
from rollout.chat import build_continuity_builder
from rollout.engine import Sampling
from rollout.recorder import Budgets
from rollout.router import Router
from rollout.tool_parser import ParsedTurn
from envs.types import Message, Task, TerminationReason, ToolCall
from rollout.worker import AgentLoopWorker

pytestmark = pytest.mark.asyncio(loop_scope="module")


class EchoTool:
    name = "echo"
    schema = function_schema("echo", "Repeat text.", {"text": {"type": "string"}}, ("text",))
    on_execute = None  # a test hook: an async callable run inside the tool (e.g. a weight push)

    def __init__(self, env=None) -> None:
        pass

    async def execute(self, arguments: Mapping[str, Any]) -> ToolResult:
        if EchoTool.on_execute is not None:
            await EchoTool.on_execute()
        await asyncio.sleep(0.01)
        return ToolResult(f"echo: {arguments['text']} " + "filler " * 20)


class LengthReward:
    """A RewardFn for tasks without an answer: the share of the budget left unused."""

    async def __call__(self, trajectory, task, ctx) -> RewardResult:
        return RewardResult(1.0 / (1 + len(trajectory.response_ids)))


class ForcedToolLoop:
    """A user loop defined outside the repo: the untrained tiny model never writes tool
    calls, so this loop calls `echo` after every generation to make real multi-turn
    trajectories; everything else (continuity, budgets) is the library's."""

    async def run(self, task, ctx):
        rec = ctx.start(ctx.chat.initial_prompt_ids(task.messages, ctx.tool_schemas))
        for turn in range(ctx.settings.max_turns):
            if rec.room_for_generation() <= 0:
                return rec.finish(TerminationReason.MAX_TOKENS)
            out = await ctx.generate()
            outcome = await ctx.run_tools(ParsedTurn("", (ToolCall("echo", {"text": f"turn {turn}"}),), ()))
            eos = len(out.token_ids) > 0 and int(out.token_ids[-1]) == ctx.chat.end_of_turn_id
            obs = ctx.chat.observation_ids(outcome.messages, eos)
            if (stop := rec.fits_observation(len(obs))) is not None:
                return rec.finish(stop)
            rec.add_observation(obs, outcome.num_calls, outcome.num_errors, outcome.seconds)
        return rec.finish(TerminationReason.MAX_TURNS)


class SpyClient:
    """Wraps a real engine client and records every prompt it is sent (per session)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.sent: dict[str, list[np.ndarray]] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request_id, prompt_ids, sampling):
        self.sent.setdefault(request_id.split("#")[0], []).append(np.array(prompt_ids))
        return await self.inner.generate(request_id, prompt_ids, sampling)


class RoundRobinRouter(Router):
    """Baseline for the prefix-cache comparison: ignores stickiness."""

    _next = 0

    def _pick(self, session_id):
        names = list(self._engines)
        RoundRobinRouter._next += 1
        return names[RoundRobinRouter._next % len(names)], False


def make_task(i: int) -> Task:
    # The task number leads the prompt, so only a trajectory's own earlier turns (and its
    # group's shared prompt) can be prefix-cache hits: no accidental cross-task sharing.
    return Task(f"task{i}", (Message("system", f"Task {i}. You are a careful agent. Use tools when useful."),
                             Message("user", f"Please work on item number {i} step by step.")),
                tools=("echo",))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tiny_model_path):
    import ray

    from rollout.engine import EngineSpec
    from rollout.engine_actor import start_engines

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    spec = EngineSpec(model_path=str(tiny_model_path), max_model_len=2048,
                      kv_cache_memory_bytes=128 << 20, enforce_eager=True)
    engines = await start_engines(spec, 2)
    yield engines
    ray.shutdown()


def make_worker(tokenizer, router, max_turns=4, max_new=24):
    settings = LoopSettings(budgets=Budgets(2048, 1500, max_new), max_turns=max_turns,
                            max_tool_calls_per_turn=2, tool_timeout_s=30)
    return AgentLoopWorker(default_loop=f"{__name__}:ForcedToolLoop", settings=settings,
                           chat=build_continuity_builder(tokenizer, "tiny"), tokenizer=tokenizer,
                           router=router, envs=EnvBuilder({"echo": EchoTool}),
                           rewards=RewardLoop(f"{__name__}:LengthReward", tokenizer.decode,
                                              timeout_s=30, max_concurrency=16),
                           trajectory_timeout_s=300)


def hf_logprobs(model, traj):
    ids = torch.tensor(traj.input_ids()[None].astype(np.int64))
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    token_lp = logp.gather(-1, ids[0, 1:, None])[:, 0].numpy()
    return token_lp[len(traj.prompt_ids) - 1:]


async def test_fifty_multiturn_trajectories_are_continuous_and_match_transformers(cluster, tokenizer,
                                                                                  tiny_model_path):
    from transformers import AutoModelForCausalLM

    spy = SpyClient(cluster["engine-0"])
    worker = make_worker(tokenizer, Router({"engine-0": spy}))
    groups = await asyncio.gather(*(worker.run_group(make_task(i), f"g{i}", 5) for i in range(10)))
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 50
    for t in trajs:
        assert t.termination is TerminationReason.MAX_TURNS and len(t.turns) == 4
        full = t.input_ids()
        sent = spy.sent[f"{t.group_id}/{t.index}"]
        assert len(sent) == 4
        for prompt in sent:
            assert np.array_equal(full[:len(prompt)], prompt)
        model_tok = t.response_mask == 1
        assert sum(turn.num_generated for turn in t.turns) == model_tok.sum()
        assert np.all(t.logprobs[~model_tok] == 0) and np.all(t.versions[model_tok] == 0)
        text = tokenizer.decode(t.response_ids[~model_tok].tolist())
        assert text.count("<tool_response>") == 4
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    diffs = []
    for t in trajs[:12]:
        ref = hf_logprobs(model, t)
        diffs.append(np.abs(t.logprobs - ref)[t.response_mask == 1])
    mean_diff = float(np.concatenate(diffs).mean())
    assert mean_diff < 1e-3, mean_diff


async def test_tokens_carry_the_version_of_a_weight_push_between_turns(cluster, tokenizer,
                                                                      tiny_model_path):
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    router = Router(dict(cluster))
    worker = make_worker(tokenizer, router, max_turns=3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    pushed = asyncio.Event()

    async def push_once():  # the controller's sequence, run while the trajectory is in a tool
        if pushed.is_set():
            return
        pushed.set()
        await worker.gate.close()  # drained: no turn is generating
        await router.update_weights_all(1, blob=save(new_state))
        worker.gate.open()

    EchoTool.on_execute = push_once
    try:
        traj = await worker.run_trajectory(make_task(99), "gv", 0)
    finally:
        EchoTool.on_execute = None
    versions = [set(traj.versions[t.response_start:t.response_start + t.num_generated]) for t in traj.turns]
    assert versions == [{0}, {1}, {1}]
    assert worker.gate.closed_s > 0
    model.load_state_dict(new_state)
    ref = hf_logprobs(model, traj)
    later = traj.versions == 1
    assert np.abs(traj.logprobs[later] - ref[later]).mean() < 1e-3


async def _hit_rate(router, engines, tokenizer, label):
    before = {n: await e.get_stats() for n, e in engines.items()}
    worker = make_worker(tokenizer, router, max_turns=6, max_new=16)
    await asyncio.gather(*(worker.run_group(make_task(100 + i), f"{label}{i}", 2) for i in range(6)))
    after = {n: await e.get_stats() for n, e in engines.items()}
    queries = sum(after[n].prefix_cache_queries - before[n].prefix_cache_queries for n in engines)
    hits = sum(after[n].prefix_cache_hits - before[n].prefix_cache_hits for n in engines)
    return hits / max(queries, 1)


async def test_sticky_routing_beats_round_robin_on_prefix_cache_hits(cluster, tokenizer):
    engines = dict(cluster)
    await asyncio.gather(*(e.reset_prefix_cache() for e in engines.values()))
    sticky = await _hit_rate(Router(engines), engines, tokenizer, "sticky")
    await asyncio.gather(*(e.reset_prefix_cache() for e in engines.values()))
    round_robin = await _hit_rate(RoundRobinRouter(engines), engines, tokenizer, "rr")
    print(f"prefix-cache hit rate from vLLM counters: sticky {sticky:.3f}, round-robin {round_robin:.3f}")
    assert sticky > round_robin + 0.05  # 2 engines: round-robin lands on the right one half the time


async def test_worker_actor_runs_a_group_from_the_recipe(cluster, tiny_model_path):
    """The Ray shells wired from the quickstart recipe: a worker actor drives the engine
    actors (before the next test kills one)."""
    import ray

    from rollout.worker_actor import AgentWorkerActor
    from trainer.run.recipe import load_config

    cfg = load_config("quickstart.yaml", ["agent.max_turns=2", "agent.max_new_tokens_per_turn=16"])
    actor = AgentWorkerActor.remote(cfg, str(tiny_model_path),
                                    {n: c.handle for n, c in cluster.items()})
    task = Task("calc", (Message("user", "What is 6*7? Use the calculator."),), tools=("calculator",),
                answer="42")
    group = pickle.loads(await actor.run_group.remote(task, "ga", 3))  # scored on the worker
    assert all(t.reward is not None for t in group.trajectories)
    assert group.size == 3 and all(t.termination in (TerminationReason.FINISHED,
                                                      TerminationReason.MAX_TOKENS,
                                                      TerminationReason.MAX_TURNS)
                                   for t in group.trajectories)
    await actor.close_gate.remote()
    await actor.open_gate.remote()
    stats = await actor.stats.remote()
    assert stats.num_finished == 3 and stats.num_running == 0
    ray.kill(actor)


async def _until(engine, done, timeout_s: float = 60.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not done(stats := await engine.get_stats()):
        assert asyncio.get_running_loop().time() < deadline, stats
        await asyncio.sleep(0.05)


async def test_a_cancelled_call_aborts_its_request_and_frees_its_kv_for_the_next_reset(cluster):
    """Cancelling a generate over Ray cancels the actor's task, and so aborts the request
    in vLLM. The engine is paused first, so the request cannot end by itself: only the
    cancellation can take it out of the engine. The next prefix reset then finds no KV in
    use (a request left running would make vLLM refuse it, `prefix_reset_refused`)."""
    engine = cluster["engine-0"]
    prompt = list(range(300, 340))
    call = asyncio.ensure_future(engine.generate("cancelled", prompt, Sampling(1800, seed=1)))
    await _until(engine, lambda s: s.num_in_flight == 1)
    await asyncio.sleep(0.5)  # into vLLM's scheduler, generating
    await engine.pause()
    try:
        call.cancel()
        await _until(engine, lambda s: s.num_in_flight == 0)
    finally:
        await engine.resume()
    refused = (await engine.get_stats()).prefix_reset_refused
    await engine.reset_prefix_cache()
    assert (await engine.get_stats()).prefix_reset_refused == refused


async def test_killing_an_engine_mid_run_loses_no_trajectory(cluster, tokenizer):
    import ray

    router = Router(dict(cluster))
    worker = make_worker(tokenizer, router, max_turns=4)
    killed = asyncio.Event()

    async def kill_once():
        if not killed.is_set():
            killed.set()
            ray.kill(cluster["engine-1"].handle)

    EchoTool.on_execute = kill_once
    try:
        groups = await asyncio.gather(*(worker.run_group(make_task(200 + i), f"k{i}", 4) for i in range(4)))
    finally:
        EchoTool.on_execute = None
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 16
    assert all(t.termination is TerminationReason.MAX_TURNS for t in trajs), \
        [(t.termination, t.termination_detail[:200]) for t in trajs]
    stats = router.stats()
    assert stats.failed_engines == ("engine-1",) and stats.num_reroutes >= 1
