"""Config-time model checks (trainer.run.model_check, rollout.rope) on a locally written
Qwen3-8B-shaped config.json: context vs positions with and without RoPE scaling, TP vs
heads, the KV cache vs one full-length sequence, and the memory estimates' numbers."""

from __future__ import annotations

import json
import math

import pytest
from model_configs import QWEN3_8B

from rollout.rope import build_rope_overrides, count_positions
from trainer.run.model_check import DecoderShape, check_models, format_model_report
from trainer.run.recipe import ConfigError, load_config

YARN_2X = "model.rope_scaling={rope_type: yarn, factor: 2.0, original_max_position_embeddings: 32768}"


@pytest.fixture
def qwen3_8b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    return tmp_path


def _swe(folder, *overrides):
    return load_config("swe_grpo.yaml", [f"model.path={folder}", "reward.judge.enabled=false",
                                         *overrides])


def test_recipe_context_beyond_positions_is_a_problem_naming_the_keys(qwen3_8b):
    cfg = _swe(qwen3_8b, "model.rope_scaling=null")  # null empties the recipe's mapping
    assert cfg.model.rope_scaling == {}
    report = check_models(cfg)
    (problem,) = [p for p in report.problems if p.startswith("model.max_context_tokens")]
    assert "65,536 exceeds the 40,960 positions" in problem and "model.rope_scaling" in problem


def test_yarn_factor_two_gives_qwen3_65536_positions(qwen3_8b):
    cfg = _swe(qwen3_8b, YARN_2X)
    assert cfg.model.rope_scaling == {"rope_type": "yarn", "factor": 2.0,
                                      "original_max_position_embeddings": 32768}
    assert check_models(cfg).problems == []
    overrides = build_rope_overrides(QWEN3_8B, cfg.model.rope_scaling)
    # The model's own rope_theta survives: the override replaces rope_parameters whole.
    assert overrides == {"rope_parameters": {"rope_theta": 1000000, "rope_type": "yarn",
                                             "factor": 2.0,
                                             "original_max_position_embeddings": 32768},
                         "max_position_embeddings": 65536}
    assert count_positions(QWEN3_8B, overrides) == 65536
    assert check_models(_swe(qwen3_8b, YARN_2X, "model.max_context_tokens=65537")).problems


def test_the_shipped_swe_recipe_passes_on_qwen3_8b_with_a_long_context_judge(qwen3_8b, tmp_path):
    judge = tmp_path / "judge"
    judge.mkdir()
    (judge / "config.json").write_text(json.dumps({
        **QWEN3_8B, "hidden_size": 5120, "num_attention_heads": 40, "num_hidden_layers": 64,
        "intermediate_size": 25600, "max_position_embeddings": 131072}))
    cfg = load_config("swe_grpo.yaml", [f"model.path={qwen3_8b}", f"reward.judge.model_path={judge}"])
    report = check_models(cfg)
    assert report.problems == [], report.problems
    # Judge engines get the policy's context unless reward.judge.max_model_len says: a stock
    # judge of 40,960 positions (Qwen3-8B's, as Qwen3-32B's) cannot take 65,536 tokens, and
    # the problem names the judge's own knobs.
    stock = [f"model.path={qwen3_8b}", f"reward.judge.model_path={qwen3_8b}"]
    short = check_models(load_config("swe_grpo.yaml", stock))
    assert [p.split(":")[0] for p in short.problems] == ["reward.judge.max_model_len"]
    assert "reward.judge.rope_scaling" in short.problems[0] and "40,960" in short.problems[0]
    own_context = check_models(load_config("swe_grpo.yaml", [*stock, "reward.judge.max_model_len=40960"]))
    assert own_context.problems == []
    yarn = ["reward.judge.rope_scaling.rope_type=yarn", "reward.judge.rope_scaling.factor=2.0"]
    assert check_models(load_config("swe_grpo.yaml", [*stock, *yarn])).problems == []
    bad = check_models(load_config("swe_grpo.yaml", [*stock, "reward.judge.rope_scaling.rope_type=yarn",
                                                     "reward.judge.rope_scaling.factor=1.0"]))
    assert [p.split(" ")[0] for p in bad.problems] == ["reward.judge.rope_scaling.factor"]


