"""Agent loops and the worker against a scripted stand-in engine (unit level): tool calls,
error observations, budgets, termination reasons, continuity, and failure containment.
The real vLLM engine runs the same loops in tests/integration."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from envs.tools.base import ToolResult, function_schema
from envs.tools.calculator import CalculatorTool
from envs.trajectory_env import EnvBuilder
from reward.loop import RewardLoop
from rollout.agent_loop import LoopSettings, ToolAgentLoop, load_agent_loop
from rollout.chat import ContinuityBuilder, build_continuity_builder, check_continuity
from rollout.engine import TokenOutput
from rollout.recorder import Budgets
from rollout.router import Router
from envs.types import Message, Task, TerminationReason, Trajectory
from rollout.worker import AgentLoopWorker


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trainer.run.tiny_model import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


class ScriptedEngine:
    """Stand-in engine: replies to each session's k-th turn with script[k] (cycling), plus the stop
    token unless the script entry starts with 'LENGTH:' (a cut-off generation). An entry
    may also be a list of token ids, sent as they are (plus the stop token)."""

    def __init__(self, tokenizer, script: list[str], delay_s: float = 0.0) -> None:
        self.tokenizer, self.script, self.delay_s = tokenizer, script, delay_s
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.prompts: dict[str, list[np.ndarray]] = {}
        self.version = 0
        self.n = 0

    async def generate(self, request_id, prompt_ids, sampling):
        session = request_id.split("#")[0]
        self.prompts.setdefault(session, []).append(np.array(prompt_ids))
        text = self.script[(len(self.prompts[session]) - 1) % len(self.script)]
        self.n += 1
        await asyncio.sleep(self.delay_s)
        if isinstance(text, list):
            text, ids = "", list(text)
        else:
            ids = self.tokenizer.encode(text.removeprefix("LENGTH:"), add_special_tokens=False)
        cut = text.startswith("LENGTH:")
        ids = ids[:sampling.max_new_tokens] if cut else ids + [self.eos]
        if len(ids) > sampling.max_new_tokens:
            ids, cut = ids[:sampling.max_new_tokens], True
        n = len(ids)
        return TokenOutput(np.array(ids, np.int32), np.full(n, -0.25, np.float32),
                           np.full(n, self.version, np.int32), "length" if cut else "stop",
                           len(prompt_ids), 0)


class EchoTool:
    name = "echo"
    schema = function_schema("echo", "Repeat text.", {"text": {"type": "string"}}, ("text",))

    def __init__(self, env=None) -> None:
        pass

    async def execute(self, arguments: Mapping[str, Any]) -> ToolResult:
        if arguments["text"] == "boom":
            raise RuntimeError("echo exploded")
        if arguments["text"] == "slow":
            await asyncio.sleep(5)
        if arguments["text"] == "submit":
            return ToolResult("submitted", ends_trajectory=True)
        return ToolResult(arguments["text"])


def exact_match(tokenizer) -> RewardLoop:
    """The reward loop of a test worker: ExactMatch on the decoded final turn."""
    return RewardLoop("exact_match", lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                      timeout_s=30.0, max_concurrency=8)


def call(name: str, **args) -> str:
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


TASK = Task("t0", (Message("system", "Use tools."), Message("user", "Compute 2+3.")),
            tools=("echo", "calculator"), answer="5")


def make_worker(tokenizer, script, *, max_turns=4, max_response_tokens=600, max_context=1024,
                tool_timeout_s=0.5, traj_timeout_s=10.0, default_loop="rollout.agent_loop:ToolAgentLoop",
                engine_delay_s=0.0):
    engine = ScriptedEngine(tokenizer, script, engine_delay_s)
    settings = LoopSettings(budgets=Budgets(max_context, max_response_tokens, 160), max_turns=max_turns,
                            max_tool_calls_per_turn=2, tool_timeout_s=tool_timeout_s)
    worker = AgentLoopWorker(default_loop=default_loop, settings=settings,
                             chat=build_continuity_builder(tokenizer, "tiny"), tokenizer=tokenizer,
                             router=Router({"e0": engine}),
                             envs=EnvBuilder({"echo": EchoTool, "calculator": CalculatorTool}),
                             rewards=exact_match(tokenizer), trajectory_timeout_s=traj_timeout_s)
    return worker, engine


def assert_continuity(tokenizer, traj: Trajectory, engine: ScriptedEngine):
    full = traj.input_ids()
    for sent in engine.prompts[f"{traj.group_id}/{traj.index}"]:
        assert np.array_equal(full[:len(sent)], sent), "a prompt sent to the engine is not a prefix"
    model = traj.response_mask == 1
    assert np.all(traj.logprobs[model] == -0.25) and np.all(traj.logprobs[~model] == 0)
    assert sum(t.num_generated for t in traj.turns) == int(model.sum())


async def test_tool_calls_run_and_observations_are_appended(tokenizer):
    script = [call("calculator", expression="2+3"), "The answer is 5."]
    worker, engine = make_worker(tokenizer, script)
    group = await worker.run_group(TASK, "g0", 3)
    for traj in group.trajectories:
        assert traj.termination is TerminationReason.FINISHED
        assert len(traj.turns) == 2 and traj.turns[0].num_tool_calls == 1
        text = tokenizer.decode(traj.response_ids.tolist())
        assert "<tool_response>\n5\n</tool_response>" in text
        assert_continuity(tokenizer, traj, engine)
    # the incremental ids equal a full re-render of the conversation
    msgs = [*TASK.messages,
            Message("assistant", "", tool_calls=(__import__("envs.types").types.ToolCall(
                "calculator", {"expression": "2+3"}),)),
            Message("tool", "5", name="calculator"), Message("assistant", "The answer is 5.")]
    schemas = [EchoTool.schema, CalculatorTool.schema]
    assert check_continuity(tokenizer, msgs, schemas, group.trajectories[0].input_ids().tolist()) is None


@pytest.mark.parametrize("reply, expected, failed_tools", [
    ("<tool_call>\n{not json}\n</tool_call>", "Tool call 1", ("(malformed)",)),
    (call("nope", x=1), "unknown tool 'nope'", ("(unknown)",)),  # a made-up name adds no key
    (call("echo", text=3), "argument 'text' must be string", ("echo",)),
    (call("echo", text="boom"), "echo failed: RuntimeError: echo exploded", ("echo",)),
    (call("echo", text="slow"), "Timeout: echo did not finish within 0.5 s", ("echo",)),
    (call("echo", text="a") + call("echo", text="b") + call("echo", text="c"), "at most 2",
     ("(malformed)",)),
])
async def test_bad_calls_and_failing_tools_become_observations(tokenizer, reply, expected,
                                                               failed_tools):
    worker, engine = make_worker(tokenizer, [reply, "done"])
    traj = await worker.run_trajectory(TASK, "g", 0)
    assert traj.termination is TerminationReason.FINISHED
    assert traj.turns[0].num_tool_errors >= 1
    assert traj.turns[0].failed_tool_names == failed_tools  # per-tool metrics
    assert expected in tokenizer.decode(traj.response_ids.tolist())
    assert worker.stats().num_tool_errors >= 1
    assert_continuity(tokenizer, traj, engine)


async def test_budgets_end_trajectories_with_the_right_reason(tokenizer):
    looping = [call("echo", text="again")]
    worker, _ = make_worker(tokenizer, looping, max_turns=3)
    assert (await worker.run_trajectory(TASK, "g", 0)).termination is TerminationReason.MAX_TURNS
    worker, _ = make_worker(tokenizer, looping, max_turns=50, max_response_tokens=200)
    t = await worker.run_trajectory(TASK, "g", 0)
    assert t.termination is TerminationReason.MAX_TOKENS and len(t.response_ids) <= 200
    prompt_len = len(build_continuity_builder(tokenizer, "tiny").initial_prompt_ids(
        TASK.messages, [EchoTool.schema, CalculatorTool.schema]))
    worker, engine = make_worker(tokenizer, looping, max_turns=50, max_response_tokens=900,
                                 max_context=prompt_len + 150)
    t = await worker.run_trajectory(TASK, "g", 0)
    assert t.termination is TerminationReason.CONTEXT_FULL
    assert all(len(p) < prompt_len + 150 for p in engine.prompts["g/0"])  # never an over-long prompt
    worker, _ = make_worker(tokenizer, ["LENGTH:" + "blah " * 200])  # never emits its stop token
    t = await worker.run_trajectory(TASK, "g", 0)
    assert t.termination is TerminationReason.MAX_TOKENS and t.turns[0].finish_reason == "length"


async def test_submit_ends_the_trajectory(tokenizer):
    worker, _ = make_worker(tokenizer, [call("echo", text="submit"), "never reached"])
    t = await worker.run_trajectory(TASK, "g", 0)
    assert t.termination is TerminationReason.FINISHED and len(t.turns) == 1


async def test_garbage_output_finishes_without_crashing(tokenizer):
    garbage = "\x00\ufffd<tool_call><tool_call>}{ ]] <|im_start|> </tool_call> \U0001F600 ``` <tool_response>"
    worker, engine = make_worker(tokenizer, [garbage, "ok"])
    group = await worker.run_group(TASK, "g", 4)
    assert all(t.termination in (TerminationReason.FINISHED, TerminationReason.MAX_TURNS)
               for t in group.trajectories)


async def test_timeout_keeps_the_partial_trajectory(tokenizer):
    worker, _ = make_worker(tokenizer, [call("echo", text="x")], max_turns=100,
                            traj_timeout_s=0.3, engine_delay_s=0.05)
    t = await worker.run_trajectory(TASK, "g", 0)
    assert t.termination is TerminationReason.TIMEOUT and "trajectory_timeout_s" in t.termination_detail
    assert len(t.turns) >= 1 and t.num_model_tokens > 0


class RaisingReward:
    async def __call__(self, trajectory, task, ctx):
        raise RuntimeError("reward exploded")


async def test_a_failing_reward_leads_the_detail_and_the_ending_follows(tokenizer):
    """The first line of a failed trajectory's detail names its failure (the breaker groups
    and shows failures by it): the reward's error, then how the loop had ended."""
    worker, _ = make_worker(tokenizer, [call("echo", text="x")], max_turns=100,
                            traj_timeout_s=0.3, engine_delay_s=0.05)
    worker.rewards = RewardLoop(f"{__name__}:RaisingReward", worker.rewards.decode,
                                timeout_s=30.0, max_concurrency=8)
    t = await worker.run_trajectory(TASK, "g", 0)
    first, rest = t.termination_detail.split("\n", 1)
    assert t.termination is TerminationReason.ERROR
    assert first == f"reward {__name__}:RaisingReward raised RuntimeError: reward exploded"
    assert rest.startswith("(the trajectory had ended: exceeded agent.trajectory_timeout_s=0.3")


