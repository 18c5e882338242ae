"""Metrics: pure functions that turn a step's groups and the loop's counters into keys,
one small logger with jsonl, wandb and console sinks, the transcript sink, and the
busy/idle clocks behind perf/*_idle_ratio.

Keys are slash-namespaced (DESIGN.md's list: perf/rollout_idle_ratio, staleness/max,
loss/clip_frac, ...). wandb is offline unless the recipe says otherwise and never needs
a network; it is imported only when its sink is built.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from envs.progress import BuildRecord
from envs.types import Group, TerminationReason, Trajectory
from rollout.durable import sum_durable_stats
from rollout.gateway.server import sum_gateway_stats
from rollout.tool_parser import tool_parse_counts

if TYPE_CHECKING:
    from buffer.replay_buffer import BufferStats
    from rollout.engine import EngineStats
    from rollout.worker import WorkerStats

log = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per step: {"step": n, "time": unix_s, key: value, ...}. Resuming at
    step `resume_step` first drops the rows written after it, so no step appears twice."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if resume_step is not None and path.is_file():
            truncate_after_step(path, resume_step)
        self._file = path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def truncate_after_step(path: Path, step: int) -> int:
    """Drop the rows of a jsonl file whose "step" is beyond `step` (a torn last line too);
    returns how many were dropped. Rewritten atomically."""
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row_step = json.loads(line).get("step", 0)
        except ValueError:
            dropped += 1
            continue
        if row_step > step:
            dropped += 1
        else:
            kept.append(line)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)
    return dropped


class WandbSink:
    """wandb, resumed under the same run id when the run folder is resumed."""

    def __init__(self, project: str, run_name: str, run_dir: Path,
                 mode: Literal["offline", "online", "disabled"], config: Mapping[str, Any]) -> None:
        import wandb
        from wandb.sdk.lib.runid import generate_id

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else generate_id()
        id_file.write_text(run_id)
        # silent: wandb's banner, its run summary at the end (~40 lines) and its sync hints;
        # the run's own closing lines say where the offline run is and how to sync it.
        self._run = wandb.init(project=project, name=run_name, dir=str(run_dir), mode=mode,
                               config=dict(config), id=run_id, resume="allow",
                               reinit="finish_previous", settings=wandb.Settings(silent=True))
        self.run_dir = Path(self._run.dir).parent

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class ConsoleSink:
    """A compact line per step with the numbers people watch."""

    KEYS = ("reward/mean", "eval/reward_mean", "perf/rollout_idle_ratio",
            "perf/trainer_idle_ratio", "staleness/mean", "staleness/max", "loss/clip_frac",
            "loss/entropy", "perf/weight_sync_s", "timing/step_s")

    def __init__(self) -> None:
        from rich.console import Console

        self._console = Console(highlight=False, soft_wrap=True)  # one line a step, any width

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        parts = [f"{k}={metrics[k]:.3g}" for k in self.KEYS if k in metrics]
        self._console.print(f"[bold]step {step}[/bold] " + "  ".join(parts))

    def close(self) -> None:
        pass


class MetricsLogger:
    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks
        self.keys_seen: set[str] = set()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.keys_seen.update(metrics)
        for sink in self.sinks:
            try:
                sink.write(step, metrics)
            except Exception:  # a broken sink must not stop training
                log.exception("metrics sink %s failed", type(sink).__name__)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class TranscriptSink:
    """Readable transcripts of a few trajectories per step, appended to transcripts.jsonl."""

    def __init__(self, path: Path, decode: Callable[[list[int]], str], per_step: int) -> None:
        self.path = path
        self.decode = decode
        self.per_step = per_step

    def write(self, step: int, groups: Sequence[Group]) -> None:
        if self.per_step <= 0:
            return
        with self.path.open("a", encoding="utf-8") as f:
            for t in [t for g in groups for t in g.trajectories][:self.per_step]:
                row = {"step": step, **t.summary(), "components": dict(t.reward_components),
                       "prompt": self.decode(t.prompt_ids.tolist()),
                       "response": self.decode(t.response_ids.tolist())}
                f.write(json.dumps(row) + "\n")


class EventSink:
    """Per-turn timeline events beside metrics.jsonl (events.jsonl, append-only, one JSON
    object per line), for the run report (launch.report). Kinds:

        {"kind": "turn", "step", "traj": "g3/1", "task", "turn", "engine", "version",
         "t0" (unix s at the turn gate), "queue_s", "generate_s", "tool_s", "tool_calls",
         "tool_errors", "tokens", "end" (the trajectory's termination, on its last turn)}
        {"kind": "push", "step", "version", "t0", "prepare_s", "gates_closed_s"}
        {"kind": "step", "step", "t0", "t1", "trainer_wait_s"}
        {"kind": "phase", "name", "t0", "t1"}  (a part of the start: tasks, model, engines)
        {"kind": "first_use", "what", "where", "t0", "t1", "ok"}  (envs.progress builds)

    At most `max_turns_per_step` turn events per step (the trained groups' turns, in
    order; the rest are counted in the step event as `turns_dropped`), so the file grows
    by at most about 250 bytes x that per step."""

    def __init__(self, path: Path, max_turns_per_step: int) -> None:
        self.path = path
        self.max_turns_per_step = max_turns_per_step

    def write(self, events: Sequence[Mapping[str, Any]]) -> None:
        if self.max_turns_per_step <= 0 or not events:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(e, separators=(",", ":")) + "\n" for e in events)


def startup_events(phases: Sequence[tuple[str, float, float]],
                   builds: Sequence[BuildRecord]) -> list[dict[str, Any]]:
    """The phase and first_use events of a run's start: (name, t0, t1) of each phase,
    and the first-use builds its process ran (envs.progress.recorded_builds)."""
    events: list[dict[str, Any]] = [{"kind": "phase", "name": name, "t0": round(t0, 4),
                                     "t1": round(t1, 4)} for name, t0, t1 in phases]
    events += [{"kind": "first_use", "what": b.what, "where": b.where, "t0": round(b.t0, 4),
                "t1": round(b.t1, 4), "ok": b.ok} for b in builds]
    return events


def turn_events(step: int, groups: Sequence[Group], limit: int) -> tuple[list[dict[str, Any]], int]:
    """The turn events of a step's groups (at most `limit`) and how many were left out."""
    events: list[dict[str, Any]] = []
    total = 0
    for t in (t for g in groups for t in g.trajectories):
        for u in t.turns:
            total += 1
            if len(events) >= limit:
                continue
            event: dict[str, Any] = {"kind": "turn", "step": step, "traj": f"{t.group_id}/{t.index}",
                     "task": t.task_id, "turn": u.index, "engine": u.engine, "version": u.version,
                     "t0": round(u.started_at, 4), "queue_s": round(u.queue_s, 4),
                     "generate_s": round(u.generate_s, 4), "tool_s": round(u.tool_s, 4),
                     "tool_calls": u.num_tool_calls, "tool_errors": u.num_tool_errors,
                     "tokens": u.num_generated}
            if u.tool_names:  # one name per call: the report's tool time by tool
                event["tools"] = list(u.tool_names)
            if u.index == len(t.turns) - 1:
                event["end"] = t.termination.value
            events.append(event)
    return events, total - len(events)


def mean_sample_reward(samples: Sequence[Trajectory]) -> float:
    """Mean reward of rows that are one per sample. Only scored groups reach training and
    evaluation, so every reward is set here."""
    rewards = [t.reward for t in samples if t.reward is not None]
    assert len(rewards) == len(samples), "an unscored trajectory reached the metrics"
    return float(np.mean(rewards))


def compute_batch_metrics(groups: Sequence[Group], version: int) -> dict[str, float]:
    """reward/*, staleness/*, rollout/*, end/* of the groups one step trains on. Rewards,
    endings and turns are per sample (its segments share one reward and ending); tokens,
    staleness and tool counts are over every trained row."""
    trajs = [t for g in groups for t in g.trajectories]
    samples = [t for t in trajs if t.segment == 0]  # one row per sample
    # Rewards and reward components over the samples in their group's baseline: a sample
    # cut by its group's deadline has no reward of its own (its ending still counts).
    scored = [t for t in samples if t.termination is not TerminationReason.DEADLINE]
    staleness = [t.staleness(version) for t in trajs if t.oldest_version is not None]
    turns = [u for t in trajs for u in t.turns]
    out = {"reward/mean": mean_sample_reward(scored),
           "staleness/mean": float(np.mean(staleness)) if staleness else 0.0,
           "staleness/max": float(max(staleness)) if staleness else 0.0,
           "rollout/tokens_generated": float(sum(t.num_model_tokens for t in trajs)),
           "rollout/turns": len(turns) / len(samples),
           "rollout/segments_per_sample": len(trajs) / len(samples),
           "rollout/prefix_cache_hit_rate": compute_hit_rate(trajs),
           # prompt tokens the engines computed (not served from the prefix cache), and
           # those served from KV of older weights (rollout.kv_after_push=reuse)
           "rollout/prefill_tokens": float(sum(u.prompt_tokens - u.cached_prompt_tokens for u in turns)),
           "rollout/stale_kv_tokens": float(sum(u.stale_kv_tokens for u in turns)),
           "rollout/tool_calls": float(sum(u.num_tool_calls for u in turns)),
           "rollout/tool_errors": float(sum(u.num_tool_errors for u in turns)),
           "rollout/tool_timeouts": float(sum(u.num_tool_timeouts for u in turns))}
    out.update({f"end/{r}": float(n) for r, n in Counter(t.termination.value for t in samples).items()})
    out.update(compute_image_metrics(trajs))
    out.update(tool_parse_counts(trajs))
    failed = Counter(n for u in turns for n in u.failed_tool_names)
    for name, n in Counter(n for u in turns for n in u.tool_names).items():
        out[f"rollout/tool_calls/{name}"] = float(n)
        out[f"rollout/tool_errors/{name}"] = float(failed[name])
    for name in sorted({k for t in scored for k in t.reward_components}):
        values = [t.reward_components.get(name, 0.0) for t in scored]
        out[f"reward/{name}"] = float(np.sum(values) if is_counted_component(name) else np.mean(values))
    return out


def compute_image_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """rollout/image* over a step's trained rows: image tokens (the positions the vision
    encoder's features fill) per row and in all, images per row, and their share of the
    rows' tokens (prompt + response; the markup ids around an image's tokens count as
    text). Empty for a step without images, as other families that only some runs have
    (gateway/*, durable/*): a text run's rows carry no image keys."""
    num_images = sum(len(t.images) for t in trajs)
    if not num_images:
        return {}
    image_tokens = sum(t.num_image_tokens for t in trajs)
    context_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    return {"rollout/image_tokens": image_tokens / len(trajs),
            "rollout/image_tokens_total": float(image_tokens),
            "rollout/images_per_trajectory": num_images / len(trajs),
            "rollout/image_token_fraction": image_tokens / context_tokens}


def is_counted_component(name: str) -> bool:
    """Reward components sluice adds of its own, logged as counts (how many trajectories):
    findings, failures and grading paths (graded_by_<path>, graded_in_image). Every other
    component is a score of the reward function, logged as its mean."""
    return name.startswith(("hack_", "graded_")) or name in ("reward_error", "timeout")


def compute_hit_rate(trajs: Sequence[Trajectory]) -> float:
    """Prompt tokens served from the prefix cache over prompt tokens sent, from the
    engines' per-request counts."""
    sent = sum(turn.prompt_tokens for t in trajs for turn in t.turns)
    cached = sum(turn.cached_prompt_tokens for t in trajs for turn in t.turns)
    return cached / sent if sent else 0.0


def compute_loop_metrics(buffer: "BufferStats", engines: Mapping[str, "EngineStats"],
                         workers: Sequence["WorkerStats"], last_cache: tuple[int, int]
                         ) -> tuple[dict[str, float], tuple[int, int]]:
    """buffer/*, staleness/dropped_groups and the engines' and workers' counters; returns
    the metrics and the prefix-cache counters to pass as `last_cache` next time."""
    queries = sum(e.prefix_cache_queries for e in engines.values())
    hits = sum(e.prefix_cache_hits for e in engines.values())
    out = {"staleness/dropped_groups": float(buffer.dropped.get("stale", 0)),
           "buffer/size": float(buffer.buffered), "buffer/running": float(buffer.running),
           "buffer/admitted": float(buffer.admitted), "buffer/trained": float(buffer.trained),
           # vLLM's own counters (cumulative per engine), as a rate since the last call
           "rollout/prefix_cache_hit_rate_vllm": (hits - last_cache[1]) / max(queries - last_cache[0], 1),
           # cumulative over the live engines: resets after a push that found KV in use
           "perf/prefix_reset_refused": float(sum(e.prefix_reset_refused for e in engines.values())),
           "rollout/trajectories_running": float(sum(w.num_running for w in workers)),
           # cumulative; counted only with agent.continuity_check (a debug setting)
           "rollout/continuity_divergences": float(sum(w.num_continuity_divergences for w in workers)),
           "reward/errors_total": float(sum(w.num_reward_errors for w in workers)),
           "env/open_s_total": float(sum(w.env_open_s for w in workers)),
           "rollout/event_loop_stalls": float(sum(w.num_loop_stalls for w in workers))}
    if resets := sum(e.mm_cache_resets for e in engines.values()):  # vision-language engines only
        out["perf/mm_cache_resets"] = float(resets)
    if images := sum(w.num_images_processed for w in workers):  # a vision-language policy only
        out["rollout/images_processed_total"] = float(images)
        out["rollout/image_process_s_total"] = float(sum(w.image_process_s for w in workers))
    gateways = [w.gateway for w in workers if w.gateway is not None]
    if gateways:  # totals over every worker's gateway (black-box harness sessions)
        out.update(sum_gateway_stats(gateways).as_metrics())
    durable = [w.durable for w in workers if w.durable is not None]
    if durable:  # trajectory journals (rollout.durable), totals over the workers
        out.update(sum_durable_stats(durable).as_metrics())
    connector_queries = sum(e.connector_queries for e in engines.values())
    if connector_queries:  # rollout.kv_offload: vLLM's own counters of its connector's tier
        out["rollout/kv_connector_queries"] = float(connector_queries)
        out["rollout/kv_connector_hits"] = float(sum(e.connector_hits for e in engines.values()))
    routers = [w.router for w in workers if w.router is not None and w.router.num_routed]
    if routers:  # rollout.routing=residency: what the routers' KV views decided (cumulative)
        out.update({"rollout/kv_routed_by_residency": float(sum(r.num_routed for r in routers)),
                    "rollout/kv_view_held_tokens": float(sum(r.view_held_tokens for r in routers)),
                    "rollout/kv_residency_moves": float(sum(r.num_residency_moves for r in routers)),
                    "rollout/kv_events_lost": float(sum(r.num_kv_events_lost for r in routers))})
    out.update({f"buffer/dropped_{k}": float(v) for k, v in buffer.dropped.items()})
    # Which groups go stale, by turns and by length: a bias against long trajectories
    # shows up here (cumulative counts).
    out.update({f"staleness/dropped_by_turns/{n}": float(c) for n, c in buffer.stale_by_turns.items()})
    out.update({f"staleness/dropped_by_length/{b}": float(c) for b, c in buffer.stale_by_length.items()})
    # Group deadlines (buffer.group_deadline_s): what the straggler policy did, and which
    # samples it cut, by the turns and tokens they had reached (cumulative counts).
    out.update({f"buffer/deadline_{k}": float(v) for k, v in buffer.deadline.items()})
    out.update({f"buffer/deadline_cut_by_turns/{n}": float(c) for n, c in buffer.cut_by_turns.items()})
    out.update({f"buffer/deadline_cut_by_length/{b}": float(c) for b, c in buffer.cut_by_length.items()})
    return out, (queries, hits)


class BusyClock:
    """Fraction of wall time something was idle. `busy()` / `idle()` switch state; the
    ratio covers the time since the last `reset()`."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._busy = False
        self._since = now()
        self._window_start = self._since
        self._idle_s = 0.0

    def _settle(self) -> None:
        now = self._now()
        if not self._busy:
            self._idle_s += now - self._since
        self._since = now

    def busy(self) -> None:
        self._settle()
        self._busy = True

    def idle(self) -> None:
        self._settle()
        self._busy = False

    def idle_ratio(self) -> float:
        self._settle()
        window = self._since - self._window_start
        return self._idle_s / window if window > 0 else 0.0

    def reset(self) -> None:
        self._settle()
        self._window_start = self._since
        self._idle_s = 0.0


class StateClock:
    """Fraction of wall time spent in each named state (at most one at a time; `None`: in
    none of them) since the last `reset()`."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._state: str | None = None
        self._since = now()
        self._window_start = self._since
        self._seconds: dict[str, float] = {}

    def _settle(self) -> None:
        now = self._now()
        if self._state is not None:
            self._seconds[self._state] = self._seconds.get(self._state, 0.0) + now - self._since
        self._since = now

    def enter(self, state: str | None) -> None:
        self._settle()
        self._state = state

    def ratio(self, state: str) -> float:
        self._settle()
        window = self._since - self._window_start
        return self._seconds.get(state, 0.0) / window if window > 0 else 0.0

    def reset(self) -> None:
        self._settle()
        self._window_start = self._since
        self._seconds = {}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
