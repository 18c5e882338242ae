"""Run-report figures: plotly figures built from `launch.report_data` records, one
function per panel. Each returns a `Panel` (figure plus the sentence that says how to read
it) or None when its inputs are absent, so a partial run gives a partial report.

plotly is imported inside the functions: `launch.report --help` and the data checks stay
fast, and the rest of the package never pays for it.
"""

from __future__ import annotations

import heapq
import math
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from buffer.replay_buffer import LENGTH_EDGES, length_bucket
from launch.report_data import (Events, Series, SpanEvent, TrajectorySpan, TurnEvent,
                                is_reward_component, trajectories_by_step)

if TYPE_CHECKING:
    import plotly.graph_objects as go

QUEUE_COLOR, TOOL_COLOR, ERROR_COLOR, PUSH_COLOR = "#b8b8b8", "#f28e2b", "#d62728", "#e0245e"
SPAN_COLORS = {"phase": "#9db4c0", "first_use": "#f6c85f"}  # start-up parts, first-use builds
MAX_BOXES = 20  # per-task / per-tool panels show the busiest this many
VERSION_SCALE = "Viridis"
K = TypeVar("K", int, str)


@dataclass(frozen=True, slots=True)
class Panel:
    key: str  # stable id: the HTML anchor and the wandb key
    title: str
    figure: "go.Figure"
    caption: str


def _layout(fig: "go.Figure", title: str, height: int = 340, **axes: object) -> "go.Figure":
    fig.update_layout(title=dict(text=title, x=0.01), height=height, template="plotly_white",
                      margin=dict(l=60, r=30, t=60, b=45), hovermode="closest",
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0.35), **axes)
    return fig


# --- timeline -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TimelineRows:
    """Trajectories packed into lanes: within a row group (an engine or a sandbox) a
    trajectory takes the lowest lane free when it starts, so a band's height is the
    group's peak concurrency."""

    lane_of: dict[tuple[int, str], int]
    bands: list[tuple[str, int, int]]  # (label, first lane, lanes)


def pack_lanes(spans: Sequence[TrajectorySpan], row_of: dict[tuple[int, str], str]) -> TimelineRows:
    by_row: dict[str, list[TrajectorySpan]] = defaultdict(list)
    for s in spans:
        by_row[row_of[(s.step, s.traj)]].append(s)
    lane_of: dict[tuple[int, str], int] = {}
    bands, offset = [], 0
    for label in sorted(by_row):
        busy: list[tuple[float, int]] = []  # (end, lane) of trajectories still running
        free: list[int] = []
        lanes = 0
        for s in sorted(by_row[label], key=lambda s: s.t0):
            while busy and busy[0][0] <= s.t0:
                heapq.heappush(free, heapq.heappop(busy)[1])
            lane = heapq.heappop(free) if free else lanes
            lanes = max(lanes, lane + 1)
            heapq.heappush(busy, (s.t1, lane))
            lane_of[(s.step, s.traj)] = offset + lane
        bands.append((label, offset, lanes))
        offset += lanes
    return TimelineRows(lane_of, bands)


def window_steps(events: Events, max_turns: int) -> tuple[list[int], str]:
    """The latest steps whose turns fit under `max_turns` (the steady state, after
    warm-up), and a note when that is not all of them."""
    counts = Counter(u.step for u in events.turns)
    steps = sorted(counts)
    kept, total = [], 0
    for step in reversed(steps):
        if kept and total + counts[step] > max_turns:
            break
        kept.append(step)
        total += counts[step]
    kept.reverse()
    note = "" if len(kept) == len(steps) else (
        f" Shown: steps {kept[0]}-{kept[-1]} of {steps[0]}-{steps[-1]} ({total} of "
        f"{sum(counts.values())} turns; raise --max-timeline-turns for more).")
    return kept, note


def slowest_spans(spans_by_step: dict[int, list[TrajectorySpan]], k: int) -> list[TrajectorySpan]:
    """The k longest trajectories (first turn's gate to last turn's end) of each step:
    the ones that held it."""
    return [s for step in sorted(spans_by_step)
            for s in sorted(spans_by_step[step], key=lambda s: -s.duration_s)[:k]]