class ExplodingLoop:
    """A user loop defined outside the repo that fails after one turn."""

    async def run(self, task, ctx):
        ctx.start(ctx.chat.initial_prompt_ids(task.messages, None))
        await ctx.generate()
        raise KeyError("user bug")


class CountingLoop:
    """A user loop defined outside the repo: a single turn, then finished."""

    async def run(self, task, ctx):
        rec = ctx.start(ctx.chat.initial_prompt_ids(task.messages, None))
        await ctx.generate()
        return rec.finish(TerminationReason.FINISHED, "counting loop")


class GreedyLoop:
    """A user loop that never checks the budgets: generates until something stops it."""

    async def run(self, task, ctx):
        ctx.start(ctx.chat.initial_prompt_ids(task.messages, None))
        while True:
            out = await ctx.generate()
            ctx.recorder.add_observation([ctx.chat.end_of_turn_id] * 3, 0, 0, 0.0)
            assert len(out.token_ids) > 0


async def test_a_loop_that_ignores_the_budgets_ends_by_the_budget_not_as_an_error(tokenizer):
    prompt_len = len(build_continuity_builder(tokenizer, "tiny").initial_prompt_ids(TASK.messages, None))
    worker, engine = make_worker(tokenizer, ["LENGTH:" + "blah " * 100], max_context=prompt_len + 100,
                                 max_response_tokens=900, default_loop=f"{__name__}:GreedyLoop")
    t = await worker.run_trajectory(TASK, "g", 0)
    assert t.termination is TerminationReason.CONTEXT_FULL, t.termination_detail
    assert all(len(p) < prompt_len + 100 for p in engine.prompts["g/0"])  # no request with no room
    worker, _ = make_worker(tokenizer, ["LENGTH:" + "blah " * 100], max_response_tokens=120,
                            default_loop=f"{__name__}:GreedyLoop")
    t = await worker.run_trajectory(TASK, "g", 0)
    assert t.termination is TerminationReason.MAX_TOKENS and t.num_model_tokens > 0


