"""Virtual-clock simulator: `python -m launch.simulate recipe=NAME.yaml [section.key=value ...]
[--profile FILE.yaml] [plan.key=value ...] --mode sync|async [--steps N] [--tail none|seed]
[--sandboxes stateful|releasable] [--token-unit N] [--seed N] [--worker model|real]
[--push-latency-s S] [--double-in-flight] [--json] [--trace FILE]`.

Runs the real `Controller` and `ReplayBuffer` (admission bound, staleness, accounting),
the real `Router` (sticky, least-loaded first turn; or by KV residency, from the engine
models' block events, with rollout.routing=residency) and `TurnGate` (pushes at turn
boundaries) on an asyncio loop whose clock fast-forwards (looptime), against simulated
engines (launch.sim.engine_model: HBM-bound decode, FLOP-bound prefill, KV pool with an LRU
prefix cache), sandboxes (launch.sim.sandbox_model: heavy-tailed exec times, a fixed pool
with queueing) and trainer (launch.sim.trainer_model: the planner's step formula, push
bytes over bandwidth). The workload is the planner's profile (launch.plan_profile: a
`--profile` file and `plan.*` arguments), whose accounts are printed beside the simulator's.

Trajectories: by default coroutines of `launch.sim.sides` that go through the router and
gate but skip tokenisation, tool parsing and reward functions (seed scale in minutes);
`--worker real` runs the real `AgentLoopWorker` and agent loop instead, with the engine
model and the sandbox pool model behind its seams (launch.sim.agent_side): real token ids,
chat template, tool parser, bash tool and rule reward, for small workloads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from envs.types import Group, Message, Task
from launch.plan import (build_plan, compute_account, compute_sandbox_nodes, load_recipe_and_profile,
                         take_profile_flag)
from launch.plan_profile import PlanProfile
from launch.sim.engine_client import SimEngine, SimWorld
from launch.sim.engine_model import EngineModel, build_engine_spec
from launch.sim.sandbox_model import ExecTimeModel, SandboxPoolModel, seed_tail
from launch.sim.sides import SimRollout, SimRouting, SimSandboxes, SimTrainer, TrajectoryProfile
from launch.sim.trainer_model import TrainerModel
from trainer.run.config import SluiceConfig

USAGE = __doc__.split("\n\n")[0]


@dataclass(frozen=True, slots=True)
class SimOptions:
    mode: str = "async"
    steps: int = 3
    tail: str = "none"  # none: every exec takes the profile's exec_s; seed: the seed's long tail
    sandboxes: str = "stateful"
    token_unit: int = 100  # real tokens per id kept by the simulated agent loop
    seed: int = 0
    restore_s: float = 0.5  # snapshot restore per grant of a releasable sandbox
    push_bytes_per_s: float = 50e9  # weight push bandwidth (NCCL broadcast)
    push_latency_s: float = 1.0  # pause, checksum, resume (--push-latency-s: a measured push)
    double_in_flight: bool = False  # CLI: also run with twice the trajectories in flight
    worker: str = "model"  # model: launch.sim.sides' trajectories; real: the AgentLoopWorker


@dataclass(frozen=True, slots=True)
class SimReport:
    mode: str
    tail: str
    steps: int
    step_s: tuple[float, ...]  # virtual seconds of each step (push to push)
    mean_step_s: float  # over the steps after the first (the pipeline is full)
    trainer_idle_ratio: float
    rollout_idle_ratio: float  # engine time neither prefilling nor decoding
    staleness_mean: float
    staleness_max: int
    prefix_cache_hit_rate: float  # hit tokens / prompt tokens, as vLLM counts them
    tier_hit_rate: float  # of the prompt tokens, those loaded from the offload tier
    # Loading them, per engine: the transfer channel's time, beside the engine's (not in prefill).
    tier_load_s_per_step: float
    prefill_s_per_step: float  # per engine, as the planner's prefill_*_s
    decode_s_per_step: float
    sandboxes_peak: int
    sandboxes_mean: float
    sandbox_wait_mean_s: float
    sandbox_wait_max_s: float
    trajectory_wall_mean_s: float
    trajectory_wall_max_s: float
    turns: int
    trajectories_trained: int
    admitted: int  # groups
    dropped: dict[str, int]
    running: int  # groups in flight when the run ended
    buffered: int  # terminal groups not trained when the run ended
    end_reasons: dict[str, int]
    # buffer/deadline_* totals at the end (buffer.group_deadline_s): late groups, cut
    # samples, partial groups, and the cuts by turns and length reached (the length bias)
    deadline: dict[str, float]
    failed_cache_resets: int
    logged_step_s: tuple[float, ...]  # the controller's own timing/step_s (virtual clock)
    logged_trainer_idle_ratio: tuple[float, ...]  # its perf/trainer_idle_ratio per step
    virtual_s: float
    wall_s: float


def build_exec_model(cfg: SluiceConfig, exec_s: float, turns: int, tail: str) -> ExecTimeModel:
    if tail == "none":
        return ExecTimeModel(mean_s=exec_s, sigma=0.0, timeout_s=float("inf"))
    if tail == "seed":  # the seed's long-tail table, cut at the recipe's tool timeout
        return seed_tail(exec_s, turns, cfg.agent.tool_timeout_s)
    raise ValueError(f"--tail {tail!r}: use none or seed")


class _Collect:
    """A metrics sink that keeps the controller's per-step metrics."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.rows.append({"step": step, **metrics})

    def close(self) -> None:
        return None


