"""The shortened quickstart that the whole-run integration tests share: the quickstart
recipe with fewer steps and smaller groups, a warm start of its own length (cached in the
test cache, so the tests build it once), no wandb and no console."""

from __future__ import annotations

from pathlib import Path

from trainer.config import SluiceConfig
from trainer.recipe import load_config

# Long enough that the tiny model calls the python tool in the right format; the first
# test that needs it pays for it (about a minute on 2 cores), the others reuse it.
WARM_START_STEPS = 120


def quickstart_config(tmp_path: Path, name: str, *overrides: str) -> SluiceConfig:
    return load_config("quickstart.yaml", [
        "train.num_steps=3", "train.group_size=4", "train.groups_per_step=2",
        f"model.warm_start_steps={WARM_START_STEPS}", f"logging.output_dir={tmp_path}",
        f"logging.run_name={name}", "logging.wandb_mode=disabled", "logging.console=false",
        *overrides])
