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

Bad input is refused cheaply, with the protocol's 4xx, and never stalls other sessions:
the body is capped before it is read (413, `GatewaySettings.max_body_bytes`), decoded with
a nesting-depth guard and no lone surrogates (rollout.gateway.refusals), every field
type-checked (rollout.gateway.protocol); text that cannot fit the session's remaining
token budget is refused from its length in characters before it is rendered (no token
covers more characters than the longest vocabulary entry); decoding, rendering and
tokenizing run on threads, big work on a lane of its own, so the event loop keeps
serving every other session. Every refusal is counted (`gateway/errors/<reason>`).

Each session has its own bearer token (OpenAI `Authorization: Bearer`, Anthropic
`x-api-key`); a sandboxed harness holding one cannot write into another session.
Requests of one session are served one at a time. Generations go through a TurnService:
the turn gate and the router of the agent-loop worker (LocalTurns, when the gateway runs
on the worker's event loop; RemoteTurns from a gateway process, rollout.gateway.procs), so
a weight push still lands between turns. fastapi and uvicorn are imported only when the
app is built.

With `journal_dir` (gateway processes), each session also appends every change to its
segments to a journal file there (rollout.gateway.journal): the generation call before it
is dispatched and after it completed, before the reply goes out, so the worker rebuilds
the segments if this process dies.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations
# (`request: Request`, imported inside build_app) as objects, not as strings it would
# have to resolve in this module's globals.
import asyncio
import functools
import logging
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar

import numpy as np

from envs.types import Message, TerminationReason, Trajectory, TrajectoryImage
from rollout.chat import ContinuityBuilder, encode
from rollout.engine import Sampling
from rollout.gate import GeneratedTurn, LocalTurns, TurnGate
from rollout.gateway.journal import REWRITE_DETAIL, SessionJournal, journal_path
from rollout.gateway.protocol import (TurnReply, TurnRequest, anthropic_response, anthropic_stream,
                                      extension_suffix, openai_response, openai_stream, parse_anthropic_request,
                                      parse_openai_request)
from rollout.gateway.refusals import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_JSON_DEPTH, ErrorReason, ProtocolError,
                                      load_json, too_large)
from rollout.gateway.refusals import Protocol as WireProtocol
from rollout.parsers import parse_generation
from rollout.recorder import Budgets, TrajectoryRecorder
from rollout.router import Router
from rollout.vision import for_engine

log = logging.getLogger(__name__)
T = TypeVar("T")

# Decoding, rendering and tokenizing run on these threads, not the event loop. Work on more
# than LARGE_WORK_CHARS characters (bytes of a body) goes to a lane of its own: big
# requests queue behind each other, never in front of the small ones of other sessions.
LARGE_WORK_CHARS = 1 << 20
NUM_SMALL_WORK_THREADS = 4
NUM_LARGE_WORK_THREADS = 2


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
    # Larger request bodies are refused (413) before they are read. 4 MiB holds a
    # 200k-token conversation with its tool schemas several times over.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Deeper JSON (arrays and objects, in the body or in tool-call arguments) is refused
    # (400) before it is decoded; real tool schemas nest about 10 deep.
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024 or self.max_json_depth < 8:
            raise ValueError(f"GatewaySettings: max_body_bytes must be >= 1024 and max_json_depth >= 8, got "
                             f"{self.max_body_bytes} and {self.max_json_depth}; the defaults are "
                             f"{DEFAULT_MAX_BODY_BYTES} and {DEFAULT_MAX_JSON_DEPTH}")


@dataclass(frozen=True, slots=True)
class GatewayStats:
    num_sessions: int  # opened, cumulative
    num_open_sessions: int
    num_segments: int  # cumulative, open segments included
    num_prefix_breaks: int  # requests that did not extend their session's previous one
    num_reencoded_tokens: int  # prompt tokens of segments after a session's first
    num_requests: int  # requests received (chat completions, messages, model lists), refused ones too
    num_errors: int  # requests answered with an error status: every refusal (4xx) and 500
    # ErrorReason value -> requests; sums to num_errors.
    errors_by_reason: Mapping[str, int] = field(default_factory=dict)
    # Counted by the worker (rollout.gateway.procs) when a gateway process died with sessions open:
    num_journal_recovered: int = 0  # segments rebuilt from those sessions' journals
    num_journal_masked: int = 0  # of those sessions, samples failed: a generation was in flight

    def as_metrics(self) -> dict[str, float]:
        """gateway/* keys (totals since the gateway started; docs/metrics.md); a reason's
        gateway/errors/<reason> once it has happened, the journal's keys once a gateway
        process has died with sessions open."""
        return {"gateway/sessions": float(self.num_sessions),
                "gateway/open_sessions": float(self.num_open_sessions),
                "gateway/segments": float(self.num_segments),
                "gateway/segments_per_session": self.num_segments / max(1, self.num_sessions),
                "gateway/prefix_breaks": float(self.num_prefix_breaks),
                "gateway/reencoded_tokens": float(self.num_reencoded_tokens),
                "gateway/requests": float(self.num_requests),
                "gateway/errors": float(self.num_errors),
                **{f"gateway/errors/{reason}": float(n) for reason, n in sorted(self.errors_by_reason.items()) if n},
                **({"gateway/journal_recovered": float(self.num_journal_recovered),
                    "gateway/journal_masked": float(self.num_journal_masked)}
                   if self.num_journal_recovered or self.num_journal_masked else {})}