async def simulate(cfg: SluiceConfig, profile: PlanProfile, opts: SimOptions,
                   events_path: Path | None = None) -> tuple[SimReport, list[dict]]:
    """One simulated run of `opts.steps` steps; the report and the per-turn trace. With
    `events_path`, the controller also writes the run report's events.jsonl schema there
    (virtual-clock timestamps), which `python -m launch.report --trace` draws."""
    from trainer.run.controller import Controller  # deferred: torch
    from trainer.run.metrics import EventSink, MetricsLogger

    plan = build_plan(cfg, profile)
    p = plan.inputs
    loop = asyncio.get_running_loop()
    world = SimWorld(opts.token_unit)
    spec = build_engine_spec(plan, max_num_seqs=cfg.rollout.max_num_seqs)
    residency = cfg.rollout.routing == "residency" and opts.worker != "real"
    engines = {f"engine{i}": SimEngine(EngineModel(spec, record_blocks=residency), world,
                                       cfg.rollout.kv_after_push, kv_events=residency)
               for i in range(cfg.rollout.num_engines)}
    pool = SandboxPoolModel(cfg.envs.num_sandbox_workers * cfg.envs.sandboxes_per_worker,
                            restore_s=opts.restore_s)
    exec_model = build_exec_model(cfg, p.exec_s, p.turns, opts.tail)
    if opts.worker == "real":  # the real AgentLoopWorker and agent loop, real token ids
        from launch.sim.agent_side import build_agent_rollout

        rollout, tasks = build_agent_rollout(cfg, plan, spec, SimSandboxes(pool), exec_model,
                                             opts.seed)
        engines = rollout.engines
    else:
        trajectory = TrajectoryProfile(p.turns, p.prompt_tokens, p.gen_tokens, p.obs_tokens,
                                       opts.token_unit)
        rollout = SimRollout(profile=trajectory, engines=engines, world=world,
                             sandboxes=SimSandboxes(pool), exec_model=exec_model,
                             releasable=opts.sandboxes == "releasable",
                             trajectory_timeout_s=cfg.agent.trajectory_timeout_s, seed=opts.seed,
                             routing=SimRouting(residency, cfg.rollout.load_poll_s,
                                                cfg.rollout.residency_load_penalty_tokens))
        tasks = [Task(id=f"task{i}", messages=(Message(role="user", content=f"task {i}"),))
                 for i in range(cfg.train.groups_per_step * 4)]
    trainer = SimTrainer(TrainerModel.from_plan(plan, opts.push_bytes_per_s, opts.push_latency_s),
                         engines, opts.token_unit)
    sink = _Collect()
    events = None
    if events_path is not None:
        events_path.unlink(missing_ok=True)
        events = EventSink(events_path, cfg.logging.max_turn_events_per_step)
    controller = Controller(cfg, tasks=tasks, rollout=rollout, trainer=trainer,
                            logger=MetricsLogger([sink]), events=events, wall_clock=loop.time,
                            clock=loop.time)
    staleness: list[int] = []

    def on_batch(groups: list[Group], version: int) -> None:
        staleness.extend(version - t.oldest_version for g in groups for t in g.trajectories
                         if t.oldest_version is not None)

    wall = time.monotonic()
    try:
        summary = await controller.run(on_batch=on_batch)
    finally:
        rollout.close()
    end_s = loop.time()
    return _report(cfg, opts, rollout, trainer, pool, engines, staleness, summary, sink.rows,
                   end_s, time.monotonic() - wall), rollout.trace


