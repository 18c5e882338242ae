"""`python -m trainer.export CHECKPOINT OUT` (trainer.run.export): a checkpoint written by the
run's own checkpoint code (torch backend, and DeepSpeed ZeRO-2 in a child process) becomes
a Hugging Face folder whose logits in transformers equal the trained weights' (not the
base model's: the weights are changed before saving) and which the real vLLM engine
loads and scores the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [{"role": "user", "content": "What is 12 * 7?"}]

# Builds a ZeRO-2 DeepSpeed backend on the tiny model, trains one step on a synthetic
# batch, saves a checkpoint with the run's code and the weights the engines would get.
DEEPSPEED_CHECKPOINT = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from buffer.batch import TrainBatch
    from buffer.replay_buffer import BufferState
    from envs.types import NO_VERSION, Trajectory
    from trainer.train.backends.deepspeed_backend import DeepSpeedBackend
    from trainer.run.checkpoint import RunState, save_checkpoint
    from trainer.train.config import LossConfig, TrainConfig
    from trainer.run.controller import ControllerState
    from trainer.run.tiny_model import ensure_tiny_model

    torch.manual_seed(0)
    backend = DeepSpeedBackend(TrainConfig(zero_stage=2, lr=1e-2, micro_batch_tokens=256),
                               ensure_tiny_model())
    rng = np.random.default_rng(0)
    trajs = []
    for i in range(4):
        mask = np.ones(16, dtype=np.int8)
        trajs.append(Trajectory("t", "g", i, rng.integers(3, 500, 6), rng.integers(3, 500, 16),
                                mask, -rng.random(16) * 3, np.zeros(16, dtype=np.int64),
                                "finished"))
    backend.train_step(TrainBatch(trajs, np.array([1.0, -1.0, 1.0, -1.0]), backend.version), LossConfig())
    state = RunState(ControllerState(backend.version, 4, (), BufferState((), 0, 0, {}, 0, 0, {}), 1))
    save_checkpoint(sys.argv[1], backend, state, model_dir=ensure_tiny_model())
    save_file({k: v.contiguous() for k, v in backend.state_dict_for_push().items()}, sys.argv[2])
""")


def export(checkpoint: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    """The documented command, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "trainer.export", str(checkpoint), str(out),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def export_here(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the same command's main in this process: the
    command's own start is checked once (`exported`), a fresh interpreter per case costs
    seconds of imports."""
    from trainer.run.export import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def reference_model(tiny_model_path: Path, weights: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    model.load_state_dict(weights)
    return model


def logits_of(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    return tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True,
                                   return_dict=False) + tok.encode("The answer is 84.")


@pytest.fixture(scope="module")
def torch_checkpoint(tiny_model_path, tmp_path_factory):
    """(checkpoint folder, the weights it holds): a torch-backend checkpoint of the tiny
    model whose weights were moved away from the base model's."""
    from buffer.replay_buffer import BufferState
    from trainer.train.backends.torch_backend import TorchBackend
    from trainer.run.checkpoint import RunState, save_checkpoint
    from trainer.train.config import TrainConfig
    from trainer.run.controller import ControllerState

    backend = TorchBackend(TrainConfig(backend="torch"), tiny_model_path, dtype="float32",
                           device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in backend.forward_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    state = RunState(ControllerState(3, 12, (), BufferState((), 0, 0, {}, 0, 0, {}), 4))
    run = tmp_path_factory.mktemp("run")
    path = save_checkpoint(run / "checkpoints", backend, state, model_dir=tiny_model_path)
    return path, {k: v.clone() for k, v in backend.state_dict_for_push().items()}


@pytest.fixture(scope="module")
def exported(torch_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "hf"
    proc = export(torch_checkpoint[0], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported {torch_checkpoint[0]} -> {out}" in proc.stdout
    return out


def test_the_export_is_a_complete_hugging_face_folder(exported, tiny_model_path):
    from transformers import AutoTokenizer

    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not any(n.endswith((".pt", ".bin")) for n in names)
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["dtype"] == "float32"
    source, copy = AutoTokenizer.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(exported)
    assert copy.chat_template == source.chat_template
    assert copy.apply_chat_template(PROMPT, tokenize=False) == \
        source.apply_chat_template(PROMPT, tokenize=False)


def test_transformers_gives_the_trained_weights_logits(exported, torch_checkpoint,
                                                       tiny_model_path, prompt_ids):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(exported).eval()
    trained = logits_of(reference_model(tiny_model_path, torch_checkpoint[1]), prompt_ids)
    base = logits_of(AutoModelForCausalLM.from_pretrained(tiny_model_path).eval(), prompt_ids)
    got = logits_of(loaded, prompt_ids)
    assert (got - base).abs().max() > 1e-2  # the checkpoint's weights, not the base model's
    assert torch.equal(got, trained)


def test_vllm_loads_the_export_and_scores_like_transformers(exported, prompt_ids):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in-process: seconds
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=str(exported), dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_model_len=512, enforce_eager=True, seed=0)
    try:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)],
                           SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    finally:
        del llm
    engine_lp = torch.tensor([step[t].logprob for step, t in
                              zip(out.prompt_logprobs[1:], prompt_ids[1:])])
    logp = torch.log_softmax(logits_of(AutoModelForCausalLM.from_pretrained(exported).eval(),
                                       prompt_ids)[:-1], dim=-1)
    ref = logp.gather(-1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]
    assert (engine_lp - ref).abs().max() < 1e-4


def test_a_deepspeed_zero2_checkpoint_exports_its_trained_weights(tmp_path, tiny_model_path,
                                                                  prompt_ids, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    # A fresh process: DeepSpeed sets RANK/MASTER_PORT in the process that builds it.
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars} | {"PYTHONPATH": str(ROOT)}
    pushed = tmp_path / "pushed.safetensors"
    proc = subprocess.run([sys.executable, "-c", DEEPSPEED_CHECKPOINT, str(tmp_path / "ckpt"),
                           str(pushed)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = tmp_path / "ckpt" / "step-000001"
    assert any((checkpoint / "backend" / "state").glob("zero_pp_rank_*_optim_states.pt"))
    out = tmp_path / "hf"
    code, _, err = export_here(capsys, checkpoint, out)
    assert code == 0, err[-3000:]
    got = logits_of(AutoModelForCausalLM.from_pretrained(out).eval(), prompt_ids)
    trained = logits_of(reference_model(tiny_model_path, load_file(pushed)), prompt_ids)
    base = logits_of(AutoModelForCausalLM.from_pretrained(tiny_model_path).eval(), prompt_ids)
    assert (got - base).abs().max() > 1e-3  # one step at lr 1e-2 moved the weights
    assert torch.allclose(got, trained, atol=1e-5)


def test_export_errors_are_one_line(torch_checkpoint, exported, tmp_path, capsys):
    code, _, err = export_here(capsys, torch_checkpoint[0], exported)
    assert code == 2 and err.strip() == f"export error: {exported} exists; export into a new folder"
    code, _, err = export_here(capsys, tmp_path, tmp_path / "out")
    assert code == 2 and "is not a complete sluice checkpoint" in err
    assert len(err.strip().splitlines()) == 1  # one line, no traceback
