"""Metrics logger sinks and the idle clocks."""

from __future__ import annotations

import json
from trainer.run.metrics import BusyClock, JsonlSink, MetricsLogger, compute_loop_metrics


class FailingSink:
    def write(self, step, metrics):
        raise OSError("disk full")

    def close(self):
        pass


def test_jsonl_sink_and_a_failing_sink_does_not_stop_logging(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    logger = MetricsLogger([FailingSink(), JsonlSink(path)])
    logger.log(1, {"reward/mean": 0.5, "loss/clip_frac": float("nan")})
    logger.log(2, {"reward/mean": 0.75})
    logger.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/mean"] == 0.5 and rows[0]["loss/clip_frac"] is None
    assert logger.keys_seen == {"reward/mean", "loss/clip_frac"}


def test_busy_clock_measures_the_idle_fraction():
    now = [0.0]
    clock = BusyClock(now=lambda: now[0])
    now[0] = 1.0  # idle 1 s
    clock.busy()
    now[0] = 4.0  # busy 3 s
    clock.idle()
    now[0] = 5.0  # idle 1 s
    assert clock.idle_ratio() == 2.0 / 5.0
    clock.busy()
    clock.reset()
    now[0] = 7.0
    assert clock.idle_ratio() == 0.0


def test_per_tool_counts_reach_the_metrics_and_the_turn_events():
    """Each call is counted under its tool's name (calls and failures), and turn events
    carry the names, so the report can split tool time by tool."""
    from envs.types import Group, Trajectory, Turn
    from trainer.run.metrics import compute_batch_metrics, turn_events

    turns = (Turn(0, 2, 0, 1, 3, "stop", 0, num_tool_calls=3, num_tool_errors=2,
                  tool_names=("price", "price", "(malformed)"),
                  failed_tool_names=("price", "(malformed)")),
             Turn(1, 6, 1, 1, 0, "stop", 0))
    traj = Trajectory("t", "g", 0, [1, 2], [3, 4], [1, 1], [-0.5, -0.5], [0, 0], "finished",
                      turns=turns, reward=1.0)
    metrics = compute_batch_metrics([Group("t", "g", (traj,))], 0)
    assert {k: v for k, v in metrics.items() if k.startswith(("rollout/tool_calls/",
                                                              "rollout/tool_errors/"))} == {
        "rollout/tool_calls/price": 2.0, "rollout/tool_errors/price": 1.0,
        "rollout/tool_calls/(malformed)": 1.0, "rollout/tool_errors/(malformed)": 1.0}
    events, dropped = turn_events(1, [Group("t", "g", (traj,))], 10)
    assert dropped == 0 and events[0]["tools"] == ["price", "price", "(malformed)"]
    assert "tools" not in events[1]


def test_startup_events_are_what_the_report_reads_back(tmp_path):
    """The run's phase and first_use events, written by EventSink, read by the report as
    labelled spans (the writer and the reader agree on the schema)."""
    from envs.progress import BuildRecord
    from launch.report_data import read_events
    from trainer.run.metrics import EventSink, startup_events

    events = startup_events([("load tasks", 10.0, 10.5), ("model (and warm start)", 10.5, 140.0)],
                            [BuildRecord("the warm start", "/c/warm-1", 11.0, 139.0, True),
                             BuildRecord("a task set", "/c/set", 5.0, 6.0, False)])
    path = tmp_path / "events.jsonl"
    EventSink(path, max_turns_per_step=10).write(events)
    problems: list[str] = []
    spans = read_events(path, problems).spans
    assert problems == []
    assert [(s.kind, s.label, s.t0, s.t1, s.detail) for s in spans] == [
        ("phase", "load tasks", 10.0, 10.5, ""),
        ("phase", "model (and warm start)", 10.5, 140.0, ""),
        ("first_use", "the warm start", 11.0, 139.0, "cached in /c/warm-1"),
        ("first_use", "a task set", 5.0, 6.0, "failed, nothing cached (/c/set)")]


def test_loop_metrics_sum_the_engines_refused_prefix_resets_and_their_cache_rates():
    import dataclasses

    from buffer.replay_buffer import BufferStats
    from rollout.engine import EngineStats

    buffer = BufferStats(**{f.name: (0 if f.type in ("int", int) else {})
                            for f in dataclasses.fields(BufferStats)})
    engines = {"e0": EngineStats(3, 0, 0, 0, 0.0, 100, 40, False, prefix_reset_refused=2),
               "e1": EngineStats(3, 0, 0, 0, 0.0, 60, 20, False, prefix_reset_refused=1)}
    out, cache = compute_loop_metrics(buffer, engines, [], (60, 20))
    assert out["perf/prefix_reset_refused"] == 3.0  # cumulative over the live engines
    assert out["rollout/prefix_cache_hit_rate_vllm"] == (60 - 20) / (160 - 60)
    assert cache == (160, 60)
    assert "rollout/kv_connector_hits" not in out  # no tier: no connector counters
    engines["e1"] = dataclasses.replace(engines["e1"], connector_queries=50, connector_hits=30)
    out, _ = compute_loop_metrics(buffer, engines, [], (60, 20))
    assert (out["rollout/kv_connector_queries"], out["rollout/kv_connector_hits"]) == (50.0, 30.0)
