"""The run report opened in a real browser (Debian's chromium, headless): built from a
short real run and from the recorded run + a simulator-style trace, every plot must have
rendered in the DOM (plotly draws an svg.main-svg into each), the page must log no
JavaScript error, and a screenshot is saved. Also: the report's figures and tables
logged to an offline wandb run."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from launch.report import ReportOptions, build_part, build_report, main
from launch.report_data import load_run, load_trace
from report_inputs import copy_recorded_run, write_trace

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: scripts/setup.sh installs Debian's "
    "'chromium' package (apt-get install chromium); without it the browser check cannot run")
BROWSER_TIMEOUT_S = 180


def chromium(*args: str) -> subprocess.CompletedProcess:
    """Headless chromium; --no-sandbox because tests may run as root. The virtual-time
    budget lets the page's scripts (plotly drawing every figure) finish before the dump."""
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--disable-dev-shm-usage", "--enable-logging=stderr", "--v=0",
                           "--virtual-time-budget=20000", *args],
                          capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)


def rendered_figures(page: Path) -> tuple[dict[str, bool], str]:
    """For each report panel in the page, whether plotly drew it (an svg.main-svg inside
    its container) in the browser's DOM; and the browser's log."""
    done = chromium("--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    marks = list(re.finditer(r'data-report-figure="([a-z_]+)"', dom))
    out = {}
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(dom)
        out[mark.group(1)] = 'class="main-svg"' in dom[mark.end():end]
    return out, done.stderr


def screenshot(page: Path, png: Path, height: int = 6000) -> Path:
    done = chromium(f"--screenshot={png}", f"--window-size=1400,{height}", page.as_uri())
    assert done.returncode == 0 and png.stat().st_size > 10_000, done.stderr[-2000:]
    return png


def check_in_browser(page: Path, expected: set[str], png: Path) -> None:
    figures, log = rendered_figures(page)
    assert set(figures) == expected
    assert all(figures.values()), [k for k, ok in figures.items() if not ok]
    # plotly reports bad figure input as console warnings; scripts that fail, as errors
    complaints = [line for line in log.splitlines() if "CONSOLE" in line]
    assert not complaints, complaints[:5]
    screenshot(page, png)


@needs_chromium
def test_report_of_the_recorded_run_and_a_trace_renders_every_plot(tmp_path):
    run_dir = copy_recorded_run(tmp_path)
    trace = write_trace(tmp_path / "sim.jsonl")
    page = build_report(run_dir, tmp_path / "report.html", trace)
    parts = [build_part(load_run(run_dir), ReportOptions()),
             build_part(load_trace(trace), ReportOptions(), trace=True)]
    expected = {p.key for part in parts for p in part.panels}
    # the recorded run draws all it can: timeline, environment, every over-steps panel
    assert {"timeline_engine", "env_exec_hist", "env_by_task", "reward", "idle", "staleness",
            "drop_bias", "prefix_cache", "throughput", "end_reasons",
            "trace_timeline_sandbox"} <= expected
    check_in_browser(page, expected, tmp_path / "report-recorded.png")


@needs_chromium
def test_report_of_a_short_real_run_joins_its_events_and_renders(tmp_path):
    import trainer.run.system
    from quickstart_run import quickstart_config

    cfg = quickstart_config(tmp_path, "report", "train.num_steps=2", "model.warm_start=null",
                            "train.backend=torch")
    summary, run_dir = asyncio.run(trainer.run.system.run(cfg, "quickstart"))
    assert summary.steps == 2
    run = load_run(run_dir)
    assert run.problems == [] and len(run.metrics) == 2
    per_step = cfg.train.group_size * cfg.train.groups_per_step
    for row in run.metrics:  # every trained turn is on the timeline, under its step
        step = int(row["step"])
        turns = [u for u in run.events.turns if u.step == step]
        assert len(turns) == round(row["rollout/turns"] * per_step)
        assert len({u.traj for u in turns}) == per_step
        assert sum(u.tokens for u in turns) == row["rollout/tokens_generated"]
    assert [p.version for p in run.events.pushes] == [1, 2]
    assert main(["--latest", str(tmp_path)]) == 0  # what `make quickstart` runs
    page = run_dir / "report.html"
    expected = {p.key for p in build_part(run, ReportOptions()).panels}
    assert "timeline_engine" in expected
    check_in_browser(page, expected, tmp_path / "report-real.png")


def test_report_figures_and_tables_reach_the_runs_offline_wandb_run(tmp_path, capsys):
    import yaml

    run_dir = copy_recorded_run(tmp_path)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["logging"]["wandb_mode"] = "offline"  # the recorded run had wandb off
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "wandb_run_id").write_text("reporttest1")  # as trainer.run.metrics.WandbSink does
    assert main([str(run_dir), "--wandb"]) == 0  # what `make quickstart` runs
    assert "report/* figures and tables logged (offline, run reporttest1)" in capsys.readouterr().out
    panels = {p.key for p in build_part(load_run(run_dir), ReportOptions()).panels}
    media = next((run_dir / "wandb").glob("offline-run-*-reporttest1")) / "files" / "media"
    plots = {p.name.split("_0_")[0]: p for p in (media / "plotly").rglob("*.plotly.json")}
    tables = {p.name.split("_0_")[0]: p for p in (media / "table").rglob("*.table.json")}
    assert set(plots) == panels and set(tables) == {"header", "slowest_trajectories", "turns"}
    turns = json.loads(tables["turns"].read_text())
    assert len(turns["data"]) == len(load_run(run_dir).events.turns)
    timeline = json.loads(plots["timeline_engine"].read_text())
    assert {t["type"] for t in timeline["data"]} >= {"bar"}
