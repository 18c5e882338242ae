"""Recipe loading and the config schema: unknown keys, types, cross-field checks, snapshot."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainer.run.config import SluiceConfig, iter_fields
from trainer.run.recipe import ConfigError, build_config, load_config

SNAPSHOT = Path(__file__).with_name("config_keys.txt")


def test_schema_defaults_are_a_valid_config():
    cfg = SluiceConfig()
    assert cfg.cluster.device == "cpu" and cfg.train.group_size == 8


@pytest.mark.parametrize("recipe", ["quickstart.yaml", "swe_grpo.yaml", "swe_mini.yaml"])
def test_bundled_recipes_load(recipe):
    cfg = load_config(recipe)
    assert isinstance(cfg, SluiceConfig)


def test_swe_recipe_describes_the_h100_layout():
    cfg = load_config("swe_grpo.yaml")
    assert cfg.cluster.device == "cuda"
    assert cfg.rollout.num_engines * cfg.rollout.tp_size == 32
    assert (cfg.train.groups_per_step, cfg.train.group_size, cfg.agent.max_turns) == (500, 8, 20)
    assert cfg.reward.judge.enabled


def test_recipe_accepts_a_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  num_steps: 7\n")
    assert load_config(str(path)).train.num_steps == 7


def test_overrides_apply_after_the_recipe_and_are_typed():
    cfg = load_config("quickstart.yaml", ["train.num_steps=3", "loss.eps_high=0.3",
                                          "rollout.kv_cache_memory_bytes=1024", "loss.dual_clip_c=3"])
    assert cfg.train.num_steps == 3
    assert cfg.loss.eps_high == 0.3
    assert cfg.rollout.kv_cache_memory_bytes == 1024
    assert cfg.loss.dual_clip_c == 3.0 and isinstance(cfg.loss.dual_clip_c, float)


def test_interpolation_resolves(tmp_path):
    path = tmp_path / "interp.yaml"
    path.write_text("train:\n  group_size: 4\n  num_minibatches: ${train.group_size}\n")
    assert load_config(str(path)).train.num_minibatches == 4


@pytest.mark.parametrize("override, suggestion", [
    ("rollout.num_engine=2", "rollout.num_engines"),
    ("rolout.num_engines=2", "rollout"),
    ("train.max_staleness=2", "buffer.max_staleness"),
    ("reward.judge.enable=true", "reward.judge.enabled"),
])
def test_unknown_keys_fail_with_the_closest_valid_key(override, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        load_config("quickstart.yaml", [override])


@pytest.mark.parametrize("override, expected", [
    ("train.lr=abc", "train.lr: expected float, got str 'abc'"),
    ("train.zero_stage=1.5", "train.zero_stage: expected int"),
    ("rollout.enable_prefix_caching=3", "rollout.enable_prefix_caching: expected bool"),
    ("cluster.device=gpu", "cluster.device: expected one of 'cpu', 'cuda'"),
    ("rollout=3", "rollout: expected a mapping"),
])
def test_type_errors_name_the_key_and_type(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        load_config("quickstart.yaml", [override])


@pytest.mark.parametrize("override, key", [
    ("rollout.tp_size=0", "rollout.tp_size"),
    ("agent.max_new_tokens_per_turn=9999", "agent.max_new_tokens_per_turn"),
    ("agent.loop=not_an_import_string", "agent.loop"),
    ("train.group_size=1", "train.group_size"),
    ("loss.is_max=0.5", "loss.is_max"),
    ("sync.transport=nccl", "sync.transport"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("envs.num_warm_sandboxes=1000", "envs.num_warm_sandboxes"),
    ("reward.fn=reward.judge:GenerativeJudge", "reward.judge.enabled"),
    ("train.backend=deepspeeed", "train.backend"),
    ("envs.sandbox_backend=lcal", "envs.sandbox_backend"),
    ("envs.tools.x=not.an.import.string", "envs.tools.x"),
])
def test_cross_field_checks_name_the_key_to_change(override, key):
    with pytest.raises(ValueError, match=f"^{key}: "):
        load_config("quickstart.yaml", [override])


def test_the_schema_names_no_toy_and_requires_what_a_run_needs():
    cfg = SluiceConfig()
    assert (cfg.model.path, cfg.envs.tasks, cfg.reward.judge.model_path) == ("", "", "")
    with pytest.raises(ValueError, match="^reward.judge.model_path: is required"):
        load_config("quickstart.yaml", ["reward.judge.enabled=true", "reward.judge.model_path=''"])


def test_bad_override_syntax_and_missing_recipe():
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config("quickstart.yaml", ["train.lr"])
    with pytest.raises(ConfigError, match="known recipes: .*quickstart.yaml"):
        load_config("no_such_recipe.yaml")


def test_config_is_frozen():
    cfg = load_config("quickstart.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_build_config_rejects_non_mapping_sections():
    with pytest.raises(ConfigError, match="train: expected a mapping"):
        build_config({"train": [1, 2]})


def test_every_key_is_documented():
    undocumented = [k for k, f in iter_fields(SluiceConfig) if len(f.metadata.get("doc", "")) < 10]
    assert undocumented == []


def test_key_set_matches_the_snapshot():
    """Every new knob is a reviewed diff: update tests/unit/config_keys.txt with the change."""
    keys = "\n".join(f"{k}: {f.type}" for k, f in iter_fields(SluiceConfig)) + "\n"
    assert keys == SNAPSHOT.read_text(), (
        "config keys changed; if intended, regenerate with:\n  python -c \"from trainer.run.config "
        "import *; print('\\n'.join(f'{k}: {f.type}' for k, f in iter_fields(SluiceConfig)))\" "
        "> tests/unit/config_keys.txt")
