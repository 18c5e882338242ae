"""The run report's readers and page on broken and partial inputs: torn, malformed and
missing files give a partial report that names what was skipped, or a ValueError that
says what to pass; never a crash. Plus the hand-checkable joins (staleness from events,
lanes, the step window)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from launch.report import build_part, build_report, latest_run, main, ReportOptions
from launch.report_data import (Events, event_series, load_run, load_trace, metric_series,
                                read_events, trajectories_by_step)
from launch.report_figures import pack_lanes, window_steps
from report_inputs import write_trace


def turn(step: int, traj: str, t0: float, *, turn: int = 0, version: int = 0, **extra) -> dict:
    row = {"kind": "turn", "step": step, "traj": traj, "task": "t", "turn": turn, "engine": "e0",
           "version": version, "t0": t0, "queue_s": 0.1, "generate_s": 0.5, "tool_s": 0.4,
           "tool_calls": 1, "tool_errors": 0, "tokens": 10}
    return {**row, **extra}


def write_lines(path: Path, rows: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def broken_run(folder: Path) -> Path:
    """A run folder with one good row of each kind and every kind of bad row."""
    folder.mkdir()
    write_lines(folder / "metrics.jsonl", [
        {"step": 0, "time": 100.0, "eval/reward_mean": 0.2},
        {"step": 1, "time": 110.0, "reward/mean": 0.5, "perf/trainer_idle_ratio": 0.3,
         "note": "text is skipped", "loss/kl": None, "flag": True},
        "[1, 2, 3]",
        {"time": 111.0, "reward/mean": 0.9},  # no step
        {"step": "2", "reward/mean": 0.9},
        {"step": 2, "time": 120.0, "reward/mean": 0.7, "staleness/mean": NaN_TEXT},
        '{"step": 3, "time": 130.0, "reward/me',  # torn last write
    ])
    with (folder / "events.jsonl").open("wb") as f:
        good = [turn(1, "g0/0", 100.0), turn(1, "g0/0", 101.0, turn=1, end="finished"),
                turn(2, "g1/0", 111.0, version=1, end="max_turns"),
                {"kind": "push", "step": 1, "version": 1, "t0": 109.0, "prepare_s": 0.2,
                 "gates_closed_s": 0.1},
                {"kind": "step", "step": 1, "t0": 100.0, "t1": 110.0, "trainer_wait_s": 3.0}]
        bad = [turn(1, "g0/1", None), turn(1, 7, 100.0), turn(1, "g0/2", 100.0, tool_s=-1.0),
               {"kind": "push", "step": 1, "t0": 109.0}, {"kind": "gate", "step": 1},
               {"no": "kind"}, turn(True, "g0/3", 100.0)]
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in good + bad))
        f.write(b"\xff\xfe not utf-8\n")
        f.write(b'{"kind": "turn", "step": 2, "traj": "g1/1", "t0": 11')  # torn
    (folder / "config.yaml").write_text("train: {num_steps: [unclosed\n")
    return folder


NaN_TEXT = float("nan")  # json.dumps writes NaN, which the reader must drop


def test_reader_keeps_the_good_rows_and_names_the_bad_ones(tmp_path):
    run = load_run(broken_run(tmp_path / "run"))
    assert [int(r["step"]) for r in run.metrics] == [0, 1, 2]
    assert run.metrics[1]["reward/mean"] == 0.5 and "note" not in run.metrics[1]
    assert "flag" not in run.metrics[1] and "loss/kl" not in run.metrics[1]
    assert "staleness/mean" not in run.metrics[2]
    ev = run.events
    assert (len(ev.turns), len(ev.pushes), len(ev.steps)) == (3, 1, 1)
    text = "\n".join(run.problems)
    assert "metrics.jsonl line 3: a JSON list" in text
    assert "metrics.jsonl line 4: no integer 'step'" in text
    assert "metrics.jsonl line 7: not JSON" in text
    assert "events.jsonl line 6: turn event without a number 't0'" in text
    assert "events.jsonl line 7: turn event without a string 'traj'" in text
    assert "negative duration" in text
    assert "more bad rows skipped" in text  # past the first five of a file, counted
    assert "'gate' x1" in text and "'None' x1" in text  # unknown kinds are ignored, said
    assert "config.yaml: not readable YAML" in text and run.config == {}


def test_a_broken_run_gives_a_partial_report_that_lists_its_problems(tmp_path):
    folder = broken_run(tmp_path / "run")
    out = build_report(folder, tmp_path / "report.html")
    page = out.read_text()
    assert "Input problems" in page and "events.jsonl line 6" in page
    assert 'data-report-figure="timeline_engine"' in page
    assert 'data-report-figure="reward"' in page
    assert "g0/0" in page  # the good trajectory is on the timeline


def test_events_alone_and_metrics_alone_are_partial_reports(tmp_path):
    only_events, only_metrics = tmp_path / "e", tmp_path / "m"
    only_events.mkdir()
    only_metrics.mkdir()
    write_lines(only_events / "events.jsonl", [turn(1, "g0/0", 5.0, end="finished")])
    write_lines(only_metrics / "metrics.jsonl", [{"step": 1, "reward/mean": 0.5}])
    part = build_part(load_run(only_events), ReportOptions())
    assert {p.key for p in part.panels} >= {"timeline_engine", "env_by_task"}
    assert any("no metrics.jsonl" in p for p in part.problems)
    part = build_part(load_run(only_metrics), ReportOptions())
    assert [p.key for p in part.panels] == ["reward"]
    assert any("no events.jsonl" in p for p in part.problems)


def test_empty_files_give_a_page_without_plots(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("")
    (folder / "events.jsonl").write_text("\n\n")
    page = build_report(folder, tmp_path / "r.html").read_text()
    assert "No plot: the input holds no metric or event" in page


def test_clear_errors_for_what_is_not_a_run_or_a_trace(tmp_path, capsys):
    with pytest.raises(ValueError, match="not a folder: pass a run folder"):
        load_run(tmp_path / "missing")
    with pytest.raises(ValueError, match="neither metrics.jsonl nor events.jsonl"):
        load_run(tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        load_trace(tmp_path / "trace.jsonl")
    (tmp_path / "junk.jsonl").write_text("hello\n{\"kind\": \"turn\"}\n")
    with pytest.raises(ValueError, match="no turn, push or step events in it"):
        load_trace(tmp_path / "junk.jsonl")
    with pytest.raises(ValueError, match="no run folder"):
        latest_run(tmp_path)
    assert main([str(tmp_path / "missing")]) == 2
    assert "report error:" in capsys.readouterr().err
    assert main([]) == 2
    assert "nothing to report" in capsys.readouterr().err


def test_latest_run_is_the_one_written_last(tmp_path):
    for name, age in (("a", 30), ("b", 10), ("c", 20)):
        (tmp_path / name).mkdir()
        path = tmp_path / name / "metrics.jsonl"
        path.write_text('{"step": 1}\n')
        os.utime(path, (time.time() - age, time.time() - age))
    (tmp_path / "not-a-run").mkdir()
    assert latest_run(tmp_path).name == "b"


def test_event_series_match_hand_computed_values(tmp_path):
    path = tmp_path / "events.jsonl"
    # step 3 trains two trajectories: one from version 1 (stale 1), one from 0 and 2 (stale 2)
    write_lines(path, [turn(3, "g0/0", 0.0, version=1, end="finished", tokens=7),
                       turn(3, "g0/1", 0.0, version=2, tokens=5),
                       turn(3, "g0/1", 2.0, turn=1, version=0, end="timeout", tokens=4),
                       {"kind": "step", "step": 3, "t0": 0.0, "t1": 4.0, "trainer_wait_s": 1.0},
                       {"kind": "push", "step": 3, "version": 3, "t0": 3.5, "prepare_s": 0.25,
                        "gates_closed_s": 0.125}])
    series = event_series(read_events(path, []))
    assert series["staleness/mean"] == ([3], [1.5])
    assert series["staleness/max"] == ([3], [2.0])
    assert series["rollout/tokens_generated"] == ([3], [16.0])
    assert series["perf/trainer_idle_ratio"] == ([3], [0.25])
    assert series["perf/weight_sync_s"] == ([3], [0.375])
    assert series["end/finished"] == ([3], [1.0]) and series["end/timeout"] == ([3], [1.0])
    spans = trajectories_by_step(read_events(path, []).turns)[3]
    assert sorted(s.duration_s for s in spans) == [1.0, 3.0]


def test_lanes_reuse_a_lane_only_after_its_trajectory_ended(tmp_path):
    path = tmp_path / "events.jsonl"
    # a: 0-1 s, b: 0.5-1.5 s overlaps a, c: 1.2-2.2 s starts after a ended
    write_lines(path, [turn(1, "a", 0.0), turn(1, "b", 0.5), turn(1, "c", 1.2),
                       turn(1, "d", 0.0, engine="e1")])
    spans = trajectories_by_step(read_events(path, []).turns)[1]
    rows = pack_lanes(spans, {(s.step, s.traj): s.engine for s in spans})
    lane = {traj: rows.lane_of[(1, traj)] for traj in "abcd"}
    assert lane["a"] == lane["c"] != lane["b"]
    assert rows.bands == [("e0", 0, 2), ("e1", 2, 1)] and lane["d"] == 2


def test_window_keeps_the_latest_steps_that_fit():
    turns = [read_one(turn(s, f"g{s}/{i}", float(s))) for s in (1, 2, 3) for i in range(4)]
    steps, note = window_steps(Events(turns=turns), max_turns=9)
    assert steps == [2, 3] and "steps 2-3 of 1-3" in note
    assert window_steps(Events(turns=turns), max_turns=100) == ([1, 2, 3], "")
    assert window_steps(Events(turns=turns), max_turns=1)[0] == [3]  # never empty


def read_one(row: dict):
    from launch.report_data import _turn

    return _turn(row)


def test_a_trace_alone_draws_sandbox_lanes_tools_and_drop_bias(tmp_path):
    trace = write_trace(tmp_path / "sim.jsonl")
    part = build_part(load_trace(trace), ReportOptions(), trace=True)
    keys = {p.key for p in part.panels}
    assert {"trace_timeline_engine", "trace_timeline_sandbox", "trace_drop_bias",
            "trace_staleness", "trace_idle", "trace_throughput"} <= keys
    by_tool = next(p for p in part.panels if p.key == "trace_env_by_tool")
    assert set(by_tool.figure.data[0].x) == {"bash", "python"}
    drop = next(p for p in part.panels if p.key == "trace_drop_bias").figure
    assert len(drop.data) == 4  # staleness by turns, by length; drop share, drops by length
    assert list(drop.data[1].x) == ["Q1", "Q2", "Q3", "Q4"]
    assert list(drop.data[3].x) == ["<1024"] and list(drop.data[3].y) == [4]
    share = dict(zip(drop.data[2].x, drop.data[2].y))
    assert share[4] > 0 and all(v == 0 for b, v in share.items() if b != 4)  # drops: 4 turns
    assert main(["--trace", str(trace)]) == 0
    assert trace.with_suffix(".html").is_file()


def test_stale_drops_come_from_the_buffer_counters_else_from_drop_events():
    from launch.report_figures import StaleDrops

    series = {"staleness/dropped_by_turns/5": ([1, 2], [1.0, 3.0]),  # cumulative: last wins
              "staleness/dropped_by_length/<1024": ([2], [2.0]), "reward/mean": ([1], [0.1])}
    found = StaleDrops.find(series, Events())
    assert found.by_turns == {5: 3} and found.by_length == {"<1024": 2}
    drop = {"kind": "drop", "step": 1, "reason": "stale", "turns": 3, "tokens": 5000}
    from launch.report_data import _drop

    found = StaleDrops.find({}, Events(drops=[_drop(drop), _drop({**drop, "reason": "failed"})]))
    assert found.by_turns == {3: 1} and found.by_length == {"<16384": 1}


def test_length_buckets_have_their_edges_on_the_upper_side():
    from buffer.replay_buffer import length_bucket

    expected = {0: "<256", 255: "<256", 256: "<1024", 1023: "<1024", 1024: "<4096",
                16383: "<16384", 65535: "<65536", 65536: ">=65536", 10**6: ">=65536"}
    assert {n: length_bucket(n) for n in expected} == expected


def test_wandb_logging_is_skipped_with_a_reason_when_the_run_had_it_off(tmp_path):
    from launch.report import log_report_to_run_wandb

    folder = tmp_path / "run"
    folder.mkdir()
    write_lines(folder / "metrics.jsonl", [{"step": 1, "reward/mean": 0.5}])
    (folder / "config.yaml").write_text("logging: {wandb_mode: disabled}\n")
    assert "not logged (the run had logging.wandb_mode=disabled" in log_report_to_run_wandb(folder)


def test_a_timeline_window_draws_only_its_own_pushes(tmp_path):
    from launch.report_figures import build_timeline

    events = load_trace(write_trace(tmp_path / "sim.jsonl")).events
    last = sum(1 for u in events.turns if u.step == 4)
    whole = build_timeline(events).figure
    window = build_timeline(events, max_turns=last).figure
    pushes = [t for t in window.data if t.name == "weight push"][0]
    assert len([t for t in whole.data if t.name == "weight push"][0].x) == 4
    assert 1 <= len(pushes.x) < 4  # the push after step 4 (and maybe step 3's, at its start)
    assert min(window.layout.xaxis.range) > 0  # zoomed onto step 4, times still from the run start


def test_the_events_of_a_recorded_run_agree_with_its_metrics():
    """The join the timeline rests on: per step, the turn events rebuild the trained
    trajectories' staleness, tokens and end reasons exactly as the controller logged them."""
    from report_inputs import RECORDED_RUN

    run = load_run(RECORDED_RUN)
    assert run.problems == []
    from_events = event_series(run.events)
    from_metrics = {k: v for k, v in metric_series(run.metrics).items() if k in from_events}
    keys = {"staleness/mean", "staleness/max", "rollout/tokens_generated", "end/finished"}
    assert keys <= set(from_metrics)
    for key in keys:
        assert from_events[key] == from_metrics[key], key


