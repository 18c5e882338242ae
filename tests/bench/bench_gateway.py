"""Bench: the gateway's overhead per request with N concurrent sessions (black-box
harnesses speaking HTTP), side by side with agent loops calling the router directly, for
one gateway on the worker's event loop and for K gateway processes behind the same
router (rollout.gateway.procs).

Stand-in engine (no model): each generate call sleeps `--engine-ms` and returns a fixed
short reply of the tiny model's tokenizer plus its stop token; the time it spends is
recorded per request. Overhead per request = the caller's wall time - the engine's time:
  gateway: httpx clients POST OpenAI chat completions to the session's URL, each turn
           extending the last (the exact path: render, suffix match, recording, hermes
           parse, JSON). The clients run in `--client-procs` processes of their own, so
           the harnesses' JSON work is not charged to the gateway; the router, turn gate
           and stand-in engine run on the bench's (the worker's) event loop; the gateway
           runs there too (K=0) or in K processes;
  direct:  the router is called with ids the caller already holds (what ToolAgentLoop
           pays besides the builder, which is measured under gateway).
CPU ms/request: CPU time of the gateway side (the bench's process and every gateway
process) while the clients ran, / requests: what spreads over K cores with K processes;
worker CPU ms/req: of that, the bench's (the worker's) process alone; client CPU ms/req:
the same for the harness stand-ins (httpx), which share the machine.
Memory per session: tracemalloc's growth over N sessions each holding the given number
of turns on the gateway's core (no HTTP), / N; plus the resident memory of each gateway
process (its fixed cost: tokenizer, template, vLLM's parsers).

    python tests/bench/bench_gateway.py [--sessions 100 500 1000] [--turns 3] [--engine-ms 20]
                                        [--gateway-procs 0 2 4] [--client-procs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time
import tracemalloc

import numpy as np

from envs.types import TerminationReason
from rollout.chat import build_continuity_builder
from rollout.engine import Sampling, TokenOutput
from rollout.gate import TurnGate
from rollout.gateway.server import Gateway, GatewayServer, GatewaySettings
from rollout.gateway.protocol import parse_openai_request
from rollout.recorder import Budgets
from rollout.router import Router

REPLY = "Sure, here is a short answer to that."


class StandInEngine:
    """Sleeps a fixed time per generation; keeps the time each request spent inside it."""

    def __init__(self, reply_ids: list[int], engine_s: float) -> None:
        self.reply = np.array(reply_ids, np.int32)
        self.engine_s = engine_s
        self.spent: dict[str, float] = {}

    async def generate(self, request_id, prompt_ids, sampling):
        start = time.perf_counter()
        await asyncio.sleep(self.engine_s)
        n = len(self.reply)
        out = TokenOutput(self.reply, np.full(n, -0.1, np.float32), np.zeros(n, np.int32), "stop",
                          len(prompt_ids), 0)
        self.spent[request_id.rsplit(".", 1)[0]] = time.perf_counter() - start
        return out


def build(tokenizer, chat, engine_s: float) -> tuple[Gateway, StandInEngine]:
    engine = StandInEngine(tokenizer.encode(REPLY, add_special_tokens=False) + [chat.end_of_turn_id], engine_s)
    gateway = Gateway(Router({"e0": engine}), TurnGate(), chat, tokenizer,
                      GatewaySettings("policy", Budgets(8192, 4096, 64)))
    return gateway, engine


def head(i: int) -> list[dict]:
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}]


def client_main(targets: list[tuple[int, str, str]], turns: int) -> tuple[list[tuple[int, int, float]], float]:
    """One client process: every (sample, url, token) session runs `turns` turns at once;
    (sample, turn, wall s) per request, and the CPU seconds the clients spent."""
    start = time.process_time()
    walls = asyncio.run(_clients(targets, turns))
    return walls, time.process_time() - start


async def _clients(targets: list[tuple[int, str, str]], turns: int) -> list[tuple[int, int, float]]:
    import httpx

    walls: list[tuple[int, int, float]] = []
    limits = httpx.Limits(max_connections=len(targets) + 8, max_keepalive_connections=len(targets) + 8)
    async with httpx.AsyncClient(limits=limits, timeout=900) as client:
        async def one(i: int, url: str, token: str) -> None:
            messages = head(i)
            for turn in range(turns):
                start = time.perf_counter()
                r = await client.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {token}"},
                                      json={"model": "policy", "messages": messages, "max_tokens": 32})
                walls.append((i, turn, time.perf_counter() - start))
                r.raise_for_status()
                messages = messages + [r.json()["choices"][0]["message"], {"role": "user", "content": "Go on."}]

        await asyncio.gather(*(one(*t) for t in targets))
    return walls


async def run_gateway(tokenizer, chat, n: int, turns: int, engine_s: float, num_procs: int,
                      num_clients: int) -> tuple[list[float], list[float], float, float, float]:
    """Overheads (s) per request, the resident MiB of each gateway process, and the CPU
    seconds per request of the gateway side (the bench's process: router, gate, stand-in
    engine, and the gateway when in-process; plus every gateway process), the client
    processes' CPU seconds per request, and the bench (worker) process's alone."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    from rollout.gateway.procs import GatewayProcesses

    gateway, engine = build(tokenizer, chat, engine_s)
    if num_procs:
        host = GatewayProcesses(gateway.router, gateway.gate, chat, gateway.settings, num_procs)
        await host.start()
        handles = [await host.open_session("bench", "g", i) for i in range(n)]
        targets = [(i, h.url, h.token) for i, h in enumerate(handles)]
    else:
        server = GatewayServer(gateway)
        await server.start()
        sessions = [gateway.open_session("bench", "g", i) for i in range(n)]
        targets = [(i, server.session_url(s), s.token) for i, s in enumerate(sessions)]
    loop = asyncio.get_running_loop()
    gateway_pids = [p.proc.pid for p in host._procs] if num_procs else []
    with ProcessPoolExecutor(num_clients, mp_context=multiprocessing.get_context("spawn")) as pool:
        await asyncio.gather(*(loop.run_in_executor(pool, client_main, [], 1) for _ in range(num_clients)))  # warm
        chunks = [targets[k::num_clients] for k in range(num_clients)]
        worker_start, procs_start = time.process_time(), sum(_cpu_s(pid) for pid in gateway_pids)
        results = await asyncio.gather(*(loop.run_in_executor(pool, client_main, c, turns) for c in chunks))
        worker_cpu_s = time.process_time() - worker_start
        cpu_s = worker_cpu_s + sum(_cpu_s(pid) for pid in gateway_pids) - procs_start
    overheads = [wall - engine.spent[f"g/{i}#{turn + 1}"] for walls, _ in results for i, turn, wall in walls]
    client_cpu_s = sum(c for _, c in results)
    rss: list[float] = []
    if num_procs:
        rss = [_rss_mib(pid) for pid in gateway_pids]
        for h in handles:
            await host.close_session(h, TerminationReason.FINISHED)
        assert host.stats().num_prefix_breaks == 0, host.stats()
        await host.stop()
    else:
        for s in sessions:
            gateway.close_session(s.id, TerminationReason.FINISHED)
        assert gateway.stats().num_prefix_breaks == 0, gateway.stats()
        await server.stop()
    return overheads, rss, cpu_s / (n * turns), client_cpu_s / (n * turns), worker_cpu_s / (n * turns)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