def _report(cfg, opts, rollout, trainer, pool, engines, staleness, summary, rows, end_s,
            wall_s) -> SimReport:
    steps = trainer.steps
    ends = [s.push_end_s for s in steps]
    step_s = tuple(b - a for a, b in zip([0.0] + ends[:-1], ends))
    busy = sum(s.push_end_s - s.train_start_s for s in steps)
    stats = [e.model.stats() for e in engines.values()]
    engine_busy = [s.prefill_busy_s + s.decode_busy_s for s in stats]
    queries = sum(s.prefix_cache_queries for s in stats)
    durations = rollout.trajectory_walls() or [0.0]
    n = max(len(steps), 1)
    pool_stats = pool.stats(end_s)
    return SimReport(
        mode=opts.mode, tail=opts.tail, steps=len(steps), step_s=step_s,
        mean_step_s=sum(step_s[1:]) / (len(step_s) - 1) if len(step_s) > 1 else
        (step_s[0] if step_s else 0.0),
        trainer_idle_ratio=1 - busy / end_s if end_s else 0.0,
        rollout_idle_ratio=1 - sum(engine_busy) / (len(stats) * end_s) if end_s else 0.0,
        staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
        staleness_max=max(staleness, default=0),
        prefix_cache_hit_rate=sum(s.prefix_cache_hits for s in stats) / queries if queries else 0.0,
        tier_hit_rate=sum(s.tier_hits for s in stats) / queries if queries else 0.0,
        tier_load_s_per_step=sum(s.tier_load_s for s in stats) / len(stats) / n,
        prefill_s_per_step=sum(s.prefill_busy_s for s in stats) / len(stats) / n,
        decode_s_per_step=sum(s.decode_busy_s for s in stats) / len(stats) / n,
        sandboxes_peak=pool_stats.peak_in_use, sandboxes_mean=pool_stats.mean_in_use,
        sandbox_wait_mean_s=pool_stats.mean_wait_s, sandbox_wait_max_s=pool_stats.max_wait_s,
        trajectory_wall_mean_s=sum(durations) / len(durations),
        trajectory_wall_max_s=max(durations), turns=rollout.num_turns,
        trajectories_trained=summary.trained * cfg.train.group_size, admitted=summary.admitted,
        dropped=dict(summary.dropped), running=summary.running, buffered=summary.buffered,
        end_reasons=dict(rollout.end_reasons), deadline=deadline_totals(rows),
        failed_cache_resets=sum(e.num_failed_resets for e in engines.values()),
        logged_step_s=tuple(r["timing/step_s"] for r in rows if "timing/step_s" in r),
        logged_trainer_idle_ratio=tuple(r["perf/trainer_idle_ratio"] for r in rows
                                        if "perf/trainer_idle_ratio" in r),
        virtual_s=end_s, wall_s=wall_s)


def deadline_totals(rows: list[dict]) -> dict[str, float]:
    """The buffer/deadline_* totals of the last metrics row that has them, by their names
    after the prefix (empty without a group deadline)."""
    prefix = "buffer/deadline_"
    last = next((r for r in reversed(rows) if any(k.startswith(prefix) for k in r)), {})
    return {k.removeprefix(prefix): float(v) for k, v in last.items() if k.startswith(prefix)}


def run_simulation(cfg: SluiceConfig, profile: PlanProfile, opts: SimOptions,
                   events_path: Path | None = None) -> tuple[SimReport, list[dict]]:
    """`simulate` on a fresh virtual-clock loop starting at 0."""
    import looptime  # deferred: only the simulator fast-forwards time

    loop = looptime.new_event_loop(start=0.0, noop_cycles=2)
    try:
        return loop.run_until_complete(simulate(cfg, profile, opts, events_path))
    finally:
        loop.close()


