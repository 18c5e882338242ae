"""The shortened quickstart that the whole-run integration tests share: the quickstart
recipe (and its cached warm start: the first test that needs it builds it, about two
minutes on 2 cores) with fewer steps and smaller groups, no wandb and no console; and the
check that every metric a run logged is explained in docs/metrics.md."""

from __future__ import annotations

import re
from pathlib import Path

from trainer.run.config import SluiceConfig
from trainer.run.recipe import load_config

ROOT = Path(__file__).resolve().parents[2]


def quickstart_config(tmp_path: Path, name: str, *overrides: str) -> SluiceConfig:
    return load_config("quickstart.yaml", [
        "train.num_steps=3", "train.group_size=4", "train.groups_per_step=2", "eval.tasks=null",
        f"logging.output_dir={tmp_path}",
        f"logging.run_name={name}", "logging.wandb_mode=disabled", "logging.console=false",
        *overrides])


def documented_key_patterns() -> list[re.Pattern[str]]:
    """The keys of docs/metrics.md's tables; `<name>` stands for one or more path parts."""
    keys = []
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith("| `"):
            keys += re.findall(r"`([a-z_]+/[^`]+)`", line.split("|")[1])
    return [re.compile("^" + re.sub(r"<[^>]+>", ".+", re.escape(k).replace(r"\<", "<")
                                    .replace(r"\>", ">")) + "$") for k in keys]


def undocumented_metrics(rows: list[dict]) -> list[str]:
    """The keys of metrics.jsonl `rows` that no docs/metrics.md row explains."""
    patterns = documented_key_patterns()
    logged = {k for r in rows for k in r if k not in ("step", "time")}
    return sorted(k for k in logged if not any(p.match(k) for p in patterns))
