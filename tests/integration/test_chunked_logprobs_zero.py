"""Chunked logprobs under DeepSpeed ZeRO (gloo on CPU, the tiny model): a ZeRO-3 backend
whose logprobs and entropy go through the LM head 16 positions at a time trains exactly like
a plain torch backend that materialises the whole micro-batch's logits. ZeRO-3 gathers the
head's weight once per chunk and again in each chunk's recompute; DeepSpeed's backward
prologue hangs on the forward's outputs, which the chunked forward returns."""

from __future__ import annotations

import numpy as np
import pytest
# The fixtures (the CPU DeepSpeed environment, the tool conversations) are that module's.
from test_backend_deepspeed import (LR, deepspeed_env, make_backend, trajectories,  # noqa: F401
                                    with_behaviour)

from buffer.batch import TrainBatch
from trainer.train.config import LossConfig, TrainConfig


@pytest.mark.parametrize("stage", [2, 3])
def test_chunked_zero_trains_like_unchunked_plain_torch(tiny_model_path, trajectories, stage):
    from trainer.train.backends.torch_backend import TorchBackend

    chunked = make_backend(tiny_model_path, zero_stage=stage, logprob_chunk_tokens=16)
    plain = TorchBackend(TrainConfig(lr=LR, micro_batch_tokens=256, num_minibatches=2,
                                     max_grad_norm=1.0, logprob_chunk_tokens=0), tiny_model_path)
    batch = with_behaviour(plain, trajectories, lambda i, n: 0.05 * (i + 1) * np.ones(n))
    advantages = [1.5, -0.5, 0.25, -1.0, 0.75, -1.0]
    loss_cfg = LossConfig(entropy_coef=0.01)  # the entropy's gradient goes through the chunks too
    for _ in range(2):
        a = chunked.train_step(TrainBatch(batch, advantages, chunked.version), loss_cfg)
        b = plain.train_step(TrainBatch(batch, advantages, plain.version), loss_cfg)
        assert abs(a.loss - b.loss) < 1e-5
        assert abs(a.metrics.entropy - b.metrics.entropy) < 1e-5
        assert a.grad_norms == pytest.approx(b.grad_norms, rel=1e-5)
    theirs = plain.state_dict_for_push()
    for name, tensor in chunked.state_dict_for_push().items():
        assert (tensor - theirs[name]).abs().max().item() < 0.05 * LR, name  # as in test_backend_deepspeed