def format_report(cfg: SluiceConfig, profile: PlanProfile, r: SimReport) -> str:
    plan = build_plan(cfg, profile)
    a = compute_account(plan.inputs)
    rows = [("step wall clock (s)", f"{r.mean_step_s:,.0f}", f"window {plan.inputs.window_s:,.0f}"),
            ("trajectory wall, mean / max (s)", f"{r.trajectory_wall_mean_s:,.0f} / "
             f"{r.trajectory_wall_max_s:,.0f}", f"{a.trajectory_wall_s:,.0f}"),
            ("decode per step (s)", f"{r.decode_s_per_step:,.0f}", f"{a.decode_s:,.0f}"),
            ("prefill per step (s)", f"{r.prefill_s_per_step:,.0f}",
             f"{a.prefill_expected_s:,.0f} ({a.prefill_cached_s:,.0f}-{a.prefill_uncached_s:,.0f})"),
            # Async rollouts run ahead of training (up to max_staleness steps), so a short run
            # does more turns than it trains: per step's worth of turns compares with the account.
            ("turns run, in steps' worth", f"{r.turns / max(a.executions, 1):,.2f}",
             f"{a.executions:,} turns a step"),
            ("prefill per step's worth of turns (s)",
             f"{r.prefill_s_per_step * r.steps * a.executions / max(r.turns, 1):,.0f}",
             f"all-hit {a.prefill_cached_s:,.0f}"),
            ("prefix-cache hit rate / KV resident", f"{r.prefix_cache_hit_rate:.1%}",
             f"{a.kv_resident_fraction:.1%}"),
            ("  of which from the offload tier", f"{r.tier_hit_rate:.1%}, {r.tier_load_s_per_step:,.0f} s",
             f"tier {plan.kv_offload_gb_per_engine:g} GB/engine" if plan.kv_offload_tier != "none"
             else "no tier"),
            ("sandboxes mean / peak", f"{r.sandboxes_mean:,.0f} / {r.sandboxes_peak:,}",
             f"{a.sandboxes_stateful:,.0f} stateful / {a.sandboxes_releasable:,.0f} releasable"),
            ("sandbox nodes at the peak", f"{compute_sandbox_nodes(r.sandboxes_peak, plan.node):,}",
             ""),
            ("training step (s)", "", f"{a.train_s:,.0f}")]
    lines = [f"simulated {r.steps} steps, mode={r.mode}, tail={r.tail}: {r.turns:,} turns, "
             f"{r.virtual_s:,.0f} virtual s in {r.wall_s:.1f} s of wall clock",
             f"  {'':<36}{'simulator':>20}  planner"]
    lines += [f"  {k:<36}{v:>20}  {w}" for k, v, w in rows]
    lines += [f"  step times (s): {', '.join(f'{s:,.0f}' for s in r.step_s)}",
              f"  trainer idle {r.trainer_idle_ratio:.0%}, rollout (engine) idle "
              f"{r.rollout_idle_ratio:.0%}; staleness mean {r.staleness_mean:.2f}, max "
              f"{r.staleness_max}; sandbox wait mean {r.sandbox_wait_mean_s:.1f} s, max "
              f"{r.sandbox_wait_max_s:.0f} s",
              f"  admitted {r.admitted} groups, trained {r.trajectories_trained} trajectories, "
              f"dropped {r.dropped or 'none'}, ends {r.end_reasons}"]
    if r.deadline:
        lines.append(f"  group deadline: {', '.join(f'{k} {v:g}' for k, v in sorted(r.deadline.items()))}")
    return "\n".join(lines)


def double_in_flight(cfg: SluiceConfig) -> SluiceConfig:
    """The seed's practice experiment: twice the trajectories in flight on the same GPUs
    (twice the groups per step, and sandboxes for them so they are not the limit)."""
    t, e = cfg.train, cfg.envs
    return dataclasses.replace(
        cfg, train=dataclasses.replace(t, groups_per_step=2 * t.groups_per_step),
        envs=dataclasses.replace(e, sandboxes_per_worker=2 * e.sandboxes_per_worker))


def format_in_flight(base: SimReport, doubled: SimReport) -> str:
    """Hit rate and prefill per trajectory, at the recipe's in-flight count and at twice it."""
    rows = [f"  {'':<34}{'as configured':>16}{'2x in flight':>16}",
            f"  {'prefix-cache hit rate':<34}{base.prefix_cache_hit_rate:>16.1%}"
            f"{doubled.prefix_cache_hit_rate:>16.1%}"]
    per_traj = [r.prefill_s_per_step * r.steps / max(r.trajectories_trained, 1)
                for r in (base, doubled)]
    rows.append(f"  {'prefill s per trajectory (engine)':<34}{per_traj[0]:>16.3f}{per_traj[1]:>16.3f}")
    rows.append(f"  {'prefill s per step':<34}{base.prefill_s_per_step:>16,.0f}"
                f"{doubled.prefill_s_per_step:>16,.0f}")
    rows.append(f"  {'step wall clock (s)':<34}{base.mean_step_s:>16,.0f}{doubled.mean_step_s:>16,.0f}")
    return "doubling the trajectories in flight (the seed's practice experiment)\n" + "\n".join(rows)


