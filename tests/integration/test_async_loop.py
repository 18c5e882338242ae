"""The whole system on this machine, shortened: real Ray pools, a real vLLM engine, real
sandboxes running the python tool, DeepSpeed, the replay buffer and the controller.
Asserts on every batch: mask/logprob/version invariants, staleness <= eta at train time;
on the run: the accounting identity (checked by the controller every step), metric keys,
transcripts, and a resumable checkpoint.

Not asserted yet: that reward rises (the quickstart's warm start does not yet teach the
tiny model to use the tool; see the issue notes)."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from rollout.types import NO_VERSION, TerminationReason
from trainer.recipe import load_config

EXPECTED_KEYS = {
    "perf/rollout_idle_ratio", "perf/trainer_idle_ratio", "perf/weight_sync_s", "staleness/mean",
    "staleness/max", "staleness/dropped_groups", "rollout/prefix_cache_hit_rate",
    "rollout/prefix_cache_hit_rate_vllm", "rollout/tokens_generated", "rollout/turns",
    "reward/mean", "loss/clip_frac", "loss/is_weight_mean", "loss/is_capped_frac",
    "loss/mismatch_kl", "timing/step_s", "timing/train_s", "buffer/admitted", "buffer/trained"}


def test_short_async_run_keeps_every_invariant(tmp_path):
    from trainer.system import run

    cfg = load_config("quickstart.yaml", [
        "train.num_steps=3", "train.group_size=4", "train.groups_per_step=2",
        "model.warm_start_steps=0", "agent.max_turns=2", "agent.max_new_tokens_per_turn=32",
        f"logging.output_dir={tmp_path}", "logging.run_name=short", "logging.wandb_mode=disabled",
        "logging.console=false", "checkpoint.every_steps=1"])
    eta = cfg.buffer.max_staleness
    seen: list[tuple[int, int]] = []

    def check_batch(groups, version):
        assert len(groups) == cfg.train.groups_per_step
        for group in groups:
            assert group.size == cfg.train.group_size
            for t in group.trajectories:
                assert isinstance(t.termination, TerminationReason)
                model = t.response_mask == 1
                assert np.all(t.logprobs[~model] == 0) and np.all(t.versions[~model] == NO_VERSION)
                assert np.all(t.versions[model] <= version)
                assert t.staleness(version) <= eta
                assert t.reward is not None
                assert sum(turn.num_generated for turn in t.turns) == model.sum()
        seen.append((version, len(groups)))

    summary, run_dir = asyncio.run(run(cfg, "short", on_batch=check_batch))
    assert summary.steps == 3 and [v for v, _ in seen] == [0, 1, 2]
    assert summary.admitted == summary.trained + sum(summary.dropped.values()) + \
        summary.running + summary.buffered
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    missing = EXPECTED_KEYS - set().union(*rows)
    assert not missing, missing
    assert any(k.startswith("end/") for k in rows[0])
    assert all(r["staleness/max"] <= eta for r in rows)
    transcripts = (run_dir / "transcripts.jsonl").read_text().splitlines()
    assert transcripts and "<|im_start|>" in json.loads(transcripts[0])["prompt"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-000003"
