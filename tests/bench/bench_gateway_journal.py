"""Bench: what the session journal (rollout.gateway.journal) costs a gateway process per
generation call, and what rebuilding a session from it costs the worker.

  records:  the three records one call appends on the exact path (the new messages'
            observation ids, the dispatch, the completion with the engine's ids, logprobs
            and versions), each one open + write + close of the session's file, for
            replies of several lengths; the median of `--repeats` rounds of `--calls` calls;
  gateway:  the gateway core (no HTTP) on the tiny model's tokenizer and template, a
            stand-in engine answering at once: CPU time (all threads: rendering runs on
            the gateway's) per request of `--sessions` sessions of `--turns` turns, with the
            journal and without (the in-process gateway's path), alternated `--repeats`
            times, the best of each: the difference is the journal's share of a real
            request's work (render of the new messages, suffix match, recording, parse);
  rebuild:  read + replay of one such session's journal (what the worker does per session
            when a process died).

    python tests/bench/bench_gateway_journal.py [--calls 2000] [--repeats 5] [--turns 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import numpy as np

from envs.types import TerminationReason, Turn
from rollout.chat import build_continuity_builder
from rollout.engine import TokenOutput
from rollout.gate import TurnGate
from rollout.gateway.journal import SessionJournal, journal_path, read_journal, rebuild_session
from rollout.gateway.protocol import parse_openai_request
from rollout.gateway.server import Gateway, GatewaySettings
from rollout.recorder import Budgets
from rollout.router import Router

BUDGETS = Budgets(32768, 16384, 2048)


def output(n: int) -> TokenOutput:
    return TokenOutput(np.arange(n, dtype=np.int32), np.full(n, -0.1, np.float32), np.full(n, 3, np.int32),
                       "stop", 4000, 3000)


def bench_records(folder: str, calls: int, repeats: int, generated: int, observed: int = 64) -> float:
    """Median µs per call: observation + dispatch + completion records."""
    out, obs, turn = output(generated), np.arange(observed, dtype=np.int32), Turn(0, 4000, 0, generated, 0, "stop", 3)
    rounds = []
    for r in range(repeats):
        journal = SessionJournal(journal_path(folder, f"records-{generated}-{r}"))
        journal.opened("task", "g", 0)
        journal.segment_started(np.arange(4000, dtype=np.int32))
        start = time.perf_counter()
        for call in range(calls):
            journal.observation_added(obs, 1, 0.5)
            journal.dispatched(call, 4000)
            journal.completed(call, out, turn)
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        journal.close()
    return statistics.median(rounds)


class StandInEngine:
    """Answers at once with a fixed reply and its stop token."""

    def __init__(self, reply_ids: list[int]) -> None:
        self.reply = np.array(reply_ids, np.int32)

    async def generate(self, request_id, prompt_ids, sampling):
        n = len(self.reply)
        return TokenOutput(self.reply, np.full(n, -0.1, np.float32), np.zeros(n, np.int32), "stop",
                           len(prompt_ids), 0)


async def session_cpu(tokenizer, chat, folder: str | None, turns: int, sessions: int) -> tuple[float, Gateway, str]:
    """CPU µs per request over `sessions` sessions of `turns` turns, the gateway, and the
    last session's id (its journal is kept open for the rebuild bench)."""
    engine = StandInEngine(tokenizer.encode("Sure, here is a short answer.", add_special_tokens=False)
                           + [chat.end_of_turn_id])
    gateway = Gateway(Router({"e0": engine}), TurnGate(), chat, tokenizer, GatewaySettings("policy", BUDGETS),
                      journal_dir=folder)
    spent, session_id = 0.0, ""
    for i in range(sessions):
        session = gateway.open_session("task", "g", i)
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
        for turn in range(turns):
            request = parse_openai_request({"messages": messages})
            start = time.process_time()
            reply = await gateway.complete(session, request)
            spent += time.process_time() - start
            messages = messages + [{"role": "assistant", "content": reply.content},
                                   {"role": "user", "content": f"Go on ({turn})."}]
        session_id = session.id
        if i < sessions - 1:
            gateway.close_session(session.id, TerminationReason.FINISHED)
    return spent / (turns * sessions) * 1e6, gateway, session_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--sessions", type=int, default=10)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from trainer.run.tiny_model import ensure_tiny_model

    with tempfile.TemporaryDirectory(prefix="sluice-journal-bench-") as folder:
        print(f"journal folder: {folder} (load average {os.getloadavg()[0]:.1f})")
        for generated in (24, 256, 2048):
            print(f"records  reply {generated:>5} tokens, 64 observation tokens: "
                  f"{bench_records(folder, args.calls, args.repeats, generated):7.1f} µs per call (3 records)")
        tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
        chat = build_continuity_builder(tokenizer, "tiny", reasoning_parser="none")
        cpu: dict[str, list[float]] = {}
        for label, where in (("without", None), ("with", folder)) * args.repeats:
            spent, gateway, session_id = asyncio.run(session_cpu(tokenizer, chat, where, args.turns, args.sessions))
            cpu.setdefault(label, []).append(spent)
            if where is not None:
                path = journal_path(folder, session_id)
                size = os.path.getsize(path)
                start = time.perf_counter()
                rebuilt = rebuild_session(read_journal(path), BUDGETS, TerminationReason.ERROR, "", "lost")
                rebuild_ms = (time.perf_counter() - start) * 1e3
            gateway.close()
        without, with_ = min(cpu["without"]), min(cpu["with"])
        print(f"gateway  {args.turns}-turn sessions, CPU per request: {without:7.1f} µs without the journal, "
              f"{with_:7.1f} µs with it ({with_ - without:+.1f} µs; best of {args.repeats} each)")
        print(f"rebuild  one {args.turns}-turn session ({size} bytes, {len(rebuilt.segments[0].turns)} turns): "
              f"{rebuild_ms:.2f} ms")


if __name__ == "__main__":
    main()
