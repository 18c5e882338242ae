"""The real `AgentLoopWorker` and agent loop in the simulated loop (`launch.simulate
--worker real`): the simulated engine and sandboxes sit behind the worker's own seams.

- Engine: `ScriptedChat` is the `EngineScript` of a `SimEngine`. The agent loop sends real
  prompt ids (its chat template, its observations); the engine model times them by their
  length, keyed by the router's session, and answers with ids that the recipe's tool
  parser reads as one `bash` call of `gen_tokens` tokens, until the last turn, which
  answers in plain text (half the samples of a group right, half wrong, so groups have
  a reward spread).
- Sandboxes: `SimSandboxProvider` is a `SandboxProvider` (the interface of the sandbox
  pool and its Ray actor) over `SandboxPoolModel`: the worker's `EnvBuilder` opens a lease
  per trajectory (stateful), the real `bash` tool execs in it, an exec takes the exec-time
  model's time and prints about `obs_tokens` tokens.
- Reward: the recipe's rule verifier (`reward.rules:ExactMatch`) on the final answer.

Real tokens flow through here (token unit 1), tokenisation and templates included, so
this mode is for small workloads; the seed's scale uses `launch.sim.sides`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from envs.pool import SandboxLease
from envs.sandbox.base import ExecResult, SandboxSpec
from envs.types import Group, Message, Task, Trajectory, WorkspaceChanges
from launch.plan import Plan
from launch.sim.engine_client import SimEngine
from launch.sim.engine_model import EngineModel, EngineSpec, SimRequest
from launch.sim.sandbox_model import ExecTimeModel
from launch.sim.sides import SimSandboxes
from rollout.deadline import DeadlineCut, gather_by_deadline
from rollout.engine import EngineStats, FinishReason, Sampling
from rollout.worker import AgentLoopWorker, WorkerStats
from trainer.run.config import SluiceConfig

ANSWER = "42"
TOOL_CALL = '<tool_call>{"name": "bash", "arguments": {"command": "pytest -q"}}</tool_call>'


class ScriptedChat:
    """`EngineScript` for the real agent loop: sizes from the ids sent, outputs that are
    tool calls of `gen_tokens` tokens for `turns - 1` turns, then a final answer."""

    token_unit = 1

    def __init__(self, tokenizer: Any, end_id: int, turns: int, gen_tokens: int) -> None:
        filler = tokenizer.encode(" think", add_special_tokens=False)[:1]
        call = tokenizer.encode(TOOL_CALL, add_special_tokens=False)
        right = tokenizer.encode(f"The answer is \\boxed{{{ANSWER}}}.", add_special_tokens=False)
        wrong = tokenizer.encode("The answer is \\boxed{7}.", add_special_tokens=False)
        self.turns = turns

        def padded(body: list[int]) -> np.ndarray:  # filler reasoning, the body, the stop
            return np.asarray(filler * max(0, gen_tokens - len(body) - 1) + body + [end_id],
                              np.int32)

        self._call, self._right, self._wrong = padded(call), padded(right), padded(wrong)
        self._first_prompt: dict[str, int] = {}

    def describe(self, request_id: str, prompt_ids: np.ndarray | list[int],
                 sampling: Sampling) -> SimRequest:
        session = request_id.split("#", 1)[0]  # AgentContext: "<group>/<index>#<n>"
        group = session.rsplit("/", 1)[0]
        shared = self._first_prompt.setdefault(session, len(prompt_ids))
        ids, _ = self.output(SimRequest(request_id, session, len(prompt_ids), 1), prompt_ids, sampling)
        return SimRequest(request_id, session, len(prompt_ids), len(ids), shared_key=group,
                          shared_tokens=shared)

    def output(self, request: SimRequest, prompt_ids: np.ndarray | list[int],
               sampling: Sampling) -> tuple[np.ndarray, FinishReason]:
        turn = int(request.request_id.rsplit("#", 1)[1]) - 1  # requests count from 1
        index = int(request.session.rsplit("/", 1)[1])
        ids = self._call if turn < self.turns - 1 else (self._right if index % 2 == 0 else self._wrong)
        if len(ids) > sampling.max_new_tokens:
            return ids[:sampling.max_new_tokens], "length"
        return ids, "stop"

    def forget(self, session: str) -> None:
        self._first_prompt.pop(session, None)


class SimSandboxProvider:
    """`SandboxProvider` over the sandbox pool model: a lease waits for a sandbox, an exec
    sleeps its drawn time (cut at its timeout) and prints `obs_text`."""

    def __init__(self, sandboxes: SimSandboxes, exec_model: ExecTimeModel, obs_text: str,
                 seed: int) -> None:
        self.sandboxes = sandboxes
        self.exec_model = exec_model
        self.obs_text = obs_text
        self.seed = seed
        self._ids = itertools.count()
        self._rngs: dict[str, random.Random] = {}

    async def acquire(self, spec: SandboxSpec) -> SandboxLease:
        holder = f"sim/{next(self._ids)}"
        waited = await self.sandboxes.acquire(holder)
        self._rngs[holder] = random.Random(f"{self.seed}/{holder}")
        return SandboxLease("sim", holder, False, waited)

    async def release(self, lease: SandboxLease) -> None:
        if self._rngs.pop(lease.sandbox_id, None) is not None:
            self.sandboxes.release(lease.sandbox_id)

    async def exec(self, lease: SandboxLease, cmd: str | list[str], timeout_s: float,
                   stdin: str | None = None) -> ExecResult:
        sample = self.exec_model.sample(self._rngs[lease.sandbox_id])
        seconds = min(sample.seconds, timeout_s)
        await asyncio.sleep(seconds)
        timed_out = sample.seconds >= timeout_s
        return ExecResult(exit_code=124 if timed_out else int(sample.failed), stdout=self.obs_text,
                          stderr="", timed_out=timed_out, oom_killed=False,
                          output_truncated=False, duration_s=seconds)

    async def read_file(self, lease: SandboxLease, path: str) -> bytes:
        return b""

    async def write_file(self, lease: SandboxLease, path: str, data: bytes) -> None:
        return None

    async def checkpoint(self, lease: SandboxLease) -> None:
        return None

    async def workspace_changes(self, lease: SandboxLease, max_bytes: int) -> WorkspaceChanges:
        return WorkspaceChanges()

    async def save_state(self, lease: SandboxLease, path: str) -> int:
        open(path, "wb").close()  # a simulated workspace holds no files
        return 0

    async def restore_state(self, lease: SandboxLease, path: str) -> None:
        return None


def build_obs_text(tokenizer: Any, obs_tokens: int) -> str:
    """Command output of about `obs_tokens` tokens (the bash tool adds its status lines)."""
    line = "test_module.py::test_case PASSED\n"
    per_line = max(1, len(tokenizer.encode(line, add_special_tokens=False)))
    return line * max(1, obs_tokens // per_line)


class AgentRollout:
    """`RolloutSide` over one in-process AgentLoopWorker (no Ray: one event loop). It runs
    a group's samples through the worker's own `run_sample` (environment, agent loop,
    release, reward) and keeps each one's virtual wall clock and ending."""

    def __init__(self, worker: AgentLoopWorker, engines: Mapping[str, SimEngine],
                 script: ScriptedChat) -> None:
        self.worker = worker
        self.engines = dict(engines)
        self.script = script
        self.trace: list[dict] = []  # one event per trajectory (the worker keeps the turns)
        self.end_reasons: Counter[str] = Counter()
        self.num_turns = 0

    async def run_group(self, task: Task, group_id: str, group_size: int,
                        deadline_s: float | None = None) -> Group:
        self.worker.check_task(task)
        cut = DeadlineCut()
        samples = await gather_by_deadline(
            [self._sample(task, group_id, i, cut) for i in range(group_size)], deadline_s, cut)
        return Group(task.id, group_id, tuple(t for segments in samples for t in segments))

    async def _sample(self, task: Task, group_id: str, index: int,
                      cut: DeadlineCut) -> list[Trajectory]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        segments = await self.worker.run_sample(task, group_id, index, cut)
        last = segments[-1]
        self.end_reasons[last.termination.value] += 1
        self.num_turns += sum(len(t.turns) for t in segments)
        self.trace.append({"kind": "trajectory", "traj": f"{group_id}/{index}",
                           "start_s": round(start, 3), "end_s": round(loop.time(), 3),
                           "turns": len(last.turns), "end": last.termination.value,
                           "reward": last.reward})
        self.script.forget(f"{group_id}/{index}")
        return segments

    def trajectory_walls(self) -> list[float]:
        """Each finished trajectory's wall clock, its sandbox wait included."""
        return [e["end_s"] - e["start_s"] for e in self.trace]

    async def close_gates(self) -> None:
        await self.worker.gate.close()

    async def open_gates(self) -> None:
        self.worker.gate.open()

    async def worker_stats(self) -> Sequence[WorkerStats]:
        return [self.worker.stats()]

    async def engine_stats(self) -> Mapping[str, EngineStats]:
        return await self.worker.router.engine_stats()

    def close(self) -> None:
        self.worker.router.close()
        for engine in self.engines.values():
            engine.close()


