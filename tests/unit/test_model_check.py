"""Config-time model checks (trainer.run.model_check, rollout.rope) on a locally written
Qwen3-8B-shaped config.json: context vs positions with and without RoPE scaling, TP vs
heads, the KV cache vs one full-length sequence, and the memory estimates' numbers."""

from __future__ import annotations

import json

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
