"""Sluice's training step against TRL 1.16's GRPOTrainer on the same GRPO batch, run by hand:

    python tests/bench/bench_trl_compare.py [--num-trajectories 16] [--tokens 128]
                                            [--steps 10] [--threads 1] [--no-deepspeed]

Both sides train the tiny model (fp32, CPU) on one batch from bench_train.build_batch:
the same prompt and response ids, the same per-trajectory advantages (+1/-1), the same
loss mask (tool segments inside the response are not trained: TRL gets them as its
`tool_mask`), a token-mean loss (sluice `token_mean`, TRL `loss_type="dapo"`, whose
normaliser is the batch's model-token count), the same clip range, AdamW at the same rate
with clipping at 1.0, and one optimizer step per step. Generation is excluded on both
sides: TRL runs through a subclass whose `_prepare_inputs` returns the prepared batch, and
each timed TRL step is what its Trainer loop does for one update (`training_step`, grad
clipping, optimizer and scheduler step, zero_grad), preceded by TRL's own no-grad
old-logprob pass, the counterpart of sluice's proximal pass. The behaviour logprobs are
the initial model's, so the first step of every side sees ratio 1 and weight 1 and must
report the same loss and gradient norm (printed as a check that the objectives agree).

Sides run interleaved (one step of each per round, the order rotating, after warm-up
rounds), so load from other users of the machine hits them alike; ratios are medians of the
per-round ratios. tokens/s counts the real (unpadded) prompt + response tokens of the
batch; model tok/s counts only the trained (mask 1) tokens; TRL also computes over its
padding, reported as padded tokens. torch runs one intra-op thread by default: on a
shared, oversubscribed machine a multi-threaded op waits for its slowest thread, which
then measures the scheduler (and hits the side with more, smaller ops hardest) rather
than the training step; `--threads 0` keeps torch's default of one per core.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# After the path fix: this file runs as a script, next to bench_train.
from bench_train import build_batch, machine_info

from buffer.batch import TrainBatch  # noqa: E402  (after the path fix: runs as a script)
from envs.types import Trajectory

EPS_LOW, EPS_HIGH, LR, MAX_GRAD_NORM = 0.2, 0.28, 1e-5, 1.0
MICRO_BATCH_TOKENS = 1 << 20  # one packed micro-batch: TRL also runs the batch in one forward


@dataclass(slots=True)
class StepTime:
    """One timed step of one side."""

    step_s: float  # the whole step
    logprob_s: float  # of step_s: the no-grad proximal (sluice) / old-logprob (TRL) pass
    loss: float
    grad_norm: float  # before clipping


def with_initial_logprobs(batch: list[Trajectory], model_path: Path) -> list[Trajectory]:
    """The batch with behaviour logprobs set to the initial model's, so the first step of
    each side is exactly on-policy (ratio 1, behaviour weight 1) and comparable."""
    import torch

    from trainer.train.backends.packing import build_micro_batches, unpack_responses
    from trainer.train.backends.torch_backend import TorchBackend
    from trainer.train.config import TrainConfig

    backend = TorchBackend(TrainConfig(backend="torch"), model_path)
    packed = build_micro_batches(batch, torch.zeros(len(batch)), MICRO_BATCH_TOKENS)
    out = list(batch)
    for b, logprobs_T in zip(packed, backend.compute_proximal_logprobs(packed)):
        for i, lp in zip(b.traj_indices, unpack_responses(b, logprobs_T)):
            mask = batch[i].response_mask == 1
            out[i] = dataclasses.replace(batch[i], logprobs=np.where(mask, lp.numpy(), 0.0))
    return out


class SluiceSide:
    """sluice's `train_step` on one backend (torch, or DeepSpeed at a ZeRO stage)."""

    def __init__(self, backend_name: str, zero_stage: int, model_path: Path,
                 batch: list[Trajectory], advantages_B: np.ndarray) -> None:
        from trainer.train.backends import build_backend
        from trainer.train.config import LossConfig, TrainConfig

        cfg = TrainConfig(backend=backend_name, zero_stage=zero_stage, lr=LR,
                          micro_batch_tokens=MICRO_BATCH_TOKENS, num_minibatches=1,
                          max_grad_norm=MAX_GRAD_NORM)
        self.name = "sluice torch" if backend_name == "torch" else f"sluice deepspeed z{zero_stage}"
        self._backend = build_backend(cfg, model_path)
        self._loss_cfg = LossConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH, aggregation="token_mean")
        self._batch, self._advantages_B = batch, advantages_B

    def step(self) -> StepTime:
        start = time.perf_counter()
        batch = TrainBatch(self._batch, self._advantages_B, self._backend.version)
        result = self._backend.train_step(batch, self._loss_cfg)
        return StepTime(time.perf_counter() - start, result.proximal_s, result.loss,
                        result.grad_norm)