def _hover(u: TurnEvent, slow: bool) -> str:
    text = (f"<b>{u.traj}</b> turn {u.turn} (trained at step {u.step})<br>task {u.task}<br>"
            f"engine {u.engine} · version {u.version}"
            + (f" · sandbox {u.sandbox}" if u.sandbox else "")
            + f"<br>queue {u.queue_s:.3g}s · generate {u.generate_s:.3g}s · tool {u.tool_s:.3g}s"
            f"<br>{u.tokens} tokens · {u.tool_calls} tool calls ({u.tool_errors} errors)")
    if u.tools:
        text += "<br>tools " + ", ".join(u.tools)
    if u.end:
        text += f"<br>ended: {u.end}"
    return text + ("<br><b>one of the slowest of its step</b>" if slow else "")


@dataclass(slots=True)
class _BarColumns:
    """One segment kind's horizontal bars, column by column (what go.Bar takes)."""

    base: list[float] = field(default_factory=list)  # start, seconds since the origin
    x: list[float] = field(default_factory=list)  # length, seconds
    y: list[int] = field(default_factory=list)  # lane
    text: list[str] = field(default_factory=list)  # hover text
    line: list[float] = field(default_factory=list)  # outline width (slow trajectories)
    color: list[int | str | None] = field(default_factory=list)  # policy version, or a colour


def _segments(turns: Sequence[TurnEvent], lane_of: dict[tuple[int, str], int], origin: float,
              slow: set[tuple[int, str]]) -> dict[str, _BarColumns]:
    """Bar columns per segment kind: each turn is queue, then generate, then tool."""
    parts = {k: _BarColumns() for k in ("queue", "generate", "tool")}
    for u in turns:
        key = (u.step, u.traj)
        start = u.t0 - origin
        is_slow = key in slow
        for kind, length in (("queue", u.queue_s), ("generate", u.generate_s), ("tool", u.tool_s)):
            if length > 0:
                col = parts[kind]
                col.base.append(round(start, 3))
                col.x.append(round(length, 4))
                col.y.append(lane_of[key])
                # the whole story on the generate bar; the others say only their part
                # (three full texts a turn would triple the page)
                col.text.append(_hover(u, is_slow) if kind == "generate" else
                                   f"<b>{u.traj}</b> turn {u.turn}: {kind} {length:.3g}s"
                                   + (f" ({', '.join(u.tools)})" if kind == "tool" and u.tools else ""))
                col.line.append(1.6 if is_slow else 0.0)
                col.color.append(u.version if kind == "generate" else
                                    ERROR_COLOR if u.tool_errors else TOOL_COLOR)
            start += length
    return parts


def _push_marks(events: Events, origin: float, top: float,
                ) -> tuple[list[dict[str, object]], list[go.Scatter]]:
    """Shapes (a red band while the turn gates were closed for a push, a dotted line when
    they closed) and a trace of hoverable markers above them. Shapes are plain dicts set
    once: adding them one by one copies the layout each time."""
    import plotly.graph_objects as go

    shapes: list[dict[str, object]] = []
    xs, texts = [], []
    for p in events.pushes:
        closed = p.t0 + p.prepare_s - origin
        shapes.append(dict(type="rect", x0=closed, x1=closed + max(p.gates_closed_s, 1e-3), y0=0,
                           y1=1, yref="paper", fillcolor=PUSH_COLOR, opacity=0.25, line_width=0,
                           layer="below"))
        shapes.append(dict(type="line", x0=closed, x1=closed, y0=0, y1=1, yref="paper",
                           line=dict(color=PUSH_COLOR, width=1, dash="dot")))
        xs.append(closed)
        texts.append(f"push of version {p.version} (after step {p.step})<br>prepare "
                     f"{p.prepare_s:.3g}s (gates open) · gates closed {p.gates_closed_s:.3g}s")
    if not xs:
        return shapes, []
    return shapes, [go.Scatter(x=xs, y=[top] * len(xs), mode="markers", name="weight push",
                               marker=dict(symbol="triangle-down", size=9, color=PUSH_COLOR),
                               hovertext=texts, hoverinfo="text")]


