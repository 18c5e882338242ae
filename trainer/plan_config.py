"""The `plan` section of the recipe: the workload profile and hardware figures the capacity
planner (`python -m launch.plan`) turns into the seed's section-7 accounts. The schema is
composed in `trainer.run.config`; the planner itself lives in `launch.plan`.

Defaults are the seed article's workload (SWE-style coding tasks: ~400 generated tokens in
~10 s, a ~30 s test run returning ~1,600 tokens, per turn; a 30-minute step on H100s).
Fields that default to None are taken from the rest of the recipe or from the model's
config.json; the doc of each says from where.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from envs.knobs import knob


@dataclass(frozen=True, slots=True)
class PlanConfig:
    # Workload profile: what one turn of one trajectory costs.
    turns: int | None = knob(None, "Turns per trajectory. None: agent.max_turns.")
    gen_tokens: int = knob(400, "Tokens the model generates in one turn (typical, not the "
                           "budget agent.max_new_tokens_per_turn).")
    gen_s: float = knob(10.0, "Wall-clock seconds of one turn's generation (decode latency).")
    exec_s: float = knob(30.0, "Sandbox execution seconds of one turn's tool call (typical).")
    cores_per_exec: float = knob(1.0, "CPU cores one execution keeps busy (CPU-hours account).")
    obs_tokens: int = knob(1600, "Tool-output tokens appended to the context per turn.")
    prompt_tokens: int = knob(2000, "Tokens of the first prompt (task, repository information).")
    window_s: float = knob(1800.0, "Target wall clock of one step's rollout; concurrency needs "
                           "are sandbox-seconds / this.")
    # GPU side.
    decode_tokens_per_s_per_gpu: float = knob(2000.0, "Decode throughput of one rollout GPU "
                                              "(the seed's figure for an 8B model on an H100).")
    gpu_flops: float = knob(989e12, "Peak dense FLOP/s of one GPU in the compute dtype "
                            "(H100 SXM bf16: 989e12).")
    mfu_prefill: float = knob(0.5, "Model FLOP utilisation of prefill (compute-bound).")
    mfu_train: float = knob(0.4, "Model FLOP utilisation of training (forward + backward).")
    hbm_bytes_per_s: float = knob(2e12, "Achieved HBM bandwidth of one GPU, for the "
                                  "bandwidth-bound decode estimate (H100 peak: 3.35e12).")
    gpu_memory_gb: float = knob(80.0, "Memory of one rollout GPU; sizes the KV pool when "
                                "plan.kv_pool_gb_per_gpu is None.")
    model_params_b: float | None = knob(None, "Policy parameters in billions. None: counted "
                                        "from model.path's config.json (dense models).")
    kv_bytes_per_token: int | None = knob(None, "KV-cache bytes per token (all layers, K and V). "
                                          "None: from model.path's config.json and model.dtype.")
    kv_pool_gb_per_gpu: float | None = knob(None, "KV-cache pool of one rollout GPU in GB. None: "
                                            "rollout.kv_cache_memory_bytes / rollout.tp_size "
                                            "when set, else plan.gpu_memory_gb x "
                                            "rollout.gpu_memory_utilization - this GPU's weights.")
    rollout_gpus: int | None = knob(None, "Rollout GPUs. None: rollout.num_engines x rollout.tp_size.")
    train_gpus: int | None = knob(None, "Training GPUs. None: train.num_ranks.")
    # Sandbox nodes.
    cores_per_sandbox: float | None = knob(None, "Cores reserved per live sandbox. None: "
                                           "envs.cpus_per_sandbox_worker / envs.sandboxes_per_worker.")
    cores_per_sandbox_node: float | None = knob(None, "Cores of one sandbox (CPU) node. None: "
                                                "envs.cpus_per_sandbox_worker (one worker per node).")
    memory_gb_per_sandbox_node: float | None = knob(None, "Memory of one sandbox node in GB; "
                                                    "sandboxes take envs.memory_limit_mb each. "
                                                    "None: only cores bound the node count.")

    def __post_init__(self) -> None:
        check_plan_config(self)


# Keys that must be > 0 when set, and those that may be 0 (a turn without a tool call has
# exec_s 0; a math task has no observation).
_POSITIVE = ("turns", "gen_tokens", "window_s", "decode_tokens_per_s_per_gpu", "gpu_flops",
             "hbm_bytes_per_s", "gpu_memory_gb", "model_params_b", "kv_bytes_per_token",
             "kv_pool_gb_per_gpu", "rollout_gpus", "train_gpus", "cores_per_sandbox",
             "cores_per_sandbox_node", "memory_gb_per_sandbox_node")
_NON_NEGATIVE = ("gen_s", "exec_s", "cores_per_exec", "obs_tokens", "prompt_tokens")


def check_plan_config(plan: PlanConfig) -> None:
    """Range checks of the plan section; each failure names the key to change."""
    names = {f.name for f in fields(plan)}
    assert set(_POSITIVE) | set(_NON_NEGATIVE) <= names
    for name in _POSITIVE + _NON_NEGATIVE:
        value, positive = getattr(plan, name), name in _POSITIVE
        if value is not None and (value <= 0 if positive else value < 0):
            raise ValueError(f"plan.{name}: must be {'>' if positive else '>='} 0, got {value}")
    for name in ("mfu_prefill", "mfu_train"):
        value = getattr(plan, name)
        if not 0 < value <= 1:
            raise ValueError(f"plan.{name}: a utilisation must be in (0, 1], got {value}")
    if plan.gen_s + plan.exec_s <= 0:
        raise ValueError("plan.gen_s: a turn takes no time (gen_s + exec_s = 0); set "
                         "plan.gen_s or plan.exec_s > 0")
