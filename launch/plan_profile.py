"""The planner's workload profile: what one turn of one trajectory costs and the hardware
figures that the capacity planner (`python -m launch.plan`) and the simulator
(`python -m launch.simulate`) turn into the seed's accounts. It is the planner's own
input, not part of a training recipe: a run never reads it.

    python -m launch.plan recipe=swe_grpo.yaml --profile my_workload.yaml plan.exec_s=45

A profile file is YAML with one `plan:` mapping of these keys; `plan.key=value` arguments
override it, and every key left out keeps its default. Defaults are the seed article's
workload (SWE-style coding tasks: ~400 generated tokens in ~10 s, a ~30 s test run
returning ~1,600 tokens, per turn; a 30-minute step on H100s). Fields that default to
None are taken from the recipe or from the model's config.json; the doc of each says
from where.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from envs.knobs import iter_fields, knob, section

PREFIX = "plan."  # how profile keys are written on the command line and in messages


@dataclass(frozen=True, slots=True)
class PlanProfile:
    # Workload profile: what one turn of one trajectory costs.
    turns: int | None = knob(None, "Turns per trajectory. None: agent.max_turns.")
    gen_tokens: int = knob(400, "Tokens the model generates in one turn (typical, not the "
                           "budget agent.max_new_tokens_per_turn).")
    gen_s: float = knob(10.0, "Wall-clock seconds of one turn's generation (decode latency).")
    exec_s: float = knob(30.0, "Sandbox execution seconds of one turn's tool call (typical).")
    cores_per_exec: float = knob(1.0, "CPU cores one execution keeps busy (CPU-hours account).")
    obs_tokens: int = knob(1600, "Tool-output tokens appended to the context per turn.")
    prompt_tokens: int = knob(2000, "Tokens of the first prompt (task, repository information).")
    images_per_trajectory: float = knob(0.0, "Images a trajectory's context holds at its end (a task's "
                                        "pictures, tools' screenshots; vision-language models).")
    tokens_per_image: int | None = knob(None, "Context tokens of one image (its run of image tokens and "
                                        "markup). None: model.path's processor on its largest image "
                                        "(needed only with images).")
    vision_prefill_factor: float | None = knob(None, "Vision-encoder FLOPs of an image per context "
                                               "token of it, over a text token's prefill FLOPs (2N). "
                                               "None: from model.path's vision_config and processor.")
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
    model_params_b: float | None = knob(None, "Policy parameters in billions. None: counted "
                                        "from model.path's config.json (dense models).")
    kv_bytes_per_token: int | None = knob(None, "KV-cache bytes per token (all layers, K and V). "
                                          "None: from model.path's config.json and model.dtype.")
    kv_pool_gb_per_gpu: float | None = knob(None, "KV-cache pool of one rollout GPU in GB. None: "
                                            "rollout.kv_cache_memory_bytes / rollout.tp_size "
                                            "when set, else cluster.gpu_memory_gb x "
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
        check_profile(self)


@dataclass(frozen=True, slots=True)
class ProfileFile:
    """The shape of a profile file (and of `plan.key=value` arguments): one `plan` section."""

    plan: PlanProfile = section(PlanProfile, "The workload profile.")


# Keys that must be > 0 when set, and those that may be 0 (a turn without a tool call has
# exec_s 0; a math task has no observation).
_POSITIVE = ("turns", "gen_tokens", "window_s", "decode_tokens_per_s_per_gpu", "gpu_flops",
             "hbm_bytes_per_s", "model_params_b", "kv_bytes_per_token", "kv_pool_gb_per_gpu",
             "rollout_gpus", "train_gpus", "cores_per_sandbox", "cores_per_sandbox_node",
             "memory_gb_per_sandbox_node", "tokens_per_image")
_NON_NEGATIVE = ("gen_s", "exec_s", "cores_per_exec", "obs_tokens", "prompt_tokens",
                 "images_per_trajectory", "vision_prefill_factor")


def check_profile(profile: PlanProfile) -> None:
    """Range checks of the profile; each failure names the key to change."""
    names = {f.name for f in fields(profile)}
    assert set(_POSITIVE) | set(_NON_NEGATIVE) <= names
    for name in _POSITIVE + _NON_NEGATIVE:
        value, positive = getattr(profile, name), name in _POSITIVE
        if value is not None and (value <= 0 if positive else value < 0):
            raise ValueError(f"plan.{name}: must be {'>' if positive else '>='} 0, got {value}")
    for name in ("mfu_prefill", "mfu_train"):
        value = getattr(profile, name)
        if not 0 < value <= 1:
            raise ValueError(f"plan.{name}: a utilisation must be in (0, 1], got {value}")
    if profile.gen_s + profile.exec_s <= 0:
        raise ValueError("plan.gen_s: a turn takes no time (gen_s + exec_s = 0); set "
                         "plan.gen_s or plan.exec_s > 0")


def split_profile_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(recipe overrides, profile overrides): `plan.key=value` arguments are the profile's."""
    profile = [a for a in args if a.startswith(PREFIX)]
    return [a for a in args if not a.startswith(PREFIX)], profile


def load_profile(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
                 ) -> PlanProfile:
    """The profile of a YAML file (None: the defaults) with `plan.key=value` overrides;
    unknown keys fail with the closest valid key (trainer.run.recipe's loader)."""
    from trainer.run.recipe import ConfigError, build_section, read_layers

    if path is not None and not Path(path).expanduser().is_file():
        raise ConfigError(f"--profile {str(path)!r} is not a file; give a YAML file with a "
                          "`plan:` mapping (python -m launch.plan --help lists its keys)")
    data = read_layers(Path(path).expanduser() if path is not None else None, overrides)
    return build_section(ProfileFile, data, "python -m launch.plan --help").plan


def profile_help() -> str:
    """Every profile key with its default and doc, for the planner's and simulator's --help."""
    lines = ["profile keys (plan.key=value or a --profile file; default; doc):"]
    for key, f in iter_fields(ProfileFile):
        lines.append(f"  {key} = {f.default!r}  [{f.type}]\n      {f.metadata['doc']}")
    return "\n".join(lines)
