"""Bench: the gateway's overhead per request with N concurrent sessions (black-box
harnesses speaking HTTP), side by side with agent loops calling the router directly.

Stand-in engine (no model): each generate call sleeps `--engine-ms` and returns a fixed
short reply of the tiny model's tokenizer plus its stop token; the time it spends is
recorded per request. Overhead per request = the caller's wall time - the engine's time:
  gateway: an httpx client per session POSTs OpenAI chat completions to the gateway
           (uvicorn + FastAPI on the same event loop; render, suffix match, recording,
           hermes parse, JSON), each turn extending the last (the exact path);
  direct:  the router is called with ids the caller already holds (what ToolAgentLoop
           pays besides the builder, which is measured under gateway).
Both run in one process on one event loop, so "gateway" also carries the client's own
JSON work. Memory per session: tracemalloc's growth over N sessions each holding the
given number of turns on the gateway's core (no HTTP), / N.

    python tests/bench/bench_gateway.py [--sessions 100 500 1000] [--turns 3] [--engine-ms 20]
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
from rollout.gateway import Gateway, GatewayServer, GatewaySettings
from rollout.gateway_protocol import parse_openai_request
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


async def run_gateway(tokenizer, chat, n: int, turns: int, engine_s: float) -> list[float]:
    import httpx

    gateway, engine = build(tokenizer, chat, engine_s)
    server = GatewayServer(gateway)
    await server.start()
    overheads: list[float] = []
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        async def one(i: int) -> None:
            session = gateway.open_session("bench", "g", i)
            url = server.session_url(session) + "/v1/chat/completions"
            headers = {"authorization": f"Bearer {session.token}"}
            messages = head(i)
            for turn in range(turns):
                start = time.perf_counter()
                r = await client.post(url, json={"model": "policy", "messages": messages, "max_tokens": 32},
                                      headers=headers)
                wall = time.perf_counter() - start
                r.raise_for_status()
                overheads.append(wall - engine.spent[f"{session.router_session}#{turn + 1}"])
                messages = messages + [r.json()["choices"][0]["message"], {"role": "user", "content": "Go on."}]
            gateway.close_session(session.id, TerminationReason.FINISHED)

        await asyncio.gather(*(one(i) for i in range(n)))
    assert gateway.stats().num_prefix_breaks == 0, gateway.stats()
    await server.stop()
    return overheads


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
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from trainer.tiny_model import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    chat = build_continuity_builder(tokenizer, "tiny", reasoning_parser="none")
    engine_s = args.engine_ms / 1000
    print(f"machine: {platform.node()} | {platform.machine()} | python {platform.python_version()} | "
          f"{__import__('os').cpu_count()} cpus")
    print("command: python " + " ".join(sys.argv))
    print(f"stand-in engine {args.engine_ms:g} ms per generation; {args.turns} turns per session\n")
    print(f"{'sessions':>8} | {'gateway p50 ms':>14} | {'gateway p99 ms':>14} | {'direct p50 ms':>13} | "
          f"{'direct p99 ms':>13} | {'wall s':>6} | {'KiB/session':>11}")
    for n in args.sessions:
        start = time.perf_counter()
        via_gateway = asyncio.run(run_gateway(tokenizer, chat, n, args.turns, engine_s))
        wall = time.perf_counter() - start
        direct = asyncio.run(run_direct(tokenizer, chat, n, args.turns, engine_s))
        memory = asyncio.run(memory_per_session(tokenizer, chat, n, args.turns))
        print(f"{n:>8} | {ms(via_gateway, 50):>14.2f} | {ms(via_gateway, 99):>14.2f} | {ms(direct, 50):>13.3f} | "
              f"{ms(direct, 99):>13.3f} | {wall:>6.1f} | {memory / 1024:>11.1f}")


if __name__ == "__main__":
    main()
