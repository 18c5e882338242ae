"""The warm-start plug-in point (`model.warm_start`): a callable run once before RL that
turns the base model folder into the folder training starts from, e.g. after a short
supervised pass. The trainer ships no built-in: warm starts are task-specific, so each
lives with its tasks and is named by import string (the quickstart's is
`launch.quickstart:toy_warm_start`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from envs.plugins import PluginPoint, signature_problem

if TYPE_CHECKING:
    from trainer.run.config import SluiceConfig

WARM_STARTS = PluginPoint("warm start", "model.warm_start", {})


class WarmStart(Protocol):
    def __call__(self, base_model_dir: Path, cfg: SluiceConfig) -> str | Path: ...


def load_warm_start(name: str) -> WarmStart:
    """The callable `name` names, checked against the contract without running it (also the
    start-up check); ValueError says what to change."""
    fn = WARM_STARTS.resolve(name)
    if not callable(fn):
        raise ValueError(f"warm start {name!r} is not callable; name a function "
                         "(base_model_dir, cfg) -> model_dir")
    problem = signature_problem(fn, ("base_model_dir", "cfg"))
    if problem:
        raise ValueError(f"warm start {name!r}{problem}")
    return fn  # type: ignore[return-value]  # checked just above
