"""The whole system on this machine, shortened, started once for every check below (the
`short_run` fixture): real Ray pools, two real vLLM engines, real sandboxes running the
python tool, DeepSpeed, the replay buffer and the controller.

- Every batch as it reaches the trainer: mask/logprob/version invariants, staleness <= eta.
- The run routes by KV residency (rollout.routing=residency: vLLM's KV cache events from
  both engines reach each router's view, which places turns).
- The run: token continuity of every trajectory (agent.continuity_check), the accounting
  identity (checked by the controller every step), metric keys (each explained in
  docs/metrics.md), transcripts, a resumable
  checkpoint, and that RL raised the held-out reward above the warm-started model's, both
  measured in this run (eval.tasks before the first step and after the last).
- Faults injected from outside as they happen in production (run_faults), which the run
  survives with every check above still holding: one of the two engines is SIGKILLed
  after the first step (its sessions move to the other, the weight push goes on to the
  live one), and a few sandbox workspaces vanish under running trajectories (the tool
  call becomes an error observation, the pool recreates the sandbox from its snapshot).
  A tool call that outlives agent.tool_timeout_s is one trajectory's fault:
  test_sandbox_tools checks it on the agent-loop worker.
- Its run report (launch.report): every trained turn on the timeline under its step, every
  push, and every plot rendered in a real browser (tests/integration/browser.py)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from browser import check_in_browser, needs_chromium
from envs.types import NO_VERSION, TerminationReason
from quickstart_run import quickstart_config, undocumented_metrics
from run_faults import WorkspaceWiper, kill_one_engine, own_temp_folder
from trainer.run.config import SluiceConfig
from trainer.run.controller import RunSummary

EXPECTED_KEYS = {
    "perf/rollout_idle_ratio", "perf/trainer_idle_ratio", "perf/weight_sync_s", "staleness/mean",
    "staleness/max", "staleness/dropped_groups", "rollout/prefix_cache_hit_rate",
    "rollout/prefix_cache_hit_rate_vllm", "rollout/tokens_generated", "rollout/turns",
    "reward/mean", "loss/clip_frac", "loss/is_weight_mean", "loss/is_capped_frac",
    "loss/mismatch_kl", "loss/entropy", "timing/step_s", "timing/train_s", "buffer/admitted",
    "buffer/trained", "env/exec_s", "env/sandboxes_in_use", "env/queue_wait_s",
    "rollout/tool_calls", "eval/reward_mean", "rollout/kv_routed_by_residency"}


# On a fresh cache the run first builds the tiny model and its warm start (~2 min alone,
# 18 min measured beside a loaded second worker): the bound catches hangs, not first use.
pytestmark = pytest.mark.timeout(2400)

NUM_STEPS = 20  # about a minute here; the quickstart's held-out reward rises ~0.2 by then
RL_RECIPE = ("train.group_size=8", "train.groups_per_step=4")  # the quickstart's own groups
WIPES = 3  # workspaces removed under running trajectories: a fault, not a learning problem


@dataclass(slots=True)
class ShortRun:
    """What the run returned, where it wrote, and the (version, num groups) of each batch
    the trainer was handed."""

    cfg: SluiceConfig
    summary: RunSummary
    run_dir: Path
    batches: list[tuple[int, int]]
    killed_engines: list[int]
    wiped: int


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> ShortRun:
    """The run, with every batch checked as the trainer gets it: a violation fails the
    run, and so every test of this module."""
    from trainer.run.system import run

    cfg = quickstart_config(tmp_path_factory.mktemp("short_run"), "short",
                            f"train.num_steps={NUM_STEPS}", *RL_RECIPE,
                            "agent.continuity_check=true", "checkpoint.every_steps=10",
                            "rollout.num_engines=2", "rollout.routing=residency",
                            "eval.tasks=toy_arithmetic_easy_heldout", "eval.num_tasks=64",
                            "eval.samples_per_task=2")
    eta = cfg.buffer.max_staleness
    batches: list[tuple[int, int]] = []
    killed: list[int] = []

    def check_batch(groups, version):
        if version == 1 and not killed:
            killed.append(kill_one_engine())
        assert len(groups) == cfg.train.groups_per_step
        for group in groups:
            assert group.size == cfg.train.group_size
            for t in group.trajectories:
                assert isinstance(t.termination, TerminationReason)
                model = t.response_mask == 1
                assert np.all(t.logprobs[~model] == 0) and np.all(t.versions[~model] == NO_VERSION)
                assert np.all(t.logprobs[model] <= 0)
                assert np.all(t.versions[model] <= version)
                assert t.staleness(version) <= eta
                assert t.reward is not None
                assert sum(turn.num_generated for turn in t.turns) == model.sum()
        batches.append((version, len(groups)))

    with own_temp_folder() as sandboxes:
        wiper = WorkspaceWiper(sandboxes, WIPES)
        wiper.start()
        try:
            summary, run_dir = asyncio.run(run(cfg, "short", on_batch=check_batch))
        finally:
            wiper.stop.set()
            wiper.join()
    return ShortRun(cfg, summary, run_dir, batches, killed, wiper.wiped)


def test_short_async_run_keeps_every_invariant_and_raises_reward(short_run: ShortRun):
    summary, run_dir, eta = short_run.summary, short_run.run_dir, short_run.cfg.buffer.max_staleness
    assert summary.steps == NUM_STEPS and [v for v, _ in short_run.batches] == list(range(NUM_STEPS))
    assert summary.admitted == summary.trained + sum(summary.dropped.values()) + \
        summary.running + summary.buffered
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == list(range(1, NUM_STEPS + 1))
    missing = EXPECTED_KEYS - set().union(*rows)
    assert not missing, missing
    assert undocumented_metrics(rows) == [], "metrics missing from docs/metrics.md"
    assert any(k.startswith("end/") for k in train_rows[0])
    assert all(r["staleness/max"] <= eta for r in train_rows)
    assert train_rows[-1]["rollout/continuity_divergences"] == 0
    assert train_rows[-1]["rollout/kv_routed_by_residency"] > 0
    transcripts = (run_dir / "transcripts.jsonl").read_text().splitlines()
    assert transcripts and "<|im_start|>" in json.loads(transcripts[0])["prompt"]
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step-{NUM_STEPS:06d}"
    before, after = summary.eval_rewards[0], summary.eval_rewards[NUM_STEPS]
    print(f"held-out reward: before RL {before:.3f}, after {NUM_STEPS} steps {after:.3f}")
    assert after > before, f"RL did not raise the held-out reward ({before:.3f} -> {after:.3f})"


def test_the_run_survives_a_killed_engine_and_vanishing_sandboxes(short_run: ShortRun):
    rows = [json.loads(line) for line in (short_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert short_run.killed_engines and short_run.summary.steps == NUM_STEPS
    assert short_run.wiped > 0
    assert sum(r.get("env/crashes", 0) for r in train_rows) > 0, "no sandbox crash reached the pool"
    assert sum(r.get("env/recreates", 0) for r in train_rows) > 0
    # The killed engine is dropped once: by the push that found it dead, or before it by
    # the driver's own calls; the engine left serves every later version.
    assert sum(r["perf/weight_push_failed_engines"] for r in train_rows) <= 1


@needs_chromium
def test_its_report_joins_its_events_and_renders(short_run: ShortRun):
    from launch.report import ReportOptions, build_part, main
    from launch.report_data import load_run

    cfg, run_dir = short_run.cfg, short_run.run_dir
    run = load_run(run_dir)
    train_rows = [r for r in run.metrics if "reward/mean" in r]
    assert run.problems == [] and len(train_rows) == NUM_STEPS
    per_step = cfg.train.group_size * cfg.train.groups_per_step
    for row in train_rows:  # every trained turn is on the timeline, under its step
        step = int(row["step"])
        turns = [u for u in run.events.turns if u.step == step]
        assert len(turns) == round(row["rollout/turns"] * per_step)
        assert len({u.traj for u in turns}) == per_step
        assert sum(u.tokens for u in turns) == row["rollout/tokens_generated"]
    assert [p.version for p in run.events.pushes] == list(range(1, NUM_STEPS + 1))
    # The start is on the timeline as labelled phases, before the first turn.
    phases = [s for s in run.events.spans if s.kind == "phase"]
    assert [s.label for s in phases] == ["load tasks", "model (and warm start)",
                                         "start engines, sandbox pools, train ranks"]
    assert phases[-1].t1 <= min(u.t0 for u in run.events.turns)
    assert main(["--latest", str(run_dir.parent)]) == 0  # what `make quickstart` runs
    page = run_dir / "report.html"
    expected = {p.key for p in build_part(run, ReportOptions()).panels}
    assert "timeline_engine" in expected
    check_in_browser(page, expected, run_dir.parent / "report-real.png")
