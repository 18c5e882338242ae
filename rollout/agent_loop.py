"""The AgentLoop API and the two built-in loops.

An AgentLoop turns one Task into one terminal Trajectory: `async run(task, ctx)`. The
context gives it everything it may use: `ctx.start(prompt_ids)` for the recorder,
`ctx.generate()` (turn gate + sticky router + budgets), the continuity builder
(`ctx.chat`), the tokenizer, the trajectory's tools and `ctx.run_tools()`. Users write
their own loops and name them by import string `package.module:Class` in a recipe
(`agent.loop`) or per task (`Task.agent_loop`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from envs.tools.base import Tool
from envs.trajectory_env import TrajectoryEnv
from rollout.chat import ContinuityBuilder, check_continuity
from rollout.durable import DurableTrajectory, ToolsRan, TurnGenerated, call_key, encode_content
from rollout.engine import Sampling, TokenOutput
from rollout.gate import LocalTurns, TurnGate
from rollout.loop_watch import ToolActivity, ToolBlockedLoop
from rollout.recorder import BudgetExhausted, Budgets, TrajectoryRecorder
from rollout.router import Router
from rollout.parsers import parse_generation
from rollout.vision import for_engine
from rollout.tool_parser import ParsedTurn, validate_arguments
from envs.types import Message, Task, TerminationReason, ToolCall, Trajectory

from envs.plugins import PluginPoint, signature_problem

if TYPE_CHECKING:
    from rollout.config import RolloutRecipe

log = logging.getLogger(__name__)

# The tool names metrics give calls that name no tool of the trajectory: a model's made-up
# names would otherwise each become a metric key.
MALFORMED_CALL = "(malformed)"  # a call that could not be read
UNKNOWN_TOOL = "(unknown)"  # a call naming a tool the trajectory does not offer


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """The per-trajectory knobs of agent.* and rollout.* an agent loop reads."""

    budgets: Budgets
    max_turns: int
    max_tool_calls_per_turn: int
    tool_timeout_s: float
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    continuity_check: bool = False  # debug: compare with a full re-render at the end

    @classmethod
    def from_config(cls, cfg: "RolloutRecipe") -> "LoopSettings":
        a, r = cfg.agent, cfg.rollout
        return cls(budgets=Budgets(cfg.model.max_context_tokens, a.max_response_tokens,
                                   a.max_new_tokens_per_turn),
                   max_turns=a.max_turns, max_tool_calls_per_turn=a.max_tool_calls_per_turn,
                   tool_timeout_s=a.tool_timeout_s, temperature=r.temperature, top_p=r.top_p,
                   top_k=r.top_k, continuity_check=a.continuity_check)


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    messages: tuple[Message, ...]  # one tool message per call or rejected call, in order
    num_calls: int
    num_errors: int  # malformed calls, unknown tools, bad arguments, exceptions, timeouts
    num_timeouts: int
    ends_trajectory: bool
    seconds: float
    tools: tuple[str, ...] = ()  # the tool of each call, in order (or MALFORMED_CALL, UNKNOWN_TOOL)
    failed_tools: tuple[str, ...] = ()  # the tools of the calls that failed, one per failure


@dataclass(slots=True)
class AgentContext:
    task: Task
    group_id: str
    index: int
    settings: LoopSettings
    chat: ContinuityBuilder
    tokenizer: Any  # a transformers tokenizer; only `decode` is used by the built-ins
    env: TrajectoryEnv  # this trajectory's tools, sandbox and final workspace
    router: Router
    gate: TurnGate
    recorder: TrajectoryRecorder | None = None
    # Finished earlier segments of this sample, in order (a loop that had to start over
    # from a fresh render, e.g. the gateway on a history rewrite, appends them); the
    # worker trains them with the returned (or salvaged) last one, under one reward.
    segments: list[Trajectory] = field(default_factory=list)
    continuity_divergence: str | None = None  # set by the debug continuity check
    activity: ToolActivity = field(default_factory=lambda: ToolActivity())  # the worker's
    # The trajectory's turn journal, and its replay when it continues after a restart
    # (rollout.durable): generate and run_tools take the journal's records while they last.
    durable: DurableTrajectory | None = None
    _num_requests: int = field(default=0)

    @property
    def session_id(self) -> str:
        return f"{self.group_id}/{self.index}"

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids a turn of this chat family ends with (some families have several)."""
        return self.chat.stop_token_ids

    def ended_with_stop(self, out: TokenOutput) -> bool:
        """Whether the generation ended on one of the family's stop tokens (not by length)."""
        return len(out.token_ids) > 0 and int(out.token_ids[-1]) in self.stop_token_ids

    @property
    def tools(self) -> Mapping[str, Tool]:
        return self.env.tools

    @property
    def tool_schemas(self) -> list[Mapping[str, Any]]:
        return self.env.tool_schemas

    def start(self, prompt_ids: Sequence[int]) -> TrajectoryRecorder:
        if self.recorder is not None:
            raise RuntimeError("ctx.start() was already called for this trajectory")
        if self.durable is not None:
            self.durable.begin(self.task.id, self.group_id, self.index, prompt_ids)
        self.recorder = TrajectoryRecorder(self.task.id, self.group_id, self.index, prompt_ids,
                                           self.settings.budgets)
        return self.recorder

    async def generate(self, max_new_tokens: int | None = None) -> TokenOutput:
        """One model turn on the recorder's context; appends the generation to it."""
        rec = self.recorder
        if rec is None:
            raise RuntimeError("call ctx.start(prompt_ids) before ctx.generate()")
        if (stop := rec.generation_stop()) is not None:
            raise BudgetExhausted(stop)  # never a request with max_tokens <= 0
        room = rec.room_for_generation()
        s = self.settings
        sampling = Sampling(max_new_tokens=min(room, max_new_tokens or room),
                            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                            stop_token_ids=self.stop_token_ids)
        num_context_ids = len(rec.context_ids)
        if self.durable is not None and (done := self.durable.take_generation(num_context_ids)) is not None:
            rec.add_generation(done.output, done.queue_s, done.generate_s, done.engine, done.started_at)
            return done.output  # as generated before the restart, versions and all
        started_at = time.time()
        self._num_requests += 1
        turn = await LocalTurns(self.router, self.gate).generate_turn(
            self.session_id, f"{self.session_id}#{self._num_requests}", rec.context_ids, sampling,
            for_engine(rec.images))
        rec.add_generation(turn.output, turn.queue_s, turn.generate_s, turn.engine, started_at)
        if self.durable is not None:
            await self.durable.record_generation(TurnGenerated.of(
                turn.output, turn.queue_s, turn.generate_s, turn.engine, started_at, num_context_ids=num_context_ids))
        return turn.output

    def text_of(self, out: TokenOutput) -> str:
        """The generated text, without the stop token the engine stopped on."""
        ids = out.token_ids.tolist()
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def check_continuity(self, messages: Sequence[Message]) -> None:
        """Debug mode: compare the trajectory's ids with a full re-render of `messages`.
        A divergence is logged and kept on the context (the worker counts it).

        A divergence inside a generation the template cannot reproduce is expected, not a
        template bug: text that does not survive decode -> encode (a non-canonical split,
        bytes that are not valid UTF-8), or a tool call the template re-renders from its
        parsed form (the model's own spacing, key order or repeated keys). That is why
        trajectories keep the sampled ids instead of re-tokenizing. It is logged at debug
        level and not counted; the check cannot see past it."""
        if self.recorder is None:
            return
        ids = self.recorder.context_ids.tolist()
        divergence = check_continuity(self.tokenizer, messages, self.tool_schemas or None, ids,
                                      images=getattr(self.chat, "images", None))
        if divergence is None:
            return
        found = self.recorder.generation_at(divergence.position)
        if found is not None:
            ids, turn = found
            if turn.tool_parse_status == "ok" or not self._round_trips(ids.tolist()):
                log.debug("trajectory %s: the template does not reproduce a generation (%s)",
                          self.session_id, divergence)
                return
        self.continuity_divergence = str(divergence)
        log.warning("trajectory %s: %s", self.session_id, divergence)

    def _round_trips(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return self.tokenizer.encode(text, add_special_tokens=False) == ids

    async def run_tools(self, parsed: ParsedTurn) -> ToolOutcome:
        """Run the turn's valid calls concurrently; every failure becomes an observation."""
        calls = tuple(call_key(c.name, c.arguments) for c in parsed.calls)
        if self.durable is not None and (ran := self.durable.take_tools(calls)) is not None:
            return ToolOutcome(ran.messages, ran.num_calls, ran.num_errors, ran.num_timeouts, ran.ends_trajectory,
                               ran.seconds, ran.tools, ran.failed_tools)
        outcome = await self._run_tools(parsed)
        if self.durable is not None:
            o = outcome
            await self.durable.record_tools(ToolsRan(
                calls, tuple(encode_content(m.content) for m in o.messages), tuple(m.name for m in o.messages),
                o.num_calls, o.num_errors, o.num_timeouts, o.ends_trajectory, o.seconds, o.tools, o.failed_tools),
                self.env)
        return outcome

    async def _run_tools(self, parsed: ParsedTurn) -> ToolOutcome:
        start = time.monotonic()
        results = await asyncio.gather(*(self._run_one(c) for c in parsed.calls))
        messages = [m for m, _, _ in results]
        messages += [Message("tool", e.message, name="error") for e in parsed.errors]
        malformed = (MALFORMED_CALL,) * len(parsed.errors)
        names = [c.name if c.name in self.tools else UNKNOWN_TOOL for c in parsed.calls]
        return ToolOutcome(
            messages=tuple(messages), num_calls=len(parsed.calls) + len(parsed.errors),
            num_errors=sum(1 for _, err, _ in results if err) + len(parsed.errors),
            num_timeouts=sum(1 for m, _, _ in results if m.text.startswith("Timeout:")),
            ends_trajectory=any(ends for _, _, ends in results), seconds=time.monotonic() - start,
            tools=(*names, *malformed),
            failed_tools=(*(n for n, (_, err, _) in zip(names, results) if err), *malformed))

    async def _run_one(self, call: ToolCall) -> tuple[Message, bool, bool]:
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return Message("tool", f"Error: unknown tool {call.name!r}; available: {known}.",
                           name=call.name), True, False
        problem = validate_arguments(call, tool.schema)
        if problem:
            return Message("tool", f"Error: {problem}", name=call.name), True, False
        timeout_s = self.settings.tool_timeout_s
        try:
            result = await asyncio.wait_for(execute_tool(tool, call.name, call.arguments,
                                                         self.activity), timeout_s)
        except TimeoutError:
            return Message("tool", f"Timeout: {call.name} did not finish within {timeout_s:g} s.",
                           name=call.name), True, False
        except ToolBlockedLoop:
            return Message("tool", f"Timeout: {call.name} did not finish within {timeout_s:g} s "
                           "(it blocked the worker's event loop).", name=call.name), True, False
        except Exception as exc:  # a failing tool is an observation, never a crashed worker
            return Message("tool", f"Error: {call.name} failed: {type(exc).__name__}: {exc}",
                           name=call.name), True, False
        return Message("tool", result.content, name=call.name), result.is_error, result.ends_trajectory


async def execute_tool(tool: Tool, name: str, arguments: Mapping[str, Any],
                       activity: ToolActivity) -> Any:
    """A tool that declares `blocking = True`, or was found blocking the loop (the worker's
    watchdog, rollout.loop_watch), runs on a thread with its own event loop, so its blocking
    work neither stalls the worker's other trajectories nor escapes the tool timeout; any
    other tool runs on the worker's loop (see envs.tools.base). The watchdog recognises a
    tool running on the loop by this function's frame."""
    if getattr(tool, "blocking", False) or name in activity.blocking:
        return await asyncio.to_thread(asyncio.run, tool.execute(arguments))
    with activity.executing(name):
        return await tool.execute(arguments)


@runtime_checkable
class AgentLoop(Protocol):
    async def run(self, task: Task, ctx: AgentContext) -> Trajectory: ...


class SingleTurnLoop:
    """One generation from the task's messages; no tools."""

    durable = True  # continued after a restart by replaying its journal (rollout.durable)

    async def run(self, task: Task, ctx: AgentContext) -> Trajectory:
        rec = ctx.start(ctx.chat.initial_prompt_ids(task.messages, None))
        if (stop := rec.generation_stop()) is not None:
            return rec.finish(stop, "the prompt fills the context")
        out = await ctx.generate()
        if out.finish_reason == "abort":
            return rec.finish(TerminationReason.ERROR, "generation was aborted")
        if out.finish_reason == "length":
            return rec.finish(TerminationReason.MAX_TOKENS)
        return rec.finish(TerminationReason.FINISHED)


class ToolAgentLoop:
    """Generate -> parse tool calls (the family's vLLM parser) -> run tools -> append
    observations, until the model answers without a tool call, a tool ends the trajectory,
    or a budget runs out.

    A turn that ends by length without a tool call ends the trajectory with max_tokens:
    the model ran out of budget mid-answer (or never emitted its stop token).

    Subclasses may override `run_tools` (e.g. to add an environment's own latency or
    bookkeeping around the tools); everything else about a turn stays as here. A subclass
    that runs tools other than through ctx.run_tools should set `durable = False`: a
    restart would otherwise run those tools again on replay (rollout.durable).
    """

    durable = True  # continued after a restart by replaying its journal (rollout.durable)

    async def run_tools(self, parsed: ParsedTurn, ctx: AgentContext) -> ToolOutcome:
        """One turn's tool calls -> their observations (ctx.run_tools by default)."""
        return await ctx.run_tools(parsed)

    async def run(self, task: Task, ctx: AgentContext) -> Trajectory:
        transcript = list(task.messages)  # only kept for the debug continuity check
        trajectory = await self._run(task, ctx, transcript)
        if ctx.settings.continuity_check:
            ctx.check_continuity(transcript)
        return trajectory

    async def _run(self, task: Task, ctx: AgentContext, transcript: list[Message]) -> Trajectory:
        rec = ctx.start(ctx.chat.initial_prompt_ids(task.messages, ctx.tool_schemas or None))
        for _ in range(ctx.settings.max_turns):
            if (stop := rec.generation_stop()) is not None:
                return rec.finish(stop)
            out = await ctx.generate()
            if out.finish_reason == "abort":
                return rec.finish(TerminationReason.ERROR, "generation was aborted")
            # vLLM's parsers of the family (rollout.parsers), as a server would read the turn;
            # the transcript keeps reasoning apart so that a re-render treats it as the template does.
            parsed = parse_generation(ctx.chat, ctx.tokenizer, out.token_ids, tools=ctx.tool_schemas,
                                      max_calls=ctx.settings.max_tool_calls_per_turn,
                                      prompt_ids=rec.context_ids[:rec.sent_prefix_lengths[-1]])
            rec.record_tool_parse(parsed.status)
            # A turn with no valid call stays as generated: parsers strip a plain answer's
            # whitespace and leave a malformed call out of `content`, where a server hands
            # the text back whole and the template renders it so. The debug re-render then
            # compares like with like.
            plain = not parsed.calls and parsed.reasoning is None
            content = ctx.text_of(out) if plain else parsed.content
            transcript.append(Message("assistant", content, parsed.calls, reasoning=parsed.reasoning))
            if not parsed.calls and not parsed.errors:
                reason = TerminationReason.MAX_TOKENS if out.finish_reason == "length" else TerminationReason.FINISHED
                return rec.finish(reason)
            outcome = await self.run_tools(parsed, ctx)
            obs = ctx.chat.observation_ids(outcome.messages, ctx.ended_with_stop(out))
            if (stop := rec.fits_observation(len(obs))) is not None:
                return rec.finish(stop, "the tool observation does not fit")
            rec.add_observation(obs, outcome.num_calls, outcome.num_errors, outcome.seconds,
                                outcome.num_timeouts, tools=outcome.tools,
                                failed_tools=outcome.failed_tools)
            transcript.extend(outcome.messages)
            if outcome.ends_trajectory:
                return rec.finish(TerminationReason.FINISHED)
        return rec.finish(TerminationReason.MAX_TURNS)


# The agent-loop plug-in point: the built-ins by short name.
AGENT_LOOPS = PluginPoint("agent loop", "agent.loop (or a task's agent_loop)", {
    "tool_agent": "rollout.agent_loop:ToolAgentLoop",
    "single_turn": "rollout.agent_loop:SingleTurnLoop",
})


def load_agent_loop(name: str) -> type:
    """Resolve a built-in name or `package.module:Class` to an AgentLoop class; ValueError
    says what is wrong."""
    obj = AGENT_LOOPS.resolve(name)
    if not isinstance(obj, type) or not inspect.iscoroutinefunction(getattr(obj, "run", None)):
        raise ValueError(f"agent loop {name!r} must be a class with "
                         f"`async def run(self, task, ctx) -> Trajectory`")
    return obj


def check_agent_loop(name: str) -> None:
    """The AgentLoop contract, checked without running the loop: a class with
    `async def run(self, task, ctx)` that the worker can build as cls(). ValueError says
    what to change."""
    cls = load_agent_loop(name)
    problem = signature_problem(cls.run, ("self", "task", "ctx"))
    if problem:
        raise ValueError(f"agent loop {name!r}: {cls.__name__}.run{problem}")
    try:
        cls()
    except TypeError as exc:
        raise ValueError(f"agent loop {name!r}: {cls.__name__}() cannot be built without "
                         f"arguments ({exc}); the worker builds it as {cls.__name__}(), so give "
                         "its parameters defaults") from exc
