"""The gateway: OpenAI (`/sessions/{id}/v1/chat/completions`) and Anthropic
(`/sessions/{id}/v1/messages`) endpoints in front of the sticky router, so a black-box
harness (one that never hands over token ids) is trained with exact tokens.

    harness --HTTP--> gateway session --turn gate--> Router.generate(ids) --> engine
                         | records ids, logprobs, versions per segment
                         v
                  Trajectory per segment (GatewayAgentLoop collects them)

Each request is rendered with the model's chat template by the continuity builder. When
its messages extend the session's previous request (those messages + the reply the
gateway returned + new tool/user messages, same tools), only the new messages are
tokenized and appended after the ids already recorded, exactly as the agent loop does:
earlier turns are never re-encoded. Anything else (history dropped, compressed or edited,
a retry of the same request, other tools) ends the session's segment and starts a new one
from a fresh render; each segment is an exact trajectory. `stats()` counts sessions,
segments, prefix breaks and re-encoded tokens (the prompt tokens of segments after a
session's first: 0 on the exact path).

Each session has its own bearer token (OpenAI `Authorization: Bearer`, Anthropic
`x-api-key`); a sandboxed harness holding one cannot write into another session.
Requests of one session are served one at a time. Generations go through a TurnService:
the turn gate and the router of the agent-loop worker (LocalTurns, when the gateway runs
on the worker's event loop; RemoteTurns from a gateway process, rollout.gateway.procs), so
a weight push still lands between turns. fastapi and uvicorn are imported only when the
app is built.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations
# (`request: Request`, imported inside build_app) as objects, not as strings it would
# have to resolve in this module's globals.
import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from envs.types import Message, TerminationReason, Trajectory
from rollout.chat import ContinuityBuilder, encode
from rollout.engine import Sampling
from rollout.gate import GeneratedTurn, LocalTurns, TurnGate
from rollout.gateway.protocol import (ProtocolError, TurnReply, TurnRequest, anthropic_response,
                                      anthropic_stream, extension_suffix, openai_response, openai_stream,
                                      parse_anthropic_request, parse_openai_request)
from rollout.parsers import parse_generation
from rollout.recorder import Budgets, TrajectoryRecorder
from rollout.router import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    model_name: str  # what /v1/models lists and responses name
    budgets: Budgets
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tool_calls_per_turn: int = 8
    # The trainer assumes the recipe's sampling; a harness's own temperature/top_p would
    # make behaviour logprobs come from another distribution. Off: the recipe's values win.
    trust_request_sampling: bool = False


@dataclass(frozen=True, slots=True)
class GatewayStats:
    num_sessions: int  # opened, cumulative
    num_open_sessions: int
    num_segments: int  # cumulative, open segments included
    num_prefix_breaks: int  # requests that did not extend their session's previous one
    num_reencoded_tokens: int  # prompt tokens of segments after a session's first
    num_requests: int
    num_errors: int  # requests refused with a protocol error

    def as_metrics(self) -> dict[str, float]:
        """gateway/* keys (totals since the gateway started; docs/metrics.md)."""
        return {"gateway/sessions": float(self.num_sessions),
                "gateway/open_sessions": float(self.num_open_sessions),
                "gateway/segments": float(self.num_segments),
                "gateway/segments_per_session": self.num_segments / max(1, self.num_sessions),
                "gateway/prefix_breaks": float(self.num_prefix_breaks),
                "gateway/reencoded_tokens": float(self.num_reencoded_tokens),
                "gateway/requests": float(self.num_requests),
                "gateway/errors": float(self.num_errors)}


def sum_gateway_stats(stats: Sequence[GatewayStats]) -> GatewayStats:
    """The counters of several gateways (workers, processes) added up."""
    return GatewayStats(*(sum(getattr(s, f.name) for s in stats) for f in fields(GatewayStats)))


@dataclass(slots=True)
class GatewaySession:
    """One harness run: its token, the trajectory identity its segments carry, and what
    the next request must extend to stay in the current segment."""

    id: str  # URL-safe; the router session is `router_session`
    token: str
    task_id: str
    group_id: str
    index: int
    router_session: str
    on_segment: Callable[[TrajectoryRecorder], None] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    segments: list[Trajectory] = field(default_factory=list)  # finished segments
    recorder: TrajectoryRecorder | None = None  # the open segment
    previous: tuple[Message, ...] = ()
    previous_tools: tuple[Mapping[str, Any], ...] = ()
    reply: Message | None = None  # the assistant turn returned to the previous request
    ended_with_stop: bool = False
    replied_at: float = 0.0
    num_requests: int = 0


class TurnService(Protocol):
    """Where a gateway's generations go: the turn gate and the sticky router, in this
    process (LocalTurns) or in the worker's, for a gateway process (rollout.gateway.procs)."""

    async def generate_turn(self, router_session: str, request_id: str, prompt_ids: Sequence[int],
                            sampling: Sampling) -> GeneratedTurn: ...


class Gateway:
    """Sessions, recording and generation; the HTTP app (`build_app`) is a thin shell.
    Generations go through `router` and `gate` of this process, or through `turns`."""

    def __init__(self, router: Router | None, gate: TurnGate | None, chat: ContinuityBuilder, tokenizer: Any,
                 settings: GatewaySettings, *, turns: TurnService | None = None) -> None:
        self.router, self.gate, self.chat, self.tokenizer = router, gate, chat, tokenizer
        if turns is None:
            if router is None or gate is None:
                raise ValueError("a Gateway needs a router and a turn gate, or `turns`")
            turns = LocalTurns(router, gate)
        self.turns = turns
        self.settings = settings
        self._sessions: dict[str, GatewaySession] = {}
        self._by_token: dict[str, str] = {}
        self._num_sessions = self._num_segments = self._num_breaks = 0
        self._num_reencoded = self._num_requests = self._num_errors = 0

    # -- sessions ----------------------------------------------------------------------
    def open_session(self, task_id: str, group_id: str, index: int, *,
                     on_segment: Callable[[TrajectoryRecorder], None] | None = None) -> GatewaySession:
        """A new session; hand `session.id` and `session.token` to the harness.
        `on_segment` sees each new segment's recorder (the loop keeps the open one on its
        context, so a trajectory timeout salvages it)."""
        session = GatewaySession(uuid.uuid4().hex, secrets.token_urlsafe(24), task_id, group_id, index,
                                 f"{group_id}/{index}", on_segment)
        self._sessions[session.id] = session
        self._by_token[session.token] = session.id
        self._num_sessions += 1
        return session

    def close_session(self, session_id: str, reason: TerminationReason,
                      detail: str = "") -> list[Trajectory]:
        """End the session: its open segment ends with `reason`; all its segments, in order.
        The token stops working at once."""
        session = self._sessions.pop(session_id)
        self._by_token.pop(session.token, None)
        if session.recorder is not None and session.recorder.turns:
            session.segments.append(session.recorder.finish(reason, detail))
            session.recorder = None
        return session.segments

    def authorize(self, session_id: str, token: str | None) -> GatewaySession:
        """The session if `token` is its own; 401 without a valid token, 403 with the token
        of another session, 404 for a session that is not open."""
        owner = self._by_token.get(token or "")
        if owner is None:
            raise ProtocolError(401, "missing or invalid API key for this gateway session")
        if not secrets.compare_digest(owner, session_id):
            raise ProtocolError(403, "this API key belongs to another session")
        session = self._sessions.get(session_id)
        if session is None:
            raise ProtocolError(404, f"session {session_id} is not open")
        return session

    def known_token(self, token: str | None) -> bool:
        return (token or "") in self._by_token

    # -- one turn ------------------------------------------------------------------------
    async def complete(self, session: GatewaySession, request: TurnRequest) -> TurnReply:
        """Record the request's new ids, generate one turn, parse it; errors are counted."""
        self._num_requests += 1
        try:
            async with session.lock:
                return await self._complete(session, request)
        except ProtocolError:
            self._num_errors += 1
            raise

    async def _complete(self, session: GatewaySession, request: TurnRequest) -> TurnReply:
        if session.id not in self._sessions:
            raise ProtocolError(404, f"session {session.id} was closed")
        extra_stops = self._stop_ids_of(request.stop)  # refused before anything is recorded
        rec = self._place_request(session, request)
        try:
            out = await self._generate(session, rec, request, extra_stops)
        except BaseException:
            # The new ids are recorded but no reply went out: whatever comes next starts
            # a new segment rather than appending the same messages twice.
            session.reply = None
            raise
        prompt_len = rec.sent_prefix_lengths[-1]
        ended = len(out.token_ids) > 0 and int(out.token_ids[-1]) in self._stop_ids
        tools = list(request.tools) or None
        if request.parse_tools:
            parsed = parse_generation(self.chat, self.tokenizer, out.token_ids, tools=tools,
                                      max_calls=self.settings.max_tool_calls_per_turn,
                                      prompt_ids=rec.context_ids[:prompt_len])
            rec.record_tool_parse(parsed.status)
            content, calls, reasoning = parsed.content, parsed.calls, parsed.reasoning
        else:
            ids = out.token_ids.tolist()[:-1] if ended else out.token_ids.tolist()
            content, calls, reasoning = self.tokenizer.decode(ids, skip_special_tokens=False), (), None
        session.previous, session.previous_tools = request.messages, request.tools
        session.reply = Message("assistant", content, tuple(calls))
        session.ended_with_stop, session.replied_at = ended, time.monotonic()
        finish = "tool_calls" if calls else "length" if out.finish_reason == "length" else "stop"
        return TurnReply(content, reasoning, tuple(calls), finish, prompt_len, len(out.token_ids),
                         self.settings.model_name)

    @property
    def _stop_ids(self) -> tuple[int, ...]:
        return tuple(getattr(self.chat, "stop_token_ids", None) or (self.chat.end_of_turn_id,))

    def _place_request(self, session: GatewaySession, request: TurnRequest) -> TrajectoryRecorder:
        """Append the request's new messages to the open segment, or start a new one."""
        rec = session.recorder
        suffix = None
        if rec is not None and session.reply is not None:
            suffix = extension_suffix(session.previous, session.reply, session.previous_tools,
                                      request.messages, request.tools)
        if rec is not None and suffix is not None:
            ids = self._suffix_ids(suffix, session.ended_with_stop)
            if ids is not None:
                if (stop := rec.fits_observation(len(ids))) is not None:
                    raise ProtocolError(400, f"the conversation no longer fits the model's budget ({stop.value})",
                                        "context_length_exceeded")
                rec.add_observation(ids, sum(m.role == "tool" for m in suffix), 0,
                                    time.monotonic() - session.replied_at)
                return rec
        tools = list(request.tools) or None
        try:
            prompt = (self.chat.initial_prompt_ids(request.messages, tools) if rec is None and not session.segments
                      else self.chat.reset_context(request.messages, tools))
        except ValueError as exc:  # the template cannot render this conversation
            raise ProtocolError(400, str(exc)) from exc
        if rec is not None:
            self._num_breaks += 1
            if rec.turns:  # a segment without a generation has nothing to train on
                session.segments.append(rec.finish(TerminationReason.FINISHED, "the harness rewrote its history"))
        if session.segments:
            self._num_reencoded += len(prompt)
        rec = TrajectoryRecorder(session.task_id, session.group_id, session.index, prompt,
                                 self.settings.budgets)
        session.recorder = rec
        self._num_segments += 1
        if session.on_segment is not None:
            session.on_segment(rec)
        return rec

    def _suffix_ids(self, suffix: Sequence[Message], ended_with_stop: bool) -> list[int] | None:
        """Ids of the new messages after the last generation; None where the builder must
        start a new segment instead (a user turn that drops earlier reasoning)."""
        roles = {m.role for m in suffix}
        if roles == {"tool"}:
            return self.chat.observation_ids(suffix, ended_with_stop)
        if self.chat.starts_segment_on_user_turn:
            return None
        if roles == {"user"}:
            return self.chat.user_message_ids(suffix, ended_with_stop)
        # Tool results then a user message (an Anthropic user turn with both): the
        # template's own continuation after the assistant turn, as for either alone.
        continuation = getattr(self.chat, "_continuation", None)
        if continuation is None:
            return None
        return encode(self.tokenizer, continuation(suffix, ended_with_stop))

    async def _generate(self, session: GatewaySession, rec: TrajectoryRecorder, request: TurnRequest,
                        extra_stops: tuple[int, ...]) -> Any:
        room = rec.room_for_generation()
        if room <= 0:
            raise ProtocolError(400, "the conversation fills the model's context or response budget",
                                "context_length_exceeded")
        s = self.settings
        trust = s.trust_request_sampling
        temperature = request.temperature if trust and request.temperature is not None else s.temperature
        top_p = request.top_p if trust and request.top_p is not None else s.top_p
        sampling = Sampling(max_new_tokens=min(room, request.max_tokens or room), temperature=temperature,
                            top_p=top_p, top_k=s.top_k, stop_token_ids=self._stop_ids + extra_stops)
        started_at = time.time()
        session.num_requests += 1
        turn = await self.turns.generate_turn(session.router_session,
                                              f"{session.router_session}#{session.num_requests}",
                                              rec.context_ids, sampling)
        rec.add_generation(turn.output, turn.queue_s, turn.generate_s, turn.engine, started_at)
        return turn.output

    def _stop_ids_of(self, stops: Sequence[str]) -> tuple[int, ...]:
        """Stop strings that are one token stop the engine there (the token is kept, as a
        stop token is); any other would need the sampled ids cut after the fact: refused."""
        ids = []
        for text in stops:
            encoded = encode(self.tokenizer, text)
            if len(encoded) != 1:
                raise ProtocolError(400, f"stop sequence {text!r} is not supported: only stop strings "
                                         "that are a single token of the model are")
            ids.append(encoded[0])
        return tuple(ids)

    def stats(self) -> GatewayStats:
        return GatewayStats(self._num_sessions, len(self._sessions), self._num_segments, self._num_breaks,
                            self._num_reencoded, self._num_requests, self._num_errors)


def _token_of(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key")


def build_app(gateway: Gateway) -> Any:
    """The FastAPI app over `gateway` (imports fastapi)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="sluice gateway", docs_url=None, redoc_url=None, openapi_url=None)

    def error(exc: ProtocolError, protocol: str) -> JSONResponse:
        return JSONResponse(exc.body(protocol), status_code=exc.status)  # type: ignore[arg-type]

    async def serve(request: Request, session_id: str, protocol: str) -> Any:
        try:
            session = gateway.authorize(session_id, _token_of(request.headers))
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ProtocolError(400, f"the request body is not valid JSON: {exc}") from exc
            turn = parse_openai_request(body) if protocol == "openai" else parse_anthropic_request(body)
            reply = await gateway.complete(session, turn)
        except ProtocolError as exc:
            return error(exc, protocol)
        except Exception as exc:  # an engine failure: the harness gets the protocol's 500
            log.warning("gateway session %s: %s: %s", session_id, type(exc).__name__, exc)
            return error(ProtocolError(500, f"generation failed: {type(exc).__name__}: {exc}"), protocol)
        if turn.stream:
            events = openai_stream(reply, turn.include_usage) if protocol == "openai" else anthropic_stream(reply)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(openai_response(reply) if protocol == "openai" else anthropic_response(reply))

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, request: Request) -> Any:
        return await serve(request, session_id, "openai")

    @app.post("/sessions/{session_id}/v1/messages")
    async def messages(session_id: str, request: Request) -> Any:
        return await serve(request, session_id, "anthropic")

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": gateway.settings.model_name, "object": "model",
                                             "created": 0, "owned_by": "sluice"}]}

    @app.get("/v1/models")
    async def list_models(request: Request) -> Any:
        if not gateway.known_token(_token_of(request.headers)):
            return error(ProtocolError(401, "missing or invalid API key"), "openai")
        return models()

    @app.get("/sessions/{session_id}/v1/models")
    async def list_session_models(session_id: str, request: Request) -> Any:
        try:
            gateway.authorize(session_id, _token_of(request.headers))
        except ProtocolError as exc:
            return error(exc, "openai")
        return models()

    return app


class GatewayServer:
    """The app served by uvicorn on the current event loop (the router's and gate's)."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0) -> None:
        self.gateway, self.host, self.port = gateway, host, port
        self._server: Any = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def session_url(self, session: GatewaySession) -> str:
        """The per-session base URL: OpenAI clients add /v1/..., so hand them `+ "/v1"`."""
        return f"{self.url}/sessions/{session.id}"

    async def start(self) -> str:
        import uvicorn

        class _Server(uvicorn.Server):
            # The worker's process owns SIGINT/SIGTERM (stop and resume); uvicorn must not.
            def capture_signals(self) -> Any:
                import contextlib
                return contextlib.nullcontext()

        config = uvicorn.Config(build_app(self.gateway), host=self.host, port=self.port,
                                log_level="warning", lifespan="off", access_log=False,
                                # Harnesses keep a connection open across turns (tool runs in
                                # between can take minutes); uvicorn's 5 s default closes it
                                # under them. A deep backlog takes 1000 sessions connecting at once.
                                timeout_keep_alive=600, backlog=4096)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the bind error
                raise RuntimeError("the gateway server exited before it started")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        log.info("gateway listening on %s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None