def test_linear_scaling_multiplies_positions_and_bad_scalings_name_the_key():
    overrides = build_rope_overrides(QWEN3_8B, {"rope_type": "linear", "factor": 4.0})
    assert "max_position_embeddings" not in overrides
    assert count_positions(QWEN3_8B, overrides) == 4 * 40960
    with pytest.raises(ValueError, match="model.rope_scaling.rope_type"):
        build_rope_overrides(QWEN3_8B, {"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="model.rope_scaling.factor"):
        build_rope_overrides(QWEN3_8B, {"rope_type": "yarn", "factor": 1.0})
    with pytest.raises(ValueError, match="model.rope_scaling.beta_fast"):
        build_rope_overrides(QWEN3_8B, {"rope_type": "yarn", "factor": 2.0, "beta_fast": "x"})


def test_recipe_loader_checks_each_mapping_value_under_its_own_key():
    with pytest.raises(ConfigError, match="model.rope_scaling.factor"):
        load_config(None, ["model.rope_scaling={rope_type: yarn, factor: true}"])
    with pytest.raises(ConfigError, match=r"envs.tools.calc: expected str"):
        load_config(None, ["envs.tools={calc: 3}"])


@pytest.mark.parametrize("tp,bad", [(2, False), (8, False), (16, False), (3, True), (12, True)])
def test_tp_size_must_divide_heads_and_fit_kv_heads(qwen3_8b, tp, bad):
    report = check_models(_swe(qwen3_8b, YARN_2X, f"rollout.tp_size={tp}"))
    tp_problems = [p for p in report.problems if p.startswith("rollout.tp_size")]
    assert bool(tp_problems) == bad, tp_problems


def test_kv_heads_that_tp_neither_divides_nor_multiplies_are_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_8B, "num_key_value_heads": 6,
                                                      "num_attention_heads": 48}))
    report = check_models(_swe(tmp_path, YARN_2X, "rollout.tp_size=4"))
    assert any("KV heads" in p and p.startswith("rollout.tp_size") for p in report.problems)


def test_kv_cache_smaller_than_one_sequence_is_a_problem(qwen3_8b):
    # 8 KV heads / TP2 = 4 per GPU: 2 x 36 layers x 4 x 128 x 2 bytes = 72 KiB per token.
    report = check_models(_swe(qwen3_8b, YARN_2X, "rollout.kv_cache_memory_bytes=1000000000"))
    (problem,) = [p for p in report.problems if p.startswith("rollout.kv_cache_memory_bytes")]
    assert f"{1_000_000_000 // (72 * 1024):,} tokens" in problem


def test_memory_estimates_match_hand_counts(qwen3_8b):
    shape = DecoderShape.from_config(QWEN3_8B, {}, "model.path")
    # Per layer: q and o 4096 x 4096 each, k and v 4096 x 1024 each, MLP 3 x 4096 x 12288.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288
    assert shape.num_params == 36 * (layer + 2 * 4096) + 2 * 151936 * 4096 + 4096
    assert round(shape.num_params / 1e9, 2) == 8.19  # Qwen3-8B: "8.2B parameters"
    report = check_models(_swe(qwen3_8b, YARN_2X))
    train = dict(report.memory[0].parts)
    n = shape.num_params
    assert train["weights"] == n * 2 / 16 and train["grads"] == n * 2 / 16  # ZeRO-3, bf16
    assert train["optimizer"] == n * 12 / 16  # fp32 master + two Adam moments
    assert train["logits (2,048-token chunk)"] == 2048 * 151936 * (5 * 4 + 2)
    engine = dict(report.memory[1].parts)
    assert engine["weights shard"] == n * 2 / 2
    unchunked = check_models(_swe(qwen3_8b, YARN_2X, "train.logprob_chunk_tokens=0"))
    logits = dict(unchunked.memory[0].parts)["logits (all 65,536 tokens)"]
    assert logits / 2**30 > 100  # the finding: one sequence's logits alone exceed an 80 GB GPU
    text = format_model_report(report)
    assert "train rank (ZeRO-3, 16 ranks)" in text and "rollout engine GPU (tp=2)" in text


