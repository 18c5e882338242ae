"""The DeepSpeed backend on the tiny model with real ZeRO (gloo on CPU): packed logprobs
equal per-sequence ones, training moves logprobs the way advantages say, the first
minibatch is exactly on-policy, gradient accumulation equals one big micro-batch, ZeRO-1/2/3
train like plain torch AdamW, the pushed weights reproduce the backend's logprobs in a
fresh transformers model, two ranks (torchrun) with uneven shards train like one
process on their union, and none of it compiles an op (the last test).

Trajectories are multi-turn tool conversations rendered with the tiny model's chat
template: assistant tokens (mask 1) around tool-response and template tokens (mask 0).
DeepSpeed's JIT-built ops (shm comm, FusedAdam: 130 s of g++ on 2 cores, and a lock file
that a killed rank leaves behind) are never used: this file gets an empty
TORCH_EXTENSIONS_DIR of its own and checks at the end that it stayed empty.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from buffer.batch import TrainBatch
from envs.types import Trajectory
from trainer.train.backends.logprobs import build_block_causal_mask, compute_token_logprobs_and_entropy
from trainer.train.backends.packing import (build_micro_batches, pack_trajectories,
                                            unpack_responses, unpack_sequences)
from trainer.train.backends.policy_model import build_policy_model
from trainer.train.config import LossConfig, TrainConfig
from trainer.train.weight_sync_nccl import specs_of

TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code and return its output.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}]
LR = 1e-3  # large for a 0.5M-parameter model on purpose: a few steps must move logprobs


@pytest.fixture(scope="module", autouse=True)
def deepspeed_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """CPU DeepSpeed with an empty TORCH_EXTENSIONS_DIR of this file's own (its torchrun
    ranks inherit it); the folder, for the last test to look into."""
    folder = tmp_path_factory.mktemp("torch_extensions")
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    yield folder
    if before is None:
        os.environ.pop("TORCH_EXTENSIONS_DIR", None)
    else:
        os.environ["TORCH_EXTENSIONS_DIR"] = before


def build_trajectory(tok, index: int, a: int, b: int, num_tool_rounds: int) -> Trajectory:
    """A tool conversation: rounds of (assistant call | tool response + glue), then an answer."""
    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    messages = [{"role": "system", "content": "You solve arithmetic with tools."},
                {"role": "user", "content": f"What is {a} * {b}?"}]
    prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    ids: list[int] = []
    mask: list[int] = []
    for r in range(num_tool_rounds):
        call = (f'Step {r}: I will compute it.\n<tool_call>\n{{"name": "python", "arguments": '
                f'{{"code": "print({a}*{b + r})"}}}}\n</tool_call><|im_end|>')
        observation = (f"\n<|im_start|>user\n<tool_response>\n{a * (b + r)}\n</tool_response>"
                       f"<|im_end|>\n<|im_start|>assistant\n")
        for text, m in ((call, 1), (observation, 0)):
            piece = enc(text)
            ids += piece
            mask += [m] * len(piece)
    answer = enc(f"The answer is {a * b}.<|im_end|>")
    ids += answer
    mask += [1] * len(answer)
    mask_arr = np.array(mask)
    return Trajectory(task_id=f"task{index}", group_id="g", index=index, prompt_ids=prompt,
                      response_ids=ids, response_mask=mask_arr,
                      logprobs=np.where(mask_arr == 1, -1.0, 0.0),
                      versions=np.where(mask_arr == 1, 0, -1), termination="finished")


def build_trajectories(model_path) -> list[Trajectory]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    specs = [(12, 7, 1), (345, 67, 2), (8, 91, 0), (23, 456, 3), (5, 6, 1), (77, 88, 2)]
    return [build_trajectory(tok, i, *s) for i, s in enumerate(specs)]


@pytest.fixture(scope="module")
def trajectories(tiny_model_path) -> list[Trajectory]:
    return build_trajectories(tiny_model_path)


def with_behaviour(backend, trajectories, offset_fn=None) -> list[Trajectory]:
    """The trajectories with behaviour logprobs = the backend's current logprobs (on-policy),
    optionally minus `offset_fn(i, n)` >= 0 on model tokens (a stale engine)."""
    batches = build_micro_batches(trajectories, torch.zeros(len(trajectories)), 512)
    out = list(trajectories)
    for packed, logprobs_T in zip(batches, backend.compute_proximal_logprobs(batches)):
        for i, resp in zip(packed.traj_indices, unpack_responses(packed, logprobs_T)):
            t = trajectories[i]
            lp = resp.numpy().astype(np.float32)
            if offset_fn is not None:
                lp = lp - offset_fn(i, len(lp))
            out[i] = dataclasses.replace(t, logprobs=np.where(t.response_mask == 1,
                                                              np.minimum(lp, 0.0), 0.0))
    return out


def make_backend(tiny_model_path, **train):
    from trainer.train.backends.deepspeed_backend import DeepSpeedBackend

    base = dict(lr=LR, micro_batch_tokens=256, num_minibatches=2, max_grad_norm=1.0)
    base.update(train)
    return DeepSpeedBackend(TrainConfig(**base), tiny_model_path)


@pytest.fixture(scope="module")
def zero2(tiny_model_path):
    return make_backend(tiny_model_path, zero_stage=2)


@pytest.fixture(scope="module")
def zero3(tiny_model_path):
    return make_backend(tiny_model_path, zero_stage=3)


@pytest.fixture(params=[2, 3], ids=["zero2", "zero3"])
def backend(request):
    return request.getfixturevalue(f"zero{request.param}")


def _per_sequence_logprobs(model, ids_L: torch.Tensor) -> torch.Tensor:
    """Plain causal forward of one sequence: log p(token t+1 | tokens <= t), length L-1."""
    logits_LV = model(input_ids=ids_L[None], use_cache=False).logits[0].float()
    return torch.log_softmax(logits_LV[:-1], dim=-1).gather(-1, ids_L[1:, None]).squeeze(-1)


@pytest.mark.parametrize("attn", ["sluice_packed_sdpa", "sdpa", "eager"])
@torch.no_grad()
def test_packed_logprobs_equal_per_sequence_forward(tiny_model_path, trajectories, attn):
    model = build_policy_model(tiny_model_path, torch.float32, torch.device("cpu"),
                               attn_implementation=attn).eval()
    assert model.config._attn_implementation == attn
    packed = pack_trajectories(trajectories, torch.ones(len(trajectories)))
    logprobs_T, entropy_T = compute_token_logprobs_and_entropy(model, packed, with_entropy=True)
    assert entropy_T is not None and bool((entropy_T >= 0).all())
    for seq_logprobs, traj in zip(unpack_sequences(packed, logprobs_T), trajectories):
        ref = _per_sequence_logprobs(model, torch.as_tensor(traj.input_ids(), dtype=torch.long))
        assert (seq_logprobs[:-1] - ref).abs().max().item() < 1e-5
    # The mask is what keeps sequences apart: one causal row over everything differs.
    leaky = model(input_ids=packed.input_ids_T[None], position_ids=packed.position_ids_T[None],
                  attention_mask=torch.ones_like(build_block_causal_mask(packed)).tril(),
                  use_cache=False).logits[0].float()
    leaky_T = torch.log_softmax(leaky, -1).gather(-1, packed.target_ids_T[:, None]).squeeze(-1)
    later = packed.seq_index_T > 0
    assert (leaky_T - logprobs_T)[later].abs().max().item() > 1e-3


@torch.no_grad()
def test_zero3_packed_logprobs_equal_a_plain_model_per_sequence(tiny_model_path, trajectories,
                                                                 zero3):
    model = build_policy_model(tiny_model_path, torch.float32, torch.device("cpu")).eval()
    model.load_state_dict(zero3.state_dict_for_push())  # whatever version the backend is at
    batches = build_micro_batches(trajectories, torch.ones(len(trajectories)), 300)
    assert len(batches) > 1
    for packed, logprobs_T in zip(batches, zero3.compute_proximal_logprobs(batches)):
        for i, seq in zip(packed.traj_indices, unpack_sequences(packed, logprobs_T)):
            ids = torch.as_tensor(trajectories[i].input_ids(), dtype=torch.long)
            assert (seq[:-1] - _per_sequence_logprobs(model, ids)).abs().max().item() < 1e-5


def _mean_model_logprob(backend, trajectories, which: list[int]) -> float:
    chosen = [trajectories[i] for i in which]
    packed = pack_trajectories(chosen, torch.zeros(len(chosen)))
    logprobs_T = backend.compute_proximal_logprobs([packed])[0]
    return logprobs_T[packed.loss_mask_T].mean().item()


def test_repeated_steps_raise_positive_and_lower_negative_logprobs(backend, trajectories):
    batch = with_behaviour(backend, trajectories[:4])
    # Each minibatch of 2 holds one of each sign. The positive ones are the longer
    # conversations: the template tokens they share with the negative ones then get a net
    # push up under token_mean, so "positive tokens go up" is what the objective implies.
    advantages = [-1.0, 1.0, -1.0, 1.0]
    positive, negative = [1, 3], [0, 2]
    pos_before = _mean_model_logprob(backend, batch, positive)
    gap_before = pos_before - _mean_model_logprob(backend, batch, negative)
    version = backend.version
    losses = [backend.train_step(TrainBatch(batch, advantages, backend.version), LossConfig()).loss for _ in range(4)]
    assert backend.version == version + 4
    assert losses[-1] < losses[0] - 0.05, losses
    pos_after = _mean_model_logprob(backend, batch, positive)
    assert pos_after > pos_before + 0.05
    assert pos_after - _mean_model_logprob(backend, batch, negative) > gap_before + 0.05


def test_first_minibatch_is_on_policy_and_proximal_stays_fixed(backend, trajectories):
    batch = with_behaviour(backend, trajectories)
    result = backend.train_step(TrainBatch(batch, [1.0, -0.5, 0.25, -1.0, 0.75, -0.25], backend.version), LossConfig())
    first, second = result.minibatch_metrics
    assert first.clip_frac == 0.0 and first.is_capped_frac == 0.0
    assert first.approx_kl < 1e-10 and first.mismatch_kl < 1e-10
    assert first.is_weight_mean == pytest.approx(1.0, abs=1e-5)
    assert first.num_tokens + second.num_tokens == sum(t.num_model_tokens for t in batch)
    # The second optimizer step still measures ratios against the pre-update proximal
    # logprobs, so the first update shows up as a policy change.
    assert second.approx_kl > 1e-8
    assert result.num_micro_batches >= 3 and result.tokens_per_s > 0
    assert np.isfinite(result.grad_norms).all() and len(result.grad_norms) == 2


def test_gradient_accumulation_equals_one_micro_batch(tiny_model_path, trajectories):
    small = make_backend(tiny_model_path, zero_stage=2, micro_batch_tokens=64,
                         num_minibatches=1, num_warmup_steps=2)
    large = make_backend(tiny_model_path, zero_stage=2, micro_batch_tokens=100_000,
                         num_minibatches=1, num_warmup_steps=2)
    assert small.current_lr == pytest.approx(LR / 2)  # linear warm-up over 2 steps
    # A stale engine, so importance weights are not all 1.
    batch = with_behaviour(small, trajectories, lambda i, n: 0.05 * (i + 1) * np.ones(n))
    advantages = [1.5, -0.5, 0.25, -1.0, 0.75, -1.0]
    results = []
    for _ in range(2):  # the second step starts from the accumulated update of the first
        results.append((small.train_step(TrainBatch(batch, advantages, small.version), LossConfig()),
                        large.train_step(TrainBatch(batch, advantages, large.version), LossConfig())))
    for r_small, r_large in results:
        assert r_small.num_micro_batches == len(trajectories) and r_large.num_micro_batches == 1
        assert abs(r_small.loss - r_large.loss) < 1e-5
        assert r_small.grad_norm == pytest.approx(r_large.grad_norm, rel=1e-5)
        assert r_small.metrics.num_tokens == r_large.metrics.num_tokens
    assert small.current_lr == pytest.approx(LR)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_zero_stage_trains_like_plain_torch_adamw(tiny_model_path, trajectories, stage):
    """Same AdamW hyper-parameters, clipping (active: norms exceed 1) and weight decay."""
    from trainer.train.backends.torch_backend import TorchBackend

    ds = make_backend(tiny_model_path, zero_stage=stage, weight_decay=0.1)
    plain = TorchBackend(TrainConfig(lr=LR, micro_batch_tokens=256, num_minibatches=2,
                                     max_grad_norm=1.0, weight_decay=0.1), tiny_model_path)
    batch = with_behaviour(ds, trajectories, lambda i, n: 0.05 * (i + 1) * np.ones(n))
    advantages = [1.5, -0.5, 0.25, -1.0, 0.75, -1.0]
    for _ in range(2):
        a = ds.train_step(TrainBatch(batch, advantages, ds.version), LossConfig())
        b = plain.train_step(TrainBatch(batch, advantages, plain.version), LossConfig())
        assert abs(a.loss - b.loss) < 1e-5
        assert a.grad_norms == pytest.approx(b.grad_norms, rel=1e-5)
    assert max(a.grad_norms) > 1.0  # so clipping was exercised
    theirs = plain.state_dict_for_push()
    # Adam's first steps act like lr * sign(g): a gradient entry near 0 may round either way
    # under a different reduction order, so allow a small fraction of lr.
    for name, tensor in ds.state_dict_for_push().items():
        assert (tensor - theirs[name]).abs().max().item() < 0.05 * LR, name


@pytest.mark.parametrize("stage", [2, 3])
def test_pushed_weights_are_updated_and_reproduce_backend_logprobs(
        request, tiny_model_path, trajectories, stage):
    from transformers import AutoModelForCausalLM

    backend = request.getfixturevalue(f"zero{stage}")
    backend.train_step(TrainBatch(with_behaviour(backend, trajectories[:4]), [1.0, -1.0, 0.5, -0.5], backend.version),
                       LossConfig())
    pushed = backend.state_dict_for_push()
    # What the broadcast push plans from without gathering: the gathered tensors' specs.
    assert backend.push_specs() == specs_of(pushed)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert set(pushed) == set(original)
    for name, tensor in pushed.items():
        assert tensor.shape == original[name].shape, name
        assert not torch.equal(tensor, original[name]), f"{name} was not updated"

    fresh = build_policy_model(tiny_model_path, torch.float32, torch.device("cpu")).eval()
    fresh.load_state_dict(pushed, strict=True)
    packed = pack_trajectories(trajectories, torch.zeros(len(trajectories)))
    with torch.no_grad():
        ref_T, _ = compute_token_logprobs_and_entropy(fresh, packed)
    ours_T = backend.compute_proximal_logprobs([packed])[0]
    assert (ours_T - ref_T).abs().max().item() < 1e-5


# Two ranks: rank 0 trains trajectories 0-3 (4 micro-batches), rank 1 trajectories 4-5 (2),
# so rank 1 must pad with zero-weight repeats to keep ZeRO-3's collectives in step.
SHARDS = ([0, 1, 2, 3], [4, 5])
TWO_RANK_ADVANTAGES = [1.5, -0.5, 0.25, -1.0, 0.75, -1.0]
TWO_RANK_TRAIN = dict(lr=LR, micro_batch_tokens=300, num_minibatches=1)


def run_two_rank_worker(out_dir: Path) -> None:
    """Body of each rank under `torchrun --nproc_per_node 2 THIS_FILE OUT_DIR`."""
    from trainer.run.tiny_model import ensure_tiny_model
    from trainer.train.backends.deepspeed_backend import DeepSpeedBackend

    rank = int(os.environ["RANK"])
    path = ensure_tiny_model()
    trajs = build_trajectories(path)
    backend = DeepSpeedBackend(TrainConfig(zero_stage=3, **TWO_RANK_TRAIN), path)
    shard = SHARDS[rank]
    mine = TrainBatch([trajs[i] for i in shard], [TWO_RANK_ADVANTAGES[i] for i in shard], 0)
    results = [backend.train_step(mine, LossConfig()) for _ in range(2)]
    pushed = backend.state_dict_for_push()  # a collective under ZeRO-3: both ranks call it
    if rank == 0:
        torch.save(pushed, out_dir / "pushed.pt")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(
        [{"grad_norm": r.grad_norm, "num_micro_batches": r.num_micro_batches} for r in results]))


def test_two_ranks_with_uneven_shards_train_like_one_process(tiny_model_path, trajectories,
                                                            tmp_path):
    from trainer.train.backends.deepspeed_backend import find_free_port
    from trainer.train.backends.torch_backend import TorchBackend

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(find_free_port()), __file__, str(tmp_path)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [step["num_micro_batches"] for step in ranks[0]] == [4, 4]
    assert [step["num_micro_batches"] for step in ranks[1]] == [2, 2]

    plain = TorchBackend(TrainConfig(**TWO_RANK_TRAIN), tiny_model_path)
    for k in range(2):
        batch = TrainBatch(trajectories, TWO_RANK_ADVANTAGES, plain.version)
        expected = plain.train_step(batch, LossConfig()).grad_norm
        for rank in ranks:  # the global norm, identical on both ranks
            assert rank[k]["grad_norm"] == pytest.approx(expected, rel=1e-5)
    pushed = torch.load(tmp_path / "pushed.pt")
    for name, tensor in plain.state_dict_for_push().items():
        assert (pushed[name] - tensor).abs().max().item() < 1e-5, name


if __name__ == "__main__":
    run_two_rank_worker(Path(sys.argv[1]))


def test_no_deepspeed_op_was_compiled(deepspeed_env: Path) -> None:
    """Every backend above started (ZeRO-1/2/3, two torchrun ranks) without a JIT build."""
    assert not any(deepspeed_env.iterdir()), sorted(p.name for p in deepspeed_env.iterdir())
