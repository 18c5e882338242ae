"""The shortened quickstart that the whole-run integration tests share: the quickstart
recipe (and its cached warm start: the first test that needs it builds it, about two
minutes on 2 cores) with fewer steps and smaller groups, no wandb and no console."""

from __future__ import annotations

from pathlib import Path

from trainer.run.config import SluiceConfig
from trainer.run.recipe import load_config


def quickstart_config(tmp_path: Path, name: str, *overrides: str) -> SluiceConfig:
    return load_config("quickstart.yaml", [
        "train.num_steps=3", "train.group_size=4", "train.groups_per_step=2", "eval.tasks=null",
        f"logging.output_dir={tmp_path}",
        f"logging.run_name={name}", "logging.wandb_mode=disabled", "logging.console=false",
        *overrides])
