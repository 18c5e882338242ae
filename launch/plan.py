"""Capacity planner: `python -m launch.plan recipe=NAME.yaml [section.key=value ...]
[--profile FILE.yaml] [plan.key=value ...] [--json]`.

Turns a recipe and the planner's own workload profile (`launch.plan_profile`: a profile
file and `plan.*` arguments, never part of a recipe) into the seed article's section-7
accounts of one training step: the environment account
(executions, CPU-hours, concurrent sandboxes, sandbox nodes) and the GPU account (decode,
prefill between the fully cached and the fully recomputed bound, KV residency, training),
then the ratio table (environment : model, sandboxes : GPU, rollout : train).

Images (vision-language models, `plan.images_per_trajectory`) are context tokens: each
image's run of `plan.tokens_per_image` ids is held in KV, prefilled and trained on like text
(never generated), and its vision-encoder pass costs `plan.vision_prefill_factor` x a text
token's prefill FLOPs per such token, wherever the image is prefilled or trained on.

The math is a set of pure functions of resolved numbers (`PlanInputs`); only
`build_plan` reads the recipe, the profile and the model's config.json. Every account assumes the
whole step's B x G trajectories are in flight at once and every turn costs the profile's
typical numbers: no tail, no queueing, no staleness overlap (`launch.simulate` models those).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.plan_profile import PlanProfile, load_profile, profile_help, split_profile_args
from rollout.rope import text_config
from trainer.run.config import SluiceConfig
from trainer.run.model_check import MOE_KEYS, DecoderShape, VisionShape, measure_image_run
from trainer.run import sizing
from trainer.run.recipe import load_config

USAGE = """usage: python -m launch.plan recipe=NAME.yaml [section.key=value ...]
                          [--profile FILE.yaml] [plan.key=value ...] [--json]

  recipe=NAME.yaml     a file in recipes/ or a path to one
  section.key=value    override any recipe key
  --profile FILE.yaml  the workload profile: a YAML file with one `plan:` mapping
  plan.key=value       override one profile key (below); unset keys keep their default
  --json               print one JSON object with the account (no table)
  -h, --help           this text and every plan.* key
