"""GPU check of the weight push between processes (tests/gpu/run_gpu_checks.py runs it):
train rank 0's own pusher (trainer.train.weight_sync_nccl: LocalSender, BroadcastPusher,
the driver's BroadcastTransport) against receiver processes that run the engine workers'
receive code (rollout.weight_reload: join_weight_group, BucketReceiver under the push
deadline) without vLLM, as tests/integration/test_weight_group_faults.py stands them up.
A receiver keeps what it received in place of a model and answers checksums and its
version as an engine does.

Scenarios: two pushes through one group, bit-exact at every receiver; a receiver that dies
mid-push (the survivor is served, well within the push deadline: a dead peer must not cost
it); a receiver that stops (SIGSTOP) mid-push (rank 0 leaves within sync.timeout_s plus
grace, the survivor is served). NCCL refuses two ranks of one communicator on one GPU
("Duplicate GPU detected"), and sluice's NCCL communicator is vLLM's PyNccl: NCCL runs only
with a GPU per rank (three) and vLLM installed; otherwise the same scenarios run over the
gloo transport, with CUDA-resident tensors on a GPU machine, and the report says so.
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from gpu_checks_models import TINY, Settings, Verdict, build_random_model, model_config

MiB = 1 << 20
NUM_RANKS_NCCL = 3  # rank 0 and two receivers, a GPU each
KILL_TIMEOUT_S = 60.0  # a dead receiver must not need the deadline: the bound is far below it
KILL_BOUND_S = 20.0
STOP_TIMEOUT_S = {True: 3.0, False: 5.0}  # dry mode, GPU
SLACK_S = 3.0  # process scheduling on a loaded machine


# --- the receiver process ------------------------------------------------------------------

def serve_receiver(commands: Any, replies: Any, device: str) -> None:
    """An engine worker's weight-group half (WeightReloadExtension's receive path without
    vLLM's loader). Commands: join, receive (with a fault: after the first tensor the
    process SIGKILLs or SIGSTOPs itself), checksum, version, exit."""
    from rollout.weight_group import Deadline, WeightGroupError, abort_quietly
    from rollout.weight_protocol import checksum_tensors, decode_plan
    from rollout.weight_reload import BucketReceiver, join_weight_group

    comm, timeout_s = None, 0.0
    held: dict[str, torch.Tensor] = {}
    version = 0
    torch.empty(1, device=device)  # CUDA's start-up (seconds) must not eat a push's deadline
    replies.put(("ok", "ready"))
    while True:
        command = commands.get()
        kind, args = command[0], command[1:]
        start = time.monotonic()
        try:
            if kind == "join":
                host, port, rank, world_size, timeout_s, backend = args
                abort_quietly(comm)  # a new group: the old one is left first, as an engine does
                comm = None
                comm = join_weight_group(backend, host, port, rank, world_size, device, timeout_s)
                replies.put(("ok", rank))
            elif kind == "receive":
                new_version, wire, fault = args
                if comm is None:
                    raise WeightGroupError("no weight group: receive before join, or the last "
                                           "push aborted it")
                receiver = BucketReceiver(comm, decode_plan(wire), device, Deadline(timeout_s))
                got: dict[str, torch.Tensor] = {}
                try:
                    for name, tensor in receiver:
                        got[name] = tensor.clone()
                        if fault and len(got) == 1:
                            os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                    receiver.drain()
                except WeightGroupError:
                    comm = None  # aborted by the failed broadcast
                    raise
                held, version = got, new_version
                replies.put(("ok", checksum_tensors(held, sorted(held)), time.monotonic() - start))
            elif kind == "checksum":
                replies.put(("ok", checksum_tensors(held, args[0])))
            elif kind == "version":
                replies.put(("ok", version))
            else:
                return
        except Exception as exc:  # the worker's answer is the failure, as sluice_* methods give it
            replies.put(("error", type(exc).__name__, str(exc)[:300], time.monotonic() - start))


class ReceiverClient:
    """A receiver process as train rank 0 sees an engine (rollout.router.EngineClient's
    weight methods). A process that dies answers ConnectionError, as Ray's call to a dead
    actor fails; a stopped one never answers."""

    def __init__(self, ctx: Any, name: str, device: str) -> None:
        self.name = name
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=serve_receiver, args=(self.commands, self.replies, device),
                                   daemon=True, name=name)
        self.process.start()
        self.fault: str | None = None  # for the next receive only
        self.received: list[str] = []  # full checksums of the pushes taken

    async def started(self) -> None:
        """Wait until the process is up, its device initialised."""
        await self._reply()

    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                backend: str, timeout_s: float) -> list[int]:
        reply = await self._call(("join", host, port, rank_offset, world_size, timeout_s, backend))
        return [int(reply[1])]

    async def receive_weights(self, version: int, wire: list[dict]) -> None:
        fault, self.fault = self.fault, None
        reply = await self._call(("receive", version, wire, fault))
        self.received.append(reply[1])

    async def checksum(self, names: list[str]) -> str:
        return (await self._call(("checksum", names)))[1]

    async def get_stats(self) -> Any:
        from rollout.engine import EngineStats

        version = (await self._call(("version",)))[1]
        return EngineStats(version=version, num_in_flight=0, num_running=0, num_waiting=0,
                           kv_cache_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0,
                           paused=False)

    async def _call(self, command: tuple) -> tuple:
        self.commands.put(command)
        return await self._reply()

    async def _reply(self) -> tuple:
        abandoned = threading.Event()
        try:
            reply = await asyncio.to_thread(self._wait_reply, abandoned)
        finally:
            abandoned.set()  # the caller gave up (the pusher's own bound): stop polling
        if reply[0] == "error":
            from rollout.weight_group import WeightGroupError

            error = WeightGroupError if reply[1] == "WeightGroupError" else RuntimeError
            raise error(f"{self.name}: {reply[1]}: {reply[2]}")
        return reply

    def _wait_reply(self, abandoned: threading.Event) -> tuple:
        while not abandoned.is_set():
            try:
                return self.replies.get(timeout=0.1)
            except queue.Empty:
                if not self.process.is_alive():
                    raise ConnectionError(f"{self.name} died (exit code {self.process.exitcode})") from None
        raise TimeoutError(f"{self.name}: the caller stopped waiting")

    def close(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)  # stopped ones too
        self.process.join(5)


class TimedSource:
    """A WeightSource over one state that notes when each push's walk ended: the pusher's
    send thread drains the walk as it leaves, so that is when rank 0 left the broadcast."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state
        self.walks_ended: list[float] = []

    def specs(self) -> list:
        from rollout.weight_protocol import specs_of

        return specs_of(self.state)

    def walk(self) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            yield from self.state.items()
        finally:
            self.walks_ended.append(time.monotonic())