async def test_exceptions_become_error_trajectories_and_user_loops_load(tokenizer):
    worker, _ = make_worker(tokenizer, ["hi"], default_loop=f"{__name__}:ExplodingLoop")
    group = await worker.run_group(TASK, "g", 2)
    for t in group.trajectories:
        assert t.termination is TerminationReason.ERROR and "KeyError: 'user bug'" in t.termination_detail
        assert t.num_model_tokens > 0  # what it generated before failing is kept
    per_task = Task("t1", TASK.messages, agent_loop=f"{__name__}:CountingLoop", answer="5")
    t = await worker.run_trajectory(per_task, "g2", 0)
    assert t.termination is TerminationReason.FINISHED and t.termination_detail == "counting loop"
    assert worker.stats().end_reasons == {"error": 2, "finished": 1}


def test_bad_import_strings_fail_with_a_clear_message():
    with pytest.raises(ValueError, match="neither a built-in nor an import string"):
        load_agent_loop("ToolAgentLoop")
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg.mod'"):
        load_agent_loop("no_such_pkg.mod:Loop")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        load_agent_loop("rollout.agent_loop:Nope")
    with pytest.raises(ValueError, match="async def run"):
        load_agent_loop("envs.types:Task")
    assert load_agent_loop("rollout.agent_loop:ToolAgentLoop") is ToolAgentLoop