def _span_marks(spans: Sequence[SpanEvent], origin: float, top: float, min_label_s: float,
                ) -> tuple[list[dict[str, object]], list[dict[str, object]], list[go.Scatter]]:
    """Shapes (a band over each phase of the start and each first-use build, builds on
    top), the labels of those at least `min_label_s` long (shorter ones would print over
    each other; their markers still hover), and hoverable markers above them."""
    import plotly.graph_objects as go

    shapes: list[dict[str, object]] = []
    labels: list[dict[str, object]] = []
    traces = []
    for kind, name in (("phase", "start-up phase"), ("first_use", "first-use build (cached after)")):
        mine = [b for b in spans if b.kind == kind]
        for b in mine:
            x0, x1 = b.t0 - origin, max(b.t1 - origin, b.t0 - origin + 1e-3)
            shapes.append(dict(type="rect", x0=x0, x1=x1, y0=0, y1=1, yref="paper", line_width=0,
                               fillcolor=SPAN_COLORS[kind], opacity=0.3 if kind == "phase" else 0.45,
                               layer="below"))
            if b.t1 - b.t0 < min_label_s:
                continue
            labels.append(dict(x=(x0 + x1) / 2, y=1, yref="paper", yanchor="top", textangle=-90,
                               showarrow=False, font=dict(size=10, color="#333"),
                               text=("first use: " if kind == "first_use" else "") + b.label))
        if mine:
            traces.append(go.Scatter(
                x=[(b.t0 + b.t1) / 2 - origin for b in mine], y=[top] * len(mine), mode="markers",
                name=name, marker=dict(symbol="square", size=9, color=SPAN_COLORS[kind]),
                hoverinfo="text", hovertext=[f"{name}: {b.label}<br>{b.t1 - b.t0:.1f} s"
                                             + (f"<br>{b.detail}" if b.detail else "") for b in mine]))
    return shapes, labels, traces


def _bar_traces(parts: dict[str, _BarColumns], versions: Sequence[int]) -> list[go.Bar | go.Scatter]:
    """The queue / generate / tool bars, and an empty trace that carries the version
    colour bar. Versions are mapped to colours here: plotly's bars accept numbers with a
    colour scale but warn per bar in the browser console."""
    import plotly.graph_objects as go
    from plotly.colors import sample_colorscale

    low, high = min(versions), max(max(versions), min(versions) + 1)
    shades = sample_colorscale(VERSION_SCALE, [i / (high - low) for i in range(high - low + 1)])
    palette = dict(zip(range(low, high + 1), shades))
    names = {"queue": "queue (turn gate, sandbox)", "generate": "generate (colour: policy version)",
             "tool": "tool (red: with errors)"}
    traces: list[go.Bar | go.Scatter] = []
    for kind, name in names.items():
        col = parts[kind]
        if not col.x:
            continue
        color = ([palette.get(v, QUEUE_COLOR) if isinstance(v, int) else QUEUE_COLOR
                  for v in col.color] if kind == "generate"
                 else col.color if kind == "tool" else QUEUE_COLOR)
        traces.append(go.Bar(orientation="h", base=col.base, x=col.x, y=col.y, width=0.8,
                             name=name,
                             marker=dict(color=color, line=dict(width=col.line, color="#111")),
                             hovertext=col.text, hoverinfo="text"))
    traces.append(go.Scatter(x=[None], y=[None], mode="markers", showlegend=False, hoverinfo="skip",
                             marker=dict(colorscale=VERSION_SCALE, cmin=low, cmax=high, color=[low],
                                         showscale=True, colorbar=dict(
                                             title="policy<br>version", len=0.6, y=0.4,
                                             dtick=max(1, math.ceil((high - low) / 8))))))
    return traces


