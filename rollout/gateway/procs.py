"""Several gateway processes behind the worker's one sticky router: the HTTP, JSON,
rendering, tokenizing and parsing of black-box harness requests spread over processes,
while every generation still passes this worker's turn gate and router (prefix-cache
stickiness, weight pushes at turn boundaries).

    harness --HTTP--> gateway process k (uvicorn + Gateway: sessions, segments)
                            | generate_turn(session, ids, sampling)   (Unix socket, pickle frames)
                            v
    agent-loop worker: TurnGate -> Router -> engines      open/close sessions, stats

A session lives in one process (its URL names that process's port), chosen as the one
with the fewest open sessions; its segments come back when the worker closes it. Each
process rebuilds the tokenizer and continuity builder from `ChatSpec` (the builder holds
vLLM parsers, which do not pickle). Processes are spawned (no fork of an event loop with
engines) and exit when the worker's connection closes.

Fail-closed: each process journals its sessions into a folder of this worker
(rollout.gateway.journal). When a process's connection closes while the worker runs, the
process is lost: it is killed if it still runs, its sessions' harnesses are stopped
(`session_lost`), closing one of its sessions rebuilds the segments from the session's
journal (a generation in flight at the death fails the sample: `error`), and the next
session to open first starts a replacement process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import struct
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from envs.types import TerminationReason, Trajectory, TrajectoryImage
from rollout.engine import Sampling
from rollout.gate import GeneratedTurn, LocalTurns, TurnGate
from rollout.gateway.journal import JournalError, journal_path, read_journal, rebuild_session, remove_journal
from rollout.gateway.server import Gateway, GatewaySettings, GatewayServer, GatewayStats, sum_gateway_stats
from rollout.router import Router

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")


@dataclass(frozen=True, slots=True)
class ChatSpec:
    """What rebuilds the worker's tokenizer and continuity builder in another process."""

    model_path: str
    family: str
    keep_thinking: bool
    template_kwargs: Mapping[str, Any]
    tool_parser: str
    reasoning_parser: str

    @classmethod
    def of(cls, chat: Any) -> "ChatSpec":
        """The spec of a built TemplateContinuity (rollout.chat)."""
        return cls(chat.tokenizer.name_or_path, chat.family.name, chat.keep_thinking, dict(chat.template_kwargs),
                   chat.tool_parser_name or "none", chat.reasoning_parser_name or "none")

    def build(self) -> tuple[Any, Any]:
        from rollout.chat import build_continuity_builder, load_tokenizer
        from rollout.vision import load_image_expander

        tokenizer = load_tokenizer(self.model_path)
        chat = build_continuity_builder(tokenizer, self.family, self.keep_thinking, self.template_kwargs,
                                        tool_parser=self.tool_parser, reasoning_parser=self.reasoning_parser,
                                        images=load_image_expander(self.model_path))
        return tokenizer, chat


class RpcPeer:
    """Both ends of one connection call each other: frames are (kind, id, method, args)
    pickles; each request is served in its own task, so calls overlap."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 handlers: Mapping[str, Callable[..., Awaitable[Any]]]) -> None:
        self.reader, self.writer, self.handlers = reader, writer, dict(handlers)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self.closed = False

    async def call(self, method: str, *args: Any) -> Any:
        if self.closed:
            raise ConnectionError(f"the gateway connection is closed ({method} not sent)")
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        self._send(("call", call_id, method, args))
        return await future

    def _send(self, frame: tuple) -> None:
        data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(_HEADER.pack(len(data)) + data)

    async def serve(self) -> None:
        """Read frames until the other end closes; then every pending call fails."""
        try:
            while True:
                (size,) = _HEADER.unpack(await self.reader.readexactly(_HEADER.size))
                kind, call_id, method, payload = pickle.loads(await self.reader.readexactly(size))
                if kind == "call":
                    task = asyncio.create_task(self._answer(call_id, method, payload))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif (future := self._pending.pop(call_id, None)) is not None and not future.done():
                    if kind == "error":
                        future.set_exception(RuntimeError(payload))
                    else:
                        future.set_result(payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed = True
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("the gateway connection closed"))
            self._pending.clear()
            for task in self._tasks:  # nobody will read their answers (a lost process's generations)
                task.cancel()

    async def _answer(self, call_id: int, method: str, args: tuple) -> None:
        try:
            result = await self.handlers[method](*args)
        except Exception as exc:  # the caller gets it as its call's error
            self._send(("error", call_id, method, f"{type(exc).__name__}: {exc}"))
        else:
            self._send(("result", call_id, method, result))

    def close(self) -> None:
        self.writer.close()


class RemoteTurns:
    """A gateway process's TurnService: each turn is a call into the worker."""

    def __init__(self, peer: RpcPeer) -> None:
        self.peer = peer

    async def generate_turn(self, router_session: str, request_id: str, prompt_ids: Sequence[int] | np.ndarray,
                            sampling: Sampling, images: tuple[TrajectoryImage, ...] = ()) -> GeneratedTurn:
        # An array pickles as one buffer; a list of numpy scalars would pickle each id.
        ids = prompt_ids if isinstance(prompt_ids, np.ndarray) else list(prompt_ids)
        return await self.peer.call("generate_turn", router_session, request_id, ids, sampling, images)


