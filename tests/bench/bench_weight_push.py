"""Benchmark (by hand, never in CI): weight push seconds per MB over the CPU transport.

Builds a random Qwen2 model of the requested size locally (no downloads), starts one real
vLLM engine actor on it, and pushes the full state dict several times through
the CPU push train rank 0 makes (rollout.weight_protocol.encode_state, then
trainer.train.weight_sync.send_prepared: Ray transfer + in-place reload + checksum
verification). Prints a table; asserts nothing about time.

    .venv/bin/python tests/bench/bench_weight_push.py [--hidden 512 --layers 8] [--pushes 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import tempfile
import time


def build_model(hidden: int, layers: int, out: str) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.run.tiny_model import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=max(2, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), tie_word_embeddings=False,
                      max_position_embeddings=2048, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


async def main_async(args: argparse.Namespace) -> None:
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.engine import EngineSpec
    from rollout.engine_actor import start_engines
    from rollout.router import Router
    from rollout.weight_protocol import encode_state, expected_checksum
    from trainer.train.weight_sync import send_prepared

    folder = tempfile.mkdtemp(prefix="push-bench-")
    try:
        path = build_model(args.hidden, args.layers, folder)
        state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        size_mb = len(encode_state(state)) / 2**20
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        engines = await start_engines(EngineSpec(model_path=path, max_model_len=1024,
                                                 kv_cache_memory_bytes=64 << 20, enforce_eager=True), 1)
        router = Router(engines)
        results, encode = [], []
        for version in range(1, args.pushes + 1):
            state = {k: v + 0.001 for k, v in state.items()}
            start = time.monotonic()
            blob, expected = encode_state(state), expected_checksum(state)
            encode.append(time.monotonic() - start)
            results.append(await send_prepared(router, blob, expected, version))
        ray.shutdown()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    total = [r.seconds + e for r, e in zip(results, encode)]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; model hidden={args.hidden} "
          f"layers={args.layers}, {size_mb:.1f} MB fp32; {args.pushes} pushes to 1 engine")
    print(f"{'metric':<28} {'median':>10} {'max':>10}")
    print(f"{'push total s (verified)':<28} {statistics.median(total):>10.3f} {max(total):>10.3f}")
    print(f"{'of which encode s':<28} {statistics.median(encode):>10.3f} {max(encode):>10.3f}")
    print(f"{'s per MB':<28} {statistics.median(total) / size_mb:>10.4f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pushes", type=int, default=5)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
