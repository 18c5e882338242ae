"""recipes/swe_mini.yaml for 2 steps in containers on two freshly built SWE-smith-style
hjson tasks, each with its own podman image (the repository at /testbed, image-only
rows): every task's image is prewarmed and used, the agent works at /testbed, the gold
patch applied through the real tools scores 1 through reward.grading.hidden_tests:HiddenTests in a
fresh container of the task's image, nothing is lost.
Heavy (Ray, vLLM, DeepSpeed, task and image building): set SLUICE_SWE_MINI=1 to run it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from swe_plugins import GOLD_ROWS_ENV

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.skipif(os.environ.get("SLUICE_SWE_MINI") != "1",
                    reason="a whole-system run (2-4 min on 2 cores); set SLUICE_SWE_MINI=1")
def test_swe_mini_gold_patch_scores_one(tmp_path, monkeypatch):
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the sandbox backends need root and bubblewrap")
    from sandbox_probes import skip_without_container_engine

    skip_without_container_engine()
    from envs.tasks.build_swe_smith import build_tasks
    from trainer.run.recipe import load_config
    from trainer.run.system import run

    rows = build_tasks(str(tmp_path / "set"), "hjson", max_tasks=2, max_tries=30, images=True)
    assert all(r["workdir"] == "/testbed" and r["image_name"] for r in rows)
    assert len({r["image_name"] for r in rows}) == 2  # one image per task
    tasks = tmp_path / "set" / "tasks.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(GOLD_ROWS_ENV, str(tasks))
    cfg = load_config("swe_mini.yaml", [
        f"envs.tasks={tasks}", "agent.loop=swe_plugins:GoldPatchLoop",
        "agent.max_new_tokens_per_turn=8", "train.num_steps=2", f"logging.output_dir={tmp_path}",
        "logging.run_name=swe", "logging.wandb_mode=disabled", "logging.console=false"])
    summary, run_dir = asyncio.run(run(cfg, "swe"))
    assert summary.steps == 2
    assert summary.admitted == summary.trained + sum(summary.dropped.values()) + \
        summary.running + summary.buffered
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    means = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    tool_log = (tmp_path / "set" / "tasks.jsonl.tool_log").read_text()
    assert means and all(m == 1.0 for m in means), (means, tool_log)
    # Every trajectory worked at the image's path and was graded in its image's container.
    outputs = [json.loads(line)["outputs"][1] for line in tool_log.splitlines()]
    assert outputs and all("/testbed" in o and "/workspace" not in o for o in outputs), outputs
    steps = [m for m in metrics if "reward/mean" in m]
    for m in steps:
        assert m["reward/graded_in_image"] == m["reward/graded_by_pytest_driver"] > 0, m
    assert {m.get("env/images_ready") for m in metrics if "env/images_ready" in m} == {2.0}
    assert {json.loads(line)["task"] for line in tool_log.splitlines()} == \
        {r["instance_id"] for r in rows}
