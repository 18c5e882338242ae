"""The entry point: --dry-run runs the start-up checks without starting anything (no Ray,
DeepSpeed, wandb), --help lists keys, bad input exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.main import main, parse_argv

ROOT = Path(__file__).resolve().parents[2]
# --dry-run validates the model's tokenizer (transformers), imports the plug-ins (the
# quickstart's warm start imports torch) and checks the chat template with vLLM's parsers,
# as a real start does; the distributed frameworks and the metrics sink stay out.
HEAVY = ("ray", "deepspeed", "wandb")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def _dry_run(recipe: str, *overrides: str, heavy: tuple[str, ...] = HEAVY) -> subprocess.CompletedProcess:
    argv = [f"recipe={recipe}", *overrides, "--dry-run"]
    probe = (f"import sys; from trainer.main import main; rc = main({argv!r}); "
             f"heavy = [m for m in {heavy!r} if m in sys.modules]; "
             "print('HEAVY', heavy); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_dry_run_prints_config_and_pool_plan_without_heavy_imports():
    # No wall-clock bound: on a shared machine it measures the load, not the code. What
    # keeps --dry-run light is that it starts and imports none of the frameworks above.
    proc = _dry_run("quickstart.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    assert "resource pools:" in proc.stdout and "rollout" in proc.stdout
    assert "max_staleness" in proc.stdout  # the resolved config is printed


def test_dry_run_prints_the_plan_of_a_recipe_for_another_machine_then_its_problems_here():
    """swe_grpo.yaml names data and models of an H100 cluster: the plan still prints
    here, and the exit code says this machine cannot run it."""
    proc = _dry_run("swe_grpo.yaml")
    assert "resource pools:" in proc.stdout and "HEAVY []" in proc.stdout
    assert proc.returncode == 2
    assert "envs.tasks: task file '/data/swe_tasks.jsonl' does not exist" in proc.stderr
    assert "model.path: '/models/Qwen3-8B' is not a folder" in proc.stderr


def test_misspelled_key_exits_2_with_a_suggestion():
    proc = _run("recipe=quickstart.yaml", "rollout.num_engine=2", "--dry-run")
    assert proc.returncode == 2
    assert "did you mean 'rollout.num_engines'" in proc.stderr


def test_help_lists_every_section(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for key in ("cluster.device", "rollout.num_engines", "buffer.max_staleness",
                "loss.aggregation", "reward.judge.enabled"):
        assert key in out


def test_unknown_flag_is_a_config_error(capsys):
    assert main(["recipe=quickstart.yaml", "--dryrun"]) == 2
    assert "unknown flag '--dryrun'" in capsys.readouterr().err


def test_parse_argv_splits_recipe_overrides_and_flags():
    assert parse_argv(["recipe=a.yaml", "x.y=1", "--dry-run"]) == ("a.yaml", ["x.y=1"], True, False)


def test_dry_run_looks_for_the_checkpoint_to_resume_as_the_run_does(tmp_path, capsys):
    assert main(["recipe=quickstart.yaml", f"logging.output_dir={tmp_path}",
                 "checkpoint.resume_from=latest", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.resume_from=latest: no checkpoint under {tmp_path}/quickstart-*" in err


def test_a_misspelled_plugin_fails_first_without_vllm_or_the_config_dump():
    """The checks run before any report, and the chat template check (vLLM's parsers,
    seconds) only once everything else passed: a typo is reported at once, error first."""
    proc = _dry_run("quickstart.yaml", "agent.loop=mypkg.loops:Nope", heavy=(*HEAVY, "vllm"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("config error: 1 problem before start:\n  - agent.loop: "), proc.stderr
    assert "HEAVY []" in proc.stdout
    assert "max_staleness" not in proc.stdout  # the resolved config waits for a clean check


def test_the_dry_run_says_which_vllm_model_runner_the_engines_use(monkeypatch, capsys):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert main(["recipe=quickstart.yaml", "model.warm_start=null", "--dry-run"]) == 0
    assert "vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0" in capsys.readouterr().out
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert main(["recipe=quickstart.yaml", "model.warm_start=null", "--dry-run"]) == 0
    assert "V2 model runner as VLLM_USE_V2_MODEL_RUNNER=1 asks" in capsys.readouterr().out