"""

# The seed's section 4.3 table: how the environment : model ratio varies with the task.
SEED_RATIO_ROWS = (
    # task type, env time per turn, turns, env : model (wall), sandboxes : GPU
    ("math (rule verifier)", "ms", "1", "~0", "no sandbox"),
    ("simple tools (search, calc)", "0.1-1 s", "3-5", "1 : 5", "tens of light processes/GPU"),
    ("code (unit tests)", "10-60 s", "15-30", "3 : 1", "50-60 containers/GPU"),
    ("SWE-bench-like (full suite)", "1-10 min", "20-50", "10 : 1", "100+ containers/GPU"),
    ("browser / GUI", "1-5 s render", "20-100", "2 : 1", "1-2 GB memory each"),
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """Every number the accounts read, resolved from the recipe and the profile."""

    groups_per_step: int  # B
    group_size: int  # G
    turns: int
    gen_tokens: int
    gen_s: float
    exec_s: float
    cores_per_exec: float
    obs_tokens: int
    prompt_tokens: int
    window_s: float
    decode_tokens_per_s_per_gpu: float
    gpu_flops: float
    mfu_prefill: float
    mfu_train: float
    model_params_b: float
    kv_bytes_per_token: int
    kv_pool_gb_per_gpu: float
    rollout_gpus: int
    train_gpus: int
    images_per_trajectory: float = 0.0
    tokens_per_image: int = 0  # context ids of one image's run (image tokens and their markup)
    vision_prefill_factor: float = 0.0  # encoder FLOPs per such id / a text token's prefill FLOPs


@dataclass(frozen=True, slots=True)
class PlanAccount:
    """The section-7 account of one step; field names are the `--json` keys."""

    trajectories: int
    executions: int
    cpu_hours: float
    trajectory_wall_s: float
    sandboxes_stateful: float
    sandboxes_releasable: float
    generated_tokens: int
    decode_s: float
    generating_concurrency: float
    final_context_tokens: int
    prefill_cached_s: float
    prefill_uncached_s: float
    kv_need_bytes: int
    kv_pool_bytes: float
    kv_resident_fraction: float
    prefill_expected_s: float
    train_tokens: int
    train_s: float
    image_tokens_per_trajectory: int  # of final_context_tokens
    vision_encoder_s: float  # of prefill_cached_s: each image encoded once


def compute_prefill_s(params: float, tokens: float, gpus: float, gpu_flops: float,
                      mfu: float) -> float:
    """Prefill is compute-bound: 2 FLOPs per parameter per token."""
    return 2 * params * tokens / (gpus * gpu_flops * mfu)


def compute_train_s(params: float, tokens: float, gpus: float, gpu_flops: float,
                    mfu: float) -> float:
    """12N per token: forward + backward (6N) plus the reference and proximal forwards."""
    return 12 * params * tokens / (gpus * gpu_flops * mfu)


def compute_account(p: PlanInputs) -> PlanAccount:
    """The issue-18 formulas, in the seed's order; image tokens (issue 28) are part of the
    final context, and their encoder pass adds vision_prefill_factor x their prefill."""
    trajectories = p.groups_per_step * p.group_size
    executions = trajectories * p.turns
    trajectory_wall_s = p.turns * (p.gen_s + p.exec_s)
    image_tokens = round(p.images_per_trajectory * p.tokens_per_image)
    final_context = p.prompt_tokens + p.turns * (p.gen_tokens + p.obs_tokens) + image_tokens
    # The context in prefill-FLOP units: text tokens 1 each, image tokens 1 + the encoder's share.
    compute_context = final_context + p.vision_prefill_factor * image_tokens
    params = p.model_params_b * 1e9
    # With a perfect prefix cache each token is prefilled once; without one every turn
    # re-prefills its whole context, on average half the final one (images re-encoded too).
    prefill_cached_s = compute_prefill_s(params, trajectories * compute_context, p.rollout_gpus,
                                         p.gpu_flops, p.mfu_prefill)
    uncached_tokens = trajectories * p.turns * compute_context / 2
    prefill_uncached_s = compute_prefill_s(params, uncached_tokens, p.rollout_gpus, p.gpu_flops,
                                           p.mfu_prefill)
    kv_need_bytes = trajectories * final_context * p.kv_bytes_per_token
    kv_pool_bytes = p.rollout_gpus * p.kv_pool_gb_per_gpu * 1e9
    resident = min(1.0, kv_pool_bytes / (kv_need_bytes / 2))
    train_tokens = trajectories * final_context
    return PlanAccount(
        trajectories=trajectories,
        executions=executions,
        cpu_hours=executions * p.exec_s * p.cores_per_exec / 3600,
        trajectory_wall_s=trajectory_wall_s,
        sandboxes_stateful=trajectories * trajectory_wall_s / p.window_s,
        sandboxes_releasable=executions * p.exec_s / p.window_s,
        generated_tokens=executions * p.gen_tokens,
        decode_s=executions * p.gen_tokens / (p.rollout_gpus * p.decode_tokens_per_s_per_gpu),
        generating_concurrency=trajectories * p.gen_s / (p.gen_s + p.exec_s),
        final_context_tokens=final_context,
        prefill_cached_s=prefill_cached_s,
        prefill_uncached_s=prefill_uncached_s,
        kv_need_bytes=kv_need_bytes,
        kv_pool_bytes=kv_pool_bytes,
        kv_resident_fraction=resident,
        prefill_expected_s=prefill_cached_s + (1 - resident) * (prefill_uncached_s - prefill_cached_s),
        train_tokens=train_tokens,
        # The trainer's passes go through the vision encoder as well (it is trained).
        train_s=compute_train_s(params, trajectories * compute_context, p.train_gpus, p.gpu_flops,
                                p.mfu_train),
        image_tokens_per_trajectory=image_tokens,
        vision_encoder_s=compute_prefill_s(params, trajectories * p.vision_prefill_factor * image_tokens,
                                           p.rollout_gpus, p.gpu_flops, p.mfu_prefill),
    )


def read_model_config(model_path: str) -> tuple[dict[str, Any] | None, str]:
    """The model's config.json as data (None when absent) and where it came from."""
    if model_path == "tiny":
        from trainer.run.tiny_model import MARKUP_TOKENS, MODEL_SHAPE, VOCAB_SIZE

        return (dict(MODEL_SHAPE, vocab_size=VOCAB_SIZE + len(MARKUP_TOKENS),
                     tie_word_embeddings=False, model_type="qwen2"), "the tiny model's shape")
    path = model_folder(model_path) / "config.json"
    if not model_path or not path.is_file():
        return None, str(path)
    return json.loads(path.read_text()), str(path)


