"""Per-token logprobs (and entropy) of a packed micro-batch under the policy: the one
forward used by both the proximal (no-grad) pass and the current (training) pass, so the
two can only differ through the weights.

Sequences in a packed row must not attend to each other. Three attention paths, chosen by
the attention implementation the model was loaded with:
- `sluice_packed_sdpa` (the CPU default): a per-sequence fallback registered with
  transformers. Each layer runs causal sdpa once per sequence (slices of q, k, v cut at
  `cu_seqlens`): no mask, cost linear in the number of sequences.
- `sdpa` / `eager`: an explicit block-diagonal causal mask (1, 1, T, T) built from the
  sequence index. Simple, but attention over the whole row costs O(T^2) time and memory.
- `flash_attention_2` (GPU only, when flash-attn is installed): `cu_seq_lens_*` are passed
  to transformers, which runs flash-attn's varlen kernel. Needs CUDA; the CPU test suite
  does not exercise it.

Logits are never materialised for the whole row when `chunk_tokens` > 0 (the default,
`train.logprob_chunk_tokens`): the decoder's last hidden states [T, H] go through the LM
head `chunk_tokens` positions at a time, and only [T] logprobs and entropies leave each
chunk. With gradients each chunk but the last is checkpointed: backward recomputes its
[chunk, V] logits instead of keeping them, so memory for one sequence is linear in its
length with a constant of about H + 2 values per position, plus one chunk's logits. At
65,536 tokens and Qwen3's 151,936-entry vocabulary the unchunked fp32 logits alone are
40 GB (three times that with softmax and gradients); one 2,048-position chunk is 1.2 GB.
The training step asks for the positions of its model tokens only (`loss_positions_only`):
the rest of the row (prompt, tool output) skips the head, its softmax and their backward.

A row that holds images (vision-language policies) also passes the model its vision
inputs, built from the rollout processor's arrays (`trainer.train.backends.vision`); the
chunked path then runs the multimodal base model, which merges the image features into
the embeddings, in place of the text decoder alone.

The chunked path still calls the model through its own `__call__` (a DeepSpeed engine's
forward included), with a forward installed on the Hugging Face module that returns the
logprobs instead of logits: DeepSpeed registers its backward prologue (ZeRO's gradient
bookkeeping) on a forward's outputs, and ZeRO-3 gathers the LM head's weight by hooks on
the head module, which every chunk calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import checkpoint

from trainer.train.backends.packing import PackedBatch
from trainer.train.backends.vision import build_vision_kwargs, check_image_runs, hidden_state_module

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PACKED_SDPA = "sluice_packed_sdpa"
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", PACKED_SDPA)
MASKED_ATTENTION = ("sdpa", "eager")


def compute_packed_sdpa_attention(module: torch.nn.Module, query_BHTD: torch.Tensor,
                                  key_BHTD: torch.Tensor, value_BHTD: torch.Tensor,
                                  attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                  scaling: float | None = None,
                                  cu_seq_lens_q: torch.Tensor | None = None,
                                  **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers attention function: causal sdpa on each packed sequence separately.

    Shapes follow transformers: q (1, heads, T, head_dim), k/v with the KV heads; returns
    (1, T, heads, head_dim). Without `cu_seq_lens_q` the row is one sequence.
    """
    if query_BHTD.shape[0] != 1:
        raise ValueError("packed attention expects one packed row (batch size 1); pack "
                         "sequences with trainer.train.backends.packing instead of padding them")
    num_tokens = query_BHTD.shape[2]
    bounds = [0, num_tokens] if cu_seq_lens_q is None else cu_seq_lens_q.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    gqa = key_BHTD.shape[1] != query_BHTD.shape[1]
    # split, not one slice per sequence: a slice's backward writes into a zeroed copy of the
    # whole row, so S slices cost S full-row fills; split's backward is one concatenation.
    outs = [torch.nn.functional.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)
        for q, k, v in zip(query_BHTD.split(lengths, dim=2), key_BHTD.split(lengths, dim=2),
                           value_BHTD.split(lengths, dim=2))]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register_packed_sdpa() -> str:
    """Make `sluice_packed_sdpa` a valid `attn_implementation` (idempotent); its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_SDPA, compute_packed_sdpa_attention)
    return PACKED_SDPA


def build_block_causal_mask(packed: PackedBatch, device: torch.device | str = "cpu"
                            ) -> torch.Tensor:
    """Bool mask (1, 1, T, T), True where query t may attend to key k: same sequence, k <= t."""
    seq_T = packed.seq_index_T.to(device)
    t = torch.arange(packed.num_tokens, device=device)
    allowed_TT = (seq_T[:, None] == seq_T[None, :]) & (t[None, :] <= t[:, None])
    return allowed_TT[None, None]


def _hf_model(model: torch.nn.Module) -> PreTrainedModel:
    """The Hugging Face causal LM: `model` itself, or the one a DeepSpeed engine wraps."""
    from transformers import PreTrainedModel

    inner = getattr(model, "module", model)  # DeepSpeedEngine.module; not a type of ours
    if not isinstance(inner, PreTrainedModel):
        raise TypeError(f"expected a Hugging Face causal LM or a DeepSpeed engine around one, "
                        f"got {type(inner).__name__}")
    return inner


def _attention_kwargs(model: PreTrainedModel, packed: PackedBatch, device: torch.device,
                      dtype: torch.dtype) -> dict[str, torch.Tensor | int]:
    # The text model's: a vision-language model's vision tower has its own (build_policy_model).
    config = model.config.get_text_config()
    impl = getattr(config, "_attn_implementation", "sdpa")
    if impl in VARLEN_ATTENTION:
        cu_seqlens = packed.cu_seqlens.to(device)
        return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens,
                "max_length_q": packed.max_seqlen, "max_length_k": packed.max_seqlen}
    if impl not in MASKED_ATTENTION:
        raise ValueError(f"attention implementation {impl!r} cannot run packed sequences; "
                         f"load the model with one of {MASKED_ATTENTION + VARLEN_ATTENTION}")
    allowed = build_block_causal_mask(packed, device)
    if impl == "sdpa":
        return {"attention_mask": allowed}
    # eager adds the mask to the scores, so it must be additive (0 or a large negative).
    additive = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return {"attention_mask": additive.masked_fill(~allowed, torch.finfo(dtype).min)}


def compute_logprobs_from_logits(logits_TV: torch.Tensor, target_ids_T: torch.Tensor,
                                 temperature: float = 1.0, with_entropy: bool = False,
                                 entropy_grad: bool = True
                                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and optionally the entropy of softmax(logits / temperature), in fp32.

    Logits are upcast first: bf16 logprobs are too coarse for PPO ratios near 1. With
    `entropy_grad=False` the entropy is a detached metric: no (T, V) softmax is kept for
    backward.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (the sampling temperature of the engines), "
                         f"got {temperature}")
    scaled_TV = logits_TV.float()
    if temperature != 1.0:
        scaled_TV = scaled_TV / temperature
    log_z_T = torch.logsumexp(scaled_TV, dim=-1)
    logprobs_T = scaled_TV.gather(-1, target_ids_T[:, None]).squeeze(-1) - log_z_T
    entropy_T = None
    if with_entropy:
        # H = log Z - sum_v p_v * x_v, without materialising log_softmax a second time.
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy_T = log_z_T - (torch.softmax(scaled_TV, dim=-1) * scaled_TV).sum(-1)
    return logprobs_T, entropy_T


def compute_chunked_logprobs(hidden_TH: torch.Tensor, head: torch.nn.Module,
                             target_ids_T: torch.Tensor, temperature: float = 1.0,
                             with_entropy: bool = False, entropy_grad: bool = True,
                             chunk_tokens: int = 2048, positions_T: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`compute_logprobs_from_logits(head(hidden_TH), ...)` computed `chunk_tokens`
    positions at a time; equal to it (values and gradients), without the [T, V] logits.

    With gradients enabled each chunk but the last is checkpointed (non-reentrant): its
    forward keeps only its slice of hidden states, and backward recomputes the chunk's
    logits. The last chunk keeps its logits: its backward runs first, right after the
    forward, so recomputing them would cost a head pass and lower no peak.

    `positions_T` (bool [T]): compute only there and return 0 elsewhere (see
    `select_positions`).
    """
    if chunk_tokens < 1:
        raise ValueError(f"train.logprob_chunk_tokens must be >= 1 for the chunked path, "
                         f"got {chunk_tokens}")
    index_N, hidden_NH, target_ids_N = select_positions(positions_T, hidden_TH, target_ids_T)
    num = hidden_NH.shape[0]
    checkpointed = torch.is_grad_enabled() and hidden_NH.requires_grad
    logprobs, entropies = [], []
    for start in range(0, num, chunk_tokens):
        args = (hidden_NH[start:start + chunk_tokens], target_ids_N[start:start + chunk_tokens],
                head, temperature, with_entropy, entropy_grad)
        if checkpointed and start + chunk_tokens < num:
            lp_C, ent_C = checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            lp_C, ent_C = _head_logprobs(*args)
        logprobs.append(lp_C)
        entropies.append(ent_C)
    entropy_N = torch.cat(entropies) if with_entropy else None
    return scatter_positions(index_N, torch.cat(logprobs), entropy_N, positions_T)


