"""Peak memory of the trainer's logprob + entropy computation against sequence length, run
by hand:

    python tests/bench/bench_logprob_memory.py [--lengths 2048,4096,8192,16384,32768]
        [--vocab 150000] [--hidden 64] [--chunk 2048] [--full-max-tokens 4096]

One packed row of T positions: hidden states [T, H] (requiring grad, as the decoder's
output does in training) go through an LM head of a 150k vocabulary, then logprobs of the
targets and the entropy are computed and backpropagated (the training pass), or computed
under no_grad (the proximal pass). `chunked` is trainer.train.backends.logprobs with
train.logprob_chunk_tokens = --chunk; `full` materialises the [T, V] fp32 logits, as the
trainer did before (and does with logprob_chunk_tokens=0). The hidden size is small on
purpose: the decoder's own activations are not what this measures.

Each case runs in a fresh process; the number is its peak resident memory (ru_maxrss)
above what it held once inputs were built. `full` stops at --full-max-tokens because it
needs about 3 x T x V x 4 bytes (19.7 GB per fp32 copy at 32k tokens). Timings are
printed for reading, never asserted.

Measured (2-core x86_64, 24 GiB, torch 2.13.0+cpu, shared with other jobs: the seconds are
contended; defaults):

     tokens  mode      train peak MiB  no-grad peak MiB  [T,V] fp32 MiB
       2048  full                5890              3545            1172
       2048  chunked             6077              3545            1172
       4096  full               11749              7060            2344
       4096  chunked             6117              3545            2344
       8192  chunked             6121              3545            4688
      16384  chunked             6125              3545            9375
      32768  chunked             6134              3545           18750

Chunked: +57 MiB from 2k to 32k tokens (the [T, H] hidden states and their gradient);
full: +5.7 GiB per 2k tokens, about 94 GiB at 32k.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_case(mode: str, num_tokens: int, vocab: int, hidden: int, chunk: int, grad: bool) -> dict:
    """In this process: build the inputs, then measure the peak above that point."""
    import torch

    sys.path.insert(0, str(ROOT))
    from trainer.train.backends.logprobs import compute_chunked_logprobs, compute_logprobs_from_logits

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    hidden_TH = torch.randn(num_tokens, hidden, requires_grad=grad)
    targets_T = torch.randint(0, vocab, (num_tokens,))
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.set_grad_enabled(grad):
        if mode == "chunked":
            lp_T, ent_T = compute_chunked_logprobs(hidden_TH, head, targets_T, 1.0, True,
                                                   True, chunk)
        else:
            lp_T, ent_T = compute_logprobs_from_logits(head(hidden_TH), targets_T, 1.0, True)
        if grad:
            (lp_T.sum() + 0.01 * ent_T.sum()).backward()
    seconds = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mb": (peak_kb - base_kb) / 1024, "seconds": seconds}


def machine_line() -> str:
    import torch

    cpus = os.cpu_count()
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"machine: {platform.system()} {platform.machine()} | {cpus} cores | "
            f"{mem_gb:.0f} GiB | python {platform.python_version()} | torch {torch.__version__} "
            f"| {torch.get_num_threads()} threads")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--full-max-tokens", type=int, default=4096)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case, JSON out
    args = parser.parse_args()
    if args.case:
        mode, tokens, grad = args.case.split(":")
        print(json.dumps(run_case(mode, int(tokens), args.vocab, args.hidden, args.chunk,
                                  grad == "grad")))
        return 0

    lengths = [int(x) for x in args.lengths.split(",")]
    print(machine_line())
    print("command: python tests/bench/bench_logprob_memory.py " + " ".join(sys.argv[1:]))
    print(f"vocab {args.vocab}, hidden {args.hidden}, chunk {args.chunk} positions; "
          f"fp32 logits of one chunk: {args.chunk * args.vocab * 4 / 2**20:.0f} MiB\n")
    header = (f"{'tokens':>7}  {'mode':<8} {'train peak MiB':>15} {'train s':>8} "
              f"{'no-grad peak MiB':>17} {'no-grad s':>9} {'[T,V] fp32 MiB':>15}")
    print(header)
    print("-" * len(header))
    for tokens in lengths:
        for mode in ("full", "chunked"):
            if mode == "full" and tokens > args.full_max_tokens:
                continue
            cells = {}
            for grad in ("grad", "nograd"):
                out = subprocess.run(
                    [sys.executable, __file__, "--case", f"{mode}:{tokens}:{grad}",
                     "--vocab", str(args.vocab), "--hidden", str(args.hidden),
                     "--chunk", str(args.chunk)], capture_output=True, text=True, check=True)
                cells[grad] = json.loads(out.stdout.strip().splitlines()[-1])
            full_mb = tokens * args.vocab * 4 / 2**20
            print(f"{tokens:>7}  {mode:<8} {cells['grad']['peak_mb']:>15.0f} "
                  f"{cells['grad']['seconds']:>8.2f} {cells['nograd']['peak_mb']:>17.0f} "
                  f"{cells['nograd']['seconds']:>9.2f} {full_mb:>15.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
