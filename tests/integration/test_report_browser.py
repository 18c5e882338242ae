"""The run report opened in a real browser (Debian's chromium, headless; tests/integration/
browser.py): built from the recorded run + a simulator-style trace, every plot must have
rendered in the DOM (plotly draws an svg.main-svg into each), the page must log no
JavaScript error, and a screenshot is saved (the report of a short real run is checked
beside that run's other checks, in test_async_loop). Also: the report's figures and
tables logged to an offline wandb run."""

from __future__ import annotations

import json

from browser import check_in_browser, needs_chromium
from launch.report import ReportOptions, build_part, build_report, main
from launch.report_data import load_run, load_trace
from report_inputs import copy_recorded_run, write_trace


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
