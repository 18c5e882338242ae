"""The vision recipe run for real: `python -m trainer.main recipe=vision_toy.yaml` builds
the tiny vision-language model and its warm start, and trains it on screens it reads
through the `screenshot` tool and in its prompt (the whole system: Ray, vLLM with images,
DeepSpeed with the vision tower, weight pushes), reporting held-out reward before and
after. Every push resets the engine's multimodal caches (perf/mm_cache_resets), the
trajectories hold image tokens (rollout/image_tokens), and every logged metric is one
docs/metrics.md explains."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from quickstart_run import undocumented_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_the_vision_recipe_trains_on_screenshots_and_reports_held_out_reward(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.main", "recipe=vision_toy.yaml", "train.num_steps=3",
         "eval.num_tasks=8", f"logging.output_dir={tmp_path}", "logging.run_name=vision",
         "logging.wandb_mode=disabled", "logging.console=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "done: 3 steps" in proc.stdout
    held_out = re.search(r"held-out mean reward \(toy_screens_heldout\): version 0: [0-9.]+, version 3: [0-9.]+",
                         proc.stdout)
    assert held_out is not None, proc.stdout[-2000:]

    logged = [json.loads(line) for line in (tmp_path / "vision" / "metrics.jsonl").read_text().splitlines()]
    assert "eval/reward_mean" in logged[0] and "eval/reward_mean" in logged[-1]  # before RL and after
    rows = [r for r in logged if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Every step trained on trajectories that saw screens (a prompt image or a screenshot; a
    # sample that answered without taking one has none).
    assert all(r["rollout/image_tokens"] > 0 and r["rollout/images_per_trajectory"] > 0 for r in rows), rows
    # A push after each step: the engine's multimodal caches were reset at each one, and the
    # later steps' trajectories were generated after such pushes.
    assert rows[-1]["perf/mm_cache_resets"] >= 2, rows[-1]
    assert rows[-1]["rollout/images_processed_total"] >= sum(r["rollout/images_per_trajectory"] for r in rows)
    assert all(r["staleness/mean"] >= 0 for r in rows)
    undocumented = undocumented_metrics(logged)
    assert undocumented == [], f"metrics missing from docs/metrics.md: {undocumented}"
    transcripts = [json.loads(line) for line in (tmp_path / "vision" / "transcripts.jsonl").read_text().splitlines()]
    assert transcripts and all(t["task_id"].startswith("toy_screens") for t in transcripts)
    assert any(t["images"] >= 1 for t in transcripts)  # they hold the screens they saw