def select_positions(positions_T: torch.Tensor | None, hidden_TH: torch.Tensor,
                     target_ids_T: torch.Tensor
                     ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(index_N, hidden_NH, target_ids_N): the rows at `positions_T` (all rows when None).

    The LM head, its softmax and their backward are most of a step's work outside the
    decoder, and the loss reads only its model tokens: prompts and tool output (often most
    of an agent's context) need no logits. At least one row is kept, so that every micro-
    batch calls the head (ZeRO-3 gathers its weight by hooks on the call).
    """
    if positions_T is None:
        return None, hidden_TH, target_ids_T
    index_N = positions_T.to(hidden_TH.device).nonzero().squeeze(1)
    if index_N.numel() == 0:
        index_N = index_N.new_zeros(1)
    return index_N, hidden_TH.index_select(0, index_N), target_ids_T[index_N]


def scatter_positions(index_N: torch.Tensor | None, logprobs_N: torch.Tensor,
                      entropy_N: torch.Tensor | None, positions_T: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The values of `select_positions`'s rows put back in a [T] row, 0 elsewhere
    (differentiable); the row kept for the head call alone is zeroed."""
    if index_N is None or positions_T is None:
        return logprobs_N, entropy_N
    keep_N = positions_T.to(index_N.device)[index_N]

    def place(values_N: torch.Tensor) -> torch.Tensor:
        return values_N.new_zeros(positions_T.shape[0]).index_add(
            0, index_N, values_N.masked_fill(~keep_N, 0.0))

    return place(logprobs_N), None if entropy_N is None else place(entropy_N)


def _head_logprobs(hidden_CH: torch.Tensor, target_ids_C: torch.Tensor, head: torch.nn.Module,
                   temperature: float, with_entropy: bool, entropy_grad: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    return compute_logprobs_from_logits(head(hidden_CH), target_ids_C, temperature,
                                        with_entropy, entropy_grad)


_REQUEST_KWARG = "sluice_logprob_request"


def _install_logprob_forward(model: PreTrainedModel) -> None:
    """Give a Hugging Face causal LM a forward that, called with `sluice_logprob_request`,
    returns (logprobs_T, entropy_T) of one packed row computed in chunks (idempotent).

    Any other call goes to the model's own forward. The decoder and the head are called as
    modules, so their hooks (ZeRO-3 gathers, activation checkpointing) act as usual.
    """
    if getattr(model, "_sluice_logprob_forward", False):
        return
    own_forward = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        request = kwargs.pop(_REQUEST_KWARG, None)
        if request is None:
            return own_forward(*args, **kwargs)
        target_ids_T, temperature, with_entropy, entropy_grad, chunk_tokens, positions_T = request
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (an LM head); "
                             "chunked logprobs need a causal LM: set train.logprob_chunk_tokens=0")
        hidden_BTH = hidden_state_module(model)(*args, **kwargs).last_hidden_state
        return compute_chunked_logprobs(hidden_BTH[0], head, target_ids_T, temperature,
                                        with_entropy, entropy_grad, chunk_tokens, positions_T)

    model.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
    # torch types Module.__setattr__ values as Tensor | Module; a plain attribute is allowed
    model._sluice_logprob_forward = True  # pyrefly: ignore[bad-argument-type]


def compute_token_logprobs_and_entropy(model: torch.nn.Module, packed: PackedBatch,
                                       temperature: float = 1.0, with_entropy: bool = False,
                                       entropy_grad: bool = True, chunk_tokens: int = 0,
                                       loss_positions_only: bool = False
                                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs_T, entropy_T or None) of every position's target in one packed row.

    `model` is a Hugging Face causal LM or a DeepSpeed engine around one. Values at the
    last position of each sequence (no target) are computed but meaningless; callers use
    `packed.loss_mask_T`. Gradients flow when called outside `torch.no_grad()`.
    `chunk_tokens` > 0 computes them from hidden states that many positions at a time
    (`compute_chunked_logprobs`); 0 materialises the whole row's logits. A row with
    `packed.images` needs a vision-language model (`trainer.train.backends.vision`).
    `loss_positions_only`: values only where `packed.loss_mask_T` is set (0 elsewhere), the
    rest of the row never reaching the LM head in the chunked path.
    """
    inner = _hf_model(model)
    param = next(inner.parameters())
    device = param.device
    kwargs: dict[str, torch.Tensor | int] = dict(_attention_kwargs(inner, packed, device, param.dtype))
    if packed.images:
        check_image_runs(inner.config, packed.input_ids_T, packed.images)
        kwargs.update(build_vision_kwargs(inner.config, packed.images, device, param.dtype))
    target_ids_T = packed.target_ids_T.to(device)
    inputs = dict(input_ids=packed.input_ids_T[None].to(device),
                  position_ids=packed.position_ids_T[None].to(device), use_cache=False, **kwargs)
    positions_T = packed.loss_mask_T if loss_positions_only else None
    if chunk_tokens > 0:
        _install_logprob_forward(inner)
        request = (target_ids_T, temperature, with_entropy, entropy_grad, chunk_tokens,
                   positions_T)
        return model(**inputs, **{_REQUEST_KWARG: request})
    logits_TV = model(**inputs).logits[0]
    index_N, logits_NV, target_ids_N = select_positions(positions_T, logits_TV, target_ids_T)
    logprobs_N, entropy_N = compute_logprobs_from_logits(logits_NV, target_ids_N, temperature,
                                                         with_entropy, entropy_grad)
    return scatter_positions(index_N, logprobs_N, entropy_N, positions_T)
