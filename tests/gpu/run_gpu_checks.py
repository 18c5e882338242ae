"""The trainer's GPU checks in one script, for a machine with one GPU (H100 / H200), torch
and transformers, and no network or package index (no vLLM, no Ray; DeepSpeed only where
a wheel was carried):

    python tests/gpu/run_gpu_checks.py --out results.json       # the GPU check, < 8 min on an H100
    python tests/gpu/run_gpu_checks.py --device cpu --tiny      # dry mode: every code path on CPU
    python tests/gpu/run_gpu_checks.py --only train_step,weight_push   # a subset, to rerun

Each check is one function (tests/gpu/gpu_checks_*.py) that returns its figures and the
expectations that failed; a check that cannot run here is skipped with its reason (ok, but
listed apart). The script prints a line per finding as it goes, then one per check with
its wall time, writes everything as JSON with --out, and exits 1 when a check failed.

  check               asserts (on CUDA; the dry mode asserts what holds on CPU)     GPU budget  dry
  sdpa_kernel         the trainer's packed GQA attention (compute_packed_sdpa_attention)  20 s     5 s
                      runs a fused kernel, not math, forward and backward, also with math
                      ruled out (sdpa_kernel); which one, and each backend alone, reported
  packed_parity       4 sequences packed in one row == each alone, chunked == unchunked   20 s     2 s
                      (Qwen3-8B shape, 2 layers, bf16, each attention the trainer loads)
  train_step          TorchBackend.train_step, tiny and Qwen3-0.6B-shaped random models,  90 s     6 s
                      8k and 34.5k tokens (one sequence of 33,000 > 32,768) with the swe
                      recipe's YaRN: behaviour logprobs from an unpacked HF forward of the
                      same weights; the step's proximal logprobs == HF's, IS weight mean ~ 1,
                      weights move, and YaRN is in effect (plain RoPE differs far more)
  memory_vs_length    Qwen3-8B shape, 2 layers, 8k and 32k tokens: the chunked path fits,  30 s     8 s
                      grows at most linearly, costs less than unchunked (OOM at 32k)
  memory_vs_estimate  Qwen3-8B slices (1, 2 layers) at 65,536 tokens, gradients alive,    45 s     5 s
                      extrapolated to 36 layers, within 1.3x of model_check's estimate of
                      weights + grads + activations + logits (no optimizer runs here)
  weight_push         LocalSender/BroadcastTransport to 2 receiver processes running the   60 s    17 s
                      engines' receive code: 2 pushes bit-exact; one receiver killed mid-push
                      (survivor served < 20 s); one stopped (rank 0 out < timeout + grace)
  deepspeed           ZeRO-3 init and one step, HF behaviour logprobs (when installed)     60 s    skip
  start-up, imports, CUDA context, model saves and loads                                  40 s     3 s
  total                                                                                  365 s   ~45 s

The budgets are estimates (no GPU was at hand when this was written): FLOPs at ~350 TFLOP/s
(35% of an H100's 989 dense bf16), each doubled for what FLOPs miss. train_step's 0.6B long
case: 28 layers x 2 x 33,000^2 x 2,048 causal attention FLOPs (125 TFLOP) + 1.2 GFLOP a
token (40 TFLOP) a forward; a step is ~4 forwards (checkpointed), plus two HF reference
forwards: ~1.2 PFLOP, 4 s. memory_vs_estimate: per Qwen3-8B layer at 65,536 tokens 35 TFLOP
attention + 25 TFLOP matmuls a forward, ~4.5x for the step; the head 82 TFLOP x 4; slices
of 1 and 2 layers: 1.4 PFLOP, 5 s. memory_vs_length: 0.4 PFLOP. weight_push is bound by its
own time-outs: the stopped receiver costs sync.timeout_s (5 s) + grace (10.5 s) by design.
The dry column was measured on a 2-core CPU shared with a running test suite (35-65 s
in all; 13 s of it the stopped receiver's deadline and grace). Timings are printed, never
asserted; the budgets are printed beside them.

Imports only the standard library, torch, transformers, numpy, PyYAML and the sluice
modules the trainer uses; deepspeed inside its check on CUDA, vllm only for NCCL with three
GPUs; never ray, omegaconf, wandb or datasets.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the models are built here
ROOT = Path(__file__).resolve().parents[2]
sys.path[1:1] = [str(ROOT), str(ROOT / "tests")]  # sluice, and tests/model_configs.py

import torch  # noqa: E402  (after the path fix: runs as a script)
from gpu_checks_attention import check_packed_parity, check_sdpa_kernel  # noqa: E402
from gpu_checks_memory import check_memory_vs_estimate, check_memory_vs_length  # noqa: E402
from gpu_checks_models import Settings, free_memory  # noqa: E402
from gpu_checks_push import check_weight_push  # noqa: E402
from gpu_checks_train import check_deepspeed, check_train_step  # noqa: E402

Check = Callable[[Settings], dict[str, Any]]
CHECKS: dict[str, tuple[Check, float]] = {  # name: (check, GPU budget in seconds)
    "sdpa_kernel": (check_sdpa_kernel, 20),
    "packed_parity": (check_packed_parity, 20),
    "train_step": (check_train_step, 90),
    "memory_vs_length": (check_memory_vs_length, 30),
    "memory_vs_estimate": (check_memory_vs_estimate, 45),
    "weight_push": (check_weight_push, 60),
    "deepspeed": (check_deepspeed, 60),
}


def environment() -> dict[str, Any]:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "gpus": torch.cuda.device_count(),
           **{name: importlib.util.find_spec(name) is not None
              for name in ("flash_attn", "deepspeed", "vllm")}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    return env


def run_check(name: str, check: Check, settings: Settings) -> dict[str, Any]:
    """One check, its wall time; an exception is that check's failure, not the run's."""
    start = time.monotonic()
    try:
        result = check(settings)
    except Exception:  # one broken check must not hide the others' results
        result = {"ok": False, "failures": [traceback.format_exc()]}
        print(traceback.format_exc(), file=sys.stderr, flush=True)
    result["seconds"] = time.monotonic() - start
    free_memory()
    return result


def status(result: dict[str, Any]) -> str:
    return "SKIP" if result.get("skipped") else "PASS" if result["ok"] else "FAIL"


def format_summary(report: dict[str, Any], settings: Settings) -> str:
    lines = ["", "summary:"]
    for name, result in report["checks"].items():
        budget = "" if settings.dry else f" (budget {CHECKS[name][1]:.0f} s)"
        lines.append(f"  {status(result)}  {name:<20} {result['seconds']:7.1f} s{budget}")
        if result.get("skipped"):
            lines.append(f"        skipped: {result['reason']}")
        for failure in result.get("failures", []):
            lines.append("        " + failure.strip().replace("\n", "\n        "))
    push = report["checks"].get("weight_push", {})
    if push and not push.get("nccl_exercised", True):
        lines.append(f"  note: weight_push ran {push['transport']} on {push['devices'][0]}: "
                     f"{push['transport_reason']}")
    results = list(report["checks"].values())
    skips = [n for n, r in report["checks"].items() if r.get("skipped")]
    failed = [n for n, r in report["checks"].items() if not r["ok"]]
    lines.append(f"  {len(results) - len(skips) - len(failed)} passed, {len(failed)} failed"
                 f"{' (' + ', '.join(failed) + ')' if failed else ''}, {len(skips)} skipped"
                 f"{' (' + ', '.join(skips) + ')' if skips else ''}; {report['seconds']:.1f} s in all")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="dry mode: tiny shapes and short sequences (needed with --device cpu)")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu --tiny for the dry mode", file=sys.stderr)
        return 2
    if args.device == "cpu" and not args.tiny:
        print("--device cpu runs the dry mode only: add --tiny", file=sys.stderr)
        return 2
    names = list(CHECKS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    settings = Settings(device=args.device, dry=args.tiny)
    # The fault scenarios log the failures they provoke (WARNING, from sluice's own modules).
    logging.basicConfig(level=logging.WARNING, format="    [log %(name)s] %(message).240s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    report: dict[str, Any] = {"environment": environment(), "command": " ".join(sys.argv),
                              "dry": settings.dry, "checks": {}}
    print("environment: " + json.dumps(report["environment"]), flush=True)
    start = time.monotonic()
    for name in names:
        print(f"{name}:", flush=True)
        result = report["checks"][name] = run_check(name, CHECKS[name][0], settings)
        print(f"  -> {status(result)} in {result['seconds']:.1f} s", flush=True)
    report["seconds"] = time.monotonic() - start
    report["modules"] = sorted({m.split(".")[0] for m in sys.modules if not m.startswith("_")})
    print(format_summary(report, settings), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    return 0 if all(r["ok"] for r in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