def build_trl_inputs(batch: list[Trajectory], advantages_B: np.ndarray, pad_id: int
                     ) -> dict[str, Any]:
    """The batch in the layout TRL's `_compute_loss` reads: left-padded prompts, right-padded
    completions, tool tokens masked by `tool_mask`, advantages per completion."""
    import torch

    num = len(batch)
    max_prompt = max(len(t.prompt_ids) for t in batch)
    max_completion = max(len(t.response_ids) for t in batch)
    prompt_ids = torch.full((num, max_prompt), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((num, max_prompt), dtype=torch.long)
    completion_ids = torch.full((num, max_completion), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((num, max_completion), dtype=torch.long)
    tool_mask = torch.zeros((num, max_completion), dtype=torch.long)
    for i, t in enumerate(batch):
        p, c = len(t.prompt_ids), len(t.response_ids)
        prompt_ids[i, max_prompt - p:] = torch.tensor(t.prompt_ids, dtype=torch.long)
        prompt_mask[i, max_prompt - p:] = 1
        completion_ids[i, :c] = torch.tensor(t.response_ids, dtype=torch.long)
        completion_mask[i, :c] = 1
        tool_mask[i, :c] = torch.tensor(t.response_mask, dtype=torch.long)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "tool_mask": tool_mask, "advantages": torch.as_tensor(advantages_B, dtype=torch.float32),
            "num_items_in_batch": (completion_mask * tool_mask).sum()}


def build_trl_trainer(model_path: Path, num_trajectories: int, out_dir: str) -> Any:
    """A GRPOTrainer configured like sluice's step (fp32, no checkpointing, constant lr)
    whose `_prepare_inputs` hands back the prepared batch instead of generating."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    class PreparedBatchGRPOTrainer(GRPOTrainer):
        def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
            return generation_batch  # already on the CPU, completions pre-generated

    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, use_vllm=False, bf16=False,
        gradient_checkpointing=False, per_device_train_batch_size=num_trajectories,
        gradient_accumulation_steps=1, num_generations=8, num_iterations=1,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        epsilon=EPS_LOW, epsilon_high=EPS_HIGH, beta=0.0, loss_type="dapo",
        report_to="none", save_strategy="no", logging_strategy="no", seed=0)
    prompts = Dataset.from_dict({"prompt": ["unused: completions are pre-generated"] * 8})
    return PreparedBatchGRPOTrainer(model=str(model_path), reward_funcs=lambda **_: [0.0],
                                    args=args, train_dataset=prompts)


class TrlSide:
    """TRL's optimisation step over a fixed batch, as its Trainer loop runs one update."""

    name = "TRL GRPOTrainer"

    def __init__(self, model_path: Path, batch: list[Trajectory], advantages_B: np.ndarray,
                 out_dir: str) -> None:
        self._trainer = trainer = build_trl_trainer(model_path, len(batch), out_dir)
        trainer.create_optimizer()
        self._model, trainer.optimizer = trainer.accelerator.prepare(trainer.model,
                                                                      trainer.optimizer)
        trainer.create_scheduler(num_training_steps=1_000)
        trainer.current_gradient_accumulation_steps = 1  # the Trainer loop sets it per update
        self._inputs = build_trl_inputs(batch, advantages_B, trainer.processing_class.pad_token_id)
        self.num_padded_tokens = (self._inputs["prompt_ids"].numel()
                                  + self._inputs["completion_ids"].numel())
        self.optimizer_name = type(trainer.optimizer.optimizer).__name__
        self.attention = trainer.model.config._attn_implementation

    def step(self) -> StepTime:
        import torch

        trainer, inputs = self._trainer, dict(self._inputs)
        start = time.perf_counter()
        with torch.no_grad():  # what _generate_and_score_completions does for old logprobs
            inputs["old_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model,
                torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                inputs["completion_ids"].size(1),
                batch_size=trainer.args.per_device_train_batch_size)
        logprob_s = time.perf_counter() - start
        loss = trainer.training_step(self._model, inputs, inputs["num_items_in_batch"])
        grad_norm = trainer.accelerator.clip_grad_norm_(self._model.parameters(),
                                                        trainer.args.max_grad_norm)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        self._model.zero_grad()
        return StepTime(time.perf_counter() - start, logprob_s, float(loss), float(grad_norm))


def run_interleaved(sides: list[Any], num_warmup: int, num_steps: int
                    ) -> dict[str, list[StepTime]]:
    """Warm-up rounds, then timed rounds of one step per side (A B C, B C A, C A B, ...)."""
    timed: dict[str, list[StepTime]] = {s.name: [] for s in sides}
    first: dict[str, StepTime] = {}
    for r in range(num_warmup + num_steps):
        shift = r % len(sides)
        for side in sides[shift:] + sides[:shift]:
            t = side.step()
            first.setdefault(side.name, t)
            if r >= num_warmup:
                timed[side.name].append(t)
    print("first step (identical weights, ratio 1: loss and grad norm should agree):")
    for name, t in first.items():
        print(f"  {name:<22} loss {t.loss:+.6f}  grad norm {t.grad_norm:.6f}")
    return timed


def format_table(timed: dict[str, list[StepTime]], num_tokens: int, num_model_tokens: int,
                 reference: str) -> str:
    """Markdown table: medians per side, and the sluice/TRL ratios as the median over rounds
    of the paired ratio (TRL's step / the side's step in the same round)."""
    ref = timed[reference]
    lines = [("| side | step_s | logprob pass s | optimisation s | tokens/s | model tok/s "
              "| ratio (step) | ratio (optimisation) | step_s min-max |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, ts in timed.items():
        step_s = float(np.median([t.step_s for t in ts]))
        logprob_s = float(np.median([t.logprob_s for t in ts]))
        opt_s = float(np.median([t.step_s - t.logprob_s for t in ts]))
        ratio_step = np.median([r.step_s / t.step_s for r, t in zip(ref, ts)])
        ratio_opt = np.median([(r.step_s - r.logprob_s) / (t.step_s - t.logprob_s)
                               for r, t in zip(ref, ts)])
        steps = [t.step_s for t in ts]
        lines.append(f"| {name} | {step_s:.3f} | {logprob_s:.3f} | {opt_s:.3f} "
                     f"| {num_tokens / step_s:.0f} | {num_model_tokens / step_s:.0f} "
                     f"| {ratio_step:.2f} | {ratio_opt:.2f} "
                     f"| {min(steps):.3f}-{max(steps):.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-trajectories", type=int, default=16,
                        help="completions in the batch (a multiple of 8, TRL's group size)")
    parser.add_argument("--tokens", type=int, default=128, help="mean tokens per trajectory")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: torch's default, one per core)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed side")
    args = parser.parse_args()
    if args.num_trajectories % 8:
        raise ValueError("--num-trajectories must be a multiple of 8 (TRL's num_generations)")

    from envs.cache import default_cache_dir  # the folders `make` uses: no rebuilds

    os.environ.setdefault("SLUICE_CACHE_DIR", str(default_cache_dir()))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(os.environ["SLUICE_CACHE_DIR"])
                                                      / "torch_extensions"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed
    # Both sides load the same folder; the vLLM-version notice and progress bars are noise here.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    import trl
    from transformers.utils import logging as hf_logging

    from trainer.run.tiny_model import ensure_tiny_model

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    torch.manual_seed(0)
    model_path = ensure_tiny_model()
    batch = with_initial_logprobs(build_batch(args.num_trajectories, args.tokens, vocab=512),
                                  model_path)
    advantages_B = np.tile([1.0, -1.0], len(batch) // 2)
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as out_dir:
        # TRL first: its Accelerator must see a plain single process, before the DeepSpeed
        # backend sets RANK/WORLD_SIZE and starts a gloo group.
        trl_side = TrlSide(model_path, batch, advantages_B, out_dir)
        sides: list[Any] = [SluiceSide("torch", 0, model_path, batch, advantages_B)]
        if not args.no_deepspeed:
            sides.append(SluiceSide("deepspeed", 2, model_path, batch, advantages_B))
        sides.append(trl_side)
        setup_s = time.perf_counter() - start
        timed = run_interleaved(sides, args.warmup, args.steps)
    bench_s = time.perf_counter() - start - setup_s

    num_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in batch)
    num_model = sum(int(t.response_mask.sum()) for t in batch)
    print()
    print("\n".join(machine_info()) + f" | trl {trl.__version__}")
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in
                   ("SLUICE_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "WANDB_MODE") if k in os.environ)
    print(f"command: cd {shlex.quote(str(ROOT))} && {env} {shlex.quote(sys.executable)} "
          f"{shlex.join(sys.argv)}")
    print(f"batch: {len(batch)} trajectories, {num_tokens} tokens ({num_model} model tokens; "
          f"TRL pads to {trl_side.num_padded_tokens}), tiny Qwen2 fp32, one optimizer step "
          f"per step; median of {args.steps} interleaved rounds after {args.warmup} warm-up "
          f"(setup {setup_s:.0f} s, rounds {bench_s:.0f} s)")
    print(f"TRL: attention {trl_side.attention}, optimizer {trl_side.optimizer_name}; sluice: "
          f"packed per-sequence sdpa, torch AdamW / DeepSpeed AdamW")
    print("ratio = median over rounds of TRL step_s / side step_s in the same round (= the "
          "side's tokens/s over TRL's; > 1: faster than TRL); optimisation = the step without "
          "the no-grad logprob pass (sluice's packing falls in the logprob pass)")
    print()
    print(format_table(timed, num_tokens, num_model, reference=trl_side.name))


if __name__ == "__main__":
    main()