def model_folder(model_path: str) -> Path:
    """The folder model.path names: a local test model's (built into the cache on first
    use: 'tiny-vl') or the path itself."""
    from trainer.run.local_models import local_model_folder

    return local_model_folder(model_path) or Path(model_path).expanduser()


# --- sandbox nodes and ratios ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SandboxNode:
    """One CPU node of the sandbox pool and what one sandbox reserves on it."""

    cores: float
    memory_gb: float | None  # None: memory does not bound how many fit
    cores_per_sandbox: float
    memory_gb_per_sandbox: float


def compute_sandbox_nodes(num_sandboxes: float, node: SandboxNode) -> int:
    """Nodes to host `num_sandboxes` whole sandboxes; a sandbox never spans two nodes."""
    fit = math.floor(node.cores / node.cores_per_sandbox + 1e-9)
    if node.memory_gb is not None:
        fit = min(fit, math.floor(node.memory_gb / node.memory_gb_per_sandbox + 1e-9))
    if fit < 1:
        raise ValueError(f"plan.cores_per_sandbox_node: a node ({node.cores:g} cores, "
                         f"{node.memory_gb} GB) cannot hold one sandbox ({node.cores_per_sandbox:g} "
                         f"cores, {node.memory_gb_per_sandbox:g} GB); raise the node size")
    return math.ceil(math.ceil(num_sandboxes - 1e-9) / fit)


def compute_decode_bound_tokens_per_s(weight_bytes_per_gpu: float, concurrency_per_gpu: float,
                                      context_tokens: float, kv_bytes_per_token: float,
                                      hbm_bytes_per_s: float) -> float:
    """Decode tokens/s of one GPU when every step reads its weights and all running KV."""
    step_s = (weight_bytes_per_gpu + concurrency_per_gpu * context_tokens * kv_bytes_per_token) \
        / hbm_bytes_per_s
    return concurrency_per_gpu / step_s


@dataclass(frozen=True, slots=True)
class PlanRatios:
    """The seed's ratio accounts: env : model wall clock, sandboxes per GPU, GPU split."""

    env_to_model_wall: float  # exec_s / gen_s of one turn
    sandboxes_per_gpu_stateful: float
    sandboxes_per_gpu_releasable: float
    rollout_gpu_s: float  # (decode + expected prefill) x rollout GPUs
    train_gpu_s: float
    rollout_to_train: float
    balanced_rollout_gpus: int  # of rollout + train GPUs, the split with equal stage times


def compute_ratios(p: PlanInputs, a: PlanAccount) -> PlanRatios:
    rollout_gpu_s = (a.decode_s + a.prefill_expected_s) * p.rollout_gpus
    train_gpu_s = a.train_s * p.train_gpus
    total = p.rollout_gpus + p.train_gpus
    return PlanRatios(
        env_to_model_wall=p.exec_s / p.gen_s if p.gen_s else math.inf,
        sandboxes_per_gpu_stateful=a.sandboxes_stateful / p.rollout_gpus,
        sandboxes_per_gpu_releasable=a.sandboxes_releasable / p.rollout_gpus,
        rollout_gpu_s=rollout_gpu_s, train_gpu_s=train_gpu_s,
        rollout_to_train=rollout_gpu_s / train_gpu_s,
        # Linear scaling of both stages with GPUs: rollout_gpu_s / n = train_gpu_s / (N - n).
        balanced_rollout_gpus=min(total - 1, max(1, round(total * rollout_gpu_s
                                                          / (rollout_gpu_s + train_gpu_s)))))


# --- from a recipe ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Plan:
    """A recipe's resolved plan: the inputs, where the derived ones came from, the node."""

    inputs: PlanInputs
    node: SandboxNode
    weight_bytes_per_gpu: float
    dtype_bytes: int  # of weights and KV
    tp_size: int  # GPUs per rollout engine
    hbm_bytes_per_s: float
    recipe_sandboxes: int  # envs.num_sandbox_workers x envs.sandboxes_per_worker
    sources: tuple[tuple[str, float, str], ...]  # (plan key, derived value, where from)
    kv_offload_tier: str = "none"  # rollout.kv_offload.tier
    kv_offload_gb_per_engine: float = 0.0  # rollout.kv_offload.gb_per_engine
    max_staleness: int = 0  # buffer.max_staleness: async keeps up to eta + 1 steps in flight
    agent_workers: str = ""  # the recipe's AgentLoopWorker processes (trainer.run.sizing), in words


