"""The environment an engine core is spawned with (rollout.engine.engine_core_env): under
enforce_eager TorchDynamo is off only while the engine core starts, vLLM's sockets go to
the engine's own folder, the launching process's environment is left as it was, and a
user's own setting wins."""

from __future__ import annotations

import os

import pytest

from envs.owner import owner_tag
from rollout.engine import EngineSpec, engine_core_env, new_ipc_dir


@pytest.mark.parametrize("eager", [True, False])
def test_dynamo_is_off_only_for_an_eager_engine_core_while_it_starts(monkeypatch, eager):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    with engine_core_env(EngineSpec(model_path="m", enforce_eager=eager)):
        seen = os.environ.get("TORCHDYNAMO_DISABLE")
    assert seen == ("1" if eager else None)
    assert "TORCHDYNAMO_DISABLE" not in os.environ  # this process is as it was


def test_the_users_own_setting_wins_and_stays(monkeypatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    with engine_core_env(EngineSpec(model_path="m", enforce_eager=True)):
        assert os.environ["TORCHDYNAMO_DISABLE"] == "0"
    assert os.environ["TORCHDYNAMO_DISABLE"] == "0"


def test_a_failed_start_restores_the_environment(monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    with pytest.raises(RuntimeError), engine_core_env(EngineSpec(model_path="m", enforce_eager=True)):
        raise RuntimeError("engine core failed to start")
    assert "TORCHDYNAMO_DISABLE" not in os.environ


def test_the_sockets_go_to_the_engines_own_folder_only_while_it_starts(monkeypatch):
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    folder = new_ipc_dir()
    try:
        assert os.path.basename(folder).startswith(f"sluice-vllm-ipc-{owner_tag()}-")
        with engine_core_env(EngineSpec(model_path="m", enforce_eager=False), folder):
            assert os.environ["VLLM_RPC_BASE_PATH"] == folder
        assert "VLLM_RPC_BASE_PATH" not in os.environ
    finally:
        os.rmdir(folder)
