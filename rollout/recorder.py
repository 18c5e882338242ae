"""Builds one Trajectory turn by turn: appends generated ids (mask 1, with logprobs and
versions) and observation ids (mask 0), tracks the token budgets, and freezes the result
with exactly one termination reason. Ids that carry images (rollout.vision.PromptIds: the
first prompt, an observation with a screenshot) add them at their place in the context.

The recorder is owned by the agent context, not by the loop, so a trajectory that times
out or raises still yields everything it produced up to that point.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from rollout.engine import TokenOutput
from envs.types import NO_VERSION, TerminationReason, Timings, Trajectory, TrajectoryImage, Turn
from rollout.vision import images_of, shift_images


@dataclass(frozen=True, slots=True)
class Budgets:
    max_context_tokens: int  # prompt + response
    max_response_tokens: int  # response only (model + observation tokens)
    max_new_tokens_per_turn: int


class BudgetExhausted(Exception):
    """A generate call with no room left: the trajectory ends with `reason` (context_full or
    max_tokens), not as an error. Raised by AgentContext.generate for loops that do not check
    `generation_stop()` first; the worker finishes the trajectory with the reason."""

    def __init__(self, reason: TerminationReason) -> None:
        super().__init__(f"no room for another generation ({reason.value})")
        self.reason = reason


class TrajectoryRecorder:
    """Appends to one trajectory. Chunks are numpy arrays; the running context is cached
    so each turn costs one concatenation of the new chunk, not of the whole history."""

    def __init__(self, task_id: str, group_id: str, index: int, prompt_ids: Sequence[int] | np.ndarray,
                 budgets: Budgets) -> None:
        self.task_id, self.group_id, self.index = task_id, group_id, index
        self.budgets = budgets
        self.prompt_ids = np.asarray(prompt_ids, dtype=np.int32)
        # The context's images, starts in context positions (what each request sends along).
        self.images: list[TrajectoryImage] = list(images_of(prompt_ids))
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._logprobs: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []
        self._context = self.prompt_ids
        # The weight version whose KV each context position has in the engine's prefix
        # cache, as far as this trajectory knows (NO_VERSION: not computed yet): what
        # Turn.stale_kv_tokens is counted against.
        self._kv_versions = np.full(len(self.prompt_ids), NO_VERSION, np.int32)
        self.turns: list[Turn] = []
        self.timings = {"generate_s": 0.0, "tool_s": 0.0, "queue_s": 0.0}
        self._start = time.monotonic()
        self.result: Trajectory | None = None
        self.sent_prefix_lengths: list[int] = []  # length of each prompt sent (continuity checks)

    @property
    def num_response_tokens(self) -> int:
        return len(self._context) - len(self.prompt_ids)

    @property
    def context_ids(self) -> np.ndarray:
        """Everything so far: what the next generate call sends."""
        return self._context

    def generation_at(self, position: int) -> tuple[np.ndarray, Turn] | None:
        """The generation (one turn's sampled ids) that covers context position `position`,
        with its turn; None where the position is prompt or observation."""
        start, k = len(self.prompt_ids), 0
        for ids, mask in zip(self._ids, self._mask):
            if start <= position < start + len(ids):
                return (ids, self.turns[k]) if mask[0] == 1 else None
            start += len(ids)
            k += int(mask[0] == 1)
        return None

    def room_for_generation(self) -> int:
        """Most tokens the next turn may generate within all three budgets."""
        b = self.budgets
        return min(b.max_new_tokens_per_turn, b.max_response_tokens - self.num_response_tokens,
                   b.max_context_tokens - len(self._context))

    def generation_stop(self) -> TerminationReason | None:
        """None while another turn may generate; otherwise why the trajectory must end:
        context_full when the context is full, else max_tokens (a response budget)."""
        if self.room_for_generation() > 0:
            return None
        if self.budgets.max_context_tokens - len(self._context) <= 0:
            return TerminationReason.CONTEXT_FULL
        return TerminationReason.MAX_TOKENS

    def _append(self, ids: np.ndarray, mask: int, logprobs: np.ndarray | None,
                versions: np.ndarray | None) -> None:
        n = len(ids)
        self._ids.append(ids.astype(np.int32, copy=False))
        self._mask.append(np.full(n, mask, dtype=np.int8))
        self._logprobs.append(logprobs if logprobs is not None else np.zeros(n, np.float32))
        self._versions.append(versions if versions is not None else np.full(n, NO_VERSION, np.int32))
        self._context = np.concatenate([self._context, self._ids[-1]])
        # A sampled token's KV is computed by the version that sampled it; an observation's
        # not until the next prefill.
        self._kv_versions = np.concatenate([self._kv_versions, self._versions[-1]])

    def add_generation(self, out: TokenOutput, queue_s: float, generate_s: float,
                       engine: str = "", started_at: float = 0.0) -> None:
        self.sent_prefix_lengths.append(len(self._context))
        start = self.num_response_tokens
        version = int(out.versions[0]) if len(out.versions) else NO_VERSION
        stale = self._track_kv(out, version)
        self._append(out.token_ids, 1, out.logprobs, out.versions)
        self.timings["queue_s"] += queue_s
        self.timings["generate_s"] += generate_s
        self.turns.append(Turn(index=len(self.turns), prompt_tokens=out.num_prompt_tokens,
                               response_start=start, num_generated=len(out.token_ids),
                               num_observation=0, finish_reason=out.finish_reason,
                               version=version, cached_prompt_tokens=out.cached_prompt_tokens,
                               generate_s=generate_s, queue_s=queue_s, engine=engine,
                               started_at=started_at, stale_kv_tokens=stale))

    def _track_kv(self, out: TokenOutput, version: int) -> int:
        """Prompt tokens of this generation served from KV of an older version than the
        one that generated it (its prefill ran at `version`: weights change only between
        requests' steps while paused); then what the cache holds after it. A cache salted
        by version serves nothing stale. Otherwise positions this trajectory never had
        computed (a group's shared prompt, cached by a sibling) count as current (a lower
        bound), and ones it had count as it computed them, even if a sibling recomputed
        them since (an upper bound there)."""
        if version == NO_VERSION:  # nothing generated: nothing known about the prefill
            return 0
        kv = self._kv_versions  # the prompt sent: the whole context so far
        cached = min(out.cached_prompt_tokens, len(kv))
        if out.cache_salted:  # whoever computed the cached blocks did so under this version
            kv[:cached] = version
        head = kv[:cached]
        stale = int(np.count_nonzero((head != NO_VERSION) & (head < version)))
        kv[cached:] = version  # the rest of the prompt was prefilled now
        return stale

    def record_tool_parse(self, status: str) -> None:
        """What the tool parser made of the last generation (a ParseStatus), for the
        `rollout/tool_parse/*` counts."""
        if not self.turns:
            raise RuntimeError("a parse status must follow a generation")
        self.turns[-1] = replace(self.turns[-1], tool_parse_status=status)

    def fits_observation(self, num_tokens: int) -> TerminationReason | None:
        """None if `num_tokens` more fit; otherwise the reason the trajectory must end."""
        if len(self._context) + num_tokens >= self.budgets.max_context_tokens:
            return TerminationReason.CONTEXT_FULL  # the engine could not take the next prompt
        if self.num_response_tokens + num_tokens >= self.budgets.max_response_tokens:
            return TerminationReason.MAX_TOKENS
        return None

    def add_observation(self, ids: list[int] | np.ndarray, num_tool_calls: int,
                        num_tool_errors: int, tool_s: float, num_tool_timeouts: int = 0, *,
                        tools: Sequence[str] = (), failed_tools: Sequence[str] = ()) -> None:
        """Tool results and template glue after the last generation (mask 0); `tools` and
        `failed_tools` name the tool of each call and of each failed one (metrics per tool)."""
        if not self.turns:
            raise RuntimeError("an observation must follow a generation")
        arr = np.asarray(ids, dtype=np.int32)
        self.images.extend(shift_images(images_of(ids), len(self._context)))
        self._append(arr, 0, None, None)
        self.timings["tool_s"] += tool_s
        last = self.turns[-1]
        self.turns[-1] = replace(
            last, num_observation=len(arr), num_tool_calls=num_tool_calls,
            num_tool_errors=num_tool_errors, tool_s=tool_s, num_tool_timeouts=num_tool_timeouts,
            tool_names=tuple(tools), failed_tool_names=tuple(failed_tools))

    def finish(self, reason: TerminationReason, detail: str = "") -> Trajectory:
        """Freeze what was recorded into a Trajectory ending with `reason`."""
        concat = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
        self.result = Trajectory(
            task_id=self.task_id, group_id=self.group_id, index=self.index,
            prompt_ids=self.prompt_ids, response_ids=concat(self._ids, np.int32),
            response_mask=concat(self._mask, np.int8), logprobs=concat(self._logprobs, np.float32),
            versions=concat(self._versions, np.int32), termination=reason,
            turns=tuple(self.turns), termination_detail=detail, images=tuple(self.images),
            timings=Timings(total_s=time.monotonic() - self._start, **self.timings))
        return self.result