@dataclass(frozen=True, slots=True)
class SessionHandle:
    """A session in a gateway process: what the harness gets and what closes it."""

    process: int
    id: str
    token: str
    url: str  # the per-session base URL (OpenAI clients add /v1)


class _Process:
    def __init__(self, index: int, proc: Any) -> None:
        self.index, self.proc = index, proc
        self.peer: RpcPeer | None = None
        self.url = ""
        self.open_sessions = 0
        self.stats = GatewayStats(0, 0, 0, 0, 0, 0, 0)  # as of its last closed session
        self.ready = asyncio.get_running_loop().create_future()
        self.lost = asyncio.Event()  # its connection closed: never chosen again
        self._reaped: asyncio.Task | None = None

    def cause(self) -> str:
        code = self.proc.exitcode
        return (f"gateway process {self.index} died (exit code {code})" if code is not None
                else f"gateway process {self.index} closed its connection to the worker")

    def reap(self) -> asyncio.Task:
        """Kill it if it still runs, and join it, once: its sessions' journals are read only
        when nothing can append to them any more."""
        if self._reaped is None:
            self._reaped = asyncio.ensure_future(self._kill_and_join())
        return self._reaped

    async def _kill_and_join(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        await asyncio.to_thread(self.proc.join, 30)


class GatewayProcesses:
    """`num_processes` gateway processes on this host, their turns served by `router`
    and `gate` of this (the worker's) event loop."""

    def __init__(self, router: Router, gate: TurnGate, chat: Any, settings: GatewaySettings,
                 num_processes: int, host: str = "127.0.0.1", start_timeout_s: float = 300.0) -> None:
        if num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        self.turns = LocalTurns(router, gate)
        self.spec, self.settings = ChatSpec.of(chat), settings
        self.num_processes, self.host, self.start_timeout_s = num_processes, host, start_timeout_s
        self._procs: list[_Process] = []  # every process started, lost ones too (index = position)
        self._server: asyncio.AbstractServer | None = None
        self._dir = tempfile.mkdtemp(prefix="sluice-gw-")
        self._socket = os.path.join(self._dir, "worker.sock")
        self.journal_dir = os.path.join(self._dir, "journals")  # one file per open session
        os.mkdir(self.journal_dir)
        self._replacing = asyncio.Lock()
        self._stopping = False
        self._num_recovered = self._num_masked = 0

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accept, path=self._socket)
        try:
            await self._spawn(self.num_processes)
        except BaseException:  # timeout or cancellation included: the processes are stopped, then re-raised
            await self.stop()
            raise
        log.info("%d gateway processes: %s", self.num_processes, ", ".join(p.url for p in self._procs))

    async def _spawn(self, count: int) -> None:
        """Start `count` more processes and wait until each has said hello; ones that do
        not in time are killed (and count as lost)."""
        ctx = multiprocessing.get_context("spawn")  # no fork of a loop holding engines
        new = []
        for _ in range(count):
            index = len(self._procs)
            proc = ctx.Process(target=_process_main,
                               args=(self._socket, index, self.spec, self.settings, self.host, self.journal_dir),
                               daemon=True, name=f"sluice-gateway-{index}")
            proc.start()
            new.append(_Process(index, proc))
            self._procs.append(new[-1])
        try:
            await asyncio.wait_for(asyncio.gather(*(p.ready for p in new)), self.start_timeout_s)
        except BaseException:  # timeout or cancellation included: these are killed, then re-raised
            for p in new:
                p.lost.set()
                await asyncio.shield(p.reap())
            raise

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        procs = self._procs
        said_hello: list[_Process] = []

        async def hello(index: int, url: str) -> None:
            procs[index].url = url
            procs[index].peer = peer
            said_hello.append(procs[index])
            if not procs[index].ready.done():
                procs[index].ready.set_result(None)

        peer = RpcPeer(reader, writer, {"generate_turn": self.turns.generate_turn, "hello": hello})
        await peer.serve()
        for proc in said_hello:
            if not self._stopping and not proc.lost.is_set():
                self._lose(proc)

    def _lose(self, proc: _Process) -> None:
        """`proc`'s connection closed while the worker runs: it died (or is killed now)."""
        proc.lost.set()
        proc.reap()
        log.warning("gateway process %d lost (its connection closed) with %d sessions open; they end as "
                    "their harnesses are stopped, their segments rebuilt from their journals",
                    proc.index, proc.open_sessions)

    async def _replace_lost(self) -> None:
        """A new process for each one lost, before the next session opens."""
        async with self._replacing:
            missing = self.num_processes - sum(not p.lost.is_set() for p in self._procs)
            if missing > 0:
                await self._spawn(missing)
                log.info("started %d gateway processes in place of lost ones", missing)

    def _peer(self, proc: _Process) -> RpcPeer:
        if proc.peer is None:
            raise RuntimeError(f"gateway process {proc.index} is not connected")
        return proc.peer

    async def open_session(self, task_id: str, group_id: str, index: int) -> SessionHandle:
        await self._replace_lost()
        proc = min((p for p in self._procs if not p.lost.is_set()), key=lambda p: (p.open_sessions, p.index))
        proc.open_sessions += 1
        try:
            session_id, token = await self._peer(proc).call("open_session", task_id, group_id, index)
        except BaseException:  # cancellation included: the count is given back, then re-raised
            proc.open_sessions -= 1
            raise
        return SessionHandle(proc.index, session_id, token, f"{proc.url}/sessions/{session_id}")

    async def close_session(self, handle: SessionHandle, reason: TerminationReason,
                            detail: str = "") -> list[Trajectory]:
        """The session's segments, ending with `reason`: from its process, or rebuilt from
        its journal if the process was lost (then counted in the journal's stats)."""
        proc = self._procs[handle.process]
        try:
            if not proc.lost.is_set():
                try:
                    segments, proc.stats = await self._peer(proc).call("close_session", handle.id, reason, detail)
                    return segments
                except ConnectionError:  # it died before answering: its journal has the session
                    pass
            return await self._recover(proc, handle, reason, detail)
        finally:
            proc.open_sessions -= 1

    async def _recover(self, proc: _Process, handle: SessionHandle, reason: TerminationReason,
                       detail: str) -> list[Trajectory]:
        await asyncio.shield(proc.reap())  # the writer is gone: the journal is final
        path = journal_path(self.journal_dir, handle.id)
        try:
            recovered = rebuild_session(read_journal(path), self.settings.budgets, reason, detail, proc.cause())
        except JournalError as exc:  # nothing trustworthy to train: the sample fails (no segments)
            log.error("%s with session %s open; its journal cannot be rebuilt: %s", proc.cause(), handle.id, exc)
            self._num_masked += 1
            return []
        finally:
            remove_journal(path)
        self._num_recovered += len(recovered.segments)
        self._num_masked += recovered.masked
        log.warning("%s with session %s open: %d segments rebuilt from its journal%s%s", proc.cause(), handle.id,
                    len(recovered.segments), "; a generation was in flight: the sample fails (error)"
                    if recovered.masked else "", " (its torn last record ignored)" if recovered.torn else "")
        return list(recovered.segments)

    async def session_lost(self, handle: SessionHandle) -> str:
        """Returns, saying what happened, once the session's process is lost (and reaped:
        its exit code is known)."""
        proc = self._procs[handle.process]
        await proc.lost.wait()
        await asyncio.shield(proc.reap())
        return proc.cause()

    def stats(self) -> GatewayStats:
        """Totals of every process, as of each one's last closed session (no round trip),
        lost processes included, and of the sessions rebuilt from journals."""
        total = sum_gateway_stats([p.stats for p in self._procs])
        return replace(total, num_open_sessions=sum(p.open_sessions for p in self._procs),
                       num_journal_recovered=self._num_recovered, num_journal_masked=self._num_masked)

    async def stop(self) -> None:
        self._stopping = True
        for p in self._procs:
            if p.peer is not None:
                p.peer.close()
        for p in self._procs:
            if p.lost.is_set():  # already being reaped: joined once, by that task
                await asyncio.shield(p.reap())
                continue
            await asyncio.to_thread(p.proc.join, 10)
            if p.proc.is_alive():
                p.proc.kill()
        self._procs = []
        if self._server is not None:
            self._server.close()
            self._server = None
        import shutil

        shutil.rmtree(self._dir, ignore_errors=True)