Sources = list[tuple[str, float, str]]  # (plan key, derived value, where it came from)


def read_model_shape(data: dict[str, Any], source: str) -> DecoderShape:
    """The dense decoder that `data` (a config.json) describes, or which plan.* keys to set."""
    if any(text_config(data).get(key) for key in MOE_KEYS):
        raise ValueError(f"plan.model_params_b: {source} describes a mixture-of-experts "
                         "model; set plan.model_params_b (and plan.kv_bytes_per_token) "
                         "explicitly")
    try:
        return DecoderShape.from_config(data, {}, source)
    except ValueError as exc:
        raise ValueError(f"plan.model_params_b: {exc}; set plan.model_params_b and "
                         "plan.kv_bytes_per_token explicitly") from None


def resolve_model(cfg: SluiceConfig, pc: PlanProfile, sources: Sources) -> tuple[float, int, int]:
    """(model_params_b, kv_bytes_per_token, dtype bytes): the profile's or from config.json."""
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if cfg.cluster.device == "cuda" else "float32"
    dtype_bytes = DTYPE_BYTES[dtype]
    params_b, kv_bytes = pc.model_params_b, pc.kv_bytes_per_token
    if params_b is not None and kv_bytes is not None:
        return params_b, kv_bytes, dtype_bytes
    data, where = read_model_config(cfg.model.path)
    if data is None:
        missing = [k for k, v in (("plan.model_params_b", params_b),
                                  ("plan.kv_bytes_per_token", kv_bytes)) if v is None]
        raise ValueError(f"{missing[0]}: model.path {cfg.model.path!r} has no config.json "
                         f"({where}) to derive it from; set {' and '.join(missing)} "
                         "(e.g. plan.model_params_b=8.2 plan.kv_bytes_per_token=147456 for "
                         "Qwen3-8B in bf16) or point model.path at the model folder")
    shape = read_model_shape(data, where)
    if params_b is None:
        params_b = shape.num_params / 1e9
        sources.append(("model_params_b", params_b, where))
    if kv_bytes is None:
        kv_bytes = shape.kv_bytes_per_token(dtype_bytes, 1)
        sources.append(("kv_bytes_per_token", kv_bytes, f"{where}, {dtype}"))
    return params_b, kv_bytes, dtype_bytes


def resolve_kv_pool_gb(cfg: SluiceConfig, pc: PlanProfile, weight_bytes_per_gpu: float,
                       sources: Sources) -> float:
    """KV pool of one rollout GPU: the profile's, the recipe's explicit size, or what is left."""
    r = cfg.rollout
    if pc.kv_pool_gb_per_gpu is not None:
        return pc.kv_pool_gb_per_gpu
    if r.kv_cache_memory_bytes is not None:
        pool_gb = r.kv_cache_memory_bytes / r.tp_size / 1e9
        sources.append(("kv_pool_gb_per_gpu", pool_gb,
                        "rollout.kv_cache_memory_bytes / rollout.tp_size"))
        return pool_gb
    pool_gb = cfg.cluster.gpu_memory_gb * r.gpu_memory_utilization - weight_bytes_per_gpu / 1e9
    if pool_gb <= 0:
        raise ValueError(f"plan.kv_pool_gb_per_gpu: the weights ({weight_bytes_per_gpu / 1e9:.1f}"
                         f" GB per GPU) fill cluster.gpu_memory_gb x rollout.gpu_memory_utilization;"
                         " raise rollout.tp_size or set plan.kv_pool_gb_per_gpu")
    sources.append(("kv_pool_gb_per_gpu", pool_gb, "cluster.gpu_memory_gb x "
                    "rollout.gpu_memory_utilization - weights / rollout.tp_size"))
    return pool_gb