async def test_unknown_task_tools_fail_before_any_trajectory(tokenizer):
    worker, engine = make_worker(tokenizer, ["x"])
    with pytest.raises(ValueError, match="unknown tools"):
        await worker.run_group(Task("t", TASK.messages, tools=("bash",)), "g", 2)
    assert engine.n == 0


async def test_continuity_check_mode_finds_no_divergence_on_clean_turns(tokenizer):
    import dataclasses

    script = [call("calculator", expression="2+3"), "The answer is 5."]
    worker, _ = make_worker(tokenizer, script)
    worker.settings = dataclasses.replace(worker.settings, continuity_check=True)
    await worker.run_group(TASK, "g", 2)
    assert worker.stats().num_continuity_divergences == 0


@pytest.mark.parametrize("reply", ["55\n<tool_call>\n", "ok <tool_call>\n{not json}\n</tool_call>\n"])
async def test_continuity_check_keeps_malformed_calls_as_generated(tokenizer, reply):
    """A turn whose only call is malformed (unclosed block, bad JSON) is text to the
    template, as a server returns it: the debug re-render must match the sampled ids."""
    import dataclasses

    worker, _ = make_worker(tokenizer, [reply, "The answer is 5."])
    worker.settings = dataclasses.replace(worker.settings, continuity_check=True)
    t = await worker.run_trajectory(TASK, "g", 0)
    assert t.turns[0].tool_parse_status != "ok" and len(t.turns) == 2
    assert worker.stats().num_continuity_divergences == 0


async def test_continuity_check_accepts_a_valid_call_in_the_models_own_spelling(tokenizer):
    """Spacing and repeated keys the parser accepts but the template re-renders canonically:
    the sampled ids are what is trained, so this is no template bug."""
    import dataclasses

    odd = ('<tool_call>\n{"name": "calculator",   "arguments": {"expression": "1", '
           '"expression": "2+3"}}\n</tool_call>')
    worker, _ = make_worker(tokenizer, [odd, "The answer is 5."])
    worker.settings = dataclasses.replace(worker.settings, continuity_check=True)
    t = await worker.run_trajectory(TASK, "g", 0)
    assert t.turns[0].tool_parse_status == "ok" and len(t.turns) == 2
    assert worker.stats().num_continuity_divergences == 0