def user_run(folder: Path, num_steps: int = 12) -> Path:
    """A run of the example's ShopReward (components correct, answered, used_tools) with
    per-tool counts, the trainer's own reward/* keys and a transcripts.jsonl of 3 lines."""
    folder.mkdir()
    rows = []
    for step in range(1, num_steps + 1):
        row = {"step": step, "reward/mean": 0.5, "reward/errors_total": 2.0,
               "reward/hack_conftest": 1.0, "reward/graded_in_image": 4.0, "reward/timeout": 1.0,
               "reward/correct": step / 10, "reward/used_tools": 1.0,
               "rollout/tool_calls": 6.0, "rollout/tool_errors": 3.0,  # totals: not a tool
               "rollout/tool_calls/price": 4.0, "rollout/tool_errors/price": 1.0,
               "rollout/tool_calls/<b>x</b>": 2.0, "rollout/tool_errors/<b>x</b>": 2.0}
        if step <= 3:
            row["reward/answered"] = float(step)
        if step == 1:
            row["rollout/tool_errors/(malformed)"] = 1.0
        rows.append(row)
    write_lines(folder / "metrics.jsonl", rows)
    write_lines(folder / "transcripts.jsonl", [{"step": 1, "reward": 1.0}, {"step": 1}, "",
                                               {"step": 2}])
    return folder


