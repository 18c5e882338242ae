"""The `buffer` section of the recipe: the staleness bound and the failure policy. The
trainer composes it into the one schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from envs.knobs import knob


@dataclass(frozen=True, slots=True)
class BufferConfig:
    max_staleness: int = knob(1, "Eta: a group trains at most this many policy versions after "
                              "its oldest token was generated; also bounds admission.")
    failure_policy: Literal["mask", "drop", "resubmit"] = knob(
        "mask", "Groups with error/timeout trajectories: mask those trajectories, drop the "
        "group, or resubmit the task.")
    max_repeated_failures: int = knob(16, "Stop the run (with a checkpoint) when this many "
                                      "groups in a row fail with the same error, or 3x this "
                                      "many with any error: a broken plug-in or task never loops.")
    max_resubmits: int = knob(2, "Resubmissions of one task before its group is dropped.")
    filter_zero_variance: bool = knob(False, "Drop groups whose rewards are all equal (no "
                                      "GRPO signal).")
