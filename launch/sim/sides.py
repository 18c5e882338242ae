"""The controller's two seams (trainer.run.seams), simulated: `SimRollout` runs each group's G
trajectories as coroutines through the real `Router` and `TurnGate` against simulated
engines and sandboxes; `SimTrainer` takes the trainer model's time per step and per push
and makes the engines adopt the new version (dropping their prefix caches).

A simulated trajectory follows the planner's profile: `turns` turns of `gen_tokens`
generated tokens, each but the last followed by one sandboxed command (the exec-time
model) and `obs_tokens` of output. Rewards are seeded coin flips: the simulator measures
time, not learning. Every turn leaves a trace event (virtual seconds).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from buffer.batch import TrainBatch
from envs.types import NO_VERSION, Group, Task, TerminationReason, Trajectory, Turn
from launch.sim.engine_client import SimEngine, SimWorld, content_ids
from launch.sim.engine_model import SimRequest
from launch.sim.sandbox_model import ExecTimeModel, SandboxPoolModel
from launch.sim.trainer_model import TrainerModel
from rollout.deadline import DeadlineCut, absorb_cut, gather_by_deadline
from rollout.engine import EngineStats, Sampling
from rollout.gate import TurnGate
from rollout.kv_residency import ResidencyView
from rollout.router import Router
from rollout.worker import WorkerStats
from trainer.train.outcomes import PushOutcome, TrainOutcome


@dataclass(frozen=True, slots=True)
class TrajectoryProfile:
    """Sizes of one simulated trajectory, in real tokens."""

    turns: int
    prompt_tokens: int
    gen_tokens: int
    obs_tokens: int
    token_unit: int  # real tokens per id the agent loop keeps

    def units(self, tokens: int) -> int:
        return max(1, round(tokens / self.token_unit))


class SimSandboxes:
    """The sandbox pool model on the loop's clock: `acquire` waits its turn."""

    def __init__(self, pool: SandboxPoolModel) -> None:
        self.pool = pool
        self._waiting: dict[str, asyncio.Future[None]] = {}

    async def acquire(self, holder: str) -> float:
        """Seconds waited for a sandbox."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        if not self.pool.acquire(start, holder):
            self._waiting[holder] = loop.create_future()
            try:
                await self._waiting[holder]
            except asyncio.CancelledError:  # e.g. the trajectory's timeout
                self._waiting.pop(holder, None)
                if self.pool.is_queued(holder):
                    self.pool.leave_queue(loop.time(), holder)
                else:  # granted in the same instant: hand it on
                    self.release(holder)
                raise
        return loop.time() - start

    def release(self, holder: str) -> None:
        for granted in self.pool.release(asyncio.get_running_loop().time(), holder):
            self._waiting.pop(granted).set_result(None)


@dataclass(slots=True)
class _Partial:
    """A trajectory as far as it got (a timeout keeps it)."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SimRouting:
    """How the simulated rollout routes turns: sticky on the router's own counts (no poll:
    deterministic), or by residency (rollout.routing=residency) over the engines' KV events,
    read on the recipe's load poll, with its load penalty."""

    residency: bool = False
    load_poll_s: float = 0.5
    load_penalty_tokens: int = 256