def _process_main(path: str, index: int, spec: ChatSpec, settings: GatewaySettings, host: str,
                  journal_dir: str) -> None:
    asyncio.run(_serve_process(path, index, spec, settings, host, journal_dir))


async def _serve_process(path: str, index: int, spec: ChatSpec, settings: GatewaySettings, host: str,
                         journal_dir: str) -> None:
    """One gateway process: a Gateway over RemoteTurns behind uvicorn, journaling its
    sessions into `journal_dir`, until the worker's connection closes."""
    tokenizer, chat = spec.build()
    reader, writer = await asyncio.open_unix_connection(path)
    holder: dict[str, Gateway] = {}

    async def open_session(task_id: str, group_id: str, sample: int) -> tuple[str, str]:
        session = holder["gw"].open_session(task_id, group_id, sample)
        return session.id, session.token

    async def close_session(session_id: str, reason: TerminationReason, detail: str) -> tuple:
        gateway = holder["gw"]
        return gateway.close_session(session_id, reason, detail), gateway.stats()

    async def stats() -> GatewayStats:
        return holder["gw"].stats()

    peer = RpcPeer(reader, writer, {"open_session": open_session, "close_session": close_session, "stats": stats})
    gateway = holder["gw"] = Gateway(None, None, chat, tokenizer, settings, turns=RemoteTurns(peer),
                                     journal_dir=journal_dir)
    server = GatewayServer(gateway, host=host)
    serving = asyncio.create_task(peer.serve())
    await server.start()
    await peer.call("hello", index, server.url)
    await serving  # the worker closed the connection: stop
    await server.stop()
