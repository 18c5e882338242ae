"""Bench: how evenly one training step's tokens spread over the train ranks, splitting by
trajectory count (contiguous equal-count shards, what TrainGroup did before) versus by
tokens (buffer.batch.balance_by_tokens). A step takes as long as its heaviest shard, so
the imbalance (heaviest shard / mean shard) is the step-time overhead of the split.

Length mix: agent trajectories whose context is log-normal between a few hundred and
~49k tokens (the seed's SWE workload: median ~8k, a long tail to the context limit),
grouped G per task with task-level correlation (one task's trajectories are alike).

    python tests/bench/bench_shard_balance.py [--trials 20]
"""

from __future__ import annotations

import argparse
import platform

import numpy as np

from buffer.batch import balance_by_tokens, shard_imbalance

LAYOUTS = [  # (name, groups_per_step B, group_size G, train ranks)
    ("swe_grpo (500x8 on 16 ranks)", 500, 8, 16),
    ("64x8 on 8 ranks", 64, 8, 8),
    ("16x8 on 8 ranks", 16, 8, 8),
    ("quickstart-like 4x8 on 2 ranks", 4, 8, 2),
]


def sample_lengths(rng: np.random.Generator, groups: int, group_size: int) -> list[int]:
    task_scale = rng.lognormal(np.log(8000), 0.8, size=groups)  # per task: hard tasks run long
    lengths = task_scale[:, None] * rng.lognormal(0.0, 0.5, size=(groups, group_size))
    return np.clip(lengths, 300, 49_152).astype(int).ravel().tolist()


def by_count(n: int, ranks: int) -> list[np.ndarray]:
    return np.array_split(np.arange(n), ranks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    print(f"machine: {platform.node()} | {platform.machine()} | python {platform.python_version()}")
    print(f"command: python tests/bench/bench_shard_balance.py --trials {args.trials}")
    print("imbalance = heaviest shard tokens / mean shard tokens (1.00 = even); "
          f"mean and worst over {args.trials} sampled batches\n")
    print(f"| layout | by count: mean | by count: worst | by tokens: mean | by tokens: worst |")
    print("|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for name, groups, group_size, ranks in LAYOUTS:
        count, token = [], []
        for _ in range(args.trials):
            lengths = sample_lengths(rng, groups, group_size)
            count.append(shard_imbalance(by_count(len(lengths), ranks), lengths))
            token.append(shard_imbalance(balance_by_tokens(lengths, ranks), lengths))
        print(f"| {name} | {np.mean(count):.3f} | {max(count):.3f} | {np.mean(token):.3f} | "
              f"{max(token):.3f} |")


if __name__ == "__main__":
    main()