async def test_continuity_check_ignores_generations_that_do_not_retokenize(tokenizer):
    """A model may sample a non-canonical split of its text; the trajectory keeps those ids
    (so a re-render differs there) and the check must not blame the template for it."""
    import dataclasses

    text = "The answer is 5."
    by_char = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]
    assert by_char != tokenizer.encode(text, add_special_tokens=False)
    worker, _ = make_worker(tokenizer, [call("calculator", expression="2+3"), by_char])
    worker.settings = dataclasses.replace(worker.settings, continuity_check=True)
    group = await worker.run_group(TASK, "g", 2)
    assert all(t.termination == TerminationReason.FINISHED for t in group.trajectories)
    assert worker.stats().num_continuity_divergences == 0


async def test_continuity_check_mode_reports_a_broken_builder(tokenizer):
    import dataclasses

    class GlueDroppingBuilder(ContinuityBuilder):
        """A broken builder: forgets the newline after <|im_end|>."""

        def __init__(self, inner):
            self.inner = inner

        @property
        def end_of_turn_id(self):
            return self.inner.end_of_turn_id

        def initial_prompt_ids(self, messages, tools):
            return self.inner.initial_prompt_ids(messages, tools)

        def observation_ids(self, msgs, ended_with_eos):
            return self.inner.observation_ids(msgs, ended_with_eos)[1:]

    worker, _ = make_worker(tokenizer, [call("calculator", expression="1+1"), "2"])
    worker.chat = GlueDroppingBuilder(worker.chat)
    worker.settings = dataclasses.replace(worker.settings, continuity_check=True)
    await worker.run_trajectory(TASK, "g", 0)
    assert worker.stats().num_continuity_divergences == 1


class SleepyTool:
    """A tool doing blocking work (time.sleep) inside execute."""

    name = "sleepy"
    schema = function_schema("sleepy", "Block for a while.", {"s": {"type": "number"}}, ("s",))
    blocking = False

    def __init__(self, env=None) -> None:
        pass

    async def execute(self, arguments: Mapping[str, Any]) -> ToolResult:
        import time

        time.sleep(float(arguments["s"]))
        return ToolResult("woke up")


class DeclaredSleepyTool(SleepyTool):
    blocking = True  # runs on its own thread: the timeout holds, the loop stays free


async def test_a_declared_blocking_tool_is_timed_out_off_the_event_loop(tokenizer):
    from envs.trajectory_env import EnvBuilder

    worker, _ = make_worker(tokenizer, [call("sleepy", s=1.5), "Answer: 5"], tool_timeout_s=0.3)
    worker.envs = EnvBuilder({"sleepy": DeclaredSleepyTool, "calculator": CalculatorTool})
    task = Task("t0", TASK.messages, tools=("sleepy",), answer="5")
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1
    tick = asyncio.create_task(ticker())
    traj = await worker.run_trajectory(task, "g", 0)
    tick.cancel()
    text = tokenizer.decode(traj.response_ids.tolist())
    assert "Timeout: sleepy did not finish within 0.3 s." in text
    assert ticks >= 4  # the event loop kept running while the tool slept
    assert worker.stats().num_loop_stalls == 0


class SpinningTool(SleepyTool):
    """Blocking work in Python code (a busy loop), which the watchdog can stop. `done` ends
    a spin early: the call moved to a thread cannot be stopped by the timeout and would
    otherwise hold the test's teardown (the loop's thread pool) for its whole 30 s."""

    done = threading.Event()

    async def execute(self, arguments: Mapping[str, Any]) -> ToolResult:
        until = time.monotonic() + float(arguments["s"])
        while time.monotonic() < until and not self.done.is_set():
            pass
        return ToolResult("spun")


def sleepy_worker(tokenizer, tool, script, tool_timeout_s):
    worker, _ = make_worker(tokenizer, script, tool_timeout_s=tool_timeout_s)
    worker.envs = EnvBuilder({"sleepy": tool, "calculator": CalculatorTool})
    return worker, Task("t0", TASK.messages, tools=("sleepy",), answer="5")


