"""The `buffer` section of the recipe: the staleness bound, the failure policy and the
straggler policy. The trainer composes it into the one schema."""

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
    group_deadline_s: float = knob(0.0, "Seconds from a group's start within which all its "
                                   "samples should end; 0: no deadline. What happens to a "
                                   "group that misses it is buffer.straggler_policy.")
    straggler_policy: Literal["wait", "drop", "partial"] = knob(
        "wait", "A group past buffer.group_deadline_s: wait for it (only counted), drop it "
        "(its unfinished samples are cut at the deadline), or cut its unfinished samples and "
        "train the finished ones, the cut ones masked and outside the GRPO baseline, when at "
        "least buffer.min_group_size finished (else the group is dropped).")
    min_group_size: int = knob(2, "straggler_policy=partial: the fewest finished samples a "
                               "cut group is trained on (2 or more: a baseline needs two).")