def resolve_images(cfg: SluiceConfig, pc: PlanProfile, params_b: float, sources: Sources
                   ) -> tuple[int, float]:
    """(tokens_per_image, vision_prefill_factor): the profile's, else measured on model.path
    (its processor on its largest image, its vision_config's encoder); unused (0) without
    images. The factor is the encoder's FLOPs for one image over 2N x the image's run."""
    tokens, factor = pc.tokens_per_image, pc.vision_prefill_factor
    if pc.images_per_trajectory == 0 or (tokens is not None and factor is not None):
        return tokens or 0, factor or 0.0
    missing = [f"plan.{k}" for k, v in (("tokens_per_image", tokens), ("vision_prefill_factor", factor))
               if v is None]
    data, where = read_model_config(cfg.model.path)
    try:
        vision = VisionShape.from_config(data or {}, missing[0])
    except ValueError as exc:
        raise ValueError(f"{exc}; set {' and '.join(missing)}") from None
    if vision is None or data is None or data.get("image_token_id") is None:
        raise ValueError(f"{missing[0]}: plan.images_per_trajectory={pc.images_per_trajectory:g} needs "
                         f"{' and '.join(missing)}, and model.path {cfg.model.path!r} has no vision-language "
                         f"config.json to derive them from ({where}); set them (`python -m trainer.main "
                         "--dry-run` with model.path at the model prints both for its processor)")
    try:
        run = measure_image_run(model_folder(cfg.model.path), int(data["image_token_id"]))
    except (OSError, ValueError, ImportError) as exc:  # no processor files, or one this install cannot load
        raise ValueError(f"{missing[0]}: the processor of model.path {cfg.model.path!r} could not be run "
                         f"({exc}); set {' and '.join(missing)}") from None
    image = f"model.path's processor, a {run.edge_pixels} x {run.edge_pixels} px image"
    if tokens is None:
        tokens = run.num_tokens
        sources.append(("tokens_per_image", tokens, image))
    if factor is None:
        factor = vision.flops_per_image_token * run.num_image_tokens / (2 * params_b * 1e9 * run.num_tokens)
        sources.append(("vision_prefill_factor", factor, f"{where}'s vision_config, {image}"))
    return tokens, factor


def build_plan(cfg: SluiceConfig, pc: PlanProfile | None = None) -> Plan:
    """Resolve every None of the profile `pc` (None: the defaults) from the recipe `cfg`
    and the model's config.json."""
    pc = pc if pc is not None else PlanProfile()
    r, e = cfg.rollout, cfg.envs
    sources: Sources = []
    params_b, kv_bytes, dtype_bytes = resolve_model(cfg, pc, sources)
    weight_bytes_per_gpu = params_b * 1e9 * dtype_bytes / r.tp_size
    pool_gb = resolve_kv_pool_gb(cfg, pc, weight_bytes_per_gpu, sources)
    tokens_per_image, vision_factor = resolve_images(cfg, pc, params_b, sources)

    def recipe_default(key: str, value: Any, default: Any, where: str) -> Any:
        if value is not None:
            return value
        sources.append((key, default, where))
        return default

    inputs = PlanInputs(
        groups_per_step=cfg.train.groups_per_step, group_size=cfg.train.group_size,
        turns=recipe_default("turns", pc.turns, cfg.agent.max_turns, "agent.max_turns"),
        gen_tokens=pc.gen_tokens, gen_s=pc.gen_s, exec_s=pc.exec_s,
        cores_per_exec=pc.cores_per_exec, obs_tokens=pc.obs_tokens,
        prompt_tokens=pc.prompt_tokens, window_s=pc.window_s,
        decode_tokens_per_s_per_gpu=pc.decode_tokens_per_s_per_gpu, gpu_flops=pc.gpu_flops,
        mfu_prefill=pc.mfu_prefill, mfu_train=pc.mfu_train, model_params_b=params_b,
        kv_bytes_per_token=kv_bytes, kv_pool_gb_per_gpu=pool_gb,
        rollout_gpus=recipe_default("rollout_gpus", pc.rollout_gpus, r.num_engines * r.tp_size,
                                    "rollout.num_engines x rollout.tp_size"),
        train_gpus=recipe_default("train_gpus", pc.train_gpus, cfg.train.num_ranks,
                                  "train.num_ranks"),
        images_per_trajectory=pc.images_per_trajectory, tokens_per_image=tokens_per_image,
        vision_prefill_factor=vision_factor)
    node = SandboxNode(
        cores=recipe_default("cores_per_sandbox_node", pc.cores_per_sandbox_node,
                             e.cpus_per_sandbox_worker, "envs.cpus_per_sandbox_worker"),
        memory_gb=pc.memory_gb_per_sandbox_node,
        cores_per_sandbox=recipe_default(
            "cores_per_sandbox", pc.cores_per_sandbox,
            e.cpus_per_sandbox_worker / e.sandboxes_per_worker,
            "envs.cpus_per_sandbox_worker / envs.sandboxes_per_worker"),
        memory_gb_per_sandbox=e.memory_limit_mb / 1024)
    return Plan(inputs=inputs, node=node, weight_bytes_per_gpu=weight_bytes_per_gpu,
                dtype_bytes=dtype_bytes, tp_size=r.tp_size, hbm_bytes_per_s=pc.hbm_bytes_per_s,
                recipe_sandboxes=e.num_sandbox_workers * e.sandboxes_per_worker,
                sources=tuple(sources), kv_offload_tier=r.kv_offload.tier,
                kv_offload_gb_per_engine=r.kv_offload.gb_per_engine,
                max_staleness=cfg.buffer.max_staleness,
                agent_workers=sizing.resolve_agent_workers(cfg).describe())