async def run_direct(tokenizer, chat, n: int, turns: int, engine_s: float) -> list[float]:
    gateway, engine = build(tokenizer, chat, engine_s)
    router, gate = gateway.router, gateway.gate
    sampling = Sampling(max_new_tokens=32, stop_token_ids=(chat.end_of_turn_id,))
    prompt = np.array(chat.initial_prompt_ids(parse_openai_request({"messages": head(0)}).messages, None), np.int32)
    overheads: list[float] = []

    async def one(i: int) -> None:
        ids = prompt
        for turn in range(turns):
            start = time.perf_counter()
            async with gate.turn():
                routed = await router.generate(f"g/{i}", f"g/{i}#{turn + 1}", ids, sampling)
            overheads.append(time.perf_counter() - start - engine.spent[f"g/{i}#{turn + 1}"])
            ids = np.concatenate([ids, routed.output.token_ids])

    await asyncio.gather(*(one(i) for i in range(n)))
    return overheads


async def memory_per_session(tokenizer, chat, n: int, turns: int) -> float:
    gateway, _ = build(tokenizer, chat, 0.0)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    sessions = [gateway.open_session("bench", "g", i) for i in range(n)]
    for turn in range(turns):
        for i, s in enumerate(sessions):
            messages = head(i)
            for _ in range(turn):  # the history the client would send
                messages = messages + [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "Go on."}]
            await gateway.complete(s, parse_openai_request({"messages": messages}))
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert gateway.stats().num_prefix_breaks == 0
    return used / n


def ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--engine-ms", type=float, default=20.0)
    parser.add_argument("--gateway-procs", type=int, nargs="+", default=[0, 2, 4],
                        help="gateway processes behind the router (0: on the worker's event loop)")
    parser.add_argument("--client-procs", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from trainer.run.tiny_model import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    chat = build_continuity_builder(tokenizer, "tiny", reasoning_parser="none")
    engine_s = args.engine_ms / 1000
    print(f"machine: {platform.node()} | {platform.machine()} | python {platform.python_version()} | "
          f"{__import__('os').cpu_count()} cpus | load {__import__('os').getloadavg()[0]:.1f}")
    print("command: python " + " ".join(sys.argv))
    print(f"stand-in engine {args.engine_ms:g} ms per generation; {args.turns} turns per session; "
          f"{args.client_procs} client processes\n")
    print(f"{'sessions':>8} | {'gateway procs':>13} | {'gateway p50 ms':>14} | {'gateway p99 ms':>14} | "
          f"{'direct p50 ms':>13} | {'direct p99 ms':>13} | {'CPU ms/req':>10} | {'worker CPU ms/req':>17} | "
          f"{'client CPU ms/req':>17} | "
          f"{'wall s':>6} | "
          f"{'KiB/session':>11} | {'MiB/gateway proc':>16}")
    for n in args.sessions:
        direct = asyncio.run(run_direct(tokenizer, chat, n, args.turns, engine_s))
        memory = asyncio.run(memory_per_session(tokenizer, chat, n, args.turns))
        for k in args.gateway_procs:
            start = time.perf_counter()
            via_gateway, rss, cpu, client_cpu, worker_cpu = asyncio.run(run_gateway(tokenizer, chat, n, args.turns, engine_s, k,
                                                            args.client_procs))
            wall = time.perf_counter() - start
            proc_mib = f"{np.mean(rss):.0f}" if rss else "(worker)"
            print(f"{n:>8} | {k:>13} | {ms(via_gateway, 50):>14.2f} | {ms(via_gateway, 99):>14.2f} | "
                  f"{ms(direct, 50):>13.3f} | {ms(direct, 99):>13.3f} | {cpu * 1000:>10.2f} | {worker_cpu * 1000:>17.2f} | "
                  f"{client_cpu * 1000:>17.2f} | "
                  f"{wall:>6.1f} | "
                  f"{memory / 1024:>11.1f} | {proc_mib:>16}", flush=True)


if __name__ == "__main__":
    main()
