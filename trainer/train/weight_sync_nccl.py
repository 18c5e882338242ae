"""Broadcast weight transport: train rank 0 plans, checksums and sends every weight
bucket to all engine workers through a communicator of their own (NCCL on GPUs, gloo on
CPUs); the driver passes a version and gets a verified result.

Group layout, outside torch.distributed's default group (which DeepSpeed owns): rank 0 is
the trainer, engine i's workers are ranks 1 + i*tp .. i*tp + tp, world size
1 + num_engines * tp. Rank 0 binds the rendezvous socket itself (no port race) and sends
host and port to the engines over the Ray control calls. Each push sends the bucket plan
(names, shapes, dtypes, offsets) over those calls and the tensors through the group, one
`sync.bucket_mb` buffer at a time.

Failures. Every broadcast is bounded inside the process that runs it (rank 0 and each
engine worker: `rollout.weight_group.bounded_broadcast`); a failed or late one aborts
that process's communicator. Rank 0 then reports which engines did not take the version
and whether they are gone (dead, or no answer in time); the driver removes those from the
router and asks again, and rank 0 forms a new group (new rendezvous, smaller world) with
the engines that are left. A push succeeds once every live engine serves the version.

    driver: BroadcastTransport.push(router, version)
        -> sender.push_broadcast(version, engines)         [train rank 0: BroadcastPusher]
              plan (shapes only) -> form group if engines changed -> send || engines receive
              -> checksum check -> BroadcastOutcome (small)
        <- failures: remove gone engines, push again (at most MAX_ATTEMPTS)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rollout.router import Router, is_engine_failure
from rollout.weight_group import (AbortFlag, CommBackend, Deadline, WeightCommunicator,
                                  WeightGroupError, abort_quietly, bounded_broadcast, build_store,
                                  build_weight_communicator)
from rollout.weight_protocol import (Bucket, TensorSpec, checksum_tensors, choose_checksum_names,
                                     encode_plan, pack_bucket, plan_buckets, specs_of)
from trainer.train.weight_sync import PushResult, WeightSyncError, check_engines

if TYPE_CHECKING:
    import torch

    from rollout.router import EngineClient

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # pushes of one version before the run stops: each removes the engines gone


def open_listen_socket(host: str) -> socket.socket:
    """A listening TCP socket on `host` and a free port the kernel picks; rank 0 serves
    the rendezvous store from it. `host` must be an address engines can reach (the train
    rank's node address), not a wildcard."""
    if host in ("", "0.0.0.0", "::"):
        raise ValueError(f"rendezvous host {host!r} is a wildcard; pass the node's address")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


def engine_rank_offsets(engine_names: Sequence[str], tp_size: int) -> dict[str, int]:
    """Rank of each engine's first worker in the group (rank 0 is the trainer)."""
    return {name: 1 + i * tp_size for i, name in enumerate(engine_names)}


def grace_s(timeout_s: float) -> float:
    """How long past its in-process deadline a process may take to report back (abort,
    Ray's reply) before the caller stops waiting for it."""
    return 10.0 + 0.1 * timeout_s


class WeightSource(Protocol):
    """The weights as rank 0 holds them: their shapes without materialising anything,
    and one walk over the full tensors (under ZeRO-3 each rank must walk once per push,
    since every tensor is gathered collectively)."""

    def specs(self) -> list[TensorSpec]: ...
    def walk(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class WeightSender:
    """Rank 0's side of the group, in the process that holds the weights."""

    def __init__(self, backend: CommBackend, device: Any, timeout_s: float) -> None:
        self.backend, self.device, self.timeout_s = backend, device, timeout_s
        self._store: Any = None  # the group's rendezvous, served from this process
        self._comm: WeightCommunicator | None = None
        self._retired: Any = None  # the last group left, (store, communicator)

    @property
    def connected(self) -> bool:
        return self._comm is not None

    def listen(self, host: str) -> tuple[str, int]:
        """Serve a new group's store on `host` (a free port); engines join it there."""
        self.drop()
        self._retired = None
        sock = open_listen_socket(host)
        port = int(sock.getsockname()[1])
        self._store = build_store(host, port, self.timeout_s, listen_socket=sock)
        return host, port

    def connect(self, world_size: int) -> None:
        """Blocks until every engine worker joined (at most sync.timeout_s, less if `drop`
        gives up on the group meanwhile)."""
        if self._store is None:
            raise RuntimeError("WeightSender.connect before listen")
        with self._on_device():
            self._comm = build_weight_communicator(self.backend, self._store, 0, world_size,
                                                   self.device, self.timeout_s)

    def drop(self) -> None:
        """Leave the group, forming or formed: set the abort mark every rank waiting in it
        reads, and abort this communicator (the other ranks may be gone). The store lives
        in this process and holds that mark: it is kept until the next group forms, by
        which time every rank left this one."""
        comm, self._comm = self._comm, None
        if self._store is not None:
            AbortFlag(self._store).raise_()
            self._retired = (self._store, comm)
            self._store = None
        abort_quietly(comm)

    def _on_device(self) -> contextlib.AbstractContextManager:
        """NCCL runs on the current CUDA device's stream; a caller thread may have another."""
        if not str(self.device).startswith("cuda"):
            return contextlib.nullcontext()
        import torch

        return torch.cuda.device(self.device)

    def send(self, buckets: Sequence[Bucket], tensors: Iterator[tuple[str, torch.Tensor]],
             deadline: Deadline) -> int:
        """Broadcast `tensors` (in plan order) bucket by bucket within `deadline`; returns
        bytes sent. A failed broadcast aborts the group (WeightGroupError)."""
        comm = self._comm  # `drop` from another thread aborts it under this loop
        if comm is None:
            raise WeightGroupError("WeightSender.send without a group")
        sent = 0
        try:
            with self._on_device():
                for bucket in buckets:
                    bounded_broadcast(comm, pack_bucket(bucket, tensors, self.device), deadline)
                    sent += bucket.num_bytes
                if str(self.device).startswith("cuda"):
                    import torch

                    torch.cuda.current_stream(self.device).synchronize()
        except WeightGroupError:
            if self._comm is comm:
                self._comm = None  # aborted by bounded_broadcast
            raise
        except BaseException:  # interrupted too: the receivers wait for a bucket that will not come
            self.drop()
            raise
        extra = next(tensors, None)
        if extra is not None:
            raise ValueError(f"weights to send hold {extra[0]!r} and more beyond the plan")
        return sent


@dataclass(frozen=True, slots=True)
class EngineFailure:
    engine: str
    reason: str
    gone: bool  # the engine died or did not answer in time: remove it from the router


@dataclass(frozen=True, slots=True)
class BroadcastOutcome:
    """What rank 0 reports of one push attempt; small (no tensors)."""

    version: int
    num_bytes: int
    plan_s: float
    seconds: float
    served: tuple[str, ...]  # engines that took the version
    failures: tuple[EngineFailure, ...]
    sender_error: str | None = None  # rank 0's own send failed for another reason than the group
    verify_error: str | None = None  # served engines report other weights or versions

    @property
    def ok(self) -> bool:
        return (self.sender_error is None and self.verify_error is None
                and all(f.gone for f in self.failures))


class _Capture:
    """Passes a walk through, keeping copies of the few tensors the checksum covers."""

    def __init__(self, walk: Iterator[tuple[str, Any]], names: Sequence[str]) -> None:
        self._walk, self._names = walk, set(names)
        self.kept: dict[str, Any] = {}

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self

    def __next__(self) -> tuple[str, Any]:
        name, tensor = next(self._walk)
        if name in self._names:
            self.kept[name] = tensor.detach().to("cpu", copy=True)
        return name, tensor


def drain(walk: Iterator[Any]) -> None:
    for _ in walk:
        pass


class BroadcastPusher:
    """Train rank 0's half of the broadcast transport (a plain class: the Ray shell is
    TrainRankActor, the tests run it in process). Keeps the group between pushes and
    forms a new one whenever the engines it is asked to push to change."""

    def __init__(self, backend: CommBackend, host: str, device: Any, bucket_bytes: int,
                 tp_size: int, timeout_s: float) -> None:
        self.backend, self.host, self.device = backend, host, device
        self.bucket_bytes, self.tp_size, self.timeout_s = bucket_bytes, tp_size, timeout_s
        self.sender = WeightSender(backend, device, timeout_s)
        self._members: tuple[str, ...] | None = None
        self.num_groups_formed = 0

    async def push(self, version: int, engines: Mapping[str, EngineClient], source: WeightSource,
                   verify: bool = True) -> BroadcastOutcome:
        """One attempt to make every engine in `engines` serve `version`. Walks `source`
        exactly once whatever happens (the other train ranks walk with it)."""
        start = time.monotonic()
        walk = source.walk()
        sender_done = threading.Event()  # the send thread finished with the walk
        sender_started = False
        try:
            specs = source.specs()
            buckets = plan_buckets(specs, self.bucket_bytes)
            wire = encode_plan(buckets)
            names = choose_checksum_names((name, len(shape)) for name, shape, _, _ in specs)
            plan_s = time.monotonic() - start
            num_bytes = sum(b.num_bytes for b in buckets)

            def outcome(served: tuple[str, ...], failures: list[EngineFailure],
                        sender_error: str | None = None, verify_error: str | None = None
                        ) -> BroadcastOutcome:
                return BroadcastOutcome(version, num_bytes, plan_s, time.monotonic() - start,
                                        served, tuple(failures), sender_error, verify_error)

            failures = await self._ensure_group(engines)
            if failures:
                return outcome((), failures)
            capture = _Capture(walk, names)
            sender_started = True
            sent, received = await self._send_and_receive(version, engines, buckets, wire,
                                                          capture, sender_done)
            failures = [self._failure(n, r) for n, r in received.items() if isinstance(r, BaseException)]
            served = tuple(n for n, r in received.items() if not isinstance(r, BaseException))
            if isinstance(sent, BaseException) or failures:
                self._leave()
            if isinstance(sent, BaseException) and not isinstance(sent, (WeightGroupError, TimeoutError)):
                return outcome(served, failures, sender_error=f"{type(sent).__name__}: {sent}")
            if failures and not all(f.gone for f in failures):
                return outcome(served, failures)
            if verify and served:
                try:
                    digest = checksum_tensors(capture.kept, names)
                    await check_engines(Router({n: engines[n] for n in served}), (names, digest), version)
                except WeightSyncError as exc:
                    return outcome(served, failures, verify_error=str(exc))
            return outcome(served, failures)
        finally:
            if not sender_started or sender_done.is_set():
                drain(walk)  # keeps rank 0 in step with the other ranks' walk
            else:
                log.error("the weight send thread is stuck past its deadline; train rank 0 "
                          "cannot walk its weights again")

    async def _send_and_receive(self, version: int, engines: Mapping[str, EngineClient],
                                buckets: Sequence[Bucket], wire: list[dict[str, Any]],
                                capture: _Capture, sender_done: threading.Event
                                ) -> tuple[Any, dict[str, Any]]:
        """Rank 0 broadcasts while every engine receives; (what the send returned or
        raised, each engine's result or exception)."""
        send = asyncio.ensure_future(self._send_in_thread(buckets, capture, sender_done))
        receives = {n: asyncio.ensure_future(self._bounded(e.receive_weights(version, wire)))
                    for n, e in engines.items()}
        await self._abort_on_first_failure([send, *receives.values()])
        results = await asyncio.gather(send, *receives.values(), return_exceptions=True)
        return results[0], dict(zip(receives, results[1:]))

    async def _abort_on_first_failure(self, calls: list[asyncio.Future]) -> None:
        """Wait for every call; once one fails (Ray reports an engine dead, a rank's
        broadcast failed) abort the group, which every rank still waiting in it sees
        within AbortFlag.CHECK_S, instead of each waiting for its deadline."""
        pending: set[asyncio.Future] = set(calls)
        aborted = False
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed and not aborted and pending:
                aborted = True
                log.warning("weight push: %s; aborting the weight group",
                            f"{type(failed[0].exception()).__name__}: {failed[0].exception()}"[:300])
                await asyncio.to_thread(self.sender.drop)

    async def _send_in_thread(self, buckets: Sequence[Bucket], capture: _Capture,
                              done: threading.Event) -> int:
        deadline = Deadline(self.timeout_s)

        def run() -> int:
            try:
                return self.sender.send(buckets, capture, deadline)
            finally:
                try:
                    drain(capture)
                finally:
                    done.set()

        return await self._bounded(asyncio.to_thread(run))

    def _bounded(self, call: Awaitable[Any]) -> Awaitable[Any]:
        """The caller's bound on a call that is bounded inside its own process: the same
        deadline plus grace, for a process that is stuck or gone without a word."""
        return asyncio.wait_for(call, self.timeout_s + grace_s(self.timeout_s))

    def _failure(self, name: str, exc: BaseException) -> EngineFailure:
        gone = is_engine_failure(exc)
        reason = ("no answer within sync.timeout_s + grace" if isinstance(exc, TimeoutError)
                  else f"{type(exc).__name__}: {str(exc)[:300]}")
        return EngineFailure(name, reason, gone)

    def _leave(self) -> None:
        self.sender.drop()
        self._members = None

    async def _ensure_group(self, engines: Mapping[str, EngineClient]) -> list[EngineFailure]:
        """Form a group with exactly `engines` unless the current one has them; the
        engines that could not join (none when formed)."""
        names = tuple(engines)
        if self._members == names and self.sender.connected:
            return []
        self._leave()
        host, port = self.sender.listen(self.host)
        world_size = 1 + len(names) * self.tp_size
        offsets = engine_rank_offsets(names, self.tp_size)
        connect = asyncio.ensure_future(self._bounded(asyncio.to_thread(self.sender.connect, world_size)))
        joins = {n: asyncio.ensure_future(self._bounded(e.init_weight_group(
                     host, port, offsets[n], world_size, self.backend, self.timeout_s)))
                 for n, e in engines.items()}
        await self._abort_on_first_failure([connect, *joins.values()])
        results = await asyncio.gather(connect, *joins.values(), return_exceptions=True)
        failures = [self._failure(n, r) for n, r in zip(joins, results[1:]) if isinstance(r, BaseException)]
        if isinstance(results[0], BaseException) and not failures:
            raise WeightSyncError(f"forming the {self.backend} weight group at {host}:{port} failed "
                                  f"on train rank 0: {results[0]}") from results[0]
        joined = sorted(r for ranks in results[1:] if not isinstance(ranks, BaseException) for r in ranks)
        if not failures and joined != list(range(1, world_size)):
            self._leave()
            raise WeightSyncError(f"engine workers joined the weight group as ranks {joined}, "
                                  f"expected 1..{world_size - 1} (is rollout.tp_size right?)")
        if failures or isinstance(results[0], BaseException):
            self._leave()
            return failures
        self._members = names
        self.num_groups_formed += 1
        log.info("weight group formed at %s:%d with %d engines (world %d)", host, port,
                 len(names), world_size)
        return []


class WeightSenderClient(Protocol):
    """How the driver reaches rank 0's BroadcastPusher: the Ray train group
    (trainer.train.train_actor.TrainGroup) or a pusher in this process (LocalSender)."""

    async def push_broadcast(self, version: int, engines: Mapping[str, EngineClient],
                             verify: bool) -> BroadcastOutcome: ...


class StateSource:
    """A WeightSource over a name -> tensor mapping that `state()` returns per push."""

    def __init__(self, state: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self._state = state

    def specs(self) -> list[TensorSpec]:
        return specs_of(self._state())

    def walk(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._state().items())


class LocalSender:
    """A BroadcastPusher in this process, sending what `state()` returns: for a single
    process and the tests of the broadcast path (the pusher runs as on rank 0)."""

    def __init__(self, state: Callable[[], Mapping[str, torch.Tensor]] | WeightSource,
                 backend: CommBackend, bucket_bytes: int, timeout_s: float, tp_size: int = 1,
                 host: str = "127.0.0.1", device: Any = "cpu") -> None:
        self.source: WeightSource = StateSource(state) if callable(state) else state
        self.pusher = BroadcastPusher(backend, host, device, bucket_bytes, tp_size, timeout_s)

    async def push_broadcast(self, version: int, engines: Mapping[str, EngineClient],
                             verify: bool) -> BroadcastOutcome:
        return await self.pusher.push(version, engines, self.source, verify)


class BroadcastTransport:
    """The driver's side: hands rank 0 a version and the live engines, removes the engines
    rank 0 reports gone, and asks again until every live engine serves the version."""

    def __init__(self, sender: WeightSenderClient, timeout_s: float) -> None:
        self.sender, self.timeout_s = sender, timeout_s

    async def push(self, router: Router, version: int, verify: bool = True) -> PushResult:
        start = time.monotonic()
        gone: list[str] = []
        problems: list[str] = []
        # Rank 0 bounds each step itself (forming: timeout + grace, sending: the same);
        # this only catches a rank 0 that cannot answer at all.
        bound = 2 * (self.timeout_s + grace_s(self.timeout_s)) + grace_s(self.timeout_s)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                outcome = await asyncio.wait_for(
                    self.sender.push_broadcast(version, router.engines, verify), bound)
            except TimeoutError as exc:
                raise WeightSyncError(f"train rank 0 did not finish pushing version {version} "
                                      f"within {bound:.0f}s") from exc
            for failure in outcome.failures:
                if failure.gone:
                    router.remove(failure.engine, WeightGroupError(failure.reason))
                    gone.append(failure.engine)
            if outcome.sender_error is not None:
                raise WeightSyncError(f"pushing version {version}: train rank 0 failed to send: "
                                      f"{outcome.sender_error}")
            if outcome.verify_error is not None:
                raise WeightSyncError(outcome.verify_error)
            if outcome.ok:
                result = PushResult(version, outcome.num_bytes, time.monotonic() - start,
                                    outcome.plan_s, outcome.served, tuple(gone), attempt)
                (log.warning if gone else log.info)(
                    "pushed version %d (%.1f MB) to %d engines in %.3fs (attempt %d%s)", version,
                    outcome.num_bytes / 2**20, len(outcome.served), result.seconds, attempt,
                    f"; engines gone: {', '.join(gone)}" if gone else "")
                return result
            problems.append(f"attempt {attempt}: " + "; ".join(
                f"{f.engine}: {f.reason}" for f in outcome.failures))
            log.warning("pushing version %d, %s; pushing again to %s", version, problems[-1],
                        ", ".join(router.engine_names))
        raise WeightSyncError(f"version {version} reached no consistent set of engines in "
                              f"{MAX_ATTEMPTS} attempts: " + " | ".join(problems))