class RecordingSender:
    """LocalSender as the driver calls it, keeping each attempt's outcome."""

    def __init__(self, sender: Any) -> None:
        self.sender, self.outcomes = sender, []

    async def push_broadcast(self, version: int, engines: Mapping[str, Any], verify: bool) -> Any:
        outcome = await self.sender.push_broadcast(version, engines, verify)
        self.outcomes.append(outcome)
        return outcome


# --- the scenarios -------------------------------------------------------------------------

def choose_transport(s: Settings) -> tuple[str, list[str], str]:
    """(backend, device of rank 0 then each receiver, why) for this machine."""
    if s.device != "cuda":
        return "gloo", ["cpu"] * 3, "no GPU: gloo over CPU tensors (NCCL not exercised)"
    gpus = torch.cuda.device_count()
    if gpus >= NUM_RANKS_NCCL and importlib.util.find_spec("vllm") is not None:
        return "nccl", [f"cuda:{i}" for i in range(NUM_RANKS_NCCL)], f"{gpus} GPUs and vLLM's PyNccl"
    why = (f"NCCL not exercised: {gpus} GPU(s) for {NUM_RANKS_NCCL} ranks (NCCL refuses two ranks "
           f"of one communicator on one GPU, 'Duplicate GPU detected')")
    if importlib.util.find_spec("vllm") is None:
        why += " and vLLM, whose PyNcclCommunicator sluice uses, is not installed"
    return "gloo", ["cuda:0"] * 3, why + "; ran gloo over CUDA-resident tensors instead"


def build_states(s: Settings) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two versions of a Qwen3-shaped model's weights on rank 0's device, the real
    vocabulary's embeddings and head among them (several buckets)."""
    shape = TINY if s.dry else {**TINY, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64,
                                "vocab_size": 151936}
    model = build_random_model(model_config(shape), s.dtype, s.device, "sdpa")
    v1 = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    gen = torch.Generator(device=s.device).manual_seed(1)
    v2 = {n: (t.float() + 0.05 * torch.randn(t.shape, generator=gen, device=s.device)).to(t.dtype)
          for n, t in v1.items()}
    return v1, v2


