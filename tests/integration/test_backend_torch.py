"""The single-process torch backend on the tiny model: the shared step loop keeps every loss
aggregation exact under gradient accumulation, activation checkpointing changes nothing,
and the learning rate warms up linearly. (DeepSpeed itself is tested in
test_backend_deepspeed.py; this file never imports it.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from buffer.batch import TrainBatch
from envs.types import Trajectory
from trainer.train.backends import build_backend
from trainer.train.backends.packing import build_micro_batches, unpack_responses
from trainer.train.backends.torch_backend import TorchBackend
from trainer.train.config import LossConfig, TrainConfig

VOCAB = 512


def random_trajectory(rng: np.random.Generator, index: int) -> Trajectory:
    """Random in-vocabulary ids: model turns with a tool segment (mask 0) between them."""
    segments = [(int(rng.integers(5, 40)), 1) for _ in range(int(rng.integers(1, 4)))]
    pieces = [segments[0]]
    for seg in segments[1:]:
        pieces += [(int(rng.integers(3, 15)), 0), seg]
    mask = np.concatenate([np.full(n, m) for n, m in pieces])
    return Trajectory(task_id=f"t{index}", group_id="g", index=index,
                      prompt_ids=rng.integers(0, VOCAB, int(rng.integers(4, 30))),
                      response_ids=rng.integers(0, VOCAB, len(mask)), response_mask=mask,
                      logprobs=np.where(mask == 1, -6.0, 0.0),
                      versions=np.where(mask == 1, 0, -1), termination="finished")


@pytest.fixture(scope="module")
def trajectories() -> list[Trajectory]:
    rng = np.random.default_rng(7)
    return [random_trajectory(rng, i) for i in range(8)]


def on_policy(backend: TorchBackend, trajectories: list[Trajectory]) -> list[Trajectory]:
    """Behaviour logprobs replaced by the backend's own, minus a per-trajectory staleness."""
    batches = build_micro_batches(trajectories, torch.zeros(len(trajectories)), 10_000)
    out = list(trajectories)
    for packed, logprobs_T in zip(batches, backend.compute_proximal_logprobs(batches)):
        for i, lp in zip(packed.traj_indices, unpack_responses(packed, logprobs_T)):
            t = trajectories[i]
            stale = np.minimum(lp.numpy() - 0.03 * i, 0.0)
            out[i] = dataclasses.replace(t, logprobs=np.where(t.response_mask == 1, stale, 0.0))
    return out


def make(tiny_model_path, **train) -> TorchBackend:
    base = dict(backend="torch", lr=1e-3, num_minibatches=2, weight_decay=0.01)
    base.update(train)
    backend = build_backend(TrainConfig(**base), tiny_model_path)
    assert isinstance(backend, TorchBackend)
    return backend


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean",
                                         "seq_mean_token_sum_norm"])
def test_every_aggregation_is_exact_under_accumulation(tiny_model_path, trajectories, aggregation):
    cfg_loss = LossConfig(aggregation=aggregation, entropy_coef=0.01)
    small = make(tiny_model_path, micro_batch_tokens=60)
    large = make(tiny_model_path, micro_batch_tokens=100_000)
    batch = on_policy(small, trajectories)
    advantages = [1.0, -1.0, 0.5, -0.5, 2.0, -0.25, 0.1, -2.0]
    for _ in range(2):
        a = small.train_step(TrainBatch(batch, advantages, small.version), cfg_loss)
        b = large.train_step(TrainBatch(batch, advantages, large.version), cfg_loss)
        assert a.num_micro_batches > b.num_micro_batches == 2
        assert abs(a.loss - b.loss) < 1e-5
        assert abs(a.metrics.entropy - b.metrics.entropy) < 1e-5
        assert a.grad_norms == pytest.approx(b.grad_norms, rel=1e-5)


def count_calls(fn, counter: dict[str, int], key: str):
    def wrapper(*args, **kwargs):
        counter[key] += 1
        return fn(*args, **kwargs)
    return wrapper


def test_gradient_checkpointing_changes_nothing(tiny_model_path, trajectories):
    plain = make(tiny_model_path, micro_batch_tokens=200)
    ckpt = make(tiny_model_path, micro_batch_tokens=200, gradient_checkpointing=True)
    batch = on_policy(plain, trajectories)
    advantages = [1.0, -1.0, 0.5, -0.5, 2.0, -0.25, 0.1, -2.0]
    calls = {"plain": 0, "ckpt": 0}
    for key, backend in (("plain", plain), ("ckpt", ckpt)):
        mlp = backend.forward_model.model.layers[0].mlp
        mlp.forward = count_calls(mlp.forward, calls, key)
    a = plain.train_step(TrainBatch(batch, advantages, plain.version), LossConfig())
    b = ckpt.train_step(TrainBatch(batch, advantages, ckpt.version), LossConfig())
    assert calls["ckpt"] > calls["plain"]  # backward recomputed the layer: checkpointing is on
    assert abs(a.loss - b.loss) < 1e-6
    assert a.grad_norms == pytest.approx(b.grad_norms, rel=1e-5)


def test_learning_rate_warms_up_linearly(tiny_model_path, trajectories):
    backend = make(tiny_model_path, num_warmup_steps=4, num_minibatches=2)
    seen = [backend.current_lr]
    for _ in range(2):  # two optimizer steps per train_step
        advantages = np.linspace(-1, 1, len(trajectories))
        backend.train_step(TrainBatch(trajectories, advantages, backend.version), LossConfig())
        seen.append(backend.current_lr)
    assert seen == pytest.approx([0.25e-3, 0.75e-3, 1e-3])
    assert backend.version == 2


def test_user_mistakes_raise_with_the_fix(tiny_model_path, trajectories):
    backend = make(tiny_model_path)
    with pytest.raises(ValueError, match="trajectories but advantages of shape"):
        backend.train_step(TrainBatch(trajectories, [1.0], backend.version), LossConfig())
    with pytest.raises(ValueError, match="kl_coef=0"):
        backend.train_step(TrainBatch(trajectories, np.zeros(len(trajectories)), backend.version),
                           LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="num_minibatches"):
        backend.train_step(TrainBatch(trajectories[:1], [0.0], backend.version), LossConfig())
    assert backend.version == 0
