"""What the train side reports to the controller: a step's metrics and how a weight push
went. Made by `trainer.train.train_actor.RayTrainer` (and the simulator's stand-in);
light on purpose, so the controller's seams import it without Ray or torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TrainOutcome:
    """What one training step reports back: its metrics (loss/*, perf/*), already flat."""

    metrics: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class PushOutcome:
    """How a verified weight push went: the engines that failed during it (dropped from
    routing; the others serve the version) and how many sends it took."""

    failed_engines: tuple[str, ...] = ()
    attempts: int = 1