async def run_scenarios(s: Settings, backend: str, devices: list[str],
                        states: tuple[dict, dict]) -> dict[str, Any]:
    """The healthy pushes, then the two faults side by side (each its own group and
    receivers): the stopped receiver costs its deadline plus grace by design."""
    from concurrent.futures import ThreadPoolExecutor

    from rollout.weight_protocol import checksum_tensors

    # Every engine call waits for its reply on a thread; a stopped receiver holds one until
    # the pusher's bound. Enough threads for both scenarios at once.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(16, "push-check"))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "gpu_checks_push"])
    full = [checksum_tensors(v, sorted(v)) for v in states]
    bucket_bytes = 4 * MiB if s.dry else 16 * MiB
    scenario = Scenario(ctx, backend, devices, bucket_bytes)
    out = {"two_pushes": await scenario.two_pushes(states, full)}
    kill, stop = await asyncio.gather(scenario.fault("kill", KILL_TIMEOUT_S, states[1], full[1]),
                                      scenario.fault("stop", STOP_TIMEOUT_S[s.dry], states[1], full[1]))
    return {**out, "kill": kill, "stop": stop}


class Scenario:
    """Receiver processes and a pusher of train rank 0 for one scenario at a time."""

    def __init__(self, ctx: Any, backend: str, devices: list[str], bucket_bytes: int) -> None:
        self.ctx, self.backend, self.devices, self.bucket_bytes = ctx, backend, devices, bucket_bytes

    def launch(self, names: list[str]) -> dict[str, ReceiverClient]:
        return {n: ReceiverClient(self.ctx, n, self.devices[i + 1]) for i, n in enumerate(names)}

    def pusher(self, source: TimedSource, timeout_s: float) -> tuple[RecordingSender, Any]:
        from trainer.train.weight_sync_nccl import BroadcastTransport, LocalSender

        sender = RecordingSender(LocalSender(source, self.backend, self.bucket_bytes, timeout_s,
                                             device=self.devices[0]))
        return sender, BroadcastTransport(sender, timeout_s)

    async def two_pushes(self, states: tuple[dict, dict], full: list[str]) -> dict[str, Any]:
        """Two versions through one group: every receiver holds exactly what rank 0 sent."""
        from rollout.router import Router

        engines = self.launch(["receiver-0", "receiver-1"])
        try:
            await asyncio.gather(*(e.started() for e in engines.values()))
            source = TimedSource(states[0])
            sender, transport = self.pusher(source, 60.0)
            router = Router(dict(engines))
            pushes = []
            for version, state in ((1, states[0]), (2, states[1])):
                source.state = state
                result = await transport.push(router, version)
                pushes.append({"version": version, "seconds": result.seconds,
                               "mib": result.num_bytes / MiB, "attempts": result.attempts,
                               "engines": list(result.engines)})
            return {"pushes": pushes, "groups_formed": sender.sender.pusher.num_groups_formed,
                    "buckets": _num_buckets(states[0], self.bucket_bytes), "sent_checksums": full,
                    "received_checksums": {n: e.received for n, e in engines.items()}}
        finally:
            for e in engines.values():
                e.close()

    async def fault(self, fault: str, timeout_s: float, state: dict, sent: str) -> dict[str, Any]:
        """A push during which the victim dies or stops after its first tensor; the driver
        drops it and pushes again to the survivor."""
        from rollout.router import Router
        from trainer.train.weight_sync_nccl import grace_s

        engines = self.launch([f"{fault}-survivor", f"{fault}-victim"])
        try:
            await asyncio.gather(*(e.started() for e in engines.values()))
            source = TimedSource(state)
            sender, transport = self.pusher(source, timeout_s)
            router = Router(dict(engines))
            engines[f"{fault}-victim"].fault = fault
            start_s = time.monotonic()
            result = await transport.push(router, 3)
            first = sender.outcomes[0]
            return {
                "timeout_s": timeout_s, "grace_s": grace_s(timeout_s), "seconds": result.seconds,
                "attempts": result.attempts, "gone": [n.split("-")[-1] for n in result.failed_engines],
                "served": [n.split("-")[-1] for n in result.engines],
                "first_attempt_s": first.seconds,
                "first_attempt_failures": [f"{f.engine}: {f.reason[:200]} (gone: {f.gone})"
                                           for f in first.failures],
                "rank0_left_s": source.walks_ended[0] - start_s,
                "survivor_checksum": engines[f"{fault}-survivor"].received[-1:], "sent_checksum": sent}
        finally:
            for e in engines.values():
                e.close()