def build_timeline(events: Events, *, by: str = "engine", max_turns: int = 6000,
                   slowest_per_step: int = 3) -> Panel | None:
    """Trajectory timeline: one lane per concurrently running trajectory, grouped by
    engine (or sandbox), bars for queue / generate / tool, generate coloured by policy
    version, weight pushes marked, the slowest trajectories of each step outlined."""
    import plotly.graph_objects as go

    turns = [u for u in events.turns if u.sandbox] if by == "sandbox" else list(events.turns)
    if not turns:
        return None
    steps, note = window_steps(Events(turns=turns), max_turns)
    keep = set(steps)
    turns = [u for u in turns if u.step in keep]
    spans_by_step = trajectories_by_step(turns)
    spans = [s for ss in spans_by_step.values() for s in ss]
    row_of = {(s.step, s.traj): (s.engine if by == "engine" else s.turns[0].sandbox or "?")
              for s in spans}
    rows = pack_lanes(spans, row_of)
    slow = {(s.step, s.traj) for s in slowest_spans(spans_by_step, slowest_per_step)}
    origin = min([u.t0 for u in events.turns] + [p.t0 for p in events.pushes]
                 + [s.t0 for s in events.steps] + [b.t0 for b in events.spans])
    versions = [u.version for u in turns if u.version is not None] or [0]
    lanes = sum(n for _, _, n in rows.bands)
    # x stays seconds since the run's first event; a window shows its steps' pushes and
    # those that fell while its trajectories ran
    start, end = min(s.t0 for s in spans), max(s.t1 for s in spans)
    shown = Events(pushes=[p for p in events.pushes
                           if p.step in keep or start <= p.t0 + p.prepare_s <= end])
    end = max([end] + [p.t0 + p.prepare_s + p.gates_closed_s for p in shown.pushes])
    # The start's phases and first-use builds: those inside the window, and those before
    # it when it holds the first step (the gap before the first turn, labelled).
    has_first_step = steps[0] == min(u.step for u in events.turns)
    bands = [b for b in events.spans if b.t0 <= end and (b.t1 >= start or has_first_step)]
    start = min([start] + [b.t0 for b in bands])
    end = max([end] + [b.t1 for b in bands])
    pad = 0.02 * (end - start) + 0.1
    shapes, marks = _push_marks(shown, origin, lanes + 0.5)
    band_shapes, labels, band_marks = _span_marks(bands, origin, lanes + 0.5,
                                                  0.02 * (end - start))
    shapes = band_shapes + shapes
    marks += band_marks
    shapes += [dict(type="line", x0=0, x1=1, xref="paper", y0=first - 0.5, y1=first - 0.5,
                    line=dict(color="#444", width=1)) for _, first, _ in rows.bands[1:]]
    fig = go.Figure(_bar_traces(_segments(turns, rows.lane_of, origin, slow), versions) + marks)
    label = "engine" if by == "engine" else "sandbox"
    _layout(fig, f"Trajectory timeline by {label}", height=min(max(140 + 12 * lanes, 420), 1600),
            barmode="overlay", bargap=0.1, shapes=shapes, annotations=labels,
            xaxis=dict(title="seconds since the run's first event", zeroline=False,
                       range=[start - origin - pad, end - origin + pad]),
            yaxis=dict(tickvals=[first + (n - 1) / 2 for _, first, n in rows.bands],
                       ticktext=[name for name, _, _ in rows.bands], title=label,
                       range=[-0.6, lanes + 1], zeroline=False, showgrid=False))
    caption = (f"Each lane is one trajectory at a time on its {label}; a trajectory's turns "
               "are queue (grey), generate (coloured by the policy version that produced "
               "it), tool (orange, red with errors). Dotted red lines and bands: the turn "
               f"gates closed for a weight push. Black outlines: the {slowest_per_step} "
               "slowest trajectories of each step (the ones that held it). Shaded bands: "
               "the run's start (grey-blue: loading tasks, the model, starting engines and "
               "pools) and first-use builds (amber: built once, cached for later runs). "
               "Drag to zoom, double-click to reset, hover for the turn." + note)
    return Panel(f"timeline_{label}", f"Timeline by {label}", fig, caption)


# --- environment time ---------------------------------------------------------------------

def build_exec_histogram(series: Series) -> Panel | None:
    """Sandbox command durations over the whole run (env/exec_s_hist/le_<bound> buckets)."""
    import plotly.graph_objects as go

    prefix = "env/exec_s_hist/le_"
    buckets = {k.removeprefix(prefix): sum(v) for k, (_, v) in series.items() if k.startswith(prefix)}
    if not sum(buckets.values()):  # no bucket, or a run whose sandboxes ran nothing
        return None
    order = sorted(buckets, key=lambda b: math.inf if b == "inf" else float(b))
    finite = [b for b in order if b != "inf"]
    labels = [f"≤ {b} s" if b != "inf" else f"> {finite[-1] if finite else 0} s" for b in order]
    fig = go.Figure(go.Bar(x=labels, y=[buckets[b] for b in order], marker_color=TOOL_COLOR,
                           hovertemplate="%{x}: %{y:.0f} commands<extra></extra>"))
    _layout(fig, "Sandbox command durations (whole run)", xaxis=dict(title="duration bucket"),
            yaxis=dict(title="commands"))
    return Panel("env_exec_hist", "Sandbox command durations", fig,
                 f"{sum(buckets.values()):.0f} sandbox commands (tool calls and grading), "
                 "counted by the sandbox pool into duration buckets.")