# --- printing --------------------------------------------------------------------------

def _scaled(value: float, unit: str = "") -> str:
    for suffix, scale in (("T", 1e12), ("B" if not unit else "G", 1e9), ("M", 1e6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {suffix}{unit}"
    return f"{value:,.0f} {unit}".rstrip()


def _pct(seconds: float, window_s: float) -> str:
    return f"{seconds / window_s:.0%} of the window"


def format_environment(plan: Plan, a: PlanAccount) -> str:
    p, n = plan.inputs, plan.node
    nodes = [compute_sandbox_nodes(x, n) for x in (a.sandboxes_stateful, a.sandboxes_releasable)]
    memory = f", {n.memory_gb:g} GB" if n.memory_gb is not None else ""
    offer = plan.recipe_sandboxes
    verdict = ("enough for stateful sandboxes" if offer >= a.sandboxes_stateful else
               "enough only if sandboxes are released between turns"
               if offer >= a.sandboxes_releasable else "too few: trajectories will queue")
    rows = [
        "environment account (one step)",
        f"  executions            {a.executions:,}  (B·G·turns = {p.groups_per_step}·{p.group_size}·{p.turns})",
        f"  CPU time              {a.cpu_hours:,.0f} CPU·h  (executions x {p.exec_s:g} s x {p.cores_per_exec:g} cores)",
        f"  trajectory wall       {a.trajectory_wall_s:,.0f} s  ({p.turns} x ({p.gen_s:g} s gen "
        f"+ {p.exec_s:g} s exec), no queueing)",
        f"  sandbox-seconds       {_scaled(a.sandboxes_stateful * p.window_s)} stateful / "
        f"{_scaled(a.sandboxes_releasable * p.window_s)} releasable",
        f"  concurrent sandboxes  {a.sandboxes_stateful:,.0f} stateful / "
        f"{a.sandboxes_releasable:,.0f} releasable  (over a {p.window_s:,.0f} s window)",
        f"  sandbox nodes         {nodes[0]:,} / {nodes[1]:,}  ({n.cores:g}-core{memory} nodes; "
        f"{n.cores_per_sandbox:g} cores + {n.memory_gb_per_sandbox:g} GB per sandbox)",
        f"  the recipe offers     {offer:,} sandboxes: {verdict}",
    ]
    if plan.agent_workers:
        rows.append(f"  agent-loop workers    {plan.agent_workers}")
    return "\n".join(rows)


def format_gpu(plan: Plan, a: PlanAccount) -> str:
    p, w = plan.inputs, plan.inputs.window_s
    per_gpu = a.generating_concurrency / p.rollout_gpus
    bound = compute_decode_bound_tokens_per_s(plan.weight_bytes_per_gpu, per_gpu,
                                              a.final_context_tokens / 2, p.kv_bytes_per_token,
                                              plan.hbm_bytes_per_s)
    rows = [
        f"GPU account ({p.rollout_gpus} rollout GPUs, {p.train_gpus} train GPUs, "
        f"{p.model_params_b:.3g}B parameters)",
        f"  generated tokens      {_scaled(a.generated_tokens)}",
        f"  decode                {a.decode_s:,.0f} s ({_pct(a.decode_s, w)}) at "
        f"{p.decode_tokens_per_s_per_gpu:,.0f} tokens/s/GPU",
        f"  generating at once    {a.generating_concurrency:,.0f} requests ({per_gpu:,.1f} per GPU);"
        f" bandwidth-bound decode there: {bound:,.0f} tokens/s/GPU",
        f"  final context         {a.final_context_tokens:,} tokens",
        *format_images(p, a),
        f"  prefill cached        {a.prefill_cached_s:,.0f} s ({_pct(a.prefill_cached_s, w)})",
        f"  prefill uncached      {a.prefill_uncached_s:,.0f} s ({_pct(a.prefill_uncached_s, w)})",
        f"  KV need / pool        {_scaled(a.kv_need_bytes, 'B')} / {_scaled(a.kv_pool_bytes, 'B')}"
        f" ({p.kv_pool_gb_per_gpu:.3g} GB per GPU): {a.kv_resident_fraction:.0%} resident",
        f"  KV tier               {format_kv_tier(plan, a)}",
        f"  prefill expected      {a.prefill_expected_s:,.0f} s ({_pct(a.prefill_expected_s, w)})",
        f"  training tokens       {_scaled(a.train_tokens)}",
        f"  training              {a.train_s:,.0f} s at MFU {p.mfu_train:g}",
    ]
    busy = a.decode_s + a.prefill_expected_s
    if busy > w:
        rows.append(f"  warning: rollout GPUs are busy {busy:,.0f} s, longer than the "
                    f"{w:,.0f} s window: add rollout GPUs or KV residency")
    return "\n".join(rows)


def format_images(p: PlanInputs, a: PlanAccount) -> list[str]:
    """The GPU account's image rows; none without images."""
    if not a.image_tokens_per_trajectory:
        return []
    img = a.image_tokens_per_trajectory
    return [f"  image tokens          {img:,} per trajectory ({p.images_per_trajectory:g} x "
            f"{p.tokens_per_image:,}), {img / a.final_context_tokens:.0%} of the final context: "
            "held in KV, prefilled and trained like text",
            f"  vision encoder        {a.vision_encoder_s:,.0f} s ({_pct(a.vision_encoder_s, p.window_s)}) "
            f"of prefill cached, at {p.vision_prefill_factor:.3g} x a text token's prefill per image "
            "token; re-encoded with every uncached prefill, and trained"]


def compute_in_flight_trajectories(plan: Plan) -> int:
    """Trajectories alive at once in an async run (trainer.run.sizing's account, which
    also sizes the agent-loop workers) for the plan's workload."""
    p = plan.inputs
    return sizing.compute_in_flight_trajectories(plan.max_staleness, p.groups_per_step,
                                                 p.group_size, plan.recipe_sandboxes)


def compute_kv_tier_gb_per_engine(plan: Plan, a: PlanAccount) -> float:
    """The offload tier each engine needs (rollout.kv_offload.gb_per_engine) for every
    trajectory's KV to stay somewhere: the KV of the trajectories in flight at their final
    context (one step's in the seed's account, more under async), over the engines; 0
    where the pools hold it. The whole of it, not what exceeds the pool: vLLM's offload
    connectors store every block as it is computed, so the tier holds a copy of what the
    pool holds too."""
    engines = max(1, plan.inputs.rollout_gpus // plan.tp_size)
    in_flight = compute_in_flight_trajectories(plan) * a.final_context_tokens * plan.inputs.kv_bytes_per_token
    need = max(a.kv_need_bytes, in_flight)
    return need / engines / 1e9 if need > a.kv_pool_bytes else 0.0


def format_kv_tier(plan: Plan, a: PlanAccount) -> str:
    need = _scaled(compute_kv_tier_gb_per_engine(plan, a) * 1e9, "B")
    configured = ("none configured (rollout.kv_offload)" if plan.kv_offload_tier == "none" else
                  f"configured: {plan.kv_offload_tier}, {plan.kv_offload_gb_per_engine:g} GB per engine")
    return (f"{need} per engine needed (KV of the {compute_in_flight_trajectories(plan):,} trajectories "
            f"in flight, per engine, where the pools cannot hold it); {configured}")


def format_ratios(plan: Plan, a: PlanAccount) -> str:
    p, r = plan.inputs, compute_ratios(plan.inputs, a)
    header = ("task type", "env time/turn", "turns", "env : model", "sandboxes : GPU")
    mine = ("this plan", f"{p.exec_s:g} s", f"{p.turns}", f"{r.env_to_model_wall:.2g} : 1",
            f"{r.sandboxes_per_gpu_stateful:.0f} stateful / {r.sandboxes_per_gpu_releasable:.0f}"
            " releasable")
    widths = (28, 14, 7, 12)
    rows = ["ratios (the seed's table, then this plan)"]
    for row in (header, *SEED_RATIO_ROWS, mine):
        rows.append("  " + "".join(f"{c:<{wd}}" for c, wd in zip(row, widths)) + row[-1])
    total = p.rollout_gpus + p.train_gpus
    rows.append(f"  rollout : train       {r.rollout_to_train:.2f} : 1 in GPU-seconds per step; "
                f"of {total} GPUs, {r.balanced_rollout_gpus} rollout / "
                f"{total - r.balanced_rollout_gpus} train balance the two stages")
    return "\n".join(rows)


def format_plan(plan: Plan, a: PlanAccount) -> str:
    p = plan.inputs
    derived = "".join(f"\n  plan.{key} = {value:.4g}  ({where})" for key, value, where in plan.sources)
    head = (f"workload: {p.groups_per_step:,} groups x G={p.group_size} = "
            f"{p.groups_per_step * p.group_size:,} trajectories of {p.turns} turns; per turn "
            f"{p.gen_tokens:,} tokens in {p.gen_s:g} s, {p.exec_s:g} s exec, {p.obs_tokens:,} "
            f"tokens back; prompt {p.prompt_tokens:,} tokens")
    if p.images_per_trajectory:
        head += f"; {p.images_per_trajectory:g} images of {p.tokens_per_image:,} tokens per trajectory"
    return "\n\n".join([head + (f"\nderived:{derived}" if derived else ""),
                        format_environment(plan, a), format_gpu(plan, a), format_ratios(plan, a)])


def format_help() -> str:
    return "\n".join([USAGE, profile_help()])


def take_profile_flag(argv: list[str]) -> tuple[list[str], str | None]:
    """argv without `--profile FILE` (or `--profile=FILE`), and FILE (None when absent)."""
    rest: list[str] = []
    path: str | None = None
    args = iter(argv)
    for arg in args:
        if arg == "--profile":
            path = next(args, None)
            if path is None:
                raise ValueError("--profile needs a file: --profile my_workload.yaml")
        elif arg.startswith("--profile="):
            path = arg.removeprefix("--profile=")
        else:
            rest.append(arg)
    return rest, path


def load_recipe_and_profile(recipe: str | None, args: list[str], profile_path: str | None
                            ) -> tuple[SluiceConfig, PlanProfile]:
    """The recipe with its overrides and the profile with its `plan.*` arguments, from one
    argument list (the planner's and the simulator's command lines)."""
    overrides, profile_overrides = split_profile_args(args)
    return load_config(recipe, overrides), load_profile(profile_path, profile_overrides)


def parse_argv(argv: list[str]) -> tuple[str | None, list[str], str | None, bool, bool]:
    """Split argv into (recipe, overrides, profile file, as_json, help); unknown flags are
    errors."""
    argv, profile_path = take_profile_flag(argv)
    flags = {arg for arg in argv if arg.startswith("-")}
    if unknown := sorted(flags - {"--json", "-h", "--help"}):
        raise ValueError(f"unknown flag {unknown[0]!r}; flags are --profile, --json and --help")
    recipes = [arg.removeprefix("recipe=") for arg in argv if arg.startswith("recipe=")]
    overrides = [arg for arg in argv if not arg.startswith(("-", "recipe="))]
    return (recipes[-1] if recipes else None), overrides, profile_path, "--json" in flags, \
        bool(flags & {"-h", "--help"})


def main(argv: list[str] | None = None) -> int:
    try:
        recipe, args, profile_path, as_json, want_help = parse_argv(
            sys.argv[1:] if argv is None else argv)
        if want_help:
            print(format_help())
            return 0
        plan = build_plan(*load_recipe_and_profile(recipe, args, profile_path))
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    account = compute_account(plan.inputs)
    if as_json:
        print(json.dumps(dataclasses.asdict(account), indent=2))
    else:
        print(format_plan(plan, account))
    return 0


if __name__ == "__main__":
    sys.exit(main())