def _num_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> int:
    from rollout.weight_protocol import plan_state_buckets

    return len(plan_state_buckets(state, bucket_bytes))


def check_weight_push(s: Settings) -> dict[str, Any]:
    """Two bit-exact pushes, a receiver killed mid-push, a receiver stopped mid-push."""
    from trainer.train.weight_sync_nccl import grace_s

    verdict = Verdict()
    backend, devices, why = choose_transport(s)
    states = build_states(s)
    mib = sum(t.numel() * t.element_size() for t in states[0].values()) / MiB
    print(f"  transport {backend}, rank 0 on {devices[0]}, receivers on {devices[1:]}: {why}", flush=True)
    scenarios = asyncio.run(run_scenarios(s, backend, devices, states))
    two = scenarios["two_pushes"]
    for name, got in two["received_checksums"].items():
        verdict.expect(got == two["sent_checksums"], f"{name} received {got}, rank 0 sent "
                       f"{two['sent_checksums']} (sha256 of every tensor)")
    verdict.expect(two["groups_formed"] == 1 and all(p["attempts"] == 1 for p in two["pushes"]),
                   f"two healthy pushes formed {two['groups_formed']} groups / attempts "
                   f"{[p['attempts'] for p in two['pushes']]}")
    print(f"  two pushes of {mib:.0f} MiB ({two['buckets']} buckets) through one group: "
          + ", ".join(f"v{p['version']} {p['seconds']:.2f} s" for p in two["pushes"])
          + f"; checksums equal: {all(g == two['sent_checksums'] for g in two['received_checksums'].values())}",
          flush=True)
    for fault, bound_s in (("kill", KILL_BOUND_S), ("stop", None)):
        sc = scenarios[fault]
        served_ok = sc["served"] == ["survivor"] and sc["gone"] == ["victim"]
        exact = sc["survivor_checksum"] == [sc["sent_checksum"]]
        if fault == "stop":
            bound_s = sc["timeout_s"] + grace_s(sc["timeout_s"]) + SLACK_S
            sc["bound_s"] = bound_s
            verdict.expect(sc["rank0_left_s"] <= sc["timeout_s"] + grace_s(sc["timeout_s"]),
                           f"stop: rank 0 left the broadcast after {sc['rank0_left_s']:.1f} s, past "
                           f"sync.timeout_s {sc['timeout_s']} + grace {grace_s(sc['timeout_s']):.1f} s")
            verdict.expect(sc["first_attempt_s"] <= bound_s,
                           f"stop: the attempt with the stopped receiver took {sc['first_attempt_s']:.1f} s "
                           f"(bound {bound_s:.1f} s)")
        else:
            sc["bound_s"] = bound_s
            verdict.expect(sc["seconds"] <= bound_s, f"kill: the survivor was served after "
                           f"{sc['seconds']:.1f} s (bound {bound_s} s, deadline {sc['timeout_s']} s)")
        verdict.expect(served_ok and sc["attempts"] == 2,
                       f"{fault}: served {sc['served']}, gone {sc['gone']}, attempts {sc['attempts']} "
                       f"(expected the survivor served on the second attempt, the victim gone)")
        verdict.expect(exact, f"{fault}: the survivor holds {sc['survivor_checksum']}, rank 0 sent "
                       f"{sc['sent_checksum']}")
        print(f"  {fault} mid-push: rank 0 left after {sc['rank0_left_s']:.2f} s, first attempt "
              f"{sc['first_attempt_s']:.2f} s, survivor served after {sc['seconds']:.2f} s "
              f"(bound {sc['bound_s']:.1f} s, sync.timeout_s {sc['timeout_s']:g}); checksum equal: {exact}",
              flush=True)
    return verdict.result(transport=backend, devices=devices, nccl_exercised=backend == "nccl",
                          transport_reason=why, mib=mib, scenarios=scenarios)
