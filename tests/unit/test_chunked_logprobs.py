"""Chunked logprobs and entropy (trainer.train.backends.logprobs) equal the unchunked ones in fp32,
values and gradients, on a bare LM head and through a real (small, random) Qwen2 model over
a packed row; and the chunked backward never keeps a [T, V] tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from envs.types import Trajectory
from trainer.train.backends.logprobs import (compute_chunked_logprobs, compute_logprobs_from_logits,
                                             compute_token_logprobs_and_entropy,
                                             register_packed_sdpa)
from trainer.train.backends.packing import pack_trajectories

# Chunked and full paths run different CPU kernels (a [1, H] x [H, V] product takes
# another path than [T, H] x [H, V]), so fp32 sums differ in order: values agree within
# float32's own tolerance (torch.testing's defaults for the dtype: rtol 1.3e-6, atol 1e-5),
# never bitwise. A wrong chunk boundary, target or temperature moves them far more.
RTOL, ATOL = 1.3e-6, 1e-5


def assert_values_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def assert_grads_close(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    """As values, with atol scaled by the largest entry when that exceeds 1: gradients sum
    over many tokens, and their rounding grows with their size."""
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL * max(1.0, float(want.abs().max())),
                               msg=lambda m: f"{name} {m}")


def _head_case(seed: int = 0, num_tokens: int = 37, hidden: int = 16, vocab: int = 101):
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        # Logits of a trained model's scale (a few units).
        head.weight.copy_(0.3 * torch.randn(vocab, hidden, generator=gen))
    hidden_TH = torch.randn(num_tokens, hidden, generator=gen, requires_grad=True)
    targets_T = torch.randint(0, vocab, (num_tokens,), generator=gen)
    weights_T = torch.randn(num_tokens, generator=gen)  # a loss that weighs tokens unevenly
    return head, hidden_TH, targets_T, weights_T


def _grads(head, hidden_TH, lp_T, ent_T, weights_T):
    loss = (lp_T * weights_T).sum() + (ent_T * weights_T.flip(0)).sum()
    g_hidden, g_head = torch.autograd.grad(loss, [hidden_TH, head.weight])
    return g_hidden, g_head


@pytest.mark.parametrize("chunk", [1, 5, 36, 37, 1000])
def test_chunked_head_equals_full_logits_values_and_gradients(chunk):
    head, hidden_TH, targets_T, weights_T = _head_case()
    ref_lp, ref_ent = compute_logprobs_from_logits(head(hidden_TH), targets_T, 0.7,
                                                   with_entropy=True)
    lp, ent = compute_chunked_logprobs(hidden_TH, head, targets_T, 0.7, with_entropy=True,
                                       chunk_tokens=chunk)
    assert lp.shape == ent.shape == (37,)
    assert_values_close(lp, ref_lp)
    assert_values_close(ent, ref_ent)
    for got, want in zip(_grads(head, hidden_TH, lp, ent, weights_T),
                         _grads(head, hidden_TH, ref_lp, ref_ent, weights_T)):
        assert_grads_close(got, want)


def test_entropy_without_gradient_is_detached_and_equal():
    head, hidden_TH, targets_T, _ = _head_case(seed=1)
    lp, ent = compute_chunked_logprobs(hidden_TH, head, targets_T, with_entropy=True,
                                       entropy_grad=False, chunk_tokens=8)
    _, ref_ent = compute_logprobs_from_logits(head(hidden_TH), targets_T, with_entropy=True)
    assert lp.requires_grad and not ent.requires_grad
    assert_values_close(ent, ref_ent)


def test_chunked_backward_saves_no_full_vocab_tensor():
    """What autograd keeps for backward: with chunks, nothing near T x V elements (the
    checkpointed chunks keep their hidden slice only, the last chunk its own [chunk, V]
    logits); without, the full logits. The head's weight is saved too: not an activation."""
    head, hidden_TH, targets_T, _ = _head_case(num_tokens=64, vocab=997)
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() != head.weight.data_ptr():
            sizes.append(t.numel())
        return t

    full = 64 * 997
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = compute_chunked_logprobs(hidden_TH, head, targets_T, with_entropy=True,
                                           chunk_tokens=8)
    assert max(sizes) == 8 * 997, sizes  # the last chunk's logits, and nothing larger
    (lp.sum() + ent.sum()).backward()  # and the recompute works
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compute_logprobs_from_logits(head(hidden_TH), targets_T, with_entropy=True)
    assert max(sizes) >= full  # the check sees the full logits when they are kept


