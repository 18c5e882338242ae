"""The capacity planner (launch.plan): the seed's section-7 accounts from its own inputs, a
second scenario computed by hand, model shapes from config.json, sandbox nodes, ratios,
the planner's own workload profile (`plan.*` arguments, a profile file) and the command
line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from model_configs import QWEN3_8B

from launch.plan import (Plan, PlanInputs, SandboxNode, build_plan, compute_account,
                         compute_decode_bound_tokens_per_s, compute_ratios,
                         compute_sandbox_nodes, load_recipe_and_profile, main, read_model_shape)
from launch.plan_profile import load_profile
from trainer.run.recipe import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]

# The issue's --json keys, in its order.
ACCOUNT_KEYS = ["trajectories", "executions", "cpu_hours", "trajectory_wall_s",
                "sandboxes_stateful", "sandboxes_releasable", "generated_tokens", "decode_s",
                "generating_concurrency", "final_context_tokens", "prefill_cached_s",
                "prefill_uncached_s", "kv_need_bytes", "kv_pool_bytes", "kv_resident_fraction",
                "prefill_expected_s", "train_tokens", "train_s",
                # issue 28: images (0 without them)
                "image_tokens_per_trajectory", "vision_encoder_s"]

# The seed's inputs on top of swe_grpo.yaml (B=500, G=8, 20 turns, gpu_memory_utilization
# 0.9): 32 rollout H100s at TP1 (its decode account reads 16 GB of weights per card), 32
# training cards, an 8B model with 128 KiB of KV per token. Its accounts take the final
# context as 40K = 20 turns x (400 + 1,600): the ~2K prompt is inside the first turn's
# growth (turn 1 starts at 2K, turn 20 at 40K), so prompt_tokens=0 reproduces its arithmetic.
SEED = ["rollout.num_engines=32", "rollout.tp_size=1", "plan.train_gpus=32",
        "plan.model_params_b=8", "plan.kv_bytes_per_token=131072", "plan.prompt_tokens=0",
        "plan.gen_tokens=400", "plan.gen_s=10", "plan.exec_s=30", "plan.cores_per_exec=1",
        "plan.obs_tokens=1600", "plan.window_s=1800", "plan.decode_tokens_per_s_per_gpu=2000",
        "plan.gpu_flops=989e12", "plan.mfu_prefill=0.5", "plan.mfu_train=0.4",
        "cluster.gpu_memory_gb=80", "plan.hbm_bytes_per_s=2e12"]


def plan_of(recipe: str, args: list[str] | tuple[str, ...] = (), profile: str | None = None) -> Plan:
    """The plan of a recipe and one argument list, as the command line splits it (recipe
    keys, `plan.*` profile keys)."""
    return build_plan(*load_recipe_and_profile(recipe, list(args), profile))


def _round_sig(x: float, digits: int) -> float:
    return float(f"{x:.{digits}g}")


@pytest.fixture(scope="module")
def seed_plan():
    plan = plan_of("swe_grpo.yaml", SEED)
    return plan, compute_account(plan.inputs)


# key, hand-computed value, the seed's printed number, significant digits it prints
SEED_ROWS = [
    ("trajectories", 500 * 8, 4000, 4),
    ("executions", 500 * 8 * 20, 80_000, 4),
    ("cpu_hours", 80_000 * 30 * 1 / 3600, 667, 3),
    ("trajectory_wall_s", 20 * (10 + 30), 800, 3),
    ("sandboxes_stateful", 4000 * 800 / 1800, 1800, 2),
    ("sandboxes_releasable", 80_000 * 30 / 1800, 1300, 2),
    ("generated_tokens", 4000 * 20 * 400, 32e6, 2),
    ("decode_s", 32e6 / (32 * 2000), 500, 2),
    ("generating_concurrency", 4000 * 10 / 40, 1000, 2),
    ("final_context_tokens", 20 * (400 + 1600), 40_000, 2),
    ("prefill_cached_s", 2 * 8e9 * 4000 * 40_000 / (32 * 989e12 * 0.5), 160, 2),  # 161.8
    ("prefill_uncached_s", 2 * 8e9 * 4000 * 20 * 20_000 / (32 * 989e12 * 0.5), 1600, 2),
    ("kv_need_bytes", 4000 * 40_000 * 131_072, 20e12, 1),  # 21.0 TB
    ("kv_pool_bytes", 32 * (80 * 0.9 - 16) * 1e9, 1.8e12, 2),  # 56 GB per card
    ("train_tokens", 4000 * 40_000, 160e6, 2),
    ("train_s", 12 * 8e9 * 160e6 / (32 * 989e12 * 0.4), 1200, 2),  # 1213
]


@pytest.mark.parametrize("key, hand, seed, digits", SEED_ROWS, ids=[r[0] for r in SEED_ROWS])
def test_the_seed_inputs_give_the_seeds_numbers(seed_plan, key, hand, seed, digits):
    value = getattr(seed_plan[1], key)
    assert value == pytest.approx(hand, rel=1e-12)
    assert _round_sig(value, digits) == seed


def test_the_seed_kv_residency_is_about_one_in_six(seed_plan):
    a = seed_plan[1]
    hand = 1.792e12 / (4000 * 40_000 * 131_072 / 2)  # pool / half the need = 0.171
    assert a.kv_resident_fraction == pytest.approx(hand, rel=1e-12)
    assert round(1 / a.kv_resident_fraction) == 6  # the seed: "roughly one in six"
    expected = a.prefill_cached_s + (1 - hand) * (a.prefill_uncached_s - a.prefill_cached_s)
    assert a.prefill_expected_s == pytest.approx(expected, rel=1e-12)
    assert _round_sig(a.prefill_expected_s, 2) == 1400  # the seed: "about 1,400 s"


def test_the_seed_machines_and_ratios(seed_plan):
    plan, a = seed_plan
    # 1,778 sandboxes x 2 vCPU on 80-core nodes: 40 per node -> 45 nodes (the seed's 45)
    assert compute_sandbox_nodes(a.sandboxes_stateful, plan.node) == math.ceil(1778 / 40) == 45
    assert compute_sandbox_nodes(a.sandboxes_releasable, plan.node) == math.ceil(1334 / 40) == 34
    r = compute_ratios(plan.inputs, a)
    assert r.env_to_model_wall == 3.0  # the seed's code row: 3 : 1
    assert 50 <= r.sandboxes_per_gpu_stateful <= 60  # the seed's code row: 50-60 per GPU
    assert r.sandboxes_per_gpu_stateful == pytest.approx(1777.78 / 32, rel=1e-5)
    rollout = (a.decode_s + a.prefill_expected_s) * 32
    assert r.rollout_to_train == pytest.approx(rollout / (a.train_s * 32), rel=1e-12)
    assert r.balanced_rollout_gpus == round(64 * rollout / (rollout + a.train_s * 32)) == 39


def test_the_seed_low_concurrency_decode_is_bandwidth_bound(seed_plan):
    plan, a = seed_plan
    # 16 GB of weights + 31.25 running x 20K average context x 128 KiB, over 2 TB/s
    hand = 31.25 / ((16e9 + 31.25 * 20_000 * 131_072) / 2e12)  # 638 tokens/s
    bound = compute_decode_bound_tokens_per_s(plan.weight_bytes_per_gpu,
                                              a.generating_concurrency / 32,
                                              a.final_context_tokens / 2, 131_072, 2e12)
    assert bound == pytest.approx(hand, rel=1e-12)
    # the seed rounds 81.9 GB of KV to 80 and 31.25 requests to 31, and prints 650
    assert bound == pytest.approx(650, rel=0.03)


def test_a_second_scenario_computed_by_hand():
    p = PlanInputs(groups_per_step=64, group_size=4, turns=10, gen_tokens=500, gen_s=5.0,
                   exec_s=15.0, cores_per_exec=2.0, obs_tokens=300, prompt_tokens=1000,
                   window_s=600.0, decode_tokens_per_s_per_gpu=1500.0, gpu_flops=1e15,
                   mfu_prefill=0.5, mfu_train=0.25, model_params_b=4.0,
                   kv_bytes_per_token=100_000, kv_pool_gb_per_gpu=7.2, rollout_gpus=8,
                   train_gpus=8)
    a = compute_account(p)
    # 256 trajectories; final context 1,000 + 10 x 800 = 9,000 tokens
    hand = dict(trajectories=256, executions=2560, cpu_hours=2560 * 15 * 2 / 3600,  # 21.33
                trajectory_wall_s=200.0, sandboxes_stateful=256 * 200 / 600,  # 85.33
                sandboxes_releasable=64.0, generated_tokens=1_280_000,
                decode_s=1_280_000 / 12_000,  # 106.67
                generating_concurrency=64.0, final_context_tokens=9000,
                prefill_cached_s=4.608,  # 2 x 4e9 x 2.304e6 / 4e15
                prefill_uncached_s=23.04,  # 2 x 4e9 x 11.52e6 / 4e15
                kv_need_bytes=230_400_000_000, kv_pool_bytes=5.76e10,
                kv_resident_fraction=0.5,  # 5.76e10 / (2.304e11 / 2)
                prefill_expected_s=13.824,  # 4.608 + 0.5 x 18.432
                train_tokens=2_304_000, train_s=55.296,  # 12 x 4e9 x 2.304e6 / 2e15
                image_tokens_per_trajectory=0, vision_encoder_s=0.0)
    assert list(hand) == ACCOUNT_KEYS
    for key, value in hand.items():
        assert getattr(a, key) == pytest.approx(value, rel=1e-12), key

    roomy = compute_account(PlanInputs(**{**_fields(p), "kv_pool_gb_per_gpu": 40.0}))
    assert roomy.kv_resident_fraction == 1.0  # 3.2e11 pool holds 2.8x the half context
    assert roomy.prefill_expected_s == pytest.approx(4.608, rel=1e-12)

    r = compute_ratios(p, a)
    assert r.env_to_model_wall == 3.0
    assert r.sandboxes_per_gpu_stateful == pytest.approx(85.333 / 8, rel=1e-4)
    # rollout (106.67 + 13.824) x 8 = 963.9 GPU-s vs train 55.296 x 8 = 442.4
    assert r.rollout_to_train == pytest.approx(120.4907 / 55.296, rel=1e-5)
    assert r.balanced_rollout_gpus == 11  # 16 x 0.6854 = 10.97


def test_images_are_context_tokens_and_their_encoder_pass_a_share_of_prefill():
    """The second scenario with 2.5 images of 400 tokens per trajectory, the encoder at half
    a text token's prefill per image token: 1,000 image tokens make the final context
    10,000 tokens (KV, training tokens) and 10,500 in prefill-FLOP units (prefill, training)."""
    text = dict(groups_per_step=64, group_size=4, turns=10, gen_tokens=500, gen_s=5.0, exec_s=15.0,
                cores_per_exec=2.0, obs_tokens=300, prompt_tokens=1000, window_s=600.0,
                decode_tokens_per_s_per_gpu=1500.0, gpu_flops=1e15, mfu_prefill=0.5, mfu_train=0.25,
                model_params_b=4.0, kv_bytes_per_token=100_000, kv_pool_gb_per_gpu=7.2, rollout_gpus=8,
                train_gpus=8)
    a = compute_account(PlanInputs(**text, images_per_trajectory=2.5, tokens_per_image=400,
                                   vision_prefill_factor=0.5))
    hand = dict(final_context_tokens=10_000, image_tokens_per_trajectory=1000,
                prefill_cached_s=5.376,  # 2 x 4e9 x 256 x 10,500 / 4e15
                vision_encoder_s=0.256,  # 2 x 4e9 x 256 x 500 / 4e15
                prefill_uncached_s=26.88,  # 2 x 4e9 x (256 x 10 x 10,500 / 2) / 4e15
                kv_need_bytes=256_000_000_000,  # 256 x 10,000 x 100,000
                kv_resident_fraction=0.45,  # 5.76e10 / (2.56e11 / 2)
                prefill_expected_s=17.2032,  # 5.376 + 0.55 x (26.88 - 5.376)
                train_tokens=2_560_000, train_s=64.512,  # 12 x 4e9 x 256 x 10,500 / 2e15
                generated_tokens=1_280_000)  # images are never generated
    for key, value in hand.items():
        assert getattr(a, key) == pytest.approx(value, rel=1e-12), key
    # Without the encoder's share, an image token costs exactly what a prompt token does.
    as_text = compute_account(PlanInputs(**{**text, "prompt_tokens": 2000}))
    free_encoder = compute_account(PlanInputs(**text, images_per_trajectory=2.5, tokens_per_image=400))
    for key in ("final_context_tokens", "prefill_cached_s", "prefill_uncached_s", "kv_need_bytes",
                "prefill_expected_s", "train_tokens", "train_s"):
        assert getattr(free_encoder, key) == pytest.approx(getattr(as_text, key), rel=1e-12), key
    assert free_encoder.vision_encoder_s == 0.0


def test_tokens_per_image_and_the_encoder_factor_come_from_a_vision_language_model():
    """The tiny Idefics3's processor makes a 224-px image (its largest) 2 x 2 tiles and the
    whole image: 5 x (<fake_token_around_image>, a tag, 16 <image>), 3 newlines and a closing
    <fake_token_around_image> = 94 ids, 80 of them image tokens. Its encoder (2 layers of 32,
    MLP 64, 14-px patches, 2 x 2 patches per token) and connector (128 x 128) cost, per image
    token, 2 x (4 x (2 x 8,544 + 18,848) + 16,384) = 320,256 FLOPs; the text model has 536,704
    parameters: factor 320,256 x 80 / (2 x 536,704 x 94)."""
    from trainer.run.tiny_vl_model import ensure_tiny_vl_model

    folder = ensure_tiny_vl_model()
    plan = plan_of("quickstart.yaml", [f"model.path={folder}", "plan.images_per_trajectory=3"])
    p = plan.inputs
    assert p.model_params_b * 1e9 == pytest.approx(536_704, rel=1e-12)
    assert p.tokens_per_image == 94
    assert p.vision_prefill_factor == pytest.approx(320_256 * 80 / (2 * 536_704 * 94), rel=1e-12)
    assert {key for key, _, _ in plan.sources} >= {"tokens_per_image", "vision_prefill_factor"}
    assert compute_account(p).image_tokens_per_trajectory == 3 * 94
    assert plan_of("quickstart.yaml", ["model.path=tiny-vl", "plan.images_per_trajectory=3"]).inputs == p
    given = plan_of("quickstart.yaml", [f"model.path={folder}", "plan.images_per_trajectory=3",
                                        "plan.tokens_per_image=500"])
    assert given.inputs.tokens_per_image == 500  # the profile's wins; the factor is still measured
    assert given.inputs.vision_prefill_factor == pytest.approx(p.vision_prefill_factor, rel=1e-12)


def test_images_on_a_text_model_ask_for_the_image_keys(capsys):
    with pytest.raises(ValueError, match=r"plan.tokens_per_image: plan.images_per_trajectory=2 needs "
                                         r"plan.tokens_per_image and plan.vision_prefill_factor"):
        plan_of("quickstart.yaml", ["plan.images_per_trajectory=2"])
    with pytest.raises(ValueError, match=r"needs plan.vision_prefill_factor, and model.path 'tiny'"):
        plan_of("quickstart.yaml", ["plan.images_per_trajectory=2", "plan.tokens_per_image=300"])
    given = plan_of("quickstart.yaml", ["plan.images_per_trajectory=2", "plan.tokens_per_image=300",
                                        "plan.vision_prefill_factor=0.2"])
    assert (given.inputs.tokens_per_image, given.inputs.vision_prefill_factor) == (300, 0.2)
    with pytest.raises(ValueError, match="plan.tokens_per_image: must be > 0"):
        load_profile(None, ["plan.tokens_per_image=0"])
    with pytest.raises(ValueError, match="plan.images_per_trajectory: must be >= 0"):
        load_profile(None, ["plan.images_per_trajectory=-1"])
    assert main(["recipe=swe_grpo.yaml", *SEED, "plan.images_per_trajectory=4", "plan.tokens_per_image=1000",
                 "plan.vision_prefill_factor=0.3"]) == 0
    out = capsys.readouterr().out
    for line in ["4 images of 1,000 tokens per trajectory", "final context         44,000 tokens",
                 "image tokens          4,000 per trajectory (4 x 1,000), 9% of the final context",
                 # 2 x 8e9 x 4,000 x 0.3 x 4,000 / (32 x 989e12 x 0.5) = 4.85 s; of 2 x 8e9 x 4,000
                 # x 45,200 / 1.5824e16 = 182.8 s
                 "vision encoder        5 s (0% of the window) of prefill cached, at 0.3 x",
                 "prefill cached        183 s"]:
        assert line in out, line


def _fields(p: PlanInputs) -> dict:
    return {name: getattr(p, name) for name in PlanInputs.__slots__}


def test_sandbox_nodes_take_the_tighter_of_cores_and_memory():
    node = SandboxNode(cores=64, memory_gb=128, cores_per_sandbox=1, memory_gb_per_sandbox=8)
    assert compute_sandbox_nodes(100, node) == 7  # 16 fit by memory: ceil(100 / 16)
    cores_only = SandboxNode(cores=64, memory_gb=None, cores_per_sandbox=1, memory_gb_per_sandbox=8)
    assert compute_sandbox_nodes(100, cores_only) == 2
    assert compute_sandbox_nodes(0.2, cores_only) == 1  # a fraction of a sandbox is one
    with pytest.raises(ValueError, match="plan.cores_per_sandbox_node"):
        compute_sandbox_nodes(10, SandboxNode(cores=2, memory_gb=None, cores_per_sandbox=4,
                                              memory_gb_per_sandbox=1))


# Qwen3-8B's shapes (its config.json on the hub has these numbers).
# Per layer: q 4096x4096 + k, v 4096x1024 + o 4096x4096, MLP 3 x 4096x12288, 2 norms of 4096;
# untied embeddings 2 x 151936x4096; the final norm. The released model counts 8,190,735,360:
# 36 x 2 x 128 more, its per-head q/k norms, which the planner leaves out.
QWEN3_8B_PARAMS = (36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096)
                   + 2 * 151936 * 4096 + 4096)


def test_model_params_and_kv_bytes_come_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    assert QWEN3_8B_PARAMS == 8_190_726_144 == 8_190_735_360 - 36 * 2 * 128
    plan = plan_of("swe_grpo.yaml", [f"model.path={tmp_path}"])
    assert plan.inputs.model_params_b * 1e9 == pytest.approx(QWEN3_8B_PARAMS, rel=1e-12)
    assert plan.inputs.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456  # bf16 K and V
    # TP2 engines hold half the weights per GPU: 80 GB x 0.9 - 8.19 GB
    assert plan.inputs.kv_pool_gb_per_gpu == pytest.approx(72 - QWEN3_8B_PARAMS / 1e9, rel=1e-12)
    assert {key for key, _, _ in plan.sources} >= {"model_params_b", "kv_bytes_per_token",
                                                   "kv_pool_gb_per_gpu"}

    fp32 = plan_of("swe_grpo.yaml", [f"model.path={tmp_path}", "model.dtype=float32"])
    assert fp32.inputs.kv_bytes_per_token == 2 * 147_456
    given = plan_of("swe_grpo.yaml", [f"model.path={tmp_path}", "plan.model_params_b=7.5"])
    assert given.inputs.model_params_b == 7.5  # an override wins over the config


def test_shape_defaults_and_biases():
    llama = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "vocab_size": 100, "tie_word_embeddings": True,
             "max_position_embeddings": 4096}
    shape = read_model_shape(llama, "x")
    assert (shape.num_kv_heads, shape.head_dim, shape.qkv_bias) == (4, 16, False)
    # 2 x (4 x 64x64 + 3 x 64x128 + 2 x 64) + tied 100x64 + 64
    assert shape.num_params == 2 * (4 * 4096 + 3 * 8192 + 128) + 6400 + 64
    qwen2 = read_model_shape({**llama, "model_type": "qwen2"}, "x")
    assert qwen2.num_params == shape.num_params + 2 * 3 * 64
    with pytest.raises(ValueError, match="plan.model_params_b: x: config.json lacks 'vocab_size'"):
        read_model_shape({k: v for k, v in llama.items() if k != "vocab_size"}, "x")


def test_a_missing_or_moe_config_says_which_keys_to_set(tmp_path):
    with pytest.raises(ValueError, match=r"plan.model_params_b.*no config.json.*"
                                         r"set plan.model_params_b and plan.kv_bytes_per_token"):
        plan_of("swe_grpo.yaml")  # /models/Qwen3-8B is not on this machine
    with pytest.raises(ValueError, match="set plan.kv_bytes_per_token"):
        plan_of("swe_grpo.yaml", ["plan.model_params_b=8"])
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_8B, "num_experts": 128}))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        plan_of("swe_grpo.yaml", [f"model.path={tmp_path}"])
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="lacks 'num_attention_heads'"):
        plan_of("swe_grpo.yaml", [f"model.path={tmp_path}"])


def test_recipe_defaults_fill_the_none_keys():
    plan = plan_of("quickstart.yaml")  # the tiny model's shape, no file read
    p = plan.inputs
    assert (p.turns, p.rollout_gpus, p.train_gpus) == (4, 1, 1)
    assert p.kv_bytes_per_token == 2 * 2 * 1 * 64 * 4  # 2 layers, 1 KV head of 64, fp32
    assert p.kv_pool_gb_per_gpu == 268_435_456 / 1e9  # rollout.kv_cache_memory_bytes
    assert (plan.node.cores, plan.node.cores_per_sandbox) == (1.0, 1 / 32)
    assert plan.recipe_sandboxes == 32
    big = ["plan.model_params_b=40", "plan.kv_bytes_per_token=1"]
    # 80 GB of bf16 weights: at TP2 40 GB per GPU leave 72 - 40 for KV; at TP1 nothing is left
    assert plan_of("swe_grpo.yaml", big).inputs.kv_pool_gb_per_gpu == \
        pytest.approx(32, rel=1e-12)
    with pytest.raises(ValueError, match="raise rollout.tp_size or set plan.kv_pool_gb_per_gpu"):
        plan_of("swe_grpo.yaml", [*big, "rollout.tp_size=1"])


def test_the_profile_is_the_planners_own_checked_input(tmp_path):
    profile = load_profile(None, ["plan.exec_s=45", "plan.turns=30"])
    assert (profile.exec_s, profile.turns, profile.gen_s) == (45.0, 30, 10.0)  # the rest: defaults
    with pytest.raises(ConfigError, match="did you mean 'plan.exec_s'.*python -m launch.plan --help"):
        load_profile(None, ["plan.exec_sec=45"])
    with pytest.raises(ValueError, match=r"plan.mfu_train: a utilisation must be in \(0, 1\]"):
        load_profile(None, ["plan.mfu_train=1.5"])
    with pytest.raises(ValueError, match="plan.exec_s: must be >= 0"):
        load_profile(None, ["plan.exec_s=-1"])
    with pytest.raises(ValueError, match="plan.rollout_gpus: must be > 0"):
        load_profile(None, ["plan.rollout_gpus=0"])
    with pytest.raises(ValueError, match="plan.gen_s"):
        load_profile(None, ["plan.gen_s=0", "plan.exec_s=0"])
    # A profile file, with arguments on top of it.
    path = tmp_path / "workload.yaml"
    path.write_text("plan:\n  exec_s: 60\n  obs_tokens: 2400\n")
    from_file = load_profile(path, ["plan.obs_tokens=100"])
    assert (from_file.exec_s, from_file.obs_tokens) == (60.0, 100)
    with pytest.raises(ConfigError, match="is not a file"):
        load_profile(tmp_path / "missing.yaml")
    # A training run never reads the profile: its keys are not recipe keys.
    with pytest.raises(ConfigError, match="unknown config key 'plan'"):
        load_config("swe_grpo.yaml", ["plan.exec_s=45"])


def test_json_has_exactly_the_issue_keys(capsys):
    assert main(["recipe=swe_grpo.yaml", *SEED, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ACCOUNT_KEYS
    assert out["executions"] == 80_000 and out["kv_need_bytes"] == 4000 * 40_000 * 131_072


def test_a_profile_file_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "slow_tests.yaml"
    path.write_text("plan:\n  exec_s: 60\n  cores_per_exec: 2\n")
    seed = [arg for arg in SEED if not arg.startswith(("plan.exec_s", "plan.cores_per_exec"))]
    assert main(["recipe=swe_grpo.yaml", *seed, "--profile", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cpu_hours"] == pytest.approx(80_000 * 60 * 2 / 3600, rel=1e-12)
    assert main(["recipe=swe_grpo.yaml", *seed, f"--profile={path}", "plan.exec_s=30", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cpu_hours"] == pytest.approx(80_000 * 30 * 2 / 3600)
    assert main(["recipe=swe_grpo.yaml", "--profile"]) == 2
    assert "--profile needs a file" in capsys.readouterr().err


def test_the_table_prints_both_accounts_nodes_and_ratios(capsys):
    assert main(["recipe=swe_grpo.yaml", *SEED]) == 0
    out = capsys.readouterr().out
    for line in ["executions            80,000", "667 CPU·h", "3.2 M stateful / 2.4 M releasable",
                 "1,778 stateful / 1,333 releasable", "sandbox nodes         45 / 34",
                 "1,800 sandboxes: enough for stateful", "decode                500 s (28%",
                 "1,000 requests", "prefill cached        162 s", "prefill uncached      1,618 s",
                 "21 TB / 1.79 TB", "17% resident", "prefill expected      1,369 s",
                 "training tokens       160 M", "training              1,213 s",
                 "code (unit tests)", "SWE-bench-like", "this plan", "3 : 1",
                 "56 stateful / 42 releasable", "39 rollout / 25 train",
                 "rollout GPUs are busy 1,869 s"]:
        assert line in out, line
    assert "image tokens" not in out and "vision encoder" not in out  # rows only with images
    assert "plan.kv_pool_gb_per_gpu = 56" in out  # derived values say where from


def test_cli_errors_and_help(capsys):
    assert main(["recipe=swe_grpo.yaml"]) == 2
    assert "config error: plan.model_params_b" in capsys.readouterr().err
    assert main(["--jsn"]) == 2
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "plan.cores_per_sandbox_node" in out and "agent.max_turns" in out
    assert "rollout.num_engines = " not in out  # only the plan keys


def test_module_entry_point_runs_without_heavy_imports():
    probe = ("import sys, runpy; sys.argv = ['plan', 'recipe=swe_grpo.yaml', {}, '--json'];\n"
             "try:\n    runpy.run_module('launch.plan', run_name='__main__')\n"
             "except SystemExit as e:\n    code = e.code\n"
             "print('HEAVY', [m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules])\n"
             "sys.exit(code)").format(", ".join(repr(s) for s in SEED))
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert '"executions": 80000' in proc.stdout and "HEAVY []" in proc.stdout