def box_trace(groups: Mapping[K, list[float]], color: str) -> go.Box:
    """One box per group from precomputed quartiles and 1.5 IQR whiskers, so the page
    carries five numbers per box, not every sample (a trace has 80,000 turns)."""
    import numpy as np
    import plotly.graph_objects as go

    stats: dict[str, list[object]] = defaultdict(list)
    for label in groups:
        values = np.asarray(groups[label], dtype=float)
        q1, median, q3 = np.percentile(values, [25, 50, 75])
        reach = 1.5 * (q3 - q1)
        stats["x"].append(label)
        stats["q1"].append(q1)
        stats["median"].append(median)
        stats["q3"].append(q3)
        stats["lowerfence"].append(values[values >= q1 - reach].min())
        stats["upperfence"].append(values[values <= q3 + reach].max())
        stats["mean"].append(values.mean())
    return go.Box(**stats, marker_color=color, showlegend=False, boxpoints=False)


def _boxes(groups: dict[str, list[float]], title: str, axis: str) -> "go.Figure":
    import plotly.graph_objects as go

    busiest = sorted(groups, key=lambda k: -len(groups[k]))[:MAX_BOXES]
    fig = go.Figure([box_trace({k: groups[k] for k in sorted(busiest)}, TOOL_COLOR)])
    return _layout(fig, title, yaxis=dict(title=axis, rangemode="tozero"),
                   xaxis=dict(type="category"))


def build_tool_time_by_task(events: Events) -> Panel | None:
    """Tool time per turn (turns that called a tool) for the busiest tasks."""
    groups: dict[str, list[float]] = defaultdict(list)
    for u in events.turns:
        if u.tool_calls and u.tool_s > 0:  # calls that ran (not refused by the parser)
            groups[u.task].append(u.tool_s)
    if not groups:
        return None
    fig = _boxes(groups, "Tool time per turn, by task", "seconds")
    shown = min(len(groups), MAX_BOXES)
    return Panel("env_by_task", "Tool time by task", fig,
                 f"Per turn that called a tool: the time its calls ran, {shown} of {len(groups)} "
                 "tasks (those with the most such turns).")


def build_tool_time_by_tool(events: Events) -> Panel | None:
    """Tool time per turn by the tools the turn called; one 'all tools' box when the
    events carry no tool names."""
    groups: dict[str, list[float]] = defaultdict(list)
    for u in events.turns:
        if u.tool_calls and u.tool_s > 0:  # calls that ran (not refused by the parser)
            groups["+".join(sorted(set(u.tools))) if u.tools else "all tools"].append(u.tool_s)
    if not groups:
        return None
    named = list(groups) != ["all tools"]
    caption = ("Per turn that called tools: the time they ran, by the set of tools the turn "
               "called." if named else "Per turn that called tools: the time they ran. The "
               "events carry no tool names (a 'tools' field on turn events), so all tools "
               "share one box.")
    return Panel("env_by_tool", "Tool time by tool", _boxes(groups, "Tool time per turn, by tool",
                                                             "seconds"), caption)


def build_turn_time_histogram(events: Events) -> Panel | None:
    """Where a turn's time goes: generate vs tool vs queue, over all recorded turns."""
    import plotly.graph_objects as go

    if not events.turns:
        return None
    import numpy as np

    fig = go.Figure()
    longest = max(max(u.generate_s, u.tool_s, u.queue_s) for u in events.turns) or 1.0
    edges = np.linspace(0.0, longest, 41)  # one bin width for all three; counts, not samples
    for name, attr, color in (("generate", "generate_s", "#4c78a8"), ("tool", "tool_s", TOOL_COLOR),
                              ("queue", "queue_s", QUEUE_COLOR)):
        values = [getattr(u, attr) for u in events.turns if getattr(u, attr) > 0]
        if values:
            counts, _ = np.histogram(values, bins=edges)
            fig.add_trace(go.Bar(x=(edges[:-1] + edges[1:]) / 2, y=counts, width=edges[1] - edges[0],
                                 name=name, marker_color=color, opacity=0.6,
                                 hovertemplate="%{x:.3g} s: %{y} turns"))
    _layout(fig, "Time per turn", barmode="overlay", xaxis=dict(title="seconds"),
            yaxis=dict(title="turns", type="log"))
    return Panel("turn_time_hist", "Time per turn", fig,
                 f"{len(events.turns)} recorded turns: distributions of their generate, tool "
                 "and queue time (zero-length parts left out; log count axis).")