class SimRollout:
    """`RolloutSide` over simulated engines and sandboxes, through the real router and gate.

    Token ids carry content (`content_ids`): a task's prompt, each turn's output and each
    observation are ids of their own, so a residency router's block keys tell trajectories
    and tasks apart as they would real text."""

    def __init__(self, *, profile: TrajectoryProfile, engines: Mapping[str, SimEngine],
                 world: SimWorld, sandboxes: SimSandboxes, exec_model: ExecTimeModel,
                 releasable: bool, trajectory_timeout_s: float, seed: int,
                 routing: SimRouting = SimRouting()) -> None:
        self.profile = profile
        self.engines = dict(engines)
        self.world = world
        if routing.residency:
            # The view counts ids: the penalty in tokens becomes ids of token_unit tokens.
            self.router = Router(dict(engines), load_poll_s=routing.load_poll_s,
                                 residency=ResidencyView(),
                                 load_penalty_tokens=round(routing.load_penalty_tokens / profile.token_unit))
        else:
            self.router = Router(dict(engines), load_poll_s=0.0)
        self.gate = TurnGate()
        self.sandboxes = sandboxes
        self.exec_model = exec_model
        self.releasable = releasable
        self.trajectory_timeout_s = trajectory_timeout_s
        self.seed = seed
        self.trace: list[dict] = []
        self._running = 0
        self._end_reasons: Counter[str] = Counter()
        self._timed_out_tools = 0

    async def run_group(self, task: Task, group_id: str, group_size: int,
                        deadline_s: float | None = None) -> Group:
        cut = DeadlineCut()
        trajectories = await gather_by_deadline(
            [self._trajectory(task, group_id, i, cut) for i in range(group_size)], deadline_s, cut)
        return Group(task.id, group_id, tuple(trajectories))

    async def _trajectory(self, task: Task, group_id: str, index: int,
                          cut: DeadlineCut) -> Trajectory:
        session = f"{group_id}/{index}"
        rng = random.Random(f"{self.seed}/{session}")
        part = _Partial(prompt_ids=content_ids(task.id, self.profile.units(self.profile.prompt_tokens)).tolist())
        self._running += 1
        held = False
        reason = TerminationReason.FINISHED
        try:
            if not self.releasable:
                await self.sandboxes.acquire(session)
                held = True
            await asyncio.wait_for(self._turns(task, session, part, rng), self.trajectory_timeout_s)
        except TimeoutError:
            reason = TerminationReason.TIMEOUT
        except asyncio.CancelledError:
            if not absorb_cut(cut):
                raise
            reason = TerminationReason.DEADLINE
        finally:
            self._running -= 1
            self.router.release(session)
            if held:
                self.sandboxes.release(session)
        self._end_reasons[reason.value] += 1
        return Trajectory(task.id, group_id, index, np.array(part.prompt_ids, np.int32),
                          np.array(part.ids, np.int32), np.array(part.mask, np.int8),
                          np.array(part.logprobs, np.float32), np.array(part.versions, np.int32),
                          reason, tuple(part.turns),
                          reward=0.0 if reason is TerminationReason.DEADLINE else float(rng.random() < 0.5))

    async def _turns(self, task: Task, session: str, part: _Partial, rng: random.Random) -> None:
        loop, p = asyncio.get_running_loop(), self.profile
        for turn in range(p.turns):
            reached = loop.time()
            context_units = len(part.prompt_ids) + len(part.ids)
            async with self.gate.turn():
                started = loop.time()
                request_id = f"{session}#{turn}"
                self.world.register(SimRequest(
                    request_id, session, context_units * p.token_unit, p.gen_tokens,
                    shared_key=task.id, shared_tokens=len(part.prompt_ids) * p.token_unit))
                routed = await self.router.generate(session, request_id,
                                                    np.array(part.prompt_ids + part.ids, np.int32),
                                                    Sampling(max_new_tokens=p.units(p.gen_tokens)))
            out, generated = routed.output, loop.time()
            start = len(part.ids)
            part.ids += out.token_ids.tolist()
            part.mask += [1] * len(out.token_ids)
            part.logprobs += out.logprobs.tolist()
            part.versions += out.versions.tolist()
            tool_s = queue_s = 0.0
            observed = 0
            if turn < p.turns - 1:
                sample = self.exec_model.sample(rng)
                self._timed_out_tools += sample.timed_out
                if self.releasable:
                    lease = f"{session}#{turn}"
                    queue_s = await self.sandboxes.acquire(lease)
                    try:
                        await asyncio.sleep(sample.seconds + self.sandboxes.pool.restore_s)
                    finally:
                        self.sandboxes.release(lease)
                else:
                    await asyncio.sleep(sample.seconds)
                tool_s = loop.time() - generated - queue_s
                observed = p.units(p.obs_tokens)
                part.ids += content_ids(f"{session}#{turn}/observation", observed).tolist()
                part.mask += [0] * observed
                part.logprobs += [0.0] * observed
                part.versions += [NO_VERSION] * observed
            part.turns.append(Turn(
                index=turn, prompt_tokens=context_units, response_start=start,
                num_generated=len(out.token_ids), num_observation=observed,
                finish_reason=out.finish_reason, version=int(out.versions[0]),
                cached_prompt_tokens=out.cached_prompt_tokens, num_tool_calls=int(observed > 0),
                generate_s=generated - started, tool_s=tool_s, queue_s=started - reached + queue_s,
                engine=routed.engine, started_at=reached))
            self.trace.append({"kind": "turn", "traj": session, "turn": turn,
                               "engine": routed.engine, "gate_s": round(reached, 3),
                               "gen_start_s": round(started, 3), "gen_end_s": round(generated, 3),
                               "tool_end_s": round(loop.time(), 3), "version": int(out.versions[0]),
                               "context_tokens": context_units * p.token_unit,
                               "cached_tokens": out.cached_prompt_tokens * p.token_unit})

    def trajectory_walls(self) -> list[float]:
        """Each trajectory's wall clock, first turn to last tool end (its sandbox wait
        before the first turn is not part of it)."""
        walls: dict[str, tuple[float, float]] = {}
        for event in self.trace:
            first, last = walls.get(event["traj"], (event["gate_s"], event["tool_end_s"]))
            walls[event["traj"]] = (min(first, event["gate_s"]), max(last, event["tool_end_s"]))
        return [b - a for a, b in walls.values()]

    @property
    def end_reasons(self) -> Counter[str]:
        return self._end_reasons

    @property
    def num_turns(self) -> int:
        return len(self.trace)

    async def close_gates(self) -> None:
        await self.gate.close()

    async def open_gates(self) -> None:
        self.gate.open()

    async def worker_stats(self) -> Sequence[WorkerStats]:
        return [WorkerStats(self._running, sum(self._end_reasons.values()),
                            dict(self._end_reasons), self._timed_out_tools, 0)]

    async def engine_stats(self) -> Mapping[str, EngineStats]:
        return await self.router.engine_stats()

    def close(self) -> None:
        self.router.close()
        for engine in self.engines.values():
            engine.close()


