"""Bench (by hand): the broadcast weight push (gloo, CPU) with every engine healthy, and
when one engine dies in the middle of a push, through `BroadcastTransport.push(router,
version)` from a rank-0 pusher.

Real parts: a local Ray cluster, `--engines` vLLM engine actors on a random Qwen2 of the
given size, rank 0's sender in this process. The fault: the victim's engine core is
stopped (SIGSTOP) so the push surely waits for it, 2 s later the engine (core and actor)
is SIGKILLed. Reported: median push seconds when healthy, seconds from the kill until the
push call returns and how it ended, and whether the next push works (and its seconds).
Never asserts timings.

    python tests/bench/bench_weight_group_faults.py [--hidden 512 --layers 8] [--engines 3]
        [--pushes 5] [--timeout 60]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import statistics
import tempfile
import time

from bench_weight_push import build_model


class Pushes:
    """One broadcast push of `state` as `version`, from a rank-0 pusher in this process."""

    def __init__(self, router, timeout_s: float, bucket_bytes: int) -> None:
        from trainer.train.weight_sync_nccl import BroadcastTransport, LocalSender

        self.router, self.state = router, {}
        sender = LocalSender(lambda: self.state, "gloo", bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        self.transport = BroadcastTransport(sender, timeout_s=timeout_s)

    async def push(self, state, version: int):
        self.state = state
        return await self.transport.push(self.router, version)


def perturbed(state, seed):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def engine_processes(router, name):
    import psutil
    import ray

    pid = ray.get(router.engines[name].handle.__ray_call__.remote(lambda actor: os.getpid()))
    cores = [c.pid for c in psutil.Process(pid).children(recursive=True)
             if c.name().startswith("VLLM::EngineCor")]
    return pid, cores


async def main_async(args: argparse.Namespace) -> None:
    import ray
    from transformers import AutoModelForCausalLM

    from rollout.engine import EngineSpec
    from rollout.engine_actor import start_engines
    from rollout.router import Router

    folder = tempfile.mkdtemp(prefix="push-faults-")
    try:
        path = build_model(args.hidden, args.layers, folder)
        base = AutoModelForCausalLM.from_pretrained(path).state_dict()
        size_mb = sum(t.numel() * t.element_size() for t in base.values()) / 2**20
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        spec = EngineSpec(model_path=path, max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                          enforce_eager=True)
        router = Router(await start_engines(spec, args.engines))
        pushes = Pushes(router, args.timeout, args.bucket_mb << 20)
        engine_code = ray.get(router.engines[router.engine_names[0]].handle.__ray_call__.remote(
            lambda actor: __import__("rollout.engine").engine.__file__))
        healthy = []
        version = 0
        for _ in range(args.pushes):
            version += 1
            start = time.monotonic()
            await pushes.push(perturbed(base, version), version)
            healthy.append(time.monotonic() - start)

        victim = router.engine_names[-1]
        actor, cores = engine_processes(router, victim)
        for pid in cores:
            os.kill(pid, signal.SIGSTOP)
        version += 1
        push = asyncio.ensure_future(pushes.push(perturbed(base, version), version))
        await asyncio.sleep(2.0)
        killed = time.monotonic()
        for pid in [*cores, actor]:
            os.kill(pid, signal.SIGKILL)
        try:
            result = await push
            ended = f"ok: {len(result.engines)} engines serve v{version}"
        except Exception as exc:
            ended = f"{type(exc).__name__}: {str(exc)[:70]}"
        returned_s = time.monotonic() - killed
        version += 1
        start = time.monotonic()
        try:
            result = await pushes.push(perturbed(base, version), version)
            after = f"ok ({len(result.engines)} engines, {time.monotonic() - start:.3f}s)"
        except Exception as exc:
            after = f"{type(exc).__name__}: {str(exc)[:70]}"
        ray.shutdown()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    api = "old API (driver plans)" if pushes.old_api else "new API (rank 0 plans)"
    print(f"machine: {platform.node()} | {platform.machine()} | {os.cpu_count()} cores | "
          f"python {platform.python_version()} | {api} | engines run {engine_code}")
    print(f"command: python tests/bench/bench_weight_group_faults.py --hidden {args.hidden} "
          f"--layers {args.layers} --engines {args.engines} --pushes {args.pushes} "
          f"--timeout {args.timeout} --bucket-mb {args.bucket_mb}")
    print(f"model: {size_mb:.1f} MB fp32; {args.engines} engines; gloo broadcast, "
          f"{args.bucket_mb} MB buckets; sync.timeout_s={args.timeout}\n")
    print("| healthy push s (median) | push returns after the kill s | that push | next push |")
    print("|---:|---:|---|---|")
    print(f"| {statistics.median(healthy):.3f} | {returned_s:.2f} | {ended} | {after} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--bucket-mb", type=int, default=8)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
