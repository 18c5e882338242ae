"""How many AgentLoopWorker processes a recipe gets: `rollout.num_agent_workers`, or with 0
(auto) a count sized from the plan before anything starts. One pure function of the config,
read by the pool plan, the worker start, `--dry-run` and the planner alike.

Auto: the trajectories the async loop can hold at once (`compute_in_flight_trajectories`),
spread over the sandbox nodes, over what one worker process drives at its ideal pace
(`rollout.trajectories_per_agent_worker`), rounded up, at least one per node; on a local
cluster no more than the CPUs the other pools leave (each worker reserves
`rollout.cpus_per_agent_worker`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from trainer.run.config import SluiceConfig


def compute_in_flight_trajectories(max_staleness: int, groups_per_step: int, group_size: int,
                                   num_sandboxes: int) -> int:
    """Trajectories alive at once in an async run: the staleness bound admits eta + 1
    steps' groups, and each holds a sandbox for its life, so the recipe's sandboxes cap
    them too (the simulator at the seed's profile: 2.25 steps' worth, sandbox-bound).
    `num_sandboxes` <= 0: no sandbox cap."""
    admitted = (max_staleness + 1) * groups_per_step * group_size
    return min(admitted, num_sandboxes) if num_sandboxes > 0 else admitted


@dataclass(frozen=True, slots=True)
class AgentWorkerCount:
    """The resolved `rollout.num_agent_workers` and where it came from."""

    total: int  # AgentLoopWorker processes in all
    per_node: int  # on each sandbox node (total / envs.num_sandbox_workers)
    auto: bool  # sized here (num_agent_workers=0), not given
    reason: str  # how, in words, for --dry-run and the planner

    def describe(self) -> str:
        nodes = self.total // self.per_node
        how = "auto" if self.auto else "rollout.num_agent_workers"
        return (f"{self.total} AgentLoopWorker process{'es' if self.total > 1 else ''} "
                f"({self.per_node} per sandbox node x {nodes}; {how}: {self.reason})")


def local_cpus_for_agent_workers(cfg: SluiceConfig) -> float | None:
    """CPUs a local cluster (cluster.address=local, one node) leaves to agent-loop workers
    after the other pools' reservations; None for a cluster joined by address, whose size
    is only known once connected (its pool placement then names what is missing)."""
    c = cfg.cluster
    if c.address != "local":
        return None
    r, t, e, j = cfg.rollout, cfg.train, cfg.envs, cfg.reward.judge
    offered = c.local_num_cpus if c.local_num_cpus is not None else (os.cpu_count() or 1)
    reserved = (r.num_engines * r.cpus_per_engine + t.num_ranks * t.cpus_per_rank
                + e.num_sandbox_workers * e.cpus_per_sandbox_worker
                + (j.num_engines * j.cpus_per_engine if j.enabled else 0.0))
    return offered - reserved


def resolve_agent_workers(cfg: SluiceConfig) -> AgentWorkerCount:
    """The AgentLoopWorker processes of `cfg`: a positive rollout.num_agent_workers as
    given; 0 sized from the plan (module docstring)."""
    r, e = cfg.rollout, cfg.envs
    nodes = e.num_sandbox_workers
    if r.num_agent_workers > 0:
        return AgentWorkerCount(r.num_agent_workers, r.num_agent_workers // nodes, False,
                                "as given")
    eta = 0 if cfg.train.mode == "sync" else cfg.buffer.max_staleness
    in_flight = compute_in_flight_trajectories(eta, cfg.train.groups_per_step,
                                               cfg.train.group_size,
                                               nodes * e.sandboxes_per_worker)
    in_flight_per_node = math.ceil(in_flight / nodes)
    per_node = max(1, math.ceil(in_flight_per_node / r.trajectories_per_agent_worker))
    reason = (f"{in_flight_per_node:,} trajectories in flight per node / "
              f"rollout.trajectories_per_agent_worker={r.trajectories_per_agent_worker:,}")
    free = local_cpus_for_agent_workers(cfg)
    if free is not None and r.cpus_per_agent_worker > 0:
        fits = max(1, math.floor(free / (nodes * r.cpus_per_agent_worker) + 1e-9))
        if fits < per_node:
            reason += (f", capped from {per_node} at {fits}: the local cluster's "
                       f"{free:g} CPUs left by the other pools / rollout.cpus_per_agent_worker="
                       f"{r.cpus_per_agent_worker:g} per worker (raise cluster.local_num_cpus "
                       "or lower rollout.cpus_per_agent_worker for more)")
            per_node = fits
    return AgentWorkerCount(per_node * nodes, per_node, True, reason)
