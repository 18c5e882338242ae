"""The guide's example package run for real as a user's own package: copied outside the
repository as `shopagent` (its modules import only the public API, rollout.api), its
recipe run from that folder, `python -m trainer.main recipe=shopagent/recipe.yaml`
warm-starts the tiny model (the quickstart's toy warm start, for a task file that is not a
built-in set) and trains 4 steps with the package's own agent loop, tool, reward function
and task file (the whole system: Ray, vLLM, sandboxes, DeepSpeed), writes metrics whose
every key docs/metrics.md explains, counts tool calls and errors per tool, and its last
checkpoint exports to a Hugging Face folder. (The command as written from the repository
root is run by tests/unit/test_docs_commands.py, with --dry-run.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from quickstart_run import undocumented_metrics

ROOT = Path(__file__).resolve().parents[2]


def user_package(home: Path) -> Path:
    """examples/my_agent as a package of the user's own, `home/shopagent`."""
    package = home / "shopagent"
    shutil.copytree(ROOT / "examples" / "my_agent", package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    recipe = package / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("examples.my_agent", "shopagent")
                      .replace("examples/my_agent", "shopagent"))
    return package


def test_the_example_package_trains_and_exports(tmp_path):
    runs = tmp_path / "runs"
    user_package(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.main", "recipe=shopagent/recipe.yaml",
         f"logging.output_dir={runs}", "logging.run_name=example", "logging.console=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "done: 4 steps" in proc.stdout
    assert "warm start: envs.tasks='shopagent/tasks.jsonl' is not a toy_arithmetic set" \
        in proc.stderr
    run = runs / "example"

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:  # the example's reward components reach the metrics
        assert {"reward/correct", "reward/answered", "reward/used_tools"} <= set(row)
        assert 0.0 <= row["reward/mean"] <= 1.0
    # The warm-started model calls tools; each call is counted under its tool's name.
    per_tool = {k: sum(r.get(k, 0.0) for r in rows) for r in rows for k in r
                if k.startswith("rollout/tool_calls/")}
    assert sum(per_tool.values()) == sum(r["rollout/tool_calls"] for r in rows) > 0, per_tool
    undocumented = undocumented_metrics(rows)
    assert undocumented == [], f"metrics missing from docs/metrics.md: {undocumented}"

    transcripts = [json.loads(line) for line in (run / "transcripts.jsonl").read_text().splitlines()]
    assert transcripts and all(t["task_id"].startswith("shop-") for t in transcripts)
    assert "price" in transcripts[0]["prompt"]  # the example's tool is offered to the model
    assert (run / "config.yaml").is_file()
    checkpoint = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert checkpoint.name == "step-000004"

    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "trainer.export", str(checkpoint), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"
    assert AutoTokenizer.from_pretrained(out).chat_template
