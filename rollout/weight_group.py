"""The weight broadcast group both ends of a broadcast push join: train rank 0 as the
sender (`trainer.train.weight_sync_nccl`), every engine worker as a receiver
(`rollout.weight_reload`). gloo on CPUs, vLLM's PyNcclCommunicator on GPUs, outside
torch.distributed's default group; the rendezvous is a TCP store rank 0 serves.

Every collective on the group is bounded inside the process that runs it: a push has one
deadline (`sync.timeout_s`) and each broadcast waits at most for what is left of it. A
broadcast that fails or runs out of time aborts the communicator (gloo's
`ProcessGroup.abort`, NCCL's `ncclCommAbort`) and sets the group's abort mark, so no rank
stays blocked in it; the next push forms a new group with the ranks that are left. torch,
vllm and NCCL are imported inside the functions that use them.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeVar

CommBackend = Literal["nccl", "gloo"]
T = TypeVar("T")
SENDER_RANK = 0


class WeightGroupError(RuntimeError):
    """A collective on the weight group failed or ran out of time; this process has
    aborted its communicator and left the group."""


class Deadline:
    """The end of one push; each collective gets what is left of it."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._end = time.monotonic() + timeout_s

    def remaining_s(self) -> float:
        left = self._end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the weight push ran past sync.timeout_s={self.timeout_s}")
        return left


class WeightCommunicator(Protocol):
    """One broadcast group; gloo on CPUs, vLLM's PyNcclCommunicator on GPUs. `broadcast`
    returns within `timeout_s` or raises; `abort` unblocks and frees the group without
    the other ranks (idempotent)."""

    def broadcast(self, tensor: Any, src: int, timeout_s: float) -> None: ...
    def abort(self) -> None: ...


ABORT_KEY = "sluice/weights/abort"


class AbortFlag:
    """The group's shared "give up" mark, a key in its rendezvous store: a rank that
    aborts sets it, and every rank waiting in a broadcast checks it a few times a second.
    A dead peer does not always fail a pending send (gloo notices only on its next read),
    so without the mark the ranks still in step would wait for their own deadline."""

    CHECK_S = 0.1

    def __init__(self, store: Any) -> None:
        self._store = store
        self._next_check = 0.0

    def raised(self) -> bool:
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + self.CHECK_S
        try:
            return bool(self._store.check([ABORT_KEY]))
        except (RuntimeError, OSError):  # torch's store errors (DistError) and a lost socket
            return True  # the store lives in rank 0: gone with it

    def raise_(self) -> None:
        try:
            self._store.set(ABORT_KEY, "1")
        except (RuntimeError, OSError):  # rank 0 (the store) is gone: the others find out themselves
            pass


def wait_for_event(is_done: Any, timeout_s: float, poll_s: float,
                   aborted: Any = lambda: False) -> None:
    """Poll `is_done()` until it is true; TimeoutError after `timeout_s`, WeightGroupError
    as soon as `aborted()` (another rank gave up on the group)."""
    end = time.monotonic() + timeout_s
    while not is_done():
        if time.monotonic() >= end:
            raise TimeoutError(f"a weight broadcast did not finish within {timeout_s:.1f}s")
        if aborted():
            raise WeightGroupError("another rank aborted the weight group")
        time.sleep(poll_s)