def test_chunk_size_must_be_positive():
    head, hidden_TH, targets_T, _ = _head_case()
    with pytest.raises(ValueError, match="train.logprob_chunk_tokens"):
        compute_chunked_logprobs(hidden_TH, head, targets_T, chunk_tokens=0)


def _small_qwen2(attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=211, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                            dtype=torch.float32)


def _packed_row():
    rng = np.random.default_rng(0)
    trajs = []
    for i, (p, r) in enumerate([(5, 9), (3, 14), (7, 4)]):
        mask = (rng.random(r) < 0.7).astype(np.int32)
        trajs.append(Trajectory(task_id=f"t{i}", group_id="g", index=i,
                                prompt_ids=rng.integers(0, 211, p).tolist(),
                                response_ids=rng.integers(0, 211, r).tolist(),
                                response_mask=mask, logprobs=np.zeros(r, np.float32),
                                versions=np.where(mask == 1, 0, -1).astype(np.int32),
                                termination="finished"))
    return pack_trajectories(trajs, torch.zeros(len(trajs)))


@pytest.mark.parametrize("attn", ["sluice_packed_sdpa", "sdpa"])
def test_model_forward_chunked_equals_unchunked(attn):
    register_packed_sdpa()
    model = _small_qwen2(attn)
    packed = _packed_row()
    weights_T = torch.linspace(-1, 1, packed.num_tokens)

    def run(chunk: int):
        model.zero_grad(set_to_none=True)
        lp, ent = compute_token_logprobs_and_entropy(model, packed, 0.8, with_entropy=True,
                                                     chunk_tokens=chunk)
        ((lp * weights_T).sum() + (ent * weights_T).sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_lp, ref_ent, ref_grads = run(0)
    lp, ent, grads = run(4)
    assert_values_close(lp, ref_lp)
    assert_values_close(ent, ref_ent)
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        assert_grads_close(grad, ref_grads[name], name)
    # The installed forward leaves ordinary calls alone.
    ids = packed.input_ids_T[None]
    assert model(input_ids=ids, use_cache=False).logits.shape == (1, packed.num_tokens, 211)


@pytest.mark.parametrize("chunk", [0, 3, 1000])
def test_loss_positions_only_equals_the_full_row_there_and_is_zero_elsewhere(chunk):
    """The training step's path: the same values and gradients at the model tokens, 0 at
    every other position, chunked or not."""
    register_packed_sdpa()
    model = _small_qwen2("sluice_packed_sdpa")
    packed = _packed_row()
    mask_T = packed.loss_mask_T
    weights_T = torch.linspace(-1, 1, packed.num_tokens) * mask_T  # a loss over model tokens

    def run(only: bool):
        model.zero_grad(set_to_none=True)
        lp, ent = compute_token_logprobs_and_entropy(model, packed, 0.8, with_entropy=True,
                                                     chunk_tokens=chunk,
                                                     loss_positions_only=only)
        ((lp * weights_T).sum() + (ent * weights_T).sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_lp, ref_ent, ref_grads = run(False)
    lp, ent, grads = run(True)
    assert 0 < int(mask_T.sum()) < packed.num_tokens
    assert_values_close(lp[mask_T], ref_lp[mask_T])
    assert_values_close(ent[mask_T], ref_ent[mask_T])
    assert not lp[~mask_T].any() and not ent[~mask_T].any()
    for name, grad in grads.items():
        assert_grads_close(grad, ref_grads[name], name)


def test_a_row_without_model_tokens_still_calls_the_head_once():
    """ZeRO-3 gathers the head's weight by hooks on its call: every micro-batch calls it."""
    head, hidden_TH, targets_T, _ = _head_case(num_tokens=9)
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    lp, _ = compute_chunked_logprobs(hidden_TH, head, targets_T, chunk_tokens=4,
                                     positions_T=torch.zeros(9, dtype=torch.bool))
    assert calls == [1] and lp.shape == (9,) and not lp.any()