def build_agent_rollout(cfg: SluiceConfig, plan: Plan, spec: EngineSpec, sandboxes: SimSandboxes,
                        exec_model: ExecTimeModel, seed: int) -> tuple[AgentRollout, list[Task]]:
    """The recipe's AgentLoopWorker (rollout.worker.build_agent_worker: its tokenizer,
    chat family and tool parser, the built-in tools, ExactMatch rewards) on the tiny
    model's tokenizer, over simulated engines and sandboxes; and tasks for it."""
    from rollout.worker import build_agent_worker
    from trainer.run.tiny_model import ensure_tiny_model

    p = plan.inputs
    turns = p.turns
    if p.gen_tokens > cfg.agent.max_new_tokens_per_turn:
        raise ValueError(f"plan.gen_tokens={p.gen_tokens} exceeds agent.max_new_tokens_per_turn="
                         f"{cfg.agent.max_new_tokens_per_turn}: the scripted tool call would be "
                         "cut; lower plan.gen_tokens")
    # The tiny model's tokenizer and family; routing on the router's own counts (a load
    # poll would add timers that change nothing here), sticky sessions that never move off
    # their engine (no imbalance reaches sys.maxsize), no request timeout (virtual time).
    sim_cfg = dataclasses.replace(
        cfg, agent=dataclasses.replace(cfg.agent, chat_family="auto", tool_parser="auto",
                                       reasoning_parser="auto", max_turns=turns),
        rollout=dataclasses.replace(cfg.rollout, load_poll_s=0.0, request_timeout_s=1e9,
                                    max_engine_imbalance=sys.maxsize),
        reward=dataclasses.replace(cfg.reward, fn="reward.rules:ExactMatch", fn_scope="all"))
    from rollout.chat import build_continuity_builder, load_tokenizer

    model_path = str(ensure_tiny_model())
    tokenizer = load_tokenizer(model_path)
    provider = SimSandboxProvider(sandboxes, exec_model, build_obs_text(tokenizer, p.obs_tokens), seed)
    # The outputs end with the family's end-of-turn id, as the worker's builder has it.
    end_id = build_continuity_builder(tokenizer, "auto", tool_parser="none",
                                      reasoning_parser="none").end_of_turn_id
    script = ScriptedChat(tokenizer, end_id, turns, p.gen_tokens)
    engines = {f"engine{i}": SimEngine(EngineModel(spec), script, cfg.rollout.kv_after_push)
               for i in range(cfg.rollout.num_engines)}
    worker = build_agent_worker(sim_cfg, model_path, engines, sandbox_provider=provider)
    return AgentRollout(worker, engines, script), build_agent_tasks(cfg.train.groups_per_step * 4)


def build_agent_tasks(num_tasks: int) -> list[Task]:
    """Tasks for the real agent loop: a question, the bash tool, the reference answer."""
    return [Task(id=f"task{i}", messages=(Message(role="user", content=f"Fix the tests of task {i}, "
                                                  "then give the answer."),),
                 tools=("bash",), answer=ANSWER) for i in range(num_tasks)]