class GlooBroadcast:
    """Broadcast over a gloo process group that lives outside torch.distributed's
    default group (CPU tensors). Waits in slices of AbortFlag.CHECK_S (gloo lets a timed
    out wait be waited on again), so a finished op returns at once and the abort mark is
    read between slices."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo

        self._flag = AbortFlag(store)
        self._group: Any = ProcessGroupGloo(PrefixStore("sluice/weights", store), rank,
                                            world_size, timedelta(seconds=timeout_s))

    def broadcast(self, tensor: Any, src: int, timeout_s: float) -> None:
        from torch.distributed import BroadcastOptions

        if self._group is None:
            raise WeightGroupError("broadcast on an aborted weight group")
        options = BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        work = self._group.broadcast([tensor], options)
        end = time.monotonic() + timeout_s
        while True:
            slice_s = min(AbortFlag.CHECK_S, end - time.monotonic())
            if slice_s <= 0:
                raise TimeoutError(f"a weight broadcast did not finish within {timeout_s:.1f}s")
            try:
                work.wait(timedelta(seconds=slice_s))
                return
            except RuntimeError as exc:  # what failed the op (a peer's reset), or the slice
                if "timed out" not in str(exc).lower():
                    raise
                if work.is_completed():
                    # Done since the slice ran out (a race that a loaded machine wins often):
                    # a second wait returns the op's own outcome at once, success or its error.
                    work.wait()
                    return
            if self._flag.raised():
                raise WeightGroupError("another rank aborted the weight group")

    def abort(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            self._flag.raise_()
            group.abort()  # closes every pair: an op still queued in gloo fails, not hangs


class NcclBroadcast:
    """PyNcclCommunicator with a CPU-side deadline: NCCL kernels wait for a dead peer
    forever, so the host polls an event recorded after the broadcast and aborts the
    communicator (ncclCommAbort, which also ends the kernel) when time is up or another
    rank gave up."""

    POLL_S = 0.002

    def __init__(self, comm: Any, store: Any) -> None:
        self._comm = comm
        self._flag = AbortFlag(store)

    def broadcast(self, tensor: Any, src: int, timeout_s: float) -> None:
        import torch

        if self._comm is None:
            raise WeightGroupError("broadcast on an aborted weight group")
        stream = torch.cuda.current_stream(tensor.device)
        self._comm.broadcast(tensor, src=src, stream=stream)
        done = torch.cuda.Event()
        done.record(stream)
        wait_for_event(done.query, timeout_s, self.POLL_S, self._flag.raised)

    def abort(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            self._flag.raise_()
            comm.destroy()  # ncclCommAbort on a helper thread, bounded by vLLM (5 s)


def build_weight_communicator(backend: CommBackend, store: Any, rank: int, world_size: int,
                              device: Any, timeout_s: float) -> WeightCommunicator:
    """Join the weight broadcast group through its store (`build_store`): wait until all
    `world_size` ranks arrived (at most `timeout_s`, less if a rank gives up), then build
    the communicator, which then finds every peer there."""
    wait_for_all_ranks(store, world_size, timeout_s)
    if backend == "gloo":
        return GlooBroadcast(store, rank, world_size, timeout_s)
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    # ncclCommInitRank blocks until every rank has called it: a rank that reached the
    # store but never gets there (hung, killed, a wrong NCCL_SOCKET_IFNAME) would hold this
    # worker inside the engine's collective_rpc for good.
    comm = build_within(
        lambda: PyNcclCommunicator(StatelessProcessGroup(rank=rank, world_size=world_size,
                                                         store=store), device=device),
        timeout_s, AbortFlag(store), discard=lambda late: late.destroy(),
        what="the NCCL communicator's set-up (ncclCommInitRank and its warm-up all-reduce)")
    if comm.disabled:
        # PyNccl turns itself into a no-op when it cannot load NCCL; a silent no-op
        # broadcast would leave the engines on old weights.
        raise RuntimeError(f"NCCL is not available in this process (device {device}); "
                           "use sync.transport=cpu")
    return NcclBroadcast(comm, store)


def build_within(make: Callable[[], T], timeout_s: float, flag: AbortFlag,
                 discard: Callable[[T], object], what: str) -> T:
    """`make()` on a helper thread, waited for at most `timeout_s` and only while no rank
    has given up on the group (`flag`). Past either, or when `make()` fails, this rank
    raises the abort mark (the others stop waiting too), then WeightGroupError (or make's
    own error). A timed-out thread stays blocked in its C call, which nothing can
    interrupt; whatever it makes if it ever returns is `discard`ed."""
    lock = threading.Lock()
    made: list[T] = []
    failed: list[BaseException] = []
    done, gave_up = threading.Event(), threading.Event()

    def run() -> None:
        try:
            value = make()
        except BaseException as exc:  # handed to the waiting caller, which raises it
            failed.append(exc)
        else:
            with lock:
                late = gave_up.is_set()
                made.append(value)
            if late:
                _discard_logged(discard, value)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="sluice-weight-group-build").start()
    try:
        wait_for_event(done.is_set, timeout_s, 0.02, flag.raised)
    except (TimeoutError, WeightGroupError) as exc:
        with lock:
            gave_up.set()
            if not made:
                flag.raise_()
                raise WeightGroupError(f"{what} did not finish within {timeout_s:.1f}s or another "
                                       f"rank gave up ({exc}); this rank left the group") from exc
    if failed:
        flag.raise_()  # the others would wait in their own set-up for this rank
        raise failed[0]
    return made[0]


def _discard_logged(discard: Callable[[T], object], value: T) -> None:
    import logging

    try:
        discard(value)
    except Exception as exc:  # a communicator nobody waits for any more: drop it anyway
        logging.getLogger(__name__).warning("discarding a late weight-group communicator: %s", exc)


def build_store(host: str, port: int, timeout_s: float,
                listen_socket: socket.socket | None = None) -> Any:
    """The group's TCP store: rank 0 serves it from `listen_socket`, the other ranks
    connect to host:port. It carries the rendezvous and the abort mark."""
    from torch.distributed import TCPStore

    kwargs: dict[str, Any] = {}
    if listen_socket is not None:
        kwargs["master_listen_fd"] = listen_socket.detach()
    return TCPStore(host, port, None, listen_socket is not None, timedelta(seconds=timeout_s),
                    wait_for_workers=False, **kwargs)


ARRIVED_KEY = "sluice/weights/arrived"


def wait_for_all_ranks(store: Any, world_size: int, timeout_s: float) -> None:
    """Count this rank in and wait for the others, giving up at the abort mark (a rank
    that learnt a peer is gone) or after `timeout_s`: the collective set-up that follows
    would wait for a missing rank without a way out."""
    store.add(ARRIVED_KEY, 1)
    flag = AbortFlag(store)
    wait_for_event(lambda: int(store.add(ARRIVED_KEY, 0)) >= world_size, timeout_s, 0.02,
                   flag.raised)


def bounded_broadcast(comm: WeightCommunicator, tensor: Any, deadline: Deadline) -> None:
    """One broadcast from the sender within what is left of `deadline`; on any failure
    the communicator is aborted and WeightGroupError raised (the group is gone)."""
    try:
        comm.broadcast(tensor, SENDER_RANK, deadline.remaining_s())
    except BaseException as exc:  # interrupted too: a half-done broadcast leaves the group unusable
        abort_quietly(comm)
        raise WeightGroupError(f"weight broadcast failed, group aborted: "
                               f"{type(exc).__name__}: {str(exc)[:300]}") from exc


ABORT_WAIT_S = 1.0


def abort_quietly(comm: WeightCommunicator | None) -> None:
    """Abort `comm` on a helper thread, waiting at most ABORT_WAIT_S: gloo's abort waits
    for an op stuck sending to a dead peer (until gloo's own timeout), and leaving must
    not hold the caller. The abort mark is set first, so the other ranks know at once."""
    if comm is None:
        return
    thread = threading.Thread(target=_abort_logged, args=(comm,), daemon=True,
                              name="sluice-weight-group-abort")
    thread.start()
    thread.join(timeout=ABORT_WAIT_S)


def _abort_logged(comm: WeightCommunicator) -> None:
    import logging

    try:
        comm.abort()
    except Exception as exc:  # the group is being dropped anyway
        logging.getLogger(__name__).warning("aborting the weight group: %s", exc)