def test_missing_model_folder_skips_with_a_note():
    report = check_models(load_config("swe_grpo.yaml", ["reward.judge.enabled=false"]))
    assert report.problems == [] and "model checks skipped" in report.notes[0]


# Idefics3-8B-Llama3's vision side, as its config.json ships it (the text side is Llama-3-8B).
IDEFICS3_8B_VISION = {"scale_factor": 2, "image_token_id": 128257,
                      "vision_config": {"hidden_size": 1152, "image_size": 364, "intermediate_size": 4304,
                                        "model_type": "idefics3_vision", "num_attention_heads": 16,
                                        "num_hidden_layers": 27, "patch_size": 14},
                      "text_config": {"hidden_size": 4096}}


def test_vision_shape_of_a_siglip_encoder_is_counted_by_hand():
    from trainer.run.model_check import VisionShape

    v = VisionShape.from_config(IDEFICS3_8B_VISION)
    assert v is not None
    # 26 x 26 patches of 14 px per 364-px tile, 2 x 2 of them per image token: 169 per tile
    assert (v.patches_per_tile, v.patches_per_image_token) == (676, 4)
    # q/k/v/o 4 x (1152^2 + 1152), fc1 + fc2 2 x 1152 x 4304 + 4304 + 1152, two LayerNorms 4 x 1152
    assert v.layer_params == 5_313_024 + 9_916_416 + 5_456 + 4_608 == 15_239_504
    # 27 layers, patch embedding 3 x 14^2 x 1152 + 1152, 676 positions x 1152, final norm 2 x 1152:
    # SigLIP-so400m without its pooling head; the connector projects 4 x 1152 -> 4096
    encoder = 27 * 15_239_504 + 678_528 + 778_752 + 2_304
    assert v.connector_params == 18_874_368
    assert v.num_params == encoder + 18_874_368 == 431_800_560
    assert v.flops_per_image_token == 2 * (4 * (27 * 15_239_504 + 678_528) + 18_874_368)
    assert v.activation_values_per_patch_layer == 8 * 1152 + 2 * 4304
    assert VisionShape.from_config(QWEN3_8B) is None  # text-only: no image account


