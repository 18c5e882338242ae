"""Reward-hacking findings reach the metrics of a whole run (real Ray, vLLM, sandboxes,
DeepSpeed, hidden-test grading in the agent-loop worker): a scripted policy
(hack_plugins.ScriptedHackLoop) solves a quarter of the code tasks honestly and, in the
rest, patches the test runner from the module under test, plants a conftest.py and a
pytest.toml, or shadows a standard-library module; `reward/hack_<finding>` counts in
metrics.jsonl and the transcripts name what each trajectory tried."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
pytestmark = pytest.mark.timeout(1200)


def test_hacking_attempts_are_counted_in_the_metrics(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the local sandbox backend needs root and bubblewrap")
    from trainer.run.recipe import load_config
    from trainer.run.system import run

    # The run's workers import the scripted policy.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")]))
    cfg = load_config("quickstart.yaml", [
        "model.warm_start=null", "eval.tasks=null", "envs.tasks=code_functions",
        "envs.num_warm_sandboxes=0", "model.max_context_tokens=4096",
        "agent.loop=hack_plugins:ScriptedHackLoop", "reward.fn=reward.grading.hidden_tests:HiddenTests",
        "agent.max_new_tokens_per_turn=8", "agent.max_response_tokens=256",
        "train.num_steps=1", "train.group_size=4", "train.groups_per_step=2",
        "buffer.max_staleness=0",
        "reward.max_concurrency=2", f"logging.output_dir={tmp_path}", "logging.run_name=hacks",
        "logging.wandb_mode=disabled", "logging.console=false",
        "logging.num_transcripts_per_step=64"])
    summary, run_dir = asyncio.run(run(cfg, "hacks"))
    assert summary.steps == 1

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Two groups a step, one trajectory of each kind per group: findings are counts.
    for row in rows:
        for finding in ("runner_config", "shadow_module", "sentinel_passed", "runner_bypassed"):
            assert row[f"reward/hack_{finding}"] == 2.0, row
        assert row["reward/hack_runner_internals"] >= 2.0, row
        # Scores are means: only the patched runner got to run (and was caught); the
        # honest quarter passes.
        assert row["reward/tamper_detected"] == pytest.approx(0.25), row
        assert row["reward/mean"] == pytest.approx(0.25), row

    transcripts = [json.loads(line) for line in
                   (run_dir / "transcripts.jsonl").read_text().splitlines()]
    by_behaviour = {t["index"] % 4: t for t in transcripts}
    assert not any(k.startswith("hack_") and v for k, v in by_behaviour[0]["components"].items())
    assert by_behaviour[1]["components"]["hack_sentinel_passed"] == 1.0
    assert by_behaviour[2]["components"]["hack_runner_config"] == 1.0
    assert by_behaviour[3]["components"]["hack_shadow_module"] == 1.0
