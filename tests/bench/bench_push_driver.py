"""Bench (by hand): what a weight push costs the driver. Train rank 0 gathers and encodes
while rollout goes on, then sends to the engines itself; the driver passes a version and
gets a PushResult (the path through the driver, which brought the state dict to it, is
gone).

Real parts: a local Ray cluster, one TrainRankActor (torch backend) and one vLLM engine
actor on a random Qwen2 of the given size, verified by checksum. Reports the driver's
peak RSS growth during the push (sampled every 5 ms), the push's wall time, and how long
the turn gates stay closed (the send). Never asserts timings.

    python tests/bench/bench_push_driver.py [--hidden 512 --layers 8] [--pushes 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time

import psutil

from bench_weight_push import build_model


class PeakRss:
    """The driver's peak RSS above its level at start, sampled on a thread."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 2**20


async def main_async(args: argparse.Namespace) -> None:
    import ray

    from rollout.engine import EngineSpec
    from rollout.engine_actor import start_engines
    from rollout.router import Router
    from trainer.run.recipe import load_config
    from trainer.train.train_actor import RayTrainer, TrainGroup

    folder = tempfile.mkdtemp(prefix="push-driver-")
    rows: list[tuple[float, float, float]] = []
    try:
        path = build_model(args.hidden, args.layers, folder)
        size_mb = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                      if f.endswith(".safetensors")) / 2**20
        cfg = load_config("quickstart.yaml", [f"model.path={path}", "model.warm_start=null",
                                              "train.backend=torch"])
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        engines = await start_engines(EngineSpec(model_path=path, max_model_len=1024,
                                                 kv_cache_memory_bytes=64 << 20, enforce_eager=True), 1)
        router = Router(engines)
        group = TrainGroup(cfg, path, None)
        trainer = RayTrainer(group, router, None)
        version = 0
        for _ in range(args.pushes):
            version += 1
            start = time.monotonic()
            with PeakRss() as rss:
                await trainer.prepare_weights(version)
                sent = time.monotonic()
                await trainer.push_weights(version)
                gates = time.monotonic() - sent
            rows.append((rss.growth_mb, time.monotonic() - start, gates))
        ray.shutdown()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"machine: {platform.node()} | {platform.machine()} | {os.cpu_count()} cores | "
          f"python {platform.python_version()}")
    print(f"command: python tests/bench/bench_push_driver.py --hidden {args.hidden} --layers "
          f"{args.layers} --pushes {args.pushes}")
    print(f"model: {size_mb:.1f} MB fp32; 1 engine; medians over {args.pushes} pushes\n")
    print("| path | driver peak RSS growth MB | push s | gates closed s |")
    print("|---|---:|---:|---:|")
    mb, total, gates = (statistics.median(r[i] for r in rows) for i in range(3))
    print(f"| from train rank 0 | {mb:.1f} | {total:.3f} | {gates:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pushes", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
