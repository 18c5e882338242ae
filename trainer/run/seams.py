"""The controller's two seams: what it needs of the rollout side and of the trainer side.

The controller is plain asyncio against these Protocols; they live beside it, the
consumer, not beside either implementation. The Ray adapters live in the thin shells
(`rollout.worker_actor.RayRollout`, `trainer.train.train_actor.RayTrainer`); the unit
tests use in-process stand-ins, and the simulator (launch) plugs simulated parts in here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from buffer.batch import TrainBatch
from envs.types import Group, Task
from rollout.engine import EngineStats
from rollout.worker import WorkerStats
from trainer.train.outcomes import PushOutcome, TrainOutcome


class RolloutSide(Protocol):
    """Agent-loop workers (they run and score groups) and the engines behind them."""

    async def run_group(self, task: Task, group_id: str, group_size: int,
                        deadline_s: float | None = None) -> Group:
        """G trajectories of `task`, scored on the worker that ran them. Raises if the
        group cannot be run at all (a broken task, a lost worker); cancellable. With
        `deadline_s`, samples still running that long after the call are cut and come back
        as unscored `deadline` trajectories (rollout.deadline)."""
        ...

    async def close_gates(self) -> None:
        """Returns once no turn is generating anywhere; new turns wait."""
        ...

    async def open_gates(self) -> None: ...

    async def worker_stats(self) -> Sequence[WorkerStats]: ...

    async def engine_stats(self) -> Mapping[str, EngineStats]: ...


class TrainerSide(Protocol):
    """The train ranks, and the path from them to the engines."""

    async def train(self, batch: TrainBatch) -> TrainOutcome: ...

    async def prepare_weights(self, version: int) -> None:
        """Get the current weights ready to send (gather, encode) while rollout goes on."""
        ...

    async def push_weights(self, version: int) -> PushOutcome:
        """Make the engines serve `version` (the weights prepared for it), verified. An
        engine that fails during the push is dropped and named in the outcome; raises if
        none is left. Called with the turn gates closed."""
        ...

    def save_state(self, folder: Path) -> None:
        """Blocking (called from a thread): write the trainer's state (trainer.run.checkpoint)."""
        ...

    def load_state(self, folder: Path) -> None: ...
