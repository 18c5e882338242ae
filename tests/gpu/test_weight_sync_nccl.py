"""On a machine with two GPUs: the NCCL weight push into a real vLLM engine. The sender
(train rank 0's role) runs in the test process on cuda:1, the engine on cuda:0; after two
pushes through one group the engine serves the pushed weights (logprobs match a
transformers forward within 1e-3) and confirms version and checksum; a trainer that
believes other weights gets an error. NCCL refuses two ranks of one communicator on the
same GPU, so one GPU is not enough."""

from __future__ import annotations

import numpy as np
import pytest
import pytest_asyncio
import torch

from rollout.engine import EngineSpec, Sampling, VLLMEngine
from rollout.router import Router
from rollout.weight_protocol import expected_checksum
from trainer.train.weight_sync import WeightSyncError, check_engines
from trainer.train.weight_sync_nccl import BroadcastTransport, LocalSender

pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason="NCCL needs the sender and the engine on different GPUs")]
PROMPT = [1, 347, 201, 332, 284, 223, 20, 13, 21, 33, 2, 1, 349, 201]
TRAINER_DEVICE = "cuda:1"  # the engine's worker takes cuda:0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def router(tiny_model_path):
    engine = VLLMEngine(EngineSpec(model_path=str(tiny_model_path), dtype="float32",
                                   max_model_len=1024, gpu_memory_utilization=0.15,
                                   max_num_seqs=8, enforce_eager=True))
    await engine.start()
    yield Router({"engine-0": engine})
    engine.shutdown()


def perturbed(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen).to(v.device)
            for k, v in model.state_dict().items()}


async def test_nccl_push_is_served_and_verified(router, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model = model.to(TRAINER_DEVICE).eval()
    current: dict[str, torch.Tensor] = {}
    sender = LocalSender(lambda: current, "nccl", bucket_bytes=1 << 20, timeout_s=120,
                         host="127.0.0.1", device=TRAINER_DEVICE)
    transport = BroadcastTransport(sender, timeout_s=120)
    for version, seed in [(1, 1), (2, 2)]:
        current = perturbed(model, seed)
        result = await transport.push(router, version)
        assert result.version == version and result.num_bytes > 1 << 20  # several buckets
        assert result.attempts == 1 and sender.pusher.num_groups_formed == 1
        model.load_state_dict(current)
        out = await router._engines["engine-0"].generate(f"check-{version}", PROMPT,
                                                         Sampling(16, seed=3))
        ids = torch.tensor([PROMPT + out.token_ids.tolist()], device=TRAINER_DEVICE)
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        ref = logp.gather(-1, ids[0, 1:, None])[:, 0][len(PROMPT) - 1:].cpu().numpy()
        # GPU kernels (TF32 matmuls, fused attention) are looser than the CPU path's.
        assert np.abs(out.logprobs - ref).max() < 1e-3
        assert np.all(out.versions == version)
    with pytest.raises(WeightSyncError, match="serve other weights"):
        await check_engines(router, expected_checksum(perturbed(model, 3)), 2)
    with pytest.raises(WeightSyncError, match="report another version"):
        await check_engines(router, expected_checksum(current), 5)
