"""AgentLoopWorker: runs one asyncio coroutine per trajectory, scores each trajectory on
this worker as soon as it ends, and returns a scored Group once all G trajectories of a
task are terminal.

Each trajectory gets its own environment (envs.trajectory_env.TrajectoryEnv: tools,
sandbox lease, final workspace), made once and released once whatever the ending; its
final workspace goes straight to this worker's reward loop and is never put on the
Trajectory, so it never leaves the node (workers are placed beside their sandbox pool).

A sample is usually one trajectory. A loop that had to start over from a fresh render
(the gateway, when a black-box harness rewrote its history) also leaves its earlier
exact segments on `ctx.segments`: the worker scores the sample once (its last segment
and its final workspace), gives every segment that reward and the sample's ending, and
numbers them (`Trajectory.segment`); the group's baseline is then taken over samples.

This is the one place where a trajectory's failure is caught: an exception anywhere in an
agent loop or its tools ends that trajectory with `error` (message kept), and the
wall-clock limit ends it with `timeout`; both keep what the trajectory produced so far.
A sample its group's deadline cuts (rollout.deadline) ends with `deadline`, unscored.
A failing reward function fails its trajectory only (reward.loop). The worker itself
never fails because of a trajectory. A thin Ray actor hosts it.

With `durable` (a DurableSetup), every trajectory of a durable loop (rollout.durable) is
journaled turn by turn in its folder on this node; a sample whose journal is there when it
starts (the run was stopped or killed and resumed with the same group ids) continues from
its last turn boundary. A group's journals are removed when the group is returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import traceback
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from envs.tools.base import ToolClass
from envs.trajectory_env import EnvBuilder, load_tool_classes
from envs.types import Group, Task, TerminationReason, Trajectory
from reward.loop import RewardLoop
from rollout.agent_loop import AgentContext, LoopSettings, execute_tool, load_agent_loop
from rollout.loop_watch import LoopWatchdog, ToolActivity
from rollout.chat import ContinuityBuilder
from rollout.deadline import DeadlineCut, absorb_cut, gather_by_deadline
from rollout.journal_file import remove_file
from rollout.durable import (DurableSetup, DurableStats, DurableTrajectory, ReplayDiverged, journal_file,
                             open_replay, remove_group)
from rollout.gate import TurnGate
from rollout.recorder import BudgetExhausted
from rollout.gateway.server import GatewayStats, sum_gateway_stats
from rollout.gateway.loop import GatewayAgentLoop
from rollout.kv_residency import ResidencyView
from rollout.router import Router, RouterStats

if TYPE_CHECKING:
    from envs.pool import SandboxProvider
    from reward.judge import JudgeClient
    from rollout.config import RolloutRecipe

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerStats:
    num_running: int  # trajectories in flight
    num_finished: int
    end_reasons: Mapping[str, int]
    num_tool_errors: int
    num_continuity_divergences: int  # only counted with agent.continuity_check
    num_reward_errors: int = 0  # trajectories whose reward function raised
    num_reward_timeouts: int = 0
    env_open_s: float = 0.0  # total time spent opening environments (sandbox waits)
    num_loop_stalls: int = 0  # times the event loop was blocked > STALL_S (a blocking tool)
    num_segments: int = 0  # trajectories returned over all finished samples (> num_finished
    # when a loop split samples into segments)
    gateway: GatewayStats | None = None  # this worker's gateway, if a loop serves one
    durable: DurableStats | None = None  # with durable_dir: the trajectory journals
    router: RouterStats | None = None  # this worker's router (residency counters, moves)
    # A vision-language policy: images its chat builder processed, and the seconds it took.
    num_images_processed: int = 0
    image_process_s: float = 0.0


class AgentLoopWorker:
    def __init__(self, *, default_loop: str, settings: LoopSettings, chat: ContinuityBuilder,
                 tokenizer: Any, router: Router, envs: EnvBuilder, rewards: RewardLoop,
                 trajectory_timeout_s: float, gate: TurnGate | None = None,
                 durable: DurableSetup | None = None) -> None:
        self.settings = settings
        self.chat = chat
        self.tokenizer = tokenizer
        self.router = router
        self.envs = envs
        self.rewards = rewards
        self.trajectory_timeout_s = trajectory_timeout_s
        self.gate = gate or TurnGate()
        self._default_loop = default_loop
        self._loops: dict[str, Any] = {default_loop: load_agent_loop(default_loop)()}
        self._num_running = 0
        self._end_reasons: Counter[str] = Counter()
        self._num_tool_errors = 0
        self._num_divergences = 0
        self._env_open_s = 0.0
        self._num_segments = 0
        self.activity = ToolActivity()
        self.watchdog = LoopWatchdog(self.activity, execute_tool.__code__, settings.tool_timeout_s)
        self.durable = durable  # None: no journals (rollout.durable)
        self._durable = DurableStats()

    def loop_for(self, task: Task) -> Any:
        """The task's own loop class if it names one, else the recipe's; resolved once."""
        name = task.agent_loop or self._default_loop
        if name not in self._loops:
            self._loops[name] = load_agent_loop(name)()
        return self._loops[name]

    def check_task(self, task: Task) -> None:
        """Fail early (before any trajectory) on a task the worker cannot run or score."""
        self.loop_for(task)
        self.envs.check_task(task)
        self.rewards.fn_for(task)

    async def run_group(self, task: Task, group_id: str, group_size: int,
                        deadline_s: float | None = None) -> Group:
        """G scored trajectories of `task`. With `deadline_s`, the samples still running
        that long after the call are cut (rollout.deadline): each comes back as one
        unscored `deadline` trajectory holding what it had produced."""
        self.check_task(task)
        cut = DeadlineCut()
        samples = await gather_by_deadline(
            [self.run_sample(task, group_id, i, cut) for i in range(group_size)], deadline_s, cut)
        if self.durable is not None:  # returned: a restart no longer needs its journals
            remove_group(self.durable.folder, group_id)
        return Group(task.id, group_id, tuple(t for segments in samples for t in segments))

    async def run_trajectory(self, task: Task, group_id: str, index: int) -> Trajectory:
        """One scored sample's last (usually only) trajectory."""
        return (await self.run_sample(task, group_id, index))[-1]

    async def run_sample(self, task: Task, group_id: str, index: int,
                         cut: DeadlineCut | None = None) -> list[Trajectory]:
        """One scored sample, as its segments in order: environment, agent loop, release,
        reward (scored once, shared by every segment). Cancelled with `cut` set, it
        returns its cut trajectory instead of raising."""
        self.watchdog.start()
        env = self.envs.build(task)
        ctx = AgentContext(task=task, group_id=group_id, index=index, settings=self.settings,
                           chat=self.chat, tokenizer=self.tokenizer, env=env,
                           router=self.router, gate=self.gate, activity=self.activity,
                           durable=self._durable_for(task, group_id, index, env.sandbox is not None))
        diverged, journal = False, None
        self._num_running += 1
        try:
            try:
                start = time.monotonic()
                await env.open()  # waits for a sandbox: not part of the trajectory's own budget
                if ctx.durable is not None:  # a continued trajectory's sandbox, as its journal left it
                    await ctx.durable.restore(env)
                self._env_open_s += time.monotonic() - start
                trajectory = await asyncio.wait_for(self.loop_for(task).run(task, ctx),
                                                    self.trajectory_timeout_s)
                _check_result(trajectory, ctx)
                if ctx.durable is not None:  # its last tools' record, before the sandbox goes back
                    await ctx.durable.settle()
            except BudgetExhausted as exc:  # the loop asked for a turn the budgets have no room for
                trajectory = self._salvage(ctx, exc.reason, str(exc))
            except ReplayDiverged as exc:  # started over below, once the environment is released
                log.warning("trajectory %s does not replay its journal (%s): starting it over", ctx.session_id, exc)
                diverged, journal = True, ctx.durable
                ctx.durable = None  # the salvage below must not replay again
                trajectory = self._salvage(ctx, TerminationReason.ERROR, str(exc))  # never returned
            except TimeoutError:
                trajectory = self._salvage(ctx, TerminationReason.TIMEOUT,
                                           f"exceeded agent.trajectory_timeout_s={self.trajectory_timeout_s:g}")
            except Exception as exc:  # the per-trajectory boundary: nothing escapes to the worker
                log.warning("trajectory %s failed: %s", ctx.session_id, exc)
                detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
                trajectory = self._salvage(ctx, TerminationReason.ERROR, detail)
            finally:
                if ctx.durable is not None:  # stopped, failed or timed out: a save in progress is dropped
                    ctx.durable.abandon()
                self._num_running -= 1
                self.router.release(ctx.session_id)
                # Shielded: a cancellation (a deadline cut, a stop) arriving here still
                # lets the sandbox go back to its pool.
                workspace = await asyncio.shield(self._release(env))
                self._count_journal(ctx.durable)
            if diverged:
                self._durable = replace(self._durable, num_restarted=self._durable.num_restarted + 1)
                self._count_journal(journal)
                assert journal is not None
                remove_file(journal.path)  # the next try journals afresh, and never replays
                return await self.run_sample(task, group_id, index, cut)
            trajectory = await self.rewards.score(trajectory, task, workspace)
        except asyncio.CancelledError:
            if not absorb_cut(cut):
                raise
            self._end_reasons[TerminationReason.DEADLINE.value] += 1
            cut_at = self._salvage(ctx, TerminationReason.DEADLINE,
                                   "cut unfinished by its group's deadline (buffer.group_deadline_s)")
            return [dataclasses.replace(cut_at, reward=0.0)]  # outside the baseline: Group.in_baseline
        segments = join_segments(ctx.segments, trajectory, ctx)
        self._end_reasons[trajectory.termination.value] += 1
        self._num_segments += len(segments)
        self._num_tool_errors += sum(u.num_tool_errors for t in segments for u in t.turns)
        self._num_divergences += ctx.continuity_divergence is not None
        return segments

    def _durable_for(self, task: Task, group_id: str, index: int, has_sandbox: bool) -> DurableTrajectory | None:
        """The sample's journal (continuing from it when one is there), or None when the
        worker keeps none or the loop is not durable."""
        loop, setup = self.loop_for(task), self.durable
        if setup is None or not getattr(loop, "durable", False):
            return None
        name = f"{type(loop).__module__}:{type(loop).__qualname__}"
        path = journal_file(setup.folder, group_id, index)
        found = open_replay(path, setup.run_id, task.id, group_id, index, name, setup.resumed_version)
        if found.reason:
            log.info("trajectory %s/%d starts over: its journal %s", group_id, index, found.reason)
            self._durable = replace(self._durable, num_restarted=self._durable.num_restarted + 1)
        elif found.replay is not None:
            self._durable = replace(self._durable, num_continued=self._durable.num_continued + 1)
        return DurableTrajectory(path, setup.run_id, name, has_sandbox, found.replay)

    def _count_journal(self, durable: DurableTrajectory | None) -> None:
        if durable is not None:
            d = self._durable
            self._durable = replace(d, num_turns_replayed=d.num_turns_replayed + durable.turns_replayed,
                                    num_journal_bytes=d.num_journal_bytes + durable.num_bytes,
                                    journal_write_s=d.journal_write_s + durable.write_s,
                                    num_records=d.num_records + durable.num_records,
                                    num_states=d.num_states + durable.num_states_saved,
                                    num_state_bytes=d.num_state_bytes + durable.state_bytes,
                                    state_save_s=d.state_save_s + durable.state_s)

    def _salvage(self, ctx: AgentContext, reason: TerminationReason, detail: str) -> Trajectory:
        """The partial trajectory of a failed loop (or a prompt-only one if it never started)."""
        if ctx.recorder is None:
            try:
                prompt = ctx.chat.initial_prompt_ids(ctx.task.messages, ctx.tool_schemas or None)
            except Exception as exc:  # the prompt itself cannot be rendered
                prompt = [ctx.chat.end_of_turn_id]  # a 1-token stand-in; the trajectory is an error
                detail += f"\n(prompt could not be rendered: {exc})"
            ctx.start(prompt)
        assert ctx.recorder is not None
        return ctx.recorder.finish(reason, detail)

    async def _release(self, env: Any) -> Any:
        try:
            return await env.release()
        except Exception as exc:  # a broken release must not lose the trajectory
            log.warning("releasing the environment of task %s failed: %s", env.task.id, exc)
            return None

    def stats(self) -> WorkerStats:
        gateways = [loop.host.stats() for loop in self._loops.values()
                    if isinstance(loop, GatewayAgentLoop) and loop.host is not None]
        images = getattr(self.chat, "images", None)  # rollout.vision.ImageExpander
        return WorkerStats(self._num_running, sum(self._end_reasons.values()),
                           dict(self._end_reasons), self._num_tool_errors, self._num_divergences,
                           self.rewards.num_errors, self.rewards.num_timeouts, self._env_open_s,
                           self.watchdog.num_stalls, self._num_segments,
                           sum_gateway_stats(gateways) if gateways else None,
                           self._durable if self.durable is not None else None,
                           self.router.stats(), images.num_processed if images else 0,
                           images.process_s if images else 0.0)