# --- over steps ---------------------------------------------------------------------------

def _step_axis(steps: Sequence[int]) -> dict[str, object]:
    """Whole-step ticks: no 1.5 on a 4-step run."""
    span = max(steps) - min(steps) if steps else 0
    return dict(title="step", dtick=max(1, math.ceil(span / 12)), tick0=0)


def build_lines(series: Series, key: str, title: str, keys: Sequence[str], caption: str, *,
                y_title: str = "", bar_keys: Sequence[str] = (), bar_title: str = "",
                y_range: Sequence[float] | None = None) -> Panel | None:
    """Step on x, one line per present key, and bars on a right axis for `bar_keys`
    (counts); None when no key is present."""
    import plotly.graph_objects as go

    present = [k for k in (*keys, *bar_keys) if k in series]
    if not present:
        return None
    fig = go.Figure()
    for k in present:
        steps, values = series[k]
        if k in bar_keys:
            fig.add_trace(go.Bar(x=steps, y=values, name=k, yaxis="y2", opacity=0.45))
            continue
        dense = len(steps) >= 60
        fig.add_trace(go.Scatter(x=steps, y=values, name=k, mode="lines" if dense else "lines+markers"))
    all_steps = [s for k in present for s in series[k][0]]
    yaxis: dict[str, object] = dict(title=y_title)
    if y_range is not None:
        yaxis["range"] = list(y_range)
    _layout(fig, title, xaxis=_step_axis(all_steps), yaxis=yaxis)
    counts = [v for k in present if k in bar_keys for v in series[k][1]]
    if counts:
        top = max(max(counts), 1.0)  # whole-number ticks, also when nothing was dropped
        fig.update_layout(yaxis2=dict(title=bar_title, overlaying="y", side="right", showgrid=False,
                                      range=[0, top * 1.1], dtick=max(1, math.ceil(top / 5))))
    return Panel(key, title, fig, caption)


def per_step_delta(steps: list[int], totals: list[float]) -> tuple[list[int], list[float]]:
    """A cumulative counter as the amount added at each step."""
    out, last = [], 0.0
    for value in totals:
        out.append(max(value - last, 0.0))
        last = value
    return steps, out


def derived_series(series: Series) -> Series:
    """Keys the report computes from others: tokens per second, drops per step."""
    out: Series = {}
    tokens, step_s = series.get("rollout/tokens_generated"), series.get("timing/step_s")
    if tokens and step_s:
        seconds = dict(zip(*step_s))
        pairs = [(s, t / seconds[s]) for s, t in zip(*tokens) if seconds.get(s, 0) > 0]
        if pairs:
            out["report/generated_tokens_per_s"] = ([s for s, _ in pairs], [v for _, v in pairs])
    # cumulative drop counters by reason; staleness/dropped_groups is buffer/dropped_stale
    counters = {k.removeprefix("buffer/dropped_"): k for k in series if k.startswith("buffer/dropped_")}
    if "stale" not in counters and "staleness/dropped_groups" in series:
        counters["stale"] = "staleness/dropped_groups"
    for reason, key in sorted(counters.items()):
        out[f"report/dropped_{reason}_per_step"] = per_step_delta(*series[key])
    return out


def build_end_reasons(series: Series) -> Panel | None:
    import plotly.graph_objects as go

    keys = sorted(k for k in series if k.startswith("end/"))
    if not keys:
        return None
    fig = go.Figure([go.Bar(x=series[k][0], y=series[k][1], name=k.removeprefix("end/"))
                     for k in keys])
    _layout(fig, "How trained trajectories ended", barmode="stack",
            xaxis=_step_axis([s for k in keys for s in series[k][0]]),
            yaxis=dict(title="trajectories"))
    return Panel("end_reasons", "End reasons", fig,
                 "Termination reasons of the trajectories each step trained on.")


