"""The trainer's GPU checks in one script, for a machine with one GPU, torch and transformers
and no network (under 10 minutes on an H100/H200):

    python tests/gpu/run_gpu_checks.py [--out results.json]          # on the GPU
    python tests/gpu/run_gpu_checks.py --device cpu --tiny           # the CPU-safe smoke run

1. memory vs length: one packed sequence of 2k..64k tokens through a Qwen3-8B-shaped model
   with few layers (hidden 4096, 32 heads, 8 KV heads, head_dim 128, intermediate 12288,
   vocab 151,936) in bf16 with activation checkpointing, logprobs + entropy forward and
   backward, chunked (train.logprob_chunk_tokens=2048) and unchunked (until it runs out of
   memory); peak CUDA memory per length and the chunked path's bytes per token.
2. packed-vs-per-sequence parity in bf16: four sequences packed in one row vs each alone,
   with every attention path present (sluice_packed_sdpa, flash_attention_2 when flash-attn
   is installed), and chunked vs unchunked on the same row.
3. DeepSpeed, when installed: one ZeRO-3 training step (one process) of the chunked path on
   a small Qwen3-shaped model saved to a temporary folder: finite loss and gradient norm.

Imports only the standard library, torch, transformers (and flash-attn / deepspeed when
present) and the sluice modules those need (trainer.train.backends). Prints a report and writes
it as JSON with --out; exit status 1 when a check fails. Memory figures are asserted only
as "the chunked path fits and grows linearly"; timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the models are built here
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (after the path fix: runs as a script)
from buffer.batch import TrainBatch  # noqa: E402  (after the path fix: runs as a script)

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6,
                max_position_embeddings=131072, tie_word_embeddings=False)
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=151936, rope_theta=1e6,
            max_position_embeddings=8192, tie_word_embeddings=False)
GPU_LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536)
CPU_LENGTHS = (256, 512, 1024)
CHUNK = 2048
PARITY_MEAN_TOL = 5e-3  # bf16 weights, fp32 logprobs: kernels differ by a few bf16 ulps
PARITY_MAX_TOL = 0.1


def build_model(shape: dict, num_layers: int, dtype: torch.dtype, device: str, attn: str,
                checkpointing: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from trainer.train.backends.logprobs import register_packed_sdpa

    register_packed_sdpa()
    torch.manual_seed(0)
    config = Qwen3Config(num_hidden_layers=num_layers, **shape)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device)


def random_trajectories(lengths: list[int], vocab: int, seed: int = 0) -> list:
    """Sequences of the given lengths (prompt 1/4, response 3/4, all model tokens)."""
    import numpy as np

    from envs.types import Trajectory

    rng = np.random.default_rng(seed)
    trajs = []
    for i, n in enumerate(lengths):
        p = max(1, n // 4)
        r = n - p
        trajs.append(Trajectory(task_id=f"t{i}", group_id="g", index=i,
                                prompt_ids=rng.integers(0, vocab, p).tolist(),
                                response_ids=rng.integers(0, vocab, r).tolist(),
                                response_mask=np.ones(r, np.int32),
                                logprobs=np.zeros(r, np.float32), versions=np.zeros(r, np.int32),
                                termination="finished"))
    return trajs


def random_packed(lengths: list[int], vocab: int, seed: int = 0):
    """The sequences of `random_trajectories` packed into one row."""
    from trainer.train.backends.packing import pack_trajectories

    return pack_trajectories(random_trajectories(lengths, vocab, seed), torch.zeros(len(lengths)))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_step(model: torch.nn.Module, packed, device: str, chunk: int) -> dict:
    """Peak memory and time of logprobs + entropy forward and backward on one packed row."""
    from trainer.train.backends.logprobs import compute_token_logprobs_and_entropy

    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    try:
        lp, ent = compute_token_logprobs_and_entropy(model, packed, 1.0, with_entropy=True,
                                                     chunk_tokens=chunk)
        (lp.float().mean() + 0.01 * ent.float().mean()).backward()
        _sync(device)
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return {"oom": True}
    out = {"oom": False, "seconds": time.perf_counter() - start}
    if device == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["above_weights_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    model.zero_grad(set_to_none=True)
    return out


def check_memory_vs_length(args, report: dict) -> None:
    shape = TINY if args.tiny else QWEN3_8B
    model = build_model(shape, args.layers, args.dtype, args.device, "sluice_packed_sdpa",
                        checkpointing=True)
    rows = []
    unchunked_oom = False
    for n in args.lengths:
        packed = random_packed([n], shape["vocab_size"], seed=n)
        row = {"tokens": n, "chunked": measure_step(model, packed, args.device, CHUNK)}
        if not unchunked_oom:
            row["unchunked"] = measure_step(model, packed, args.device, 0)
            unchunked_oom = row["unchunked"]["oom"]
        rows.append(row)
        print(f"  {n:>6} tokens  chunked {_fmt(row['chunked'])}  unchunked "
              f"{_fmt(row.get('unchunked', {'oom': True, 'skipped': True}))}", flush=True)
    del model
    report["memory_vs_length"] = rows
    fits = all(not r["chunked"]["oom"] for r in rows)
    result = {"ok": fits, "detail": "the chunked path ran at every length" if fits else
              "the chunked path ran out of memory"}
    peaks = [(r["tokens"], r["chunked"].get("above_weights_gib")) for r in rows
             if not r["chunked"]["oom"] and "above_weights_gib" in r["chunked"]]
    if len(peaks) >= 2:
        (n0, p0), (n1, p1) = peaks[0], peaks[-1]
        slope = (p1 - p0) * 2**30 / (n1 - n0)
        result["chunked_bytes_per_token"] = slope
        # Linear with a small constant: growth per token stays within 3x of the average.
        steps = [(b - a) * 2**30 / (m - k) for (k, a), (m, b) in zip(peaks, peaks[1:])]
        result["ok"] = fits and max(steps) <= 3 * max(slope, 1.0)
        result["detail"] += f"; {slope / 1024:.0f} KiB per token above the weights"
    both = [r for r in rows if not r["chunked"]["oom"] and not r.get("unchunked", {"oom": True})["oom"]
            and "peak_gib" in r["chunked"]]
    if both and both[-1]["tokens"] >= 8192:
        # Past a few chunks the unchunked [T, V] logits must cost more than the chunks do.
        last = both[-1]
        saved = last["unchunked"]["peak_gib"] - last["chunked"]["peak_gib"]
        result["ok"] = result["ok"] and saved > 0
        result["detail"] += (f"; at {last['tokens']} tokens chunking saves {saved:.1f} GiB "
                             f"of peak memory")
    report["checks"]["memory_vs_length"] = result


def _fmt(cell: dict) -> str:
    if cell.get("skipped"):
        return "skipped (ran out of memory at a shorter length)"
    if cell["oom"]:
        return "out of memory"
    mem = f"{cell['peak_gib']:6.1f} GiB peak " if "peak_gib" in cell else ""
    return f"{mem}{cell['seconds']:6.2f} s"


@torch.no_grad()
def check_packed_parity(args, report: dict) -> None:
    from trainer.train.backends.logprobs import compute_token_logprobs_and_entropy
    from trainer.train.backends.packing import pack_trajectories

    shape = TINY if args.tiny else QWEN3_8B
    attns = ["sluice_packed_sdpa"]
    if args.device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        attns.append("flash_attention_2")
    lengths = [700, 1500, 300, 2100] if not args.tiny else [70, 150, 30, 210]
    trajs = random_trajectories(lengths, shape["vocab_size"], seed=1)
    packed = pack_trajectories(trajs, torch.zeros(len(trajs)))
    results = {}
    for attn in attns:
        model = build_model(shape, args.layers, args.dtype, args.device, attn, False).eval()
        row_lp, _ = compute_token_logprobs_and_entropy(model, packed, chunk_tokens=CHUNK)
        unchunked_lp, _ = compute_token_logprobs_and_entropy(model, packed, chunk_tokens=0)
        diffs = []
        for s, (a, b) in enumerate(zip(packed.cu_seqlens[:-1].tolist(), packed.cu_seqlens[1:].tolist())):
            single = pack_trajectories([trajs[s]], torch.zeros(1))
            alone, _ = compute_token_logprobs_and_entropy(model, single, chunk_tokens=CHUNK)
            mask = packed.loss_mask_T[a:b].to(alone.device)
            diffs.append((row_lp[a:b] - alone)[mask].abs().float())
        d = torch.cat(diffs)
        chunk_d = (row_lp - unchunked_lp)[packed.loss_mask_T.to(row_lp.device)].abs().float()
        ok = d.mean().item() < PARITY_MEAN_TOL and d.max().item() < PARITY_MAX_TOL
        ok = ok and chunk_d.max().item() < PARITY_MAX_TOL
        results[attn] = {"ok": ok, "packed_vs_alone_mean": d.mean().item(),
                         "packed_vs_alone_max": d.max().item(),
                         "chunked_vs_unchunked_max": chunk_d.max().item()}
        print(f"  {attn:<20} packed vs alone: mean {d.mean().item():.2e} max "
              f"{d.max().item():.2e}; chunked vs unchunked max {chunk_d.max().item():.2e}",
              flush=True)
        del model
    report["checks"]["packed_parity"] = {"ok": all(r["ok"] for r in results.values()),
                                         "detail": results}


def check_deepspeed(args, report: dict) -> None:
    if args.device != "cuda" or importlib.util.find_spec("deepspeed") is None:
        report["checks"]["deepspeed"] = {"ok": True, "skipped": True,
                                         "detail": "needs CUDA and deepspeed"}
        return
    from transformers import AutoModelForCausalLM, Qwen3Config

    from trainer.train.backends.deepspeed_backend import DeepSpeedBackend
    from trainer.train.config import LossConfig, TrainConfig

    with tempfile.TemporaryDirectory() as folder:
        shape = dict(TINY, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=64)
        AutoModelForCausalLM.from_config(Qwen3Config(num_hidden_layers=2, **shape)).save_pretrained(folder)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        backend = DeepSpeedBackend(TrainConfig(zero_stage=3, lr=1e-5, micro_batch_tokens=4096,
                                               logprob_chunk_tokens=512,
                                               gradient_checkpointing=True), folder,
                                   dtype="bfloat16", device="cuda")
        trajs = random_trajectories([1500, 900, 2000], shape["vocab_size"], seed=3)
        result = backend.train_step(TrainBatch(trajs, [1.0, -0.5, -0.5], backend.version), LossConfig())
    ok = bool(torch.isfinite(torch.tensor([result.loss, result.grad_norm])).all())
    report["checks"]["deepspeed"] = {"ok": ok, "detail": f"ZeRO-3 step: loss {result.loss:.4f}, "
                                     f"grad norm {result.grad_norm:.3f}"}
    print(f"  deepspeed ZeRO-3 chunked step: loss {result.loss:.4f} grad norm "
          f"{result.grad_norm:.3f}", flush=True)


def environment() -> dict:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "flash_attn": importlib.util.find_spec("flash_attn") is not None,
           "deepspeed": importlib.util.find_spec("deepspeed") is not None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small hidden size (CPU smoke run)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lengths", default=None, help="comma-separated token counts")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu --tiny for the CPU-safe run", file=sys.stderr)
        return 2
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    args.lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths else
                    list(GPU_LENGTHS if args.device == "cuda" else CPU_LENGTHS))
    report: dict = {"environment": environment(), "command": " ".join(sys.argv), "checks": {}}
    print("environment: " + json.dumps(report["environment"]))
    start = time.monotonic()
    for name, check in (("memory vs length", check_memory_vs_length),
                        ("packed parity", check_packed_parity), ("deepspeed", check_deepspeed)):
        print(f"{name}:", flush=True)
        try:
            check(args, report)
        except Exception:  # one broken check must not hide the others' results
            key = name.replace(" ", "_")
            report["checks"][key] = {"ok": False, "detail": traceback.format_exc()}
            print(traceback.format_exc(), file=sys.stderr)
    report["seconds"] = time.monotonic() - start
    report["modules"] = sorted({m.split(".")[0] for m in sys.modules if not m.startswith("_")})
    for name, result in report["checks"].items():
        print(f"{'PASS' if result['ok'] else 'FAIL'}  {name}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    return 0 if all(r["ok"] for r in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
