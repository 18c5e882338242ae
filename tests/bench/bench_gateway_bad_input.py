"""Bench: what bad input costs the gateway, and what it costs the other sessions.

The real server (uvicorn, FastAPI), the tiny model's real tokenizer and continuity
builder, and a stand-in engine (no model: each generation sleeps `--engine-ms` and returns a
fixed short reply plus the stop token). The harnesses are httpx clients in a process of
their own, so their JSON work is not charged to the gateway's event loop.

1. Refusal: the wall time of each kind of bad request (median of `--repeats`): a lone
   surrogate, `"tools": 5`, 100k-deep JSON, invalid UTF-8, a 50 MB body (with its
   Content-Length, and chunked), a message too long for the session's budget.
2. Isolation: a victim session sends `--probes` small requests one after another while an
   attacker session sends, back to back: nothing; 50 MB bodies; 3 MB messages that fit a
   huge budget (so they are rendered and tokenized, on the large lane); 100k-deep bodies.
   The victim's p50 and max latency, and the attacker's own per-request time.

    python tests/bench/bench_gateway_bad_input.py [--engine-ms 5] [--repeats 5] [--probes 30]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import platform
import statistics
import time

import numpy as np

from rollout.chat import build_continuity_builder
from rollout.engine import TokenOutput
from rollout.gate import TurnGate
from rollout.gateway.server import Gateway, GatewayServer, GatewaySettings
from rollout.recorder import Budgets
from rollout.router import Router

MB = 2**20
SMALL = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8}


class StandInEngine:
    """Sleeps a fixed time per generation and returns a fixed reply (no model)."""

    def __init__(self, reply_ids: list[int], engine_s: float) -> None:
        self.reply, self.engine_s = np.array(reply_ids, np.int32), engine_s

    async def generate(self, request_id, prompt_ids, sampling):
        await asyncio.sleep(self.engine_s)
        n = len(self.reply)
        return TokenOutput(self.reply, np.full(n, -0.1, np.float32), np.zeros(n, np.int32), "stop",
                           len(prompt_ids), 0)


def bad_bodies() -> dict[str, bytes | None]:
    """name -> body (None: a 50 MB chunked upload, made by the client)."""
    return {"lone surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            '"tools": 5': b'{"messages": [{"role": "user", "content": "x"}], "tools": 5}',
            "100k-deep JSON": b"[" * 100_000 + b"]" * 100_000,
            "invalid UTF-8": b'{"messages": [{"role": "user", "content": "\xff"}]}',
            "50 MB body (Content-Length)": b"x" * (50 * MB),
            "50 MB body (chunked)": None,
            "1 MB message, 8k-token session": (b'{"messages": [{"role": "user", "content": "' + b"w" * MB + b'"}]}')}


async def _post(client, url: str, token: str, body: bytes | None) -> tuple[int, float]:
    async def chunked():
        for _ in range(50):
            yield b"y" * MB

    start = time.perf_counter()
    r = await client.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {token}"},
                          content=chunked() if body is None else body)
    return r.status_code, time.perf_counter() - start


async def _clients(small: tuple[str, str], victim: tuple[str, str], attacker: tuple[str, str], huge: tuple[str, str],
                   repeats: int, probes: int) -> dict:
    import json

    import httpx

    out: dict = {"refusal": {}, "isolation": {}}
    async with httpx.AsyncClient(timeout=600) as client:
        for name, body in bad_bodies().items():
            runs = [await _post(client, *small, body) for _ in range(repeats)]
            out["refusal"][name] = (runs[0][0], statistics.median(t for _, t in runs))
        small_body = json.dumps(SMALL).encode()
        backgrounds = {"nothing": None, "50 MB bodies": (attacker, b"x" * (50 * MB)),
                       "3 MB messages, tokenized": (huge, json.dumps({"messages": [
                           {"role": "user", "content": "the cat sat. " * 240_000}], "max_tokens": 4}).encode()),
                       "100k-deep bodies": (attacker, b"[" * 100_000 + b"]" * 100_000)}
        for name, background in backgrounds.items():
            stop, own = asyncio.Event(), []

            async def attack() -> None:
                while background is not None and not stop.is_set():
                    own.append(await _post(client, *background[0], background[1]))

            task = asyncio.create_task(attack())
            await asyncio.sleep(0.2 if background is not None else 0)
            lat = [(await _post(client, *victim, small_body))[1] for _ in range(probes)]
            stop.set()
            await task
            out["isolation"][name] = (statistics.median(lat), max(lat), len(own),
                                      statistics.median(t for _, t in own) if own else 0.0,
                                      sorted({s for s, _ in own}))
    return out


def client_main(*args) -> dict:
    return asyncio.run(_clients(*args))


async def main(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from trainer.run.tiny_model import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    chat = build_continuity_builder(tokenizer, "tiny", reasoning_parser="none")
    engine = StandInEngine(tokenizer.encode("Four.", add_special_tokens=False) + [chat.end_of_turn_id],
                           args.engine_ms / 1000)
    servers = []
    for budget in (8192, 10_000_000):  # an ordinary budget; one that lets 3 MB through to the tokenizer
        gateway = Gateway(Router({"e0": engine}), TurnGate(), chat, tokenizer,
                          GatewaySettings("policy", Budgets(budget, budget // 2, 8)))
        servers.append(GatewayServer(gateway))
        await servers[-1].start()
    normal, roomy = servers
    ends = [(normal.session_url(s), s.token) for s in (normal.gateway.open_session("b", "g", i) for i in range(3))]
    huge = roomy.gateway.open_session("b", "huge", 0)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        result = await asyncio.to_thread(pool.apply, client_main, (ends[0], ends[1], ends[2],
                                                                   (roomy.session_url(huge), huge.token),
                                                                   args.repeats, args.probes))
    for server in servers:
        await server.stop()
    print(f"# {platform.node()}, {multiprocessing.cpu_count()} cores; stand-in engine {args.engine_ms} ms; "
          f"max_token_chars {normal.gateway.max_token_chars}")
    print("\n| bad request | status | wall ms (median) |\n|---|---:|---:|")
    for name, (status, wall) in result["refusal"].items():
        print(f"| {name} | {status} | {wall * 1000:.1f} |")
    print("\n| attacker sends | victim p50 ms | victim max ms | attacker requests | attacker ms each | "
          "attacker statuses |\n|---|---:|---:|---:|---:|---|")
    for name, (p50, worst, n, each, statuses) in result["isolation"].items():
        print(f"| {name} | {p50 * 1000:.1f} | {worst * 1000:.1f} | {n} | {each * 1000:.0f} | {statuses} |")
    print("\ngateway errors by reason:", normal.gateway.stats().errors_by_reason, roomy.gateway.stats().errors_by_reason)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--probes", type=int, default=30)
    asyncio.run(main(parser.parse_args()))
