"""Builds a whole run from a checked config and runs it: model (and warm start), Ray
pools, engines, sandbox pools, agent workers, train ranks, reward loop, metrics sinks,
the controller, checkpoints and Ctrl-C. `trainer.main` calls `run(cfg)`."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from trainer.config import SluiceConfig
from trainer.controller import Controller, RunSummary
from trainer.metrics import ConsoleSink, JsonlSink, MetricsLogger, MetricsSink, WandbSink

log = logging.getLogger(__name__)


def resolve_run_dir(cfg: SluiceConfig, recipe_name: str) -> Path:
    name = cfg.logging.run_name or f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.logging.output_dir).resolve() / name
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def resolve_model_path(path: str) -> Path:
    """A model folder: `path`, or the tiny test model (built on first use) for 'tiny'."""
    from trainer.tiny_model import ensure_tiny_model

    if not path:
        raise ValueError("model.path is required: a Hugging Face model folder, or 'tiny'")
    return ensure_tiny_model() if path == "tiny" else Path(path)


def resolve_model(cfg: SluiceConfig) -> str:
    """The policy folder: model.path, after the warm start that model.warm_start names."""
    from envs.plugins import resolve_plugin

    base = resolve_model_path(cfg.model.path)
    if cfg.model.warm_start is None:
        return str(base)
    warm_start = resolve_plugin("warm start", cfg.model.warm_start)
    return str(warm_start(base, cfg))


def build_sinks(cfg: SluiceConfig, run_dir: Path) -> list[MetricsSink]:
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    if cfg.logging.wandb_mode != "disabled":
        sinks.append(WandbSink(cfg.logging.project, run_dir.name, run_dir, cfg.logging.wandb_mode,
                               asdict(cfg)))
    if cfg.logging.console:
        sinks.append(ConsoleSink())
    return sinks


async def run(cfg: SluiceConfig, recipe_name: str = "run",
              on_batch: Callable[[list, int], None] | None = None) -> tuple[RunSummary, Path]:
    import ray
    from transformers import AutoTokenizer

    from envs.pool import load_sandbox_factory
    from envs.pool_actor import start_sandbox_pools
    from envs.pool_metrics import PoolMetrics
    from envs.tasks import load_tasks
    from reward.loop import RewardLoop
    from rollout.engine import EngineSpec
    from rollout.engine_actor import start_engines
    from rollout.judge_client import start_judge
    from rollout.router import Router
    from rollout.worker_actor import AgentWorkerActor
    from trainer.checkpoint import RunState, latest_checkpoint, load_checkpoint, save_checkpoint
    from trainer.pools import build_pools, connect_cluster
    from trainer.train_actor import TrainGroup
    from trainer.weight_sync import build_transport, push_weights, resolve_transport

    resolve_transport(cfg)
    run_dir = resolve_run_dir(cfg, recipe_name)
    tasks = load_tasks(cfg.envs.tasks, cfg.envs.task_format)
    eval_tasks = load_tasks(cfg.eval.tasks)[:cfg.eval.num_tasks] if cfg.eval.tasks else []
    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    connect_cluster(cfg)
    placed = build_pools(cfg)
    engines = await start_engines(EngineSpec.from_config(cfg, model_path), cfg.rollout.num_engines,
                                  placed["rollout"])
    judge = await start_judge(cfg, str(resolve_model_path(cfg.reward.judge.model_path)),
                              placed.get("judge"))  # None unless reward.judge.enabled
    sandboxes = await start_sandbox_pools(cfg.envs, placed["sandbox"])
    workers = [AgentWorkerActor.options(num_cpus=cfg.rollout.cpus_per_agent_worker).remote(
        cfg, model_path, {n: c.handle for n, c in engines.items()}, sandboxes.handles)
        for _ in range(cfg.rollout.num_agent_workers)]
    trainer = TrainGroup(cfg, model_path, placed["train"])
    transport = build_transport(cfg, sender=trainer)
    rewards = RewardLoop(cfg.reward.fn, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                         timeout_s=cfg.reward.timeout_s, max_concurrency=cfg.reward.max_concurrency,
                         judge=judge,
                         create_sandbox=load_sandbox_factory(cfg.envs.sandbox_backend))
    checkpoints = run_dir / "checkpoints"
    state = RunState(step=0, data_cursor=0)
    resume = cfg.checkpoint.resume_from
    if resume:
        path = latest_checkpoint(checkpoints) if resume == "latest" else Path(resume)
        if path is None:
            raise ValueError(f"checkpoint.resume_from=latest but {checkpoints} has no checkpoint")
        state = await asyncio.to_thread(load_checkpoint, path, trainer)
    logger = MetricsLogger(build_sinks(cfg, run_dir))
    pool_metrics = PoolMetrics()

    async def env_metrics() -> dict[str, float]:
        return pool_metrics.update(await sandboxes.stats())

    controller = Controller(cfg, tasks=tasks, workers=workers, router=Router(engines), trainer=trainer,
                            score_group=rewards.score_group, logger=logger, run_dir=run_dir,
                            tokenizer=tokenizer, start_version=state.step,
                            data_cursor=state.data_cursor, pending_tasks=state.in_flight_tasks,
                            buffered_groups=state.buffered_groups, eval_tasks=eval_tasks,
                            env_metrics=env_metrics, transport=transport)
    if resume and state.step > 0:
        await push_weights(controller.router, await trainer.state_dict_for_push(), state.step,
                           transport=transport)

    def snapshot() -> RunState:
        return RunState(step=controller.version, data_cursor=controller.cursor,
                        buffered_groups=controller.buffer.buffered_groups(),
                        in_flight_tasks=controller.in_flight_tasks())

    async def on_step(step: int) -> None:
        every = cfg.checkpoint.every_steps
        if every and step % every == 0:
            await asyncio.to_thread(save_checkpoint, checkpoints, trainer, snapshot(),
                                    cfg.checkpoint.keep_last)

    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, controller.stop)
    try:
        summary = await controller.run(on_step, on_batch)
        await asyncio.to_thread(save_checkpoint, checkpoints, trainer, snapshot(),
                                cfg.checkpoint.keep_last)
    finally:
        logger.close()
        ray.shutdown()
    return summary, run_dir