_BY_TURNS = re.compile(r"(?:stale|dropped)_by_turns/(\d+)$")
_BY_LENGTH = re.compile(r"(?:stale|dropped)_by_length/(.+)$")


@dataclass(frozen=True, slots=True)
class StaleDrops:
    """Groups the staleness bound dropped, by the most turns of their trajectories and by
    the bucket of their longest response: from the buffer's cumulative counters in the
    metrics (`*_by_turns/<n>`, `*_by_length/<bucket>`), else from drop events."""

    by_turns: Counter[int]
    by_length: Counter[str]

    @classmethod
    def find(cls, series: Series, events: Events) -> "StaleDrops":
        by_turns: Counter[int] = Counter()
        by_length: Counter[str] = Counter()
        for key, (_, values) in series.items():
            if (m := _BY_TURNS.search(key)) is not None:
                by_turns[int(m.group(1))] += int(values[-1])
            elif (m := _BY_LENGTH.search(key)) is not None:
                by_length[m.group(1)] += int(values[-1])
        if not by_turns and not by_length:
            for d in events.drops:
                if d.reason == "stale" and d.turns is not None:
                    by_turns[round(d.turns)] += 1
                if d.reason == "stale" and d.tokens is not None:
                    by_length[length_bucket(d.tokens)] += 1
        return cls(by_turns, by_length)


def build_drop_bias(series: Series, events: Events) -> Panel | None:
    """Staleness of the trained trajectories by their turns and length and, where the
    inputs count stale drops by turns and length, the share dropped per turn count: long
    trajectories are the stale ones, so the bound drops them first."""
    from plotly.subplots import make_subplots

    spans = [s for ss in trajectories_by_step(events.turns).values() for s in ss
             if s.oldest_version is not None]
    drops = StaleDrops.find(series, events)
    with_drops = bool(drops.by_turns or drops.by_length)
    if not spans and not with_drops:
        return None
    fig = make_subplots(rows=2 if with_drops else 1, cols=2, vertical_spacing=0.18, subplot_titles=(
        "staleness by turns", "staleness by length (generated tokens, quartile)",
        *(["stale groups: share dropped, by most turns", "stale groups dropped, by longest "
           "response (tokens)"] if with_drops else [])))
    stale = [s.step - 1 - (s.oldest_version or 0) for s in spans]
    if spans:
        by_turns: dict[int, list[float]] = defaultdict(list)
        by_quartile: dict[str, list[float]] = defaultdict(list)
        cuts = sorted(s.tokens for s in spans)
        edges = [cuts[min(int(q * len(cuts)), len(cuts) - 1)] for q in (0.25, 0.5, 0.75)]
        for span, value in zip(spans, stale):
            by_turns[len(span.turns)].append(value)
            by_quartile[f"Q{1 + sum(span.tokens > e for e in edges)}"].append(value)
        fig.add_trace(box_trace(dict(sorted(by_turns.items())), "#4c78a8"), 1, 1)
        fig.add_trace(box_trace(dict(sorted(by_quartile.items())), "#72b7b2"), 1, 2)
    if with_drops:
        _drop_share(fig, spans, drops)
    _layout(fig, "Staleness and drop bias", height=640 if with_drops else 360)
    fig.update_yaxes(title_text="versions stale", row=1, col=1)
    caption = ("Top: staleness (versions between the policy that generated a trajectory's "
               "oldest token and the one that trained on it) of the trained trajectories.")
    caption += (" Bottom: groups dropped by the staleness bound, as a share of the groups of "
                "the same most-turns count (dropped + trained), and by their longest response."
                if with_drops else " The inputs do not break stale drops down by turns or "
                "length (buffer counters or 'drop' events), so the drop share is not drawn.")
    return Panel("drop_bias", "Staleness and drop bias", fig, caption)


