"""The quickstart workload with a heavy-tailed environment and a training step of realistic
weight, in `train.mode=sync` and `async` side by side, run by hand:

    python tests/bench/bench_sync_vs_async.py [--steps 10] [--rounds 1] [--exec-s 1.0]
        [--turns 2] [--exec-timeout-s 12] [--train-copies 2] [--tail sandbox|loop]
        [--base-s 0.2] [--slow-fraction 0.1] [--variant NAME:key=value,...] [--keep DIR]
        [key=value ...]

Each run is `python -m trainer.main recipe=quickstart.yaml` (real Ray, vLLM, sandboxes,
DeepSpeed; no held-out eval, whose time would land in the last step) with
`agent.loop=heavy_tail_loop:HeavyTailToolLoop`:
- `--tail sandbox` (the default): every python/bash command the model writes runs behind a
  `sleep` in its own sandbox, drawn from the simulator's `--tail seed` exec-time model
  (launch.sim.sandbox_model.seed_tail: a lognormal body of mean `--exec-s`; hangs on 5% of
  the trajectories of `--turns` commands, which `envs.exec_timeout_s=--exec-timeout-s`
  kills: a real timeout). Sandboxes stay held and timeouts are the pool's own. The draws
  are seeded per command (group, sample, turn) and round, so the modes of a round meet
  the same tail.
- `--tail loop`: the old sleep-only mode (a sleep in the loop after the tool: `--base-s`,
  a `--slow-fraction` of turns ten times that).
The train rank is `weighted_backend:WeightedDeepSpeedBackend`: each step trains on
`--train-copies` copies of its batch (the work of a batch that many times larger, the
same update), so training weighs against rollout as in the seed's account (1,213 s of
training, 800 s trajectories). Every run also gets PROFILE_OVERRIDES: a staleness bound of
2 (a hang lasts 2-3 async steps: under 1 it comes back stale) and 50 sandboxes (x 1.3
oversubscription: the 64 trajectories (eta + 1) x B x G admits; the quickstart's 32 cap
admission at 5 of its 8 groups, which its start log says). Extra `key=value` arguments go
to every run after them; each
`--variant NAME:key=value,...` is one more async run per round with its own overrides on
top (e.g. the project as it was, for a before/after in the same rounds).

Modes alternate (sync, async, variants, sync, ...) so machine noise hits all. Reports, from each
run's metrics.jsonl and excluding the first step (engine start-up, first batch): seconds per
step, idle ratios, the step's parts (training, weight sync, gates closed), sandbox waits
and exec times, staleness and drops; then the ratio, and the `python -m launch.simulate`
commands of the same profile (exec-time model, turns, generation, training and push time
as measured here) with the simulator's ratio beside the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from quickstart_runs import ROOT, bench_env, run_alternating, run_quickstart

# Per-step means of these metrics (docs/metrics.md), beside seconds per step.
MEAN_KEYS = {"rollout_idle": "perf/rollout_idle_ratio", "trainer_idle": "perf/trainer_idle_ratio",
             "train_s": "timing/train_s", "sync_s": "perf/weight_sync_s",
             "gates_closed_s": "perf/weight_gates_closed_s", "staleness": "staleness/mean",
             "sandbox_wait_s": "env/queue_wait_s", "exec_s": "env/exec_s",
             "timeouts": "env/timeouts", "in_flight": "rollout/trajectories_running",
             "turns": "rollout/turns", "tokens": "rollout/tokens_generated",
             "reward": "reward/mean"}
SIM_STEPS = 40  # virtual steps: a few seconds of CPU, enough for the tail to average out
TABLE = ("s_per_step", "rollout_idle", "trainer_idle", "train_s", "sync_s", "gates_closed_s",
         "sandbox_wait_s", "exec_s", "timeouts", "in_flight", "staleness", "staleness_max",
         "dropped_stale", "turns", "reward")


# Process groups the CPU sampler tells apart, by a part of the command line (first match).
# A process of none of them is counted with its parent when that is the engine, the train
# rank or the sandbox pool (vLLM's engine core, the sandboxes' commands), else as "ray".
CPU_GROUPS = (("engine", ("ray::EngineActor",)), ("trainer", ("ray::TrainRankActor",)),
              ("sandboxes", ("ray::SandboxPoolActor",)), ("agent_workers", ("ray::AgentWorkerActor",)),
              ("driver", ("trainer.main",)))
INHERITED = ("engine", "trainer", "sandboxes")


class CpuSampler:
    """Samples the CPU seconds of this process's descendants (the run: driver, Ray, engine,
    train rank, sandbox worker and its sandboxes) every `every_s`, summed per CPU_GROUPS
    group ("ray" for the rest): `cores(t0, t1)` is each group's mean cores used between two
    unix times of the run. A process that ended keeps its last reading; one that lived less
    than `every_s` is missed (an approximation: the sandboxes' short commands)."""

    def __init__(self, every_s: float = 0.5) -> None:
        import psutil  # deferred: only this bench needs it (Ray installs it)

        self._psutil, self.every_s = psutil, every_s
        self._last: dict[int, tuple[str, float]] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _group(self, proc) -> str:
        cmd = " ".join(proc.cmdline())
        own = next((g for g, keys in CPU_GROUPS if any(k in cmd for k in keys)), None)
        parent = self._last.get(proc.ppid(), ("ray",))[0]
        return own or (parent if parent in INHERITED else "ray")

    def _run(self) -> None:
        me = self._psutil.Process()
        while not self._stop.wait(self.every_s):
            for proc in me.children(recursive=True):
                try:
                    with proc.oneshot():
                        times = proc.cpu_times()
                        known = self._last.get(proc.pid, ("ray",))[0]  # a Ray worker becomes an actor
                        group = known if known != "ray" else self._group(proc)
                        self._last[proc.pid] = (group, times.user + times.system)
                except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                    continue
            totals: dict[str, float] = {}
            for group, cpu in self._last.values():
                totals[group] = totals.get(group, 0.0) + cpu
            self.samples.append((time.time(), totals))

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def cores(self, t0: float, t1: float) -> dict[str, float]:
        def at(t: float) -> dict[str, float]:
            return min(self.samples, key=lambda s: abs(s[0] - t))[1]
        a, b = at(t0), at(t1)
        return {g: (b.get(g, 0.0) - a.get(g, 0.0)) / (t1 - t0) for g in b}


def turn_times(events_path: Path, first_step: int) -> dict[str, float]:
    """Means over the trained turns of steps >= first_step (events.jsonl): seconds generating,
    waiting at the turn gate, in tools; and each trajectory's wall clock."""
    turns = [e for e in map(json.loads, events_path.read_text().splitlines())
             if e["kind"] == "turn" and e["step"] >= first_step]
    spans: dict[str, list[float]] = {}
    for e in turns:
        span = spans.setdefault(f"{e['step']}:{e['traj']}", [e["t0"], e["t0"]])
        span[0] = min(span[0], e["t0"])
        span[1] = max(span[1], e["t0"] + e["queue_s"] + e["generate_s"] + e["tool_s"])
    walls = sorted(b - a for a, b in spans.values())
    return {"gen_s": statistics.fmean(e["generate_s"] for e in turns),
            "gate_wait_s": statistics.fmean(e["queue_s"] for e in turns),
            "tool_s": statistics.fmean(e["tool_s"] for e in turns if e["tool_calls"]),
            "traj_s": statistics.fmean(walls), "traj_max_s": walls[-1]}


def run_once(mode: str, args: argparse.Namespace, out_dir: Path, env: dict[str, str]) -> dict[str, float]:
    """One run of `mode`: sync, async, or a --variant's name (async with its overrides)."""
    start = time.monotonic()
    name = f"{mode}-{int(time.time())}"
    variant = dict(args.variant).get(mode, [])
    with CpuSampler() as cpu:
        rows = run_quickstart(name, [
            f"train.mode={'sync' if mode == 'sync' else 'async'}", f"train.num_steps={args.steps}",
            "agent.loop=heavy_tail_loop:HeavyTailToolLoop",
            "train.backend=weighted_backend:WeightedDeepSpeedBackend",
            f"envs.exec_timeout_s={args.exec_timeout_s}",
            f"agent.tool_timeout_s={args.exec_timeout_s + 5}", *args.overrides, *variant], out_dir, env)
    wall = time.monotonic() - start
    rows = rows[1:]  # the first step includes start-up
    seconds = rows[-1]["time"] - rows[0]["time"]
    out = {"s_per_step": seconds / (len(rows) - 1), "wall_s": wall,
           "staleness_max": max(r["staleness/max"] for r in rows),
           "dropped_stale": rows[-1].get("buffer/dropped_stale", 0.0)}
    for column, key in MEAN_KEYS.items():
        out[column] = statistics.fmean(r.get(key, 0.0) for r in rows)
    out.update(turn_times(out_dir / name / "events.jsonl", int(rows[0]["step"])))
    out.update({f"cores_{g}": c for g, c in cpu.cores(rows[0]["time"], rows[-1]["time"]).items()})
    out["load_avg"] = os.getloadavg()[0]
    return out


def simulate(mode: str, sim_args: list[str], trace: Path | None = None) -> dict:
    """The simulator's report (--json) for `mode` on `sim_args`."""
    cmd = [sys.executable, "-m", "launch.simulate", *sim_args, "--mode", mode, "--json"]
    if trace is not None:
        cmd += ["--trace", str(trace)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def simulator_args(args: argparse.Namespace, sync: dict[str, float]) -> list[str]:
    """`launch.simulate` arguments for the profile measured in the sync runs: the bench's
    exec-time model (--tail seed, the same mean plus the sandbox's own cost per command,
    turns and timeout), the turns and tokens per turn, the measured push, and the engine
    and trainer models scaled so that a turn generates and a step trains in the measured
    seconds (the GPU models' bandwidth and MFU are the knobs)."""
    from launch.plan import build_plan, load_recipe_and_profile

    from launch.sim.sandbox_model import seed_tail

    turns = max(2, round(sync["turns"]))
    prompt_tokens, obs_tokens = 200, 30  # the toy's first prompt and tool output, about
    # A command takes its drawn sleep plus the sandbox's own cost (starting python3 in the
    # sandbox, the exec round trip): that cost goes into the simulator's mean exec time.
    model, rng = seed_tail(args.exec_s, args.turns, args.exec_timeout_s), random.Random(0)
    sleep_s = statistics.fmean(min(model.sample(rng).seconds, args.exec_timeout_s)
                               for _ in range(100_000))
    exec_s = args.exec_s + max(0.0, sync["tool_s"] - sleep_s)
    cfg, _ = load_recipe_and_profile("quickstart.yaml", list(args.overrides), None)
    trajectories = cfg.train.group_size * cfg.train.groups_per_step
    gen_tokens = max(1, round(sync["tokens"] / (trajectories * sync["turns"])))
    base = ["recipe=quickstart.yaml", *args.overrides, f"plan.turns={turns}",
            f"plan.exec_s={exec_s:.3g}", f"plan.gen_tokens={gen_tokens}",
            f"plan.obs_tokens={obs_tokens}", f"plan.prompt_tokens={prompt_tokens}",
            f"agent.tool_timeout_s={args.exec_timeout_s:g}", "--tail", "seed",
            "--token-unit", "1", "--steps", str(SIM_STEPS),
            "--push-latency-s", f"{sync['sync_s']:.2g}"]
    cfg, profile = load_recipe_and_profile("quickstart.yaml", [a for a in base if "=" in a
                                                               and not a.startswith("recipe=")], None)
    p = build_plan(cfg, profile).inputs
    # The simulated trajectory's context: the prompt, every turn's generation, an
    # observation after each turn but the last (launch.sim.sides).
    tokens = trajectories * (prompt_tokens + turns * gen_tokens + (turns - 1) * obs_tokens)
    mfu = 12 * p.model_params_b * 1e9 * tokens / (p.train_gpus * p.gpu_flops * sync["train_s"])
    with tempfile.TemporaryDirectory() as tmp:  # generation: decode time is 1 / bandwidth
        trace = Path(tmp) / "trace.jsonl"
        simulate("sync", [*base, f"plan.mfu_train={mfu:.4g}"], trace)
        gen = [e["generate_s"] for e in map(json.loads, trace.read_text().splitlines())
               if e.get("kind") == "turn"]
    hbm = profile.hbm_bytes_per_s * statistics.fmean(gen) / sync["gen_s"]
    return [*base, f"plan.mfu_train={mfu:.4g}", f"plan.hbm_bytes_per_s={hbm:.4g}"]


PROFILE_OVERRIDES = ("buffer.max_staleness=2", "envs.sandboxes_per_worker=50")


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition(":")
    if not name or name in ("sync", "async") or "=" not in overrides:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: use NAME:key=value[,key=value]")
    return name, overrides.split(",")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tail", choices=("sandbox", "loop"), default="sandbox")
    parser.add_argument("--exec-s", type=float, default=1.0)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--exec-timeout-s", type=float, default=12.0)
    parser.add_argument("--train-copies", type=int, default=2)
    parser.add_argument("--base-s", type=float, default=0.2)
    parser.add_argument("--slow-fraction", type=float, default=0.1)
    parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                        help="NAME:key=value,key=value: also run async with these overrides "
                             "(after the common ones), in the same rounds")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the run folders (metrics.jsonl, events.jsonl) here")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run, after "
                        f"the profile's ({' '.join(PROFILE_OVERRIDES)})")
    args = parser.parse_args()
    args.overrides = [*PROFILE_OVERRIDES, *args.overrides]

    env = bench_env(HEAVY_TAIL_WHERE=args.tail, HEAVY_TAIL_EXEC_S=str(args.exec_s),
                    HEAVY_TAIL_TURNS=str(args.turns),
                    HEAVY_TAIL_TIMEOUT_S=str(args.exec_timeout_s),
                    HEAVY_TAIL_BASE_S=str(args.base_s),
                    HEAVY_TAIL_SLOW_FRACTION=str(args.slow_fraction),
                    BENCH_TRAIN_BATCH_COPIES=str(args.train_copies))
    runs_so_far: dict[str, int] = {}

    def run_one(mode: str, out: Path) -> dict[str, float]:
        # Each round its own tail, the same for every mode of the round (heavy_tail_loop).
        runs_so_far[mode] = runs_so_far.get(mode, 0) + 1
        return run_once(mode, args, out, {**env, "HEAVY_TAIL_SEED": str(runs_so_far[mode])})

    modes = ("sync", "async", *(name for name, _ in args.variant))
    results = run_alternating(modes, args.rounds, run_one, args.keep)
    print(f"command: python tests/bench/{Path(__file__).name} " + " ".join(sys.argv[1:]))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if args.tail == "sandbox":
        print(f"workload: quickstart recipe, {args.steps} steps (first excluded); each command "
              f"sleeps in its sandbox first (the simulator's seed tail: mean {args.exec_s:g} s, "
              f"hangs on 5% of {args.turns}-command trajectories, killed at "
              f"envs.exec_timeout_s={args.exec_timeout_s:g}); training on {args.train_copies} "
              "copies of each batch\n")
    else:
        print(f"workload: quickstart recipe, {args.steps} steps (first excluded); tool turns take "
              f"+{args.base_s:g} s in the loop, {args.slow_fraction:.0%} of them "
              f"+{10 * args.base_s:g} s; training on {args.train_copies} copies of each batch\n")
    print("| mode | " + " | ".join(TABLE) + " |")
    print("|---" * (len(TABLE) + 1) + "|")
    for mode, runs in results.items():
        cells = [f"{statistics.fmean(r[k] for r in runs):.3g}" for k in TABLE]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    mean = {m: {k: statistics.fmean(r.get(k, 0.0) for r in runs) for k in runs[0]} for m, runs in results.items()}
    ratio = mean["sync"]["s_per_step"] / mean["async"]["s_per_step"]
    print(f"\nsync / async seconds per step: {ratio:.2f}x" + "".join(
        f", sync / {m}: {mean['sync']['s_per_step'] / mean[m]['s_per_step']:.2f}x" for m in modes[2:]))
    for m in modes[1:]:
        per_round = [s["s_per_step"] / a["s_per_step"] for s, a in zip(results["sync"], results[m])]
        print(f"  {m}, by round: " + ", ".join(f"{x:.2f}x" for x in per_round))
    print("measured per turn (means): " + ", ".join(
        f"{m}: generate {v['gen_s']:.2f} s, gate wait {v['gate_wait_s']:.3f} s, tool "
        f"{v['tool_s']:.2f} s, trajectory {v['traj_s']:.1f} s (max {v['traj_max_s']:.1f} s)"
        for m, v in mean.items()))
    groups = sorted({k for runs in results.values() for r in runs for k in r if k.startswith("cores_")})
    print("\ncores used over the timed steps, by process group (2-core machine; the load "
          "average includes other users' work):\n| mode | " + " | ".join(g[6:] for g in groups)
          + " | all | load avg |\n" + "|---" * (len(groups) + 3) + "|")
    for m, v in mean.items():
        print(f"| {m} | " + " | ".join(f"{v.get(g, 0.0):.2f}" for g in groups)
              + f" | {sum(v.get(g, 0.0) for g in groups):.2f} | {v['load_avg']:.1f} |")
    if args.tail != "sandbox":
        return
    sim_args = simulator_args(args, mean["sync"])
    print("\nthe simulator on the same profile (launch.simulate, virtual clock):\n"
          f"    python -m launch.simulate {' '.join(sim_args)} --mode sync|async")
    sim = {m: simulate(m, sim_args) for m in ("sync", "async")}
    print("| simulated | s_per_step | rollout_idle | trainer_idle | staleness | staleness_max | "
          "sandbox_wait_s | trajectory mean / max (s) |\n|---|---|---|---|---|---|---|---|")
    for m, r in sim.items():
        print(f"| {m} | {r['mean_step_s']:.3g} | {r['rollout_idle_ratio']:.3g} | "
              f"{r['trainer_idle_ratio']:.3g} | {r['staleness_mean']:.3g} | {r['staleness_max']} | "
              f"{r['sandbox_wait_mean_s']:.3g} | {r['trajectory_wall_mean_s']:.3g} / "
              f"{r['trajectory_wall_max_s']:.3g} |")
    print(f"\nsimulated sync / async: {sim['sync']['mean_step_s'] / sim['async']['mean_step_s']:.2f}x "
          f"(measured {ratio:.2f}x)")


if __name__ == "__main__":
    main()
