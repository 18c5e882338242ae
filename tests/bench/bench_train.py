"""Training throughput of the tiny model on one GRPO batch, run by hand:

    python tests/bench/bench_train.py [--num-trajectories 32] [--tokens 200] [--steps 3]

Builds a batch of multi-turn trajectories (random in-vocabulary ids, model turns around
tool segments), then times `train_step` with the DeepSpeed backend (ZeRO-2 by default)
for several micro-batch token budgets: with the per-sequence sdpa attention (the CPU
default), with activation checkpointing, with sdpa over a block-diagonal mask, and once
with the plain torch backend for reference; one untimed warm-up step each. tokens/s
counts every packed token of the step (prompt + response, proximal pass included in the
wall time); model tok/s counts only the trained (mask 1) tokens. Prints a table with the
machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
ATTENTION_LABELS = {"sluice_packed_sdpa": "per-seq sdpa", "sdpa": "sdpa+mask"}
sys.path.insert(0, str(ROOT))

from buffer.batch import TrainBatch  # noqa: E402  (after the path fix: runs as a script)
from envs.types import Trajectory  # noqa: E402  (after the path fix: runs as a script)


def build_batch(num: int, tokens: int, vocab: int, seed: int = 0) -> list[Trajectory]:
    """`num` trajectories of about `tokens` tokens: a 20% prompt, then model turns of
    ~30 tokens separated by tool segments of ~10 (mask 0)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        total = int(rng.integers(int(tokens * 0.8), int(tokens * 1.2)))
        prompt_len = max(4, total // 5)
        mask: list[int] = []
        while len(mask) < total - prompt_len:
            mask += [1] * int(rng.integers(20, 40)) + [0] * int(rng.integers(5, 15))
        mask_arr = np.array(mask[:total - prompt_len])
        mask_arr[-1] = 1  # every trajectory ends on a model token (its end of turn)
        out.append(Trajectory(
            task_id=f"t{i // 8}", group_id=f"g{i // 8}", index=i % 8,
            prompt_ids=rng.integers(0, vocab, prompt_len),
            response_ids=rng.integers(0, vocab, len(mask_arr)), response_mask=mask_arr,
            logprobs=np.where(mask_arr == 1, -6.0, 0.0), versions=np.where(mask_arr == 1, 0, -1),
            termination="finished"))
    return out


def machine_info() -> list[str]:
    import deepspeed
    import torch
    import transformers

    cpu = platform.processor() or "?"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return [f"machine: {platform.node()} | {platform.system()} {platform.machine()} | {cpu}",
            f"cores: {os.cpu_count()} (torch threads {torch.get_num_threads()}) | load avg "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} | gpu: {gpu}",
            f"python {platform.python_version()} | torch {torch.__version__} | deepspeed "
            f"{deepspeed.__version__} | transformers {transformers.__version__}"]


@dataclass(frozen=True, slots=True)
class BenchRow:
    backend: str
    attention: str
    micro_batch_tokens: int
    checkpointing: bool
    num_micro_batches: int
    step_s: float  # median over the timed steps
    proximal_s: float
    tokens_per_s: float  # all packed tokens / step_s
    model_tokens_per_s: float  # mask-1 tokens / step_s


def bench(backend_name: str, zero_stage: int, micro_batch_tokens: int,
          batch: list[Trajectory], num_steps: int, model_path: Path,
          gradient_checkpointing: bool = False, attn: str | None = None) -> BenchRow:
    from trainer.train.backends import build_backend
    from trainer.train.config import LossConfig, TrainConfig

    cfg = TrainConfig(backend=backend_name, zero_stage=zero_stage, lr=1e-5,
                      micro_batch_tokens=micro_batch_tokens, num_minibatches=1,
                      gradient_checkpointing=gradient_checkpointing)
    backend = build_backend(cfg, model_path, attn_implementation=attn)
    model = backend.forward_model
    attn_used = getattr(model, "module", model).config._attn_implementation  # DS engine wraps it
    advantages = np.tile([1.0, -1.0], len(batch) // 2 + 1)[:len(batch)]
    backend.train_step(TrainBatch(batch, advantages, backend.version), LossConfig())  # warm-up: allocator, kernels
    results = [backend.train_step(TrainBatch(batch, advantages, backend.version), LossConfig())
               for _ in range(num_steps)]
    step_s = float(np.median([r.step_s for r in results]))
    first = results[0]
    return BenchRow(
        backend=backend_name if backend_name == "torch" else f"deepspeed z{zero_stage}",
        attention=ATTENTION_LABELS.get(attn_used, attn_used),
        micro_batch_tokens=micro_batch_tokens, checkpointing=gradient_checkpointing,
        num_micro_batches=first.num_micro_batches, step_s=step_s,
        proximal_s=float(np.median([r.proximal_s for r in results])),
        tokens_per_s=first.num_tokens / step_s,
        model_tokens_per_s=first.metrics.num_tokens / step_s)


def format_table(rows: list[BenchRow]) -> str:
    head = (f"{'backend':<13} {'attention':<12} {'mb_tokens':>9} {'ckpt':>4} {'micro':>5} "
            f"{'step_s':>7} {'prox_s':>7} {'tokens/s':>9} {'model tok/s':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.backend:<13} {r.attention:<12} {r.micro_batch_tokens:>9} "
                     f"{'on' if r.checkpointing else 'off':>4} {r.num_micro_batches:>5} "
                     f"{r.step_s:>7.3f} {r.proximal_s:>7.3f} {r.tokens_per_s:>9.0f} "
                     f"{r.model_tokens_per_s:>11.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-trajectories", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=200, help="mean tokens per trajectory")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (median)")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--budgets", default="1024,2048,8192",
                        help="comma-separated train.micro_batch_tokens values")
    args = parser.parse_args()

    from envs.cache import default_cache_dir  # the folders `make` uses: no rebuilds

    os.environ.setdefault("SLUICE_CACHE_DIR", str(default_cache_dir()))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(os.environ["SLUICE_CACHE_DIR"])
                                                      / "torch_extensions"))
    import torch

    from trainer.run.tiny_model import ensure_tiny_model

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model_path = ensure_tiny_model()
    batch = build_batch(args.num_trajectories, args.tokens, vocab=512)
    budgets = [int(b) for b in args.budgets.split(",")]
    z, n = args.zero_stage, args.steps
    rows = [bench("deepspeed", z, b, batch, n, model_path) for b in budgets]
    rows.append(bench("deepspeed", z, budgets[-1], batch, n, model_path,
                      gradient_checkpointing=True))
    # The block-diagonal mask path: O(T^2) in the micro-batch size.
    rows += [bench("deepspeed", z, b, batch, n, model_path, attn="sdpa") for b in budgets]
    rows.append(bench("torch", 0, budgets[-1], batch, n, model_path))
    total = sum(len(t.prompt_ids) + len(t.response_ids) for t in batch)
    model = sum(t.num_model_tokens for t in batch)
    print("\n".join(machine_info()))
    print(f"batch: {len(batch)} trajectories, {total} tokens ({model} model tokens), "
          f"tiny Qwen2 (fp32), one optimizer step per train_step, median of {n} steps")
    print(format_table(rows))


if __name__ == "__main__":
    main()