def section(page: str, title: str) -> str:
    """The HTML of one table section of a page: from its heading to its caption."""
    start = page.index(f">{title}</h3>")
    return page[start:page.index('<p class="caption">', start)]


def test_reward_components_are_the_users_with_first_and_last_steps(tmp_path):
    part = build_part(load_run(user_run(tmp_path / "run")), ReportOptions())
    table = next(t for t in part.tables if t.key == "reward_components_table")
    # correct = step / 10: steps 1-5 average 0.3, steps 8-12 average 1.0; answered has
    # 3 steps, too few to average: its first and last
    assert table.rows == [["answered", "1.000 (step 1)", "3.000 (step 3)", "+2.000", "3"],
                          ["correct", "0.300 (steps 1-5)", "1.000 (steps 8-12)", "+0.700", "12"],
                          ["used_tools", "1.000 (steps 1-5)", "1.000 (steps 8-12)", "+0.000", "12"]]
    panel = next(p for p in part.panels if p.key == "reward_components")
    assert [t.name for t in panel.figure.data] == ["reward/answered", "reward/correct",
                                                   "reward/used_tools"]


def test_tool_errors_per_tool_are_summed_and_sorted_by_errors(tmp_path):
    run = user_run(tmp_path / "run")
    part = build_part(load_run(run), ReportOptions())
    table = next(t for t in part.tables if t.key == "tool_errors")
    assert table.head == ("tool", "calls", "errors", "error rate")
    assert table.rows == [["<b>x</b>", "24", "24", "100.0%"], ["price", "48", "12", "25.0%"],
                          ["(malformed)", "0", "1", "-"]]
    page = build_report(run, tmp_path / "report.html").read_text()
    html_table = section(page, "Tool calls and errors per tool")
    assert "<tr><td>&lt;b&gt;x&lt;/b&gt;</td><td>24</td><td>24</td><td>100.0%</td></tr>" in html_table
    assert "<b>x</b>" not in html_table
    assert '<a href="#tool_errors">' in page and '<a href="#reward_components_table">' in page