def test_a_vision_config_of_another_layout_skips_the_image_accounts_with_a_note(tmp_path):
    # Qwen2-VL's vision_config names its layers `depth` and its width `embed_dim`.
    config = {**QWEN3_8B, "vision_config": {"depth": 32, "embed_dim": 1280, "patch_size": 14}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    report = check_models(_swe(tmp_path, YARN_2X))
    assert report.problems == []
    (note,) = [n for n in report.notes if n.startswith("image accounts skipped")]
    assert "vision_config lacks 'num_hidden_layers'" in note


@pytest.fixture(scope="module")
def tiny_vl():
    from trainer.run.tiny_vl_model import ensure_tiny_vl_model

    return ensure_tiny_vl_model()


def _tiny_vl_parameters(folder) -> dict[str, int]:
    """Parameters per top-level module of the saved weights, from the safetensors header."""
    import struct

    raw = (folder / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    counts: dict[str, int] = {}
    for name, entry in header.items():
        if name != "__metadata__":
            key = name.split(".")[1] if name.startswith("model.") else name.split(".")[0]
            counts[key] = counts.get(key, 0) + math.prod(entry["shape"])
    return counts


def test_the_dry_run_shows_what_an_image_costs_on_the_tiny_vision_language_model(tiny_vl):
    """quickstart (fp32, ZeRO-2 on one rank, tp 1) on the tiny Idefics3: its largest image
    (224 px: 2 x 2 tiles and the whole image) is a run of 94 ids with 80 image tokens. Per
    image token: KV 2 (K, V) x 2 layers x 1 KV head x 64 x 4 bytes = 1,024 B; text-model
    activations 2 layers x (9 x 128 + 4 x 384 + 3 x 64) x 4 = 23,040 B; vision activations
    4 patches x 2 layers x (8 x 32 + 2 x 64) x 4 = 12,288 B (a 64-patch tile: 196,608 B)."""
    from trainer.run.model_check import ImageRun, VisionShape, estimate_image_memory, format_model_report

    cfg = load_config("quickstart.yaml", [f"model.path={tiny_vl}"])
    report = check_models(cfg)
    assert report.problems == []
    config = json.loads((tiny_vl / "config.json").read_text())
    vision = VisionShape.from_config(config)
    assert vision is not None
    saved = _tiny_vl_parameters(tiny_vl)
    assert vision.num_params == saved["vision_model"] + saved["connector"] == 38_048 + 16_384
    text = "\n".join(report.notes)
    assert "an image of 224 x 224 px (the processor's largest): 94 ids in the context, 80 of them image " \
           "tokens, 5 tiles of 112 px" in text
    assert "per image token: KV 1 KiB on an engine GPU" in text
    assert "training activations 34.5 KiB (22.5 KiB text model + 12 KiB vision encoder)" in text
    assert "vision encoder activations 192 KiB per tile, 960 KiB per image" in text  # 5 tiles, 80 tokens
    assert "plan.tokens_per_image=94 plan.vision_prefill_factor=0.254" in text
    shape = DecoderShape.from_config(config, {}, "model.path")
    m = estimate_image_memory(cfg, shape, vision, ImageRun(224, 94, 80, 5), 4)
    assert (m.kv_bytes_per_token, m.kv_bytes_per_image) == (1024, 94 * 1024)
    assert m.encoder_output_bytes_per_image == 80 * 128 * 4
    assert (m.text_activation_bytes_per_token, m.vision_activation_bytes_per_image_token) == (23_040, 12_288)
    assert m.vision_activation_bytes_per_tile == 196_608
    checkpointed = estimate_image_memory(load_config("quickstart.yaml", [f"model.path={tiny_vl}",
                                                                          "train.gradient_checkpointing=true"]),
                                         shape, vision, ImageRun(224, 94, 80, 5), 4)
    # each layer's input (2 x 128; 2 x 32 per patch) plus one layer's working set
    assert checkpointed.text_activation_bytes_per_token == (2 * 128 + 2880) * 4
    assert checkpointed.vision_activation_bytes_per_image_token == 4 * (2 * 32 + 384) * 4
    # The encoder and connector are trained: fp32 weights, grads and two Adam moments (16 B each).
    train = dict(report.memory[0].parts)
    assert train["vision encoder (weights, grads, optimizer)"] == 54_432 * 16
    assert dict(report.memory[1].parts)["vision encoder shard"] == 54_432 * 4
    assert "vision encoder + connector: 54,432 parameters" in format_model_report(report)
    by_name = check_models(load_config("quickstart.yaml", ["model.path=tiny-vl"]))
    assert by_name.notes == report.notes  # the local model's name reaches the same folder


def test_the_vision_activation_estimate_matches_what_autograd_keeps(tiny_vl):
    """The tiny encoder's forward on 5 tiles, with every tensor autograd saves for backward
    counted once (by storage; weights and the pixel input left out): per patch and layer
    two LayerNorm inputs and outputs, q/k/v, the attention output (sdpa) and fc1's output
    and activation, 8 x 32 + 2 x 64 values, as the estimate says; the remainder is norm
    statistics, attention log-sum-exps and the final norm's input (about 6 %)."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    from trainer.run.model_check import ImageRun, VisionShape, estimate_image_memory

    model = Idefics3ForConditionalGeneration.from_pretrained(tiny_vl, attn_implementation="sdpa")
    encoder = model.model.vision_model
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    pixels = torch.randn(5, 3, 112, 112)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.is_floating_point() and storage.data_ptr() not in weights | {pixels.untyped_storage().data_ptr()}:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        encoder(pixel_values=pixels)
    config = json.loads((tiny_vl / "config.json").read_text())
    vision = VisionShape.from_config(config)
    assert vision is not None
    cfg = load_config("quickstart.yaml", [f"model.path={tiny_vl}"])
    m = estimate_image_memory(cfg, DecoderShape.from_config(config, {}, "model.path"), vision,
                              ImageRun(224, 94, 80, 5), 4)
    assert m.vision_activation_bytes_per_tile * 5 == 983_040  # 5 x 64 patches x 2 layers x 384 x 4 B
    assert sum(kept.values()) == pytest.approx(983_040, rel=0.1)