def join_segments(earlier: Sequence[Trajectory], last: Trajectory, ctx: AgentContext) -> list[Trajectory]:
    """The sample's segments, numbered in order, each with the scored `last` one's reward,
    components and ending (a failed sample fails as a whole: the buffer's failure policy
    then applies to all its segments, never only to the one it ended in)."""
    for t in earlier:
        _check_result(t, ctx)
    if not earlier:
        return [last]
    ending = f"the sample ended {last.termination.value}" + (f": {last.termination_detail}"
                                                            if last.termination_detail else "")
    joined = [dataclasses.replace(t, segment=i, reward=last.reward, reward_components=last.reward_components,
                                  termination=last.termination,
                                  termination_detail=f"{t.termination_detail or 'segment ended'} ({ending})")
              for i, t in enumerate(earlier)]
    return [*joined, dataclasses.replace(last, segment=len(earlier))]


def _check_result(trajectory: object, ctx: AgentContext) -> None:
    """A user loop must return the trajectory of this task, group and index."""
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"agent loop returned {type(trajectory).__name__}, not a Trajectory")
    if (trajectory.task_id, trajectory.group_id, trajectory.index) != (ctx.task.id, ctx.group_id, ctx.index):
        raise ValueError(f"agent loop returned trajectory {trajectory.task_id}/{trajectory.group_id}/"
                         f"{trajectory.index} for {ctx.task.id}/{ctx.group_id}/{ctx.index}")