def test_the_transcripts_link_is_relative_to_the_reports_folder(tmp_path, monkeypatch):
    run = user_run(tmp_path / "my run")
    page = build_report(run, tmp_path / "reports" / "r.html").read_text()
    assert ('<th>transcripts</th><td><a href="../my%20run/transcripts.jsonl">../my run/'
            'transcripts.jsonl</a> (3 transcripts, one JSON object a line)</td>') in page
    assert main([str(run)]) == 0  # the default: report.html beside the transcripts
    assert '<a href="transcripts.jsonl">transcripts.jsonl</a>' in (run / "report.html").read_text()

    def no_relative_path(path, start):
        raise ValueError("path is on mount 'D:', start on mount 'C:'")

    monkeypatch.setattr("launch.report.os.path.relpath", no_relative_path)
    page = build_report(run, tmp_path / "reports" / "r.html").read_text()
    absolute = (run / "transcripts.jsonl").resolve()
    assert f'<a href="{absolute.as_uri()}">{absolute}</a>' in page


def test_a_run_without_components_tool_counts_or_transcripts_renders_without_them(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    write_lines(folder / "metrics.jsonl", [
        {"step": s, "reward/mean": 0.5, "reward/errors_total": 0.0, "reward/reward_error": 0.0,
         "rollout/tool_calls": 4.0, "rollout/tool_errors": 1.0} for s in (1, 2)])
    part = build_part(load_run(folder), ReportOptions())
    assert part.tables == [] and "transcripts" not in dict(part.header)
    assert "reward_components" not in {p.key for p in part.panels}
    page = build_report(folder, tmp_path / "report.html").read_text()
    assert "Reward components" not in page and "errors per tool" not in page
    assert 'data-report-figure="reward"' in page


def test_the_reward_keys_docs_metrics_lists_as_the_trainers_own_are_not_components():
    from launch.report_data import is_reward_component

    docs = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    keys = re.findall(r"^\| `(reward/[^`]+)`", docs, flags=re.MULTILINE)
    assert "reward/<component>" in keys and len(keys) > 5
    for key in keys:
        if key != "reward/<component>":  # a family such as reward/hack_<finding>: one member
            assert not is_reward_component(re.sub(r"<[^>]+>", "x", key)), key
    assert all(is_reward_component(f"reward/{n}") for n in ("correct", "answered", "used_tools"))
    assert not is_reward_component("reward/std") and not is_reward_component("rollout/turns")


def startup_rows(origin: float) -> list[dict]:
    """The start of a run as trainer.run.system writes it: a first-use build during the
    checks, the phases of the start, then the first turn at `origin` + 130."""
    return [{"kind": "first_use", "what": "the warm start of tiny (4096 demonstrations)",
             "where": "/cache/models/warm-1", "t0": origin, "t1": origin + 100.0, "ok": True},
            {"kind": "first_use", "what": "the task set", "t0": origin + 100.0,
             "t1": origin + 101.0, "ok": False},
            {"kind": "phase", "name": "model (and warm start)", "t0": origin + 101.0,
             "t1": origin + 102.0},
            {"kind": "phase", "name": "start engines, sandbox pools, train ranks",
             "t0": origin + 102.0, "t1": origin + 130.0}]


def test_start_up_phases_and_first_use_builds_are_labelled_bands(tmp_path):
    from launch.report_figures import SPAN_COLORS, build_timeline

    folder = tmp_path / "run"
    folder.mkdir()
    bad = [{"kind": "phase", "name": "x", "t0": 5.0}, {"kind": "first_use", "t0": 1.0, "t1": 2.0},
           {"kind": "phase", "name": "y", "t0": 5.0, "t1": 4.0}]
    write_lines(folder / "events.jsonl", startup_rows(1000.0) + bad + [
        turn(1, "g0/0", 1130.0, end="finished"),
        {"kind": "step", "step": 1, "t0": 1130.0, "t1": 1132.0, "trainer_wait_s": 1.0}])
    run = load_run(folder)
    spans = run.events.spans
    assert [(s.kind, s.label, s.t1 - s.t0) for s in spans] == [
        ("first_use", "the warm start of tiny (4096 demonstrations)", 100.0),
        ("first_use", "the task set", 1.0), ("phase", "model (and warm start)", 1.0),
        ("phase", "start engines, sandbox pools, train ranks", 28.0)]
    assert [s.detail for s in spans[:2]] == ["cached in /cache/models/warm-1",
                                             "failed, nothing cached"]
    text = "\n".join(run.problems)
    assert "line 5: phase event without a number 't1'" in text
    assert "line 6: first_use event without a string 'what'" in text
    assert "line 7: phase event ending before it starts" in text

    figure = build_timeline(run.events).figure
    bands = [s for s in figure.layout.shapes if s.type == "rect"]
    assert [(b.fillcolor, b.x0, b.x1) for b in bands] == [
        (SPAN_COLORS["phase"], 101.0, 102.0), (SPAN_COLORS["phase"], 102.0, 130.0),
        (SPAN_COLORS["first_use"], 0.0, 100.0), (SPAN_COLORS["first_use"], 100.0, 101.0)]
    labels = [a.text for a in figure.layout.annotations]  # bands of 1 s of 132: no label
    assert labels == ["start engines, sandbox pools, train ranks",
                      "first use: the warm start of tiny (4096 demonstrations)"]
    low, high = figure.layout.xaxis.range
    assert low < 0 and high > 130.0  # the gap before the first turn is on the axis
    marks = {t.name: list(t.hovertext) for t in figure.data if t.name and "start" in t.name
             or t.name and "first-use" in t.name}
    assert len(marks["start-up phase"]) == 2  # every band hovers, labelled or not
    assert "failed, nothing cached" in marks["first-use build (cached after)"][1]
    assert "cached in /cache/models/warm-1" in marks["first-use build (cached after)"][0]


def test_a_window_of_later_steps_leaves_the_start_out(tmp_path):
    from launch.report_figures import build_timeline

    events = load_trace(write_trace(tmp_path / "sim.jsonl")).events
    events.spans.extend(read_events(_rows_file(tmp_path, startup_rows(-200.0)), []).spans)
    last = sum(1 for u in events.turns if u.step == 4)
    whole = build_timeline(events).figure
    window = build_timeline(events, max_turns=last).figure
    assert len(whole.layout.annotations) == 2 and min(whole.layout.xaxis.range) < 0
    assert len(window.layout.annotations) == 0 and min(window.layout.xaxis.range) > 200


def _rows_file(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "start.jsonl"
    write_lines(path, rows)
    return path
