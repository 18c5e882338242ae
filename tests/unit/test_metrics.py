"""Metrics logger sinks and the idle clocks."""

from __future__ import annotations

import json
from pathlib import Path
from trainer.run.metrics import BusyClock, JsonlSink, MetricsLogger, StateClock, compute_loop_metrics


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


def test_state_clock_splits_the_window_between_named_states():
    now = [0.0]
    clock = StateClock(now=lambda: now[0])
    now[0] = 1.0  # in no state 1 s
    clock.enter("staleness")
    now[0] = 4.0  # 3 s
    clock.enter("sandboxes")
    now[0] = 5.0  # 1 s
    clock.enter(None)
    now[0] = 8.0  # in none 3 s
    assert clock.ratio("staleness") == 3.0 / 8.0 and clock.ratio("sandboxes") == 1.0 / 8.0
    clock.enter("staleness")
    clock.reset()  # the state goes on into the next window
    now[0] = 10.0
    assert clock.ratio("staleness") == 1.0 and clock.ratio("sandboxes") == 0.0


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


def _image(start: int, num_tokens: int, num_image_tokens: int):
    from envs.types import Image, TrajectoryImage

    return TrajectoryImage(start, num_tokens, Image(b"\x89PNG not decoded here"), (7,), {}, num_image_tokens)


def test_image_metrics_count_image_tokens_per_row_and_their_share_of_the_context():
    """Two rows of one step: 30 + 10 ids holding two images (runs of 18 and 6 ids, 16 and 4
    image tokens: one in the prompt, one a tool's screenshot in the response, mask 0) and
    20 + 20 ids of text only. Per row: (20 + 0) / 2 image tokens, 2 / 2 images; share:
    20 of the 80 ids."""
    import dataclasses

    from envs.types import Group, Trajectory
    from trainer.run.metrics import compute_batch_metrics

    response_mask = [1, 1, 0, 0, 0, 0, 0, 0, 1, 1]  # the screenshot's run: ids 32..37
    versions = [0 if m else -1 for m in response_mask]
    with_images = Trajectory("t", "g", 0, list(range(30)), list(range(10)), response_mask, [0.0] * 10,
                             versions, "finished", reward=1.0, images=(_image(4, 18, 16), _image(32, 6, 4)))
    text = Trajectory("t", "g", 1, list(range(20)), list(range(20)), [1] * 20, [0.0] * 20, [0] * 20,
                      "finished", reward=0.0)
    metrics = compute_batch_metrics([Group("t", "g", (with_images, text))], 0)
    images = {k: v for k, v in metrics.items() if k.startswith("rollout/image")}
    assert images == {"rollout/image_tokens": 10.0, "rollout/image_tokens_total": 20.0,
                      "rollout/images_per_trajectory": 1.0, "rollout/image_token_fraction": 0.25}
    docs = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    assert [k for k in images if f"| `{k}` |" not in docs] == []  # every image key is documented
    # A step without images (every step of a text run) logs none of them.
    text_only = compute_batch_metrics([Group("t", "g", (dataclasses.replace(text, index=0),))], 0)
    assert not [k for k in text_only if k.startswith("rollout/image")]
