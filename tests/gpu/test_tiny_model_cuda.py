"""On a CUDA machine: the tiny model runs in the GPU vLLM build with the same logprobs as a
transformers forward on the GPU (fp32), and pools place on real GPUs."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def cuda_engine(tiny_model_path):
    from vllm import LLM

    llm = LLM(model=str(tiny_model_path), dtype="float32", gpu_memory_utilization=0.2,
              max_model_len=1024, enforce_eager=True, seed=0)
    yield llm
    del llm


def test_cuda_vllm_matches_transformers_fp32(tiny_model_path, cuda_engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    params = SamplingParams(max_tokens=32, temperature=1.0, logprobs=0, seed=1, ignore_eos=True)
    sample = cuda_engine.generate([TokensPrompt(prompt_token_ids=prompt)], params)[0].outputs[0]
    engine_lp = torch.tensor([s[t].logprob for s, t in zip(sample.logprobs, sample.token_ids)])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).cuda().eval()
    ids = torch.tensor([prompt + list(sample.token_ids)], device="cuda")
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    ref = logp.gather(-1, ids[0, 1:, None])[:, 0][len(prompt) - 1:].cpu()
    # GPU kernels (TF32 matmuls, fused attention) are looser than the CPU path's 5e-7.
    assert (engine_lp - ref).abs().max().item() < 1e-3
