"""What one training step consumes: a TrainBatch (trajectories, their advantages, the
policy version it trains at), and how it is split across data-parallel train ranks.

Shards are balanced by tokens, not by trajectory count: agent contexts range from
hundreds to tens of thousands of tokens, and a step takes as long as its heaviest shard.
Plain Python and numpy; no Ray, no torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from envs.types import Group, Trajectory

ZERO_VARIANCE_TOL = 1e-8  # rewards this close count as equal: such a group carries no signal


def is_zero_variance(rewards_G: Sequence[float] | np.ndarray) -> bool:
    """True when all rewards of a group are equal (within 1e-8): every GRPO advantage is
    0, so the group only costs compute (buffer.filter_zero_variance)."""
    r_G = np.asarray(rewards_G, dtype=np.float64)
    if r_G.ndim != 1 or r_G.size == 0:
        raise ValueError(f"rewards_G must be a non-empty 1-D array, got shape {r_G.shape}")
    return bool(r_G.max() - r_G.min() <= ZERO_VARIANCE_TOL)


def num_tokens(t: Trajectory) -> int:
    """Tokens one trajectory costs in the training forward pass (prompt + response)."""
    return len(t.prompt_ids) + len(t.response_ids)


@dataclass(frozen=True, slots=True)
class TrainBatch:
    """The trajectories of one step, one advantage each (same order), and the version the
    trainer is at when it trains on them (the staleness reference)."""

    trajectories: tuple[Trajectory, ...]
    advantages: np.ndarray  # float32, shape (len(trajectories),)
    version: int

    def __post_init__(self) -> None:
        adv = np.asarray(self.advantages, dtype=np.float32)
        if adv.shape != (len(self.trajectories),):
            raise ValueError(f"TrainBatch: {len(self.trajectories)} trajectories but advantages "
                             f"of shape {adv.shape}")
        object.__setattr__(self, "trajectories", tuple(self.trajectories))
        object.__setattr__(self, "advantages", adv)

    @classmethod
    def from_groups(cls, groups: Sequence[Group], advantages_per_group: Sequence[np.ndarray],
                    version: int) -> "TrainBatch":
        trajectories = tuple(t for g in groups for t in g.trajectories)
        advantages = np.concatenate([np.asarray(a, np.float32) for a in advantages_per_group])
        return cls(trajectories, advantages, version)

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def num_tokens(self) -> int:
        return sum(num_tokens(t) for t in self.trajectories)

    def shards(self, num_shards: int) -> list["TrainBatch"]:
        """`num_shards` batches whose token totals are as even as greedy placement makes
        them (longest first onto the lightest shard); each keeps its trajectories in batch
        order. Every shard gets at least one trajectory when there are enough."""
        return [TrainBatch(tuple(self.trajectories[i] for i in idx), self.advantages[idx],
                           self.version)
                for idx in balance_by_tokens([num_tokens(t) for t in self.trajectories],
                                             num_shards)]


def balance_by_tokens(lengths: Sequence[int], num_shards: int) -> list[np.ndarray]:
    """Indices of `lengths` split into `num_shards` parts with near-equal sums (LPT greedy:
    at most 4/3 of the optimal heaviest part), each part sorted."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    heap = [(0, s) for s in range(num_shards)]  # (tokens so far, shard)
    parts: list[list[int]] = [[] for _ in range(num_shards)]
    # Longest first; ties by index so the split is deterministic.
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, s = heapq.heappop(heap)
        parts[s].append(i)
        heapq.heappush(heap, (total + lengths[i], s))
    return [np.array(sorted(p), dtype=np.int64) for p in parts]


def shard_imbalance(parts: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Heaviest shard's tokens over the mean shard's (1.0 = perfectly even)."""
    totals = [sum(lengths[i] for i in p) for p in parts]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean else 1.0