def parse_argv(argv: list[str]) -> tuple[str | None, list[str], str | None, SimOptions, bool,
                                         str | None]:
    """(recipe, overrides with plan.* ones, profile file, options, as_json, trace path);
    flags take `--flag value`."""
    argv, profile_path = take_profile_flag(argv)
    recipe, overrides, as_json, trace = None, [], False, None
    values: dict[str, str] = {}
    doubled = False
    names = {"--mode": "mode", "--steps": "steps", "--tail": "tail", "--sandboxes": "sandboxes",
             "--token-unit": "token_unit", "--seed": "seed", "--worker": "worker",
             "--push-latency-s": "push_latency_s"}
    it = iter(argv)
    for arg in it:
        if arg == "--json":
            as_json = True
        elif arg == "--double-in-flight":
            doubled = True
        elif arg in names or arg == "--trace":
            value = next(it, None)
            if value is None:
                raise ValueError(f"{arg} needs a value")
            if arg == "--trace":
                trace = value
            else:
                values[names[arg]] = value
        elif arg.startswith("-"):
            raise ValueError(f"unknown flag {arg!r}; see python -m launch.simulate --help")
        elif arg.startswith("recipe="):
            recipe = arg.removeprefix("recipe=")
        else:
            overrides.append(arg)
    if values.get("worker") == "real":
        values.setdefault("token_unit", "1")
    default = SimOptions()

    def count(name: str, fallback: int) -> int:
        text = values.get(name)
        if text is None:
            return fallback
        if not text.lstrip("-").isdigit():
            raise ValueError(f"--{name.replace('_', '-')} takes a whole number, got {text!r}")
        return int(text)

    try:
        push_latency_s = float(values.get("push_latency_s", default.push_latency_s))
    except ValueError:
        raise ValueError(f"--push-latency-s takes seconds, got {values['push_latency_s']!r}") from None
    if not push_latency_s >= 0:
        raise ValueError(f"--push-latency-s must be >= 0 seconds, got {push_latency_s:g}")
    opts = SimOptions(mode=values.get("mode", default.mode), steps=count("steps", default.steps),
                      tail=values.get("tail", default.tail),
                      sandboxes=values.get("sandboxes", default.sandboxes),
                      token_unit=count("token_unit", default.token_unit), seed=count("seed", default.seed),
                      double_in_flight=doubled, worker=values.get("worker", default.worker),
                      push_latency_s=push_latency_s)
    if opts.mode not in ("sync", "async") or opts.sandboxes not in ("stateful", "releasable"):
        raise ValueError("--mode is sync or async; --sandboxes is stateful or releasable")
    if opts.worker not in ("model", "real"):
        raise ValueError("--worker is model or real")
    if opts.worker == "real" and (opts.token_unit != 1 or opts.sandboxes != "stateful"):
        raise ValueError("--worker real runs real token ids (--token-unit 1) in stateful "
                         "sandboxes (the worker's environment holds one per trajectory)")
    if opts.steps < 1 or opts.token_unit < 1:
        raise ValueError("--steps and --token-unit must be >= 1")
    return recipe, overrides, profile_path, opts, as_json, trace


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(f"usage (the command line is the first paragraph):\n\n{__doc__}")
        return 0
    try:
        recipe, overrides, profile_path, opts, as_json, trace = parse_argv(argv)
        cfg, profile = load_recipe_and_profile(
            recipe, [*overrides, f"train.mode={opts.mode}", f"train.num_steps={opts.steps}",
                     "eval.tasks=null"], profile_path)
        build_exec_model(cfg, profile.exec_s, 1, opts.tail)
        build_plan(cfg, profile)
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    report, _ = run_simulation(cfg, profile, opts, Path(trace) if trace else None)
    if opts.double_in_flight:
        doubled, _ = run_simulation(double_in_flight(cfg), profile, opts)
        print(json.dumps({"as_configured": dataclasses.asdict(report),
                          "doubled": dataclasses.asdict(doubled)}, indent=2) if as_json
              else format_in_flight(report, doubled))
        return 0
    print(json.dumps(dataclasses.asdict(report), indent=2) if as_json
          else format_report(cfg, profile, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
