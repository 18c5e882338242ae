"""How many mutation sentinels a task needs, and what they cost (run by hand):

    python tests/bench/bench_mutation_sentinels.py [--reps 3] [--trials 200000]

1. False accept of a selective bypass: a task has N real tests, F of which fail on the
   attacker's code; the grader plants M mutation sentinels (reward.grading.sentinels)
   that the attacker cannot tell from real tests; it bypasses some tests (makes them
   pass: a swapped body, a forged report) and is accepted only if every failing real
   test is bypassed and no sentinel is. Three attackers, analytically (hypergeometric)
   and by simulation:
   - blind: bypasses a random subset of b of the N + M tests, the best b for it:
     max_b C(N-F, b-F) / C(N+M, b);
   - failure-aware: runs each test first, so it knows the F + M failing ones (every
     sentinel fails) and bypasses F of them at random: 1 / C(F+M, F);
   - group-aware: also pairs each copy with its original (same calls, one literal
     apart) and guesses which of a group of k+1 is real: (1/(k+1))^F when each failing
     test has k copies (the grader's names and values leave it nothing better).
   The table gives the smallest M that keeps each below 1e-3.
2. Grading time per trajectory on bundled code tasks (local backend, gold patch): the
   constant sentinels of before (MUTANTS_PER_TASK = 0) against the default.
Prints tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from math import comb
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "integration"),
                str(Path(__file__).resolve().parents[1])]

TARGET = 1e-3


def blind(n: int, f: int, m: int) -> float:
    return max(comb(n - f, b - f) / comb(n + m, b) for b in range(f, n + 1))


def failure_aware(f: int, m: int) -> float:
    return 1 / comb(f + m, f)


def group_aware(f: int, k: int) -> float:
    return (1 / (k + 1)) ** f


def simulate_blind(n: int, f: int, m: int, trials: int, rng: random.Random) -> float:
    b = max(range(f, n + 1), key=lambda b: comb(n - f, b - f) / comb(n + m, b))
    tests = list(range(n + m))  # 0..f-1 failing real, f..n-1 passing real, n.. sentinels
    accepted = 0
    for _ in range(trials):
        chosen = set(rng.sample(tests, b))
        accepted += all(i in chosen for i in range(f)) and not any(i >= n for i in chosen)
    return accepted / trials


def simulate_failure_aware(f: int, m: int, trials: int, rng: random.Random) -> float:
    failing = list(range(f + m))  # 0..f-1 real
    return sum(set(rng.sample(failing, f)) == set(range(f)) for _ in range(trials)) / trials


def smallest(rate, limit: int = 4000) -> int | str:
    return next((m for m in range(limit) if rate(m) < TARGET), f">{limit}")


def false_accept_tables(trials: int) -> None:
    rng = random.Random(0)
    print(f"false accept, analytic vs simulated ({trials} trials)")
    print(f"{'N':>3} {'F':>3} {'M':>3} | {'blind':>10} {'sim':>10} | {'fail-aware':>10} {'sim':>10}")
    for n, f, m in ((5, 5, 4), (5, 5, 8), (5, 3, 8), (5, 1, 8), (10, 2, 8), (30, 1, 8)):
        print(f"{n:>3} {f:>3} {m:>3} | {blind(n, f, m):>10.2e} "
              f"{simulate_blind(n, f, m, trials, rng):>10.2e} | {failure_aware(f, m):>10.2e} "
              f"{simulate_failure_aware(f, m, trials, rng):>10.2e}")
    print(f"\nsmallest M with false accept < {TARGET:g}")
    print(f"{'N':>3} {'F':>3} | {'blind':>6} {'fail-aware':>10} | group-aware at k=1,2,4")
    for n in (5, 10, 30):
        for f in sorted({1, 2, n // 2, n}):
            print(f"{n:>3} {f:>3} | {smallest(lambda m: blind(n, f, m)):>6} "
                  f"{smallest(lambda m: failure_aware(f, m)):>10} | "
                  + "  ".join(f"{group_aware(f, k):.1e}" for k in (1, 2, 4)))


async def grading_times(reps: int) -> None:
    import reward.grading.prepare as prepare
    from envs.tasks import load_tasks
    from envs.tasks.code import spec_by_name
    from grading_tasks import sandbox_factory
    from reward.base import RewardContext
    from reward.grading.hidden_tests import HiddenTests, score_run
    from reward.grading.sentinels import MUTANTS_PER_TASK
    from reward.workspace import WorkspaceChanges

    names = ("run_length_encode", "balanced_brackets", "primes_up_to", "lru_cache",
             "edit_distance")
    tasks = [t for t in load_tasks("code_functions") if t.id.split("/")[-1] in names]
    print(f"\ngrading time per trajectory (local backend, gold patch, median of {reps}, s):"
          " whole grading / the tests' run; sentinels planted")
    print(f"{'task':<18} {'before':>13} {'sent.':>5} | {'after':>13} {'sent.':>5}")
    totals: dict[int, list[float]] = {0: [], MUTANTS_PER_TASK: []}
    for task in tasks:
        spec = spec_by_name(task.id)
        gold = WorkspaceChanges(written={spec.module: spec.reference.encode()})
        cells = []
        for count in (0, MUTANTS_PER_TASK):
            prepare.MUTANTS_PER_TASK = count
            walls, tests, planted = [], [], 0
            for _ in range(reps):
                ctx = RewardContext(workspace=gold, create_sandbox=sandbox_factory("local"),
                                    timeout_s=120)
                start = time.monotonic()
                run = await HiddenTests().grade(task, gold, ctx)
                walls.append(time.monotonic() - start)
                tests.append(run.tests_s)
                planted = len(run.layout.sentinels)
                result = score_run(task, run, partial_credit=False)
                assert result.reward == 1.0, result.detail
            totals[count].append(statistics.median(walls))
            cells.append(f"{statistics.median(walls):>6.2f}/{statistics.median(tests):<6.2f} "
                         f"{planted:>5}")
        prepare.MUTANTS_PER_TASK = MUTANTS_PER_TASK
        print(f"{task.id.split('/')[-1]:<18} {cells[0]} | {cells[1]}")
    before, after = (statistics.mean(totals[c]) for c in (0, MUTANTS_PER_TASK))
    print(f"{'mean':<18} {before:>6.2f}{'':>13} | {after:>6.2f}   "
          f"(+{after - before:.2f} s per trajectory)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--trials", type=int, default=200_000)
    parser.add_argument("--no-grading", action="store_true")
    args = parser.parse_args()
    false_accept_tables(args.trials)
    if not args.no_grading:
        asyncio.run(grading_times(args.reps))


if __name__ == "__main__":
    main()