def build_agent_worker(cfg: "RolloutRecipe", model_path: str, engines: Mapping[str, Any], *,
                       sandbox_provider: "SandboxProvider | None" = None,
                       judge: "JudgeClient | None" = None,
                       tool_classes: Mapping[str, ToolClass] | None = None,
                       durable: DurableSetup | None = None) -> AgentLoopWorker:
    """An AgentLoopWorker for the recipe: tokenizer and continuity builder of the policy, a
    sticky router over `engines`, the built-in tools plus `envs.tools` (unless
    `tool_classes` replaces them), sandboxes from `sandbox_provider`, and a reward loop
    grading on this node (`envs.sandbox_backend` sandboxes, the judge's engines)."""
    from envs.pool import load_sandbox_factory
    from envs.tools.sandbox_tools import build_sandbox_tool_settings
    from rollout.chat import build_continuity_builder, decode_text, load_tokenizer
    from rollout.vision import load_image_expander

    tokenizer = load_tokenizer(model_path)
    chat = build_continuity_builder(tokenizer, cfg.agent.chat_family, cfg.agent.keep_thinking,
                                    tool_parser=cfg.agent.tool_parser,
                                    reasoning_parser=cfg.agent.reasoning_parser,
                                    images=load_image_expander(model_path))
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    envs = EnvBuilder(tool_classes if tool_classes is not None else load_tool_classes(cfg.envs.tools),
                      sandbox_provider, build_sandbox_tool_settings(cfg.envs, count_tokens=count))
    rewards = RewardLoop(cfg.reward.fn, lambda ids: decode_text(tokenizer, ids, skip_special_tokens=True),
                         timeout_s=cfg.reward.timeout_s, max_concurrency=cfg.reward.max_concurrency,
                         judge=judge, create_sandbox=load_sandbox_factory(cfg.envs.sandbox_backend),
                         scope=cfg.reward.fn_scope, hack_policy=cfg.reward.hack_policy)
    router = Router(dict(engines), max_sessions=cfg.rollout.num_router_sessions,
                    request_timeout_s=cfg.rollout.request_timeout_s,
                    load_poll_s=cfg.rollout.load_poll_s,
                    max_imbalance=cfg.rollout.max_engine_imbalance,
                    residency=ResidencyView() if cfg.rollout.routing == "residency" else None,
                    load_penalty_tokens=cfg.rollout.residency_load_penalty_tokens)
    return AgentLoopWorker(default_loop=cfg.agent.loop, settings=LoopSettings.from_config(cfg),
                           chat=chat, tokenizer=tokenizer, router=router, envs=envs,
                           rewards=rewards, trajectory_timeout_s=cfg.agent.trajectory_timeout_s,
                           durable=durable if cfg.rollout.durable_trajectories else None)