def sum_gateway_stats(stats: Sequence[GatewayStats]) -> GatewayStats:
    """The counters of several gateways (workers, processes) added up."""
    by_reason: Counter[str] = Counter()
    for s in stats:
        by_reason.update(s.errors_by_reason)
    totals = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(GatewayStats)
              if f.name != "errors_by_reason"}
    return GatewayStats(**totals, errors_by_reason=dict(by_reason))


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
    journal: SessionJournal = field(default_factory=lambda: SessionJournal(None))  # no path: not journaled


class TurnService(Protocol):
    """Where a gateway's generations go: the turn gate and the sticky router, in this
    process (LocalTurns) or in the worker's, for a gateway process (rollout.gateway.procs)."""

    async def generate_turn(self, router_session: str, request_id: str, prompt_ids: Sequence[int] | np.ndarray,
                            sampling: Sampling, images: tuple[TrajectoryImage, ...] = ()) -> GeneratedTurn: ...


class Gateway:
    """Sessions, recording and generation; the HTTP app (`build_app`) is a thin shell.
    Generations go through `router` and `gate` of this process, or through `turns`."""

    def __init__(self, router: Router | None, gate: TurnGate | None, chat: ContinuityBuilder, tokenizer: Any,
                 settings: GatewaySettings, *, turns: TurnService | None = None,
                 journal_dir: str | None = None) -> None:
        self.router, self.gate, self.chat, self.tokenizer = router, gate, chat, tokenizer
        if turns is None:
            if router is None or gate is None:
                raise ValueError("a Gateway needs a router and a turn gate, or `turns`")
            turns = LocalTurns(router, gate)
        self.turns = turns
        self.settings = settings
        self.journal_dir = journal_dir  # None: sessions are not journaled (the in-process gateway)
        self._sessions: dict[str, GatewaySession] = {}
        self._by_token: dict[str, str] = {}
        self._num_sessions = self._num_segments = self._num_breaks = 0
        self._num_reencoded = self._num_requests = 0
        self._errors: Counter[ErrorReason] = Counter()
        # No token of this model decodes to more characters than its longest vocabulary
        # entry (byte-level BPE: one character per byte; sentencepiece: one per character),
        # so text of C characters is at least C / this many tokens, whatever the template.
        self.max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        self._small_work = ThreadPoolExecutor(NUM_SMALL_WORK_THREADS, "sluice-gateway")
        self._large_work = ThreadPoolExecutor(NUM_LARGE_WORK_THREADS, "sluice-gateway-large")

    # -- sessions ----------------------------------------------------------------------
    def open_session(self, task_id: str, group_id: str, index: int, *,
                     on_segment: Callable[[TrajectoryRecorder], None] | None = None) -> GatewaySession:
        """A new session; hand `session.id` and `session.token` to the harness.
        `on_segment` sees each new segment's recorder (the loop keeps the open one on its
        context, so a trajectory timeout salvages it)."""
        session = GatewaySession(uuid.uuid4().hex, secrets.token_urlsafe(24), task_id, group_id, index,
                                 f"{group_id}/{index}", on_segment)
        if self.journal_dir is not None:
            session.journal = SessionJournal(journal_path(self.journal_dir, session.id))
            session.journal.opened(task_id, group_id, index)
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
        session.journal.close()
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
            raise ProtocolError(404, f"session {session_id:.64} is not open")
        return session

    async def list_models(self, session_id: str | None, token: str | None) -> dict[str, Any]:
        """The OpenAI model list, for any open session's token (or `session_id`'s own)."""
        async def listed() -> dict[str, Any]:
            if session_id is not None:
                self.authorize(session_id, token)
            elif (token or "") not in self._by_token:
                raise ProtocolError(401, "missing or invalid API key")
            return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model", "created": 0,
                                                 "owned_by": "sluice"}]}
        return await self._counted(listed())

    # -- one request -------------------------------------------------------------------
    async def handle(self, protocol: WireProtocol, session_id: str, token: str | None, declared_length: str | None,
                     chunks: AsyncIterator[bytes]) -> tuple[TurnRequest, TurnReply]:
        """One HTTP request end to end: authorize, read the body (capped), decode and
        validate it on a thread, complete the turn. Counted like `complete`."""
        async def handled() -> tuple[TurnRequest, TurnReply]:
            session = self.authorize(session_id, token)
            body = await self.read_body(declared_length, chunks)
            turn = await self._offload(len(body), self._parse, protocol, body)
            return turn, await self._complete_locked(session, turn)
        return await self._counted(handled())

    async def read_body(self, declared_length: str | None, chunks: AsyncIterator[bytes]) -> bytes:
        """The body, refused (413) as soon as it is known to be over max_body_bytes: from
        its Content-Length before any byte is read, or while a chunked one arrives."""
        limit = self.settings.max_body_bytes
        if declared_length is not None and declared_length.isdigit():  # uvicorn checked the header's form
            size = int(declared_length) if len(declared_length) <= 18 else None  # None: absurdly long
            if size is None or size > limit:
                raise too_large(limit, size)
        parts, size = [], 0
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise too_large(limit, None)
            parts.append(chunk)
        return b"".join(parts)

    def _parse(self, protocol: WireProtocol, body: bytes) -> TurnRequest:
        """A body -> TurnRequest (on a worker thread: pure, no session state)."""
        depth = self.settings.max_json_depth
        parse = parse_openai_request if protocol == "openai" else parse_anthropic_request
        return parse(load_json(body, depth), depth)

    async def complete(self, session: GatewaySession, request: TurnRequest) -> TurnReply:
        """Record the request's new ids, generate one turn, parse it; counted (requests,
        errors by reason)."""
        return await self._counted(self._complete_locked(session, request))

    async def _counted(self, work: Awaitable[T]) -> T:
        """Every request counts once; every failure once, by its reason. A refusal stays the
        ProtocolError it is; anything else is the engine (or this gateway) failing, not
        the client: the protocol's 500."""
        self._num_requests += 1
        try:
            return await work
        except ProtocolError as exc:
            self._errors[exc.reason] += 1
            raise
        except Exception as exc:  # an engine failure (or a gateway bug): a counted 500, never a crash
            self._errors[ErrorReason.SERVER] += 1
            log.warning("gateway request failed: %s: %s", type(exc).__name__, exc)
            raise ProtocolError(500, f"generation failed: {type(exc).__name__}: {exc}") from exc

    async def _complete_locked(self, session: GatewaySession, request: TurnRequest) -> TurnReply:
        async with session.lock:
            return await self._complete(session, request)

    async def _complete(self, session: GatewaySession, request: TurnRequest) -> TurnReply:
        self._check_open(session)
        extra_stops = self._stop_ids_of(request.stop)  # refused before anything is recorded
        self._temperature_top_p(request)
        rec = await self._place_request(session, request)
        try:
            out = await self._generate(session, rec, request, extra_stops)
        except BaseException:  # cancellation included: reset as below, then re-raised
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
        # Journaled before the reply goes out: whatever the harness was answered, the
        # journal holds (the parse status included, so the turn is whole).
        session.journal.completed(session.num_requests, out, rec.turns[-1])
        session.previous, session.previous_tools = request.messages, request.tools
        session.reply = Message("assistant", content, tuple(calls))
        session.ended_with_stop, session.replied_at = ended, time.monotonic()
        finish = "tool_calls" if calls else "length" if out.finish_reason == "length" else "stop"
        return TurnReply(content, reasoning, tuple(calls), finish, prompt_len, len(out.token_ids),
                         self.settings.model_name)

    def _check_open(self, session: GatewaySession) -> None:
        """Between awaits the worker may close the session (its trajectory timed out)."""
        if session.id not in self._sessions:
            raise ProtocolError(404, f"session {session.id} was closed")

    @property
    def _stop_ids(self) -> tuple[int, ...]:
        return self.chat.stop_token_ids

    async def _place_request(self, session: GatewaySession, request: TurnRequest) -> TrajectoryRecorder:
        """Append the request's new messages to the open segment, or start a new one. The
        text is measured before it is rendered, and rendered on a thread."""
        rec = session.recorder
        suffix = None
        if rec is not None and session.reply is not None:
            suffix = extension_suffix(session.previous, session.reply, session.previous_tools,
                                      request.messages, request.tools)
        if rec is not None and suffix is not None:
            b = rec.budgets
            self._check_fits(suffix, min(b.max_context_tokens - len(rec.context_ids),
                                         b.max_response_tokens - rec.num_response_tokens))
            ids = await self._offload(_num_chars(suffix), self._suffix_ids, suffix, session.ended_with_stop)
            self._check_open(session)
            if ids is not None:
                if (stop := rec.fits_observation(len(ids))) is not None:
                    raise ProtocolError(400, f"the conversation no longer fits the model's budget ({stop.value})",
                                        "context_length_exceeded", reason=ErrorReason.CONTEXT)
                num_tool_calls, tool_s = sum(m.role == "tool" for m in suffix), time.monotonic() - session.replied_at
                rec.add_observation(ids, num_tool_calls, 0, tool_s)
                session.journal.observation_added(ids, num_tool_calls, tool_s)
                return rec
        self._check_fits(request.messages, self.settings.budgets.max_context_tokens)
        first = rec is None and not session.segments
        try:
            prompt = await self._offload(_num_chars(request.messages), self._render, request.messages,
                                         list(request.tools) or None, first)
        except ValueError as exc:  # the template cannot render this conversation
            raise ProtocolError(400, str(exc)) from exc
        self._check_open(session)
        if rec is not None:
            self._num_breaks += 1
            if rec.turns:  # a segment without a generation has nothing to train on
                session.segments.append(rec.finish(TerminationReason.FINISHED, REWRITE_DETAIL))
        if session.segments:
            self._num_reencoded += len(prompt)
        rec = TrajectoryRecorder(session.task_id, session.group_id, session.index, prompt,
                                 self.settings.budgets)
        session.recorder = rec
        session.journal.segment_started(rec.prompt_ids, rec.images)
        self._num_segments += 1
        if session.on_segment is not None:
            session.on_segment(rec)
        return rec

    def _check_fits(self, messages: Sequence[Message], room: int) -> None:
        """Refuse, before rendering, text that cannot fit in `room` tokens: system, user and
        tool text is rendered verbatim (assistant turns may be trimmed of reasoning, so
        they are not counted) and no token covers more than max_token_chars characters.
        Images are not counted (their runs only add tokens), so the bound stays a lower one."""
        chars = sum(len(m.text.strip()) for m in messages if m.role != "assistant")
        least = -(-chars // self.max_token_chars)
        if chars and least >= room:
            raise ProtocolError(400, f"the request cannot fit this session's budget: its system, user and tool "
                                     f"text ({chars} characters) is at least {least} tokens (no token of this "
                                     f"model is over {self.max_token_chars} characters) and {max(room, 0)} "
                                     "tokens are left", "context_length_exceeded", reason=ErrorReason.CONTEXT)

    async def _offload(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread, so the event loop keeps serving other sessions;
        work over LARGE_WORK_CHARS on the large lane."""
        pool = self._large_work if size > LARGE_WORK_CHARS else self._small_work
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    def _render(self, messages: Sequence[Message], tools: list[Mapping[str, Any]] | None, first: bool) -> list[int]:
        return (self.chat.initial_prompt_ids(messages, tools) if first
                else self.chat.reset_context(messages, tools))

    def _suffix_ids(self, suffix: Sequence[Message], ended_with_stop: bool) -> list[int] | None:
        """Ids of the new messages after the last generation; None where the builder must
        start a new segment instead (a user turn that drops earlier reasoning, or text
        after which the template's continuation cannot be derived)."""
        roles = {m.role for m in suffix}
        try:
            if roles == {"tool"}:
                return self.chat.observation_ids(suffix, ended_with_stop)
            if self.chat.starts_segment_on_user_turn:
                return None
            if roles == {"user"}:
                return self.chat.user_message_ids(suffix, ended_with_stop)
            # Tool results then a user message (an Anthropic user turn with both): the
            # template's own continuation after the assistant turn, as for either alone.
            return self.chat.continuation_ids(suffix, ended_with_stop)
        except ValueError:  # the builder cannot continue exactly here: a fresh render can
            return None

    async def _generate(self, session: GatewaySession, rec: TrajectoryRecorder, request: TurnRequest,
                        extra_stops: tuple[int, ...]) -> Any:
        room = rec.room_for_generation()
        if room <= 0:
            raise ProtocolError(400, "the conversation fills the model's context or response budget",
                                "context_length_exceeded", reason=ErrorReason.CONTEXT)
        s = self.settings
        temperature, top_p = self._temperature_top_p(request)
        sampling = Sampling(max_new_tokens=min(room, request.max_tokens or room), temperature=temperature,
                            top_p=top_p, top_k=s.top_k, stop_token_ids=self._stop_ids + extra_stops)
        started_at = time.time()
        session.num_requests += 1
        call = session.num_requests
        session.journal.dispatched(call, len(rec.context_ids))
        try:
            turn = await self.turns.generate_turn(session.router_session, f"{session.router_session}#{call}",
                                                  rec.context_ids, sampling, for_engine(rec.images))
        except BaseException:  # cancellation included: journaled as recording nothing, then re-raised
            session.journal.failed(call)
            raise
        rec.add_generation(turn.output, turn.queue_s, turn.generate_s, turn.engine, started_at)
        return turn.output

    def _temperature_top_p(self, request: TurnRequest) -> tuple[float, float]:
        """The recipe's sampling, or the request's where trust_request_sampling is on."""
        s = self.settings
        trust = s.trust_request_sampling
        temperature = request.temperature if trust and request.temperature is not None else s.temperature
        top_p = request.top_p if trust and request.top_p is not None else s.top_p
        if top_p <= 0:  # the protocols allow 0; the engine samples only with top_p in (0, 1]
            raise ProtocolError(400, "'top_p' must be above 0 for this gateway (it samples with the request's "
                                     "top_p)", param="top_p")
        return temperature, top_p

    def _stop_ids_of(self, stops: Sequence[str]) -> tuple[int, ...]:
        """Stop strings that are one token stop the engine there (the token is kept, as a
        stop token is); any other would need the sampled ids cut after the fact: refused
        (one longer than any token without encoding it)."""
        ids = []
        for text in stops:
            encoded = encode(self.tokenizer, text) if len(text) <= self.max_token_chars else ()
            if len(encoded) != 1:
                raise ProtocolError(400, f"stop sequence {text!r:.80} is not supported: only stop strings "
                                         "that are a single token of the model are", param="stop",
                                    reason=ErrorReason.UNSUPPORTED)
            ids.append(encoded[0])
        return tuple(ids)

    def stats(self) -> GatewayStats:
        return GatewayStats(self._num_sessions, len(self._sessions), self._num_segments, self._num_breaks,
                            self._num_reencoded, self._num_requests, sum(self._errors.values()),
                            {reason.value: n for reason, n in self._errors.items()})

    def close(self) -> None:
        """Stop the worker threads (work in flight finishes; nothing new starts)."""
        self._small_work.shutdown(wait=False, cancel_futures=True)
        self._large_work.shutdown(wait=False, cancel_futures=True)


def _num_chars(messages: Sequence[Message]) -> int:
    """About how much work rendering `messages` is (which lane it runs on): their text, and
    each image's encoded bytes, which the processor decodes and expands on the same thread."""
    return sum(len(m.text) + len(m.reasoning or "") + sum(len(i.data) for i in m.images) for m in messages)


def _token_of(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key")


def build_app(gateway: Gateway) -> Any:
    """The FastAPI app over `gateway` (imports fastapi)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.requests import ClientDisconnect

    app = FastAPI(title="sluice gateway", docs_url=None, redoc_url=None, openapi_url=None)

    def error(exc: ProtocolError, protocol: WireProtocol) -> JSONResponse:
        return JSONResponse(exc.body(protocol), status_code=exc.status)  # type: ignore[arg-type]

    async def body_chunks(request: Request) -> AsyncIterator[bytes]:
        try:
            async for chunk in request.stream():
                yield chunk
        except ClientDisconnect as exc:
            raise ProtocolError(400, "the client disconnected before it sent the whole body",
                                reason=ErrorReason.MALFORMED) from exc

    async def serve(request: Request, session_id: str, protocol: WireProtocol) -> Any:
        try:
            turn, reply = await gateway.handle(protocol, session_id, _token_of(request.headers),
                                               request.headers.get("content-length"), body_chunks(request))
        except ProtocolError as exc:  # every refusal and failure, counted by the gateway
            return error(exc, protocol)
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

    async def models(session_id: str | None, request: Request) -> Any:
        try:
            return await gateway.list_models(session_id, _token_of(request.headers))
        except ProtocolError as exc:
            return error(exc, "openai")

    @app.get("/v1/models")
    async def list_models(request: Request) -> Any:
        return await models(None, request)

    @app.get("/sessions/{session_id}/v1/models")
    async def list_session_models(session_id: str, request: Request) -> Any:
        return await models(session_id, request)

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
        self.gateway.close()