async def test_an_undeclared_blocking_tool_is_named_while_it_blocks(tokenizer, caplog):
    """The watchdog runs on a thread: its warning is written while the loop is still
    blocked (before the tool returns), and names the tool and the fix."""
    worker, task = sleepy_worker(tokenizer, SleepyTool, [call("sleepy", s=2.5), "Answer: 5"], 30)
    seen_while_blocked = []

    class Probe(logging.Handler):
        def emit(self, record):
            seen_while_blocked.append(worker.activity.on_loop != {})

    probe = Probe(level=logging.WARNING)
    logging.getLogger("rollout.loop_watch").addHandler(probe)
    try:
        with caplog.at_level("WARNING", logger="rollout.loop_watch"):
            traj = await worker.run_trajectory(task, "g", 0)
    finally:
        logging.getLogger("rollout.loop_watch").removeHandler(probe)
    assert "woke up" in tokenizer.decode(traj.response_ids.tolist())  # under its timeout: kept
    assert worker.stats().num_loop_stalls == 1
    assert seen_while_blocked and seen_while_blocked[0]
    assert any("tool 'sleepy' has blocked the event loop" in r.message
               and "blocking = True" in r.message for r in caplog.records)
    assert worker.activity.blocking == {"sleepy"}  # its later calls run on a thread


async def test_a_tool_blocking_the_loop_past_its_timeout_is_stopped_then_runs_on_a_thread(tokenizer):
    """Python code that holds the loop past agent.tool_timeout_s gets ToolBlockedLoop raised
    inside it (a timeout observation, the trajectory goes on); the tool's next call runs on
    a thread, where the plain timeout fires while the loop keeps turning."""
    script = [call("sleepy", s=30), call("sleepy", s=30), "Answer: 5"]
    worker, task = sleepy_worker(tokenizer, SpinningTool, script, 1.5)
    SpinningTool.done.clear()
    start = time.monotonic()
    try:
        traj = await worker.run_trajectory(task, "g", 0)
    finally:
        SpinningTool.done.set()
    elapsed = time.monotonic() - start
    text = tokenizer.decode(traj.response_ids.tolist())
    assert "Timeout: sleepy did not finish within 1.5 s (it blocked the worker's event loop)." in text
    assert "Timeout: sleepy did not finish within 1.5 s." in text  # the second call, on a thread
    assert traj.termination is TerminationReason.FINISHED
    assert elapsed < 25  # neither 30 s spin ran to its end on the loop
    assert worker.stats().num_loop_stalls == 1  # the call on a thread did not block the loop



def test_the_watchdog_thread_ends_with_its_event_loop(tokenizer):
    worker, task = sleepy_worker(tokenizer, SleepyTool, ["Answer: 5"], 5)
    asyncio.run(worker.run_trajectory(task, "g", 0))  # starts the watchdog, then closes the loop
    assert worker.watchdog.thread is not None
    worker.watchdog.thread.join(timeout=5)
    assert not worker.watchdog.thread.is_alive(), "the watchdog outlived its event loop"


async def test_a_loop_saturated_by_many_short_tool_steps_blames_no_tool():
    """Thousands of trajectories waking together keep the loop busy past the stall
    threshold with short steps, many of them inside a tool: a heartbeat that late is no
    blocking tool, so none is named or moved to a thread (where calls queue for the
    loop's few executor threads)."""
    from rollout.agent_loop import execute_tool
    from rollout.loop_watch import LoopWatchdog, ToolActivity

    class ShortStepsTool:
        name = "steps"

        async def execute(self, arguments: Mapping[str, Any]) -> ToolResult:
            for _ in range(3):
                until = time.perf_counter() + 0.003  # 3 ms of Python work per step
                while time.perf_counter() < until:
                    pass
                await asyncio.sleep(0)
            return ToolResult("done")

    activity = ToolActivity()
    watchdog = LoopWatchdog(activity, execute_tool.__code__, 30.0, probe_s=0.05, stall_s=0.25)
    watchdog.start()
    late = []

    async def lateness():  # the heartbeat the watchdog reads is late like this one
        while True:
            start = time.monotonic()
            await asyncio.sleep(0.05)
            late.append(time.monotonic() - start - 0.05)
    probe = asyncio.create_task(lateness())
    await asyncio.sleep(0.1)
    results = await asyncio.gather(*(execute_tool(ShortStepsTool(), "steps", {}, activity)
                                     for _ in range(150)))
    probe.cancel()
    assert all(r.content == "done" for r in results)
    assert max(late) > 0.3  # the loop was as late as a blocked one (150 x 3 ms a round)
    assert watchdog.num_stalls == 0 and activity.blocking == set()
