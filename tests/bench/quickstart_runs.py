"""What the quickstart benches share (not a bench): one `python -m trainer.main
recipe=quickstart.yaml` run with overrides, read back as its trained steps' metric rows,
and the environment that lets the run's Ray workers import the bench's agent loops."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent


def bench_env(**variables: str) -> dict[str, str]:
    """This process's environment plus `variables`, with the bench folder on PYTHONPATH
    (Ray workers inherit it) and the cache folders `make` uses (the tiny model, its warm
    start and DeepSpeed's op builds are reused, not built again)."""
    sys.path.insert(0, str(ROOT))
    from envs.cache import default_cache_dir

    env = dict(os.environ, **variables,
               PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")])))
    env.setdefault("SLUICE_CACHE_DIR", str(default_cache_dir()))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(env["SLUICE_CACHE_DIR"]) / "torch_extensions"))
    return env


def run_quickstart(name: str, overrides: list[str], out_dir: Path, env: dict[str, str]) -> list[dict]:
    """The metric rows of the trained steps of one quickstart run (no held-out eval, no
    wandb, no console); exits with the run's stderr if it fails."""
    cmd = [sys.executable, "-m", "trainer.main", "recipe=quickstart.yaml", *overrides,
           f"logging.output_dir={out_dir}", f"logging.run_name={name}", "eval.tasks=null",
           "logging.wandb_mode=disabled", "logging.console=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run {name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def run_alternating(modes: tuple[str, ...], rounds: int,
                    run_one: Callable[[str, Path], dict],
                    keep_dir: Path | None = None) -> dict[str, list[dict]]:
    """`run_one(mode, out_dir)` for each mode in turn, `rounds` times (so machine noise hits
    every mode alike), each result printed as it comes; the results by mode. The run
    folders go to a temporary folder, or stay in `keep_dir` when given."""
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        out = keep_dir or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for _ in range(rounds):
            for mode in modes:
                results[mode].append(run_one(mode, out))
                print(f"{mode}: {results[mode][-1]}", flush=True)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}")
    return results