def _drop_share(fig: "go.Figure", spans: Sequence[TrajectorySpan], drops: StaleDrops) -> None:
    import plotly.graph_objects as go

    groups: dict[tuple[int, str], int] = defaultdict(int)
    for s in spans:  # a group's turn count is its longest trajectory's, as the buffer counts
        key = (s.step, s.traj.rsplit("/", 1)[0])
        groups[key] = max(groups[key], len(s.turns))
    trained = Counter(groups.values())
    buckets = sorted(set(trained) | set(drops.by_turns))
    dropped = drops.by_turns
    fig.add_trace(go.Bar(x=buckets, y=[dropped[b] / (dropped[b] + trained[b]) for b in buckets],
                         marker_color=ERROR_COLOR, showlegend=False,
                         hovertext=[f"{dropped[b]} dropped, {trained[b]} trained" for b in buckets],
                         hoverinfo="text+x"), 2, 1)
    order = [f"<{e}" for e in LENGTH_EDGES] + [f">={LENGTH_EDGES[-1]}"]
    labels = [b for b in order if b in drops.by_length] + sorted(set(drops.by_length) - set(order))
    fig.add_trace(go.Bar(x=labels, y=[drops.by_length[b] for b in labels], marker_color=ERROR_COLOR,
                         showlegend=False), 2, 2)
    fig.update_xaxes(title_text="most turns in the group", row=2, col=1)
    fig.update_yaxes(title_text="share dropped", range=[0, 1.02], row=2, col=1)
    fig.update_yaxes(title_text="groups", row=2, col=2)


def build_step_panels(series: Series, events: Events) -> list[Panel]:
    """The over-steps panels, in reading order; absent inputs leave their panel out."""
    s = {**series, **derived_series(series)}
    panels = [
        build_lines(s, "reward", "Reward and held-out eval", ["reward/mean", "eval/reward_mean"],
                    "Training reward of each step's groups; held-out reward (eval/*) where "
                    "evaluated (before any step is step 0).", y_title="reward"),
        build_lines(s, "reward_components", "Reward components by step",
                    sorted(k for k in s if is_reward_component(k)),
                    "Mean per step of each component the reward function returned "
                    "(reward/<name>); the table 'Reward components' gives each one's first "
                    "and last steps.", y_title="mean per step"),
        build_lines(s, "idle", "Idle ratios", ["perf/rollout_idle_ratio", "perf/trainer_idle_ratio"],
                    "Share of each step's wall time the engines (sampled) and the trainer "
                    "(waiting for groups) were idle.", y_title="idle share", y_range=(0, 1.02)),
        build_lines(s, "staleness", "Staleness", ["staleness/mean", "staleness/max"],
                    "Versions between generation and training of each step's trajectories; "
                    "right axis: groups dropped by the staleness bound (and other reasons) "
                    "at each step.", y_title="versions",
                    bar_keys=sorted(k for k in s if k.startswith("report/dropped_")),
                    bar_title="groups dropped"),
        build_drop_bias(s, events),
        build_lines(s, "prefix_cache", "Prefix-cache hit rate",
                    ["rollout/prefix_cache_hit_rate", "rollout/prefix_cache_hit_rate_vllm"],
                    "Prompt tokens served from the engines' prefix cache: per request of the "
                    "trained trajectories, and vLLM's own counters.", y_title="hit rate",
                    y_range=(0, 1.02)),
        build_lines(s, "throughput", "Tokens per second",
                    ["report/generated_tokens_per_s", "perf/train_tokens_per_s"],
                    "Generated tokens of the trained trajectories over the step's wall time, "
                    "and the trainer's tokens per second.", y_title="tokens / s"),
        build_lines(s, "step_time", "Step time",
                    ["timing/step_s", "timing/train_s", "perf/weight_sync_s",
                     "perf/weight_gates_closed_s", "timing/eval_s"],
                    "Wall time of each step and its parts; gates_closed is the part of the "
                    "weight push that held turns.", y_title="seconds"),
        build_lines(s, "occupancy", "Occupancy",
                    ["buffer/size", "buffer/running", "rollout/trajectories_running",
                     "env/sandboxes_in_use"],
                    "At the end of each step: groups buffered and running, trajectories "
                    "running, sandboxes leased.", y_title="count"),
        build_lines(s, "env_time", "Environment time",
                    ["env/exec_s", "env/exec_s_p50", "env/exec_s_p99", "env/queue_wait_s"],
                    "Sandbox command time (mean, p50, p99) and the wait for a sandbox, per step.",
                    y_title="seconds"),
        build_end_reasons(s),
    ]
    return [p for p in panels if p is not None]