@dataclass(frozen=True, slots=True)
class StepRecord:
    version: int  # the version the step produced
    train_start_s: float
    train_end_s: float
    push_end_s: float
    train_tokens: int  # real tokens (ids x token_unit)


class SimTrainer:
    """`TrainerSide` whose steps and pushes take the trainer model's time."""

    def __init__(self, model: TrainerModel, engines: Mapping[str, SimEngine],
                 token_unit: int) -> None:
        self.model = model
        self.engines = dict(engines)
        self.token_unit = token_unit
        self.steps: list[StepRecord] = []
        self._train: tuple[float, float, int] = (0.0, 0.0, 0)

    async def train(self, batch: TrainBatch) -> TrainOutcome:
        loop = asyncio.get_running_loop()
        start, tokens = loop.time(), batch.num_tokens * self.token_unit
        await asyncio.sleep(self.model.step_s(tokens))
        self._train = (start, loop.time(), tokens)
        return TrainOutcome({"sim/train_tokens": float(tokens)})

    async def prepare_weights(self, version: int) -> None:
        return None  # gathering is inside the push time of the trainer model

    async def push_weights(self, version: int) -> PushOutcome:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self.model.push_s())
        await asyncio.gather(*(e.update_weights(version) for e in self.engines.values()))
        start, end, tokens = self._train
        self.steps.append(StepRecord(version, start, end, loop.time(), tokens))
        return PushOutcome()

    def save_state(self, folder: Path) -> None:
        raise NotImplementedError("the simulator keeps no trainer state to checkpoint")

    def load_state(self, folder: Path) -> None:
        raise NotImplementedError("the simulator keeps no trainer state to checkpoint")
