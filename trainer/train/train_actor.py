"""Thin Ray shell for training: one TrainRankActor per bundle of the train pool, hosting a
backend (DeepSpeed by default); `TrainGroup`, which drives all ranks with the same call
and splits each batch between them by tokens; and `RayTrainer`, the controller's
TrainerSide over a TrainGroup. All behaviour lives in trainer.train.backends."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from buffer.batch import TrainBatch
from rollout.router import Router
from trainer.train.config import TrainRecipe
from trainer.train.outcomes import PushOutcome, TrainOutcome
from trainer.train.weight_sync import WeightSyncError
from trainer.train.weight_sync_nccl import BroadcastTransport

if TYPE_CHECKING:
    from trainer.train.backends import TrainBackend


@ray.remote
class TrainRankActor:
    def __init__(self, cfg: TrainRecipe, model_path: str, rank: int, world_size: int,
                 master_addr: str, master_port: int) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        from rollout.rope import build_rope_overrides, read_config_json
        from trainer.train.backends import build_backend

        self.cfg = cfg
        self.rank = rank
        self._prepared: tuple[int, bytes, tuple[list[str], str]] | None = None
        # The same RoPE scaling the engines get (EngineSpec.hf_overrides), or the trainer's
        # logprobs would come from another model than the one that sampled.
        overrides = (build_rope_overrides(read_config_json(model_path), cfg.model.rope_scaling)
                     if cfg.model.rope_scaling else None)
        self.backend = build_backend(cfg.train, model_path, dtype=cfg.model.dtype,
                                     device="cuda" if cfg.cluster.device == "cuda" else "cpu",
                                     temperature=cfg.rollout.temperature,
                                     config_overrides=overrides)
        self.pusher: Any = None  # rank 0's BroadcastPusher (the weight group) once it pushed

    def train_step(self, shard: TrainBatch) -> Any:
        return self.backend.train_step(shard, self.cfg.loss)

    def prepare_push(self, version: int) -> int:
        """Every rank: gather the weights (a collective under ZeRO-3). Rank 0 keeps them,
        encoded, with their checksum, for `send_push`; it returns the bytes prepared. Runs
        while rollout goes on: only the send needs the turn gates closed."""
        from rollout.weight_protocol import encode_state, expected_checksum

        state = self.backend.state_dict_for_push()
        if self.rank != 0:
            return 0
        self._prepared = (version, encode_state(state), expected_checksum(state))
        return len(self._prepared[1])

    def send_push(self, version: int, engine_handles: dict[str, Any], verify: bool) -> Any:
        """Rank 0: send the prepared weights straight to every engine and verify them; the
        driver only learns the outcome (a PushResult), never the weights."""
        from rollout.engine_actor import RayEngineClient
        from trainer.train.weight_sync import send_prepared

        if self._prepared is None or self._prepared[0] != version:
            raise RuntimeError(f"send_push({version}) without prepare_push({version})")
        _, blob, expected = self._prepared
        self._prepared = None
        router = Router({n: RayEngineClient(h) for n, h in engine_handles.items()})
        return asyncio.run(send_prepared(router, blob, expected, version, verify=verify))

    def version(self) -> int:
        return self.backend.version

    def push_broadcast(self, version: int, engine_handles: dict[str, Any], verify: bool) -> Any:
        """Rank 0: plan, send and verify `version` through the weight broadcast group
        (formed again whenever the engines change); a BroadcastOutcome, no tensors."""
        from rollout.engine_actor import RayEngineClient

        if self.pusher is None:
            self.pusher = self._build_pusher()
        engines = {n: RayEngineClient(h) for n, h in engine_handles.items()}
        return asyncio.run(self.pusher.push(version, engines, BackendWeights(self.backend), verify))

    def walk_push(self) -> None:
        """Ranks > 0: walk the weights with rank 0's push (a gather per tensor under ZeRO-3)."""
        for _ in BackendWeights(self.backend).walk():
            pass

    def _build_pusher(self) -> Any:
        import torch

        from trainer.train.weight_sync import resolve_transport
        from trainer.train.weight_sync_nccl import BroadcastPusher

        cuda = self.cfg.cluster.device == "cuda"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
        return BroadcastPusher(resolve_transport(self.cfg), ray.util.get_node_ip_address(),  # type: ignore[arg-type]
                               device, self.cfg.sync.bucket_mb << 20, self.cfg.rollout.tp_size,
                               self.cfg.sync.timeout_s)

    def save_state(self, folder: str) -> None:
        self.backend.save_state(folder)

    def load_state(self, folder: str) -> None:
        self.backend.load_state(folder)


def _node_address_and_port() -> tuple[str, int]:
    """Rank 0's rendezvous address; runs on rank 0's node."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), int(s.getsockname()[1])


class BackendWeights:
    """A backend's weights as trainer.train.weight_sync_nccl.WeightSource: its shapes
    (without a gather where the backend can tell them) and its one-tensor-at-a-time walk."""

    def __init__(self, backend: TrainBackend) -> None:
        self.backend = backend

    def specs(self) -> list:
        return self.backend.push_specs()

    def walk(self) -> Iterator[tuple[str, Any]]:
        return self.backend.iter_push_tensors()  # one full tensor at a time


class TrainGroup:
    """All ranks of the train pool. Each call goes to every rank (the backends hold
    collectives); a batch is split into contiguous per-rank shards."""

    def __init__(self, cfg: TrainRecipe, model_path: str, placement_group: Any | None) -> None:
        world = cfg.train.num_ranks
        gpus = 1 if cfg.cluster.device == "cuda" else 0

        def options(i: int) -> dict[str, Any]:
            opts: dict[str, Any] = {"num_cpus": 0, "num_gpus": gpus}
            if placement_group is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=i)
            return opts

        probe = ray.remote(_node_address_and_port).options(**options(0))
        addr, port = ray.get(probe.remote())
        # @ray.remote made the class an ActorClass; type checkers do not apply class decorators.
        self.ranks = [TrainRankActor.options(**options(i)).remote(  # pyrefly: ignore[missing-attribute]
                      cfg, model_path, i, world, addr, port) for i in range(world)]
        self.version = 0

    async def train_step(self, batch: TrainBatch) -> Any:
        """Returns rank 0's StepResult; every rank trains on its shard (balanced by tokens:
        the step takes as long as its heaviest shard)."""
        refs = [rank.train_step.remote(shard)
                for rank, shard in zip(self.ranks, batch.shards(len(self.ranks)))]
        results = await asyncio.gather(*refs)
        self.version += 1
        return results[0]

    async def push_broadcast(self, version: int, engines: Mapping[str, Any], verify: bool) -> Any:
        """trainer.train.weight_sync_nccl.WeightSenderClient: rank 0 pushes `version` to `engines`
        (RayEngineClients) while the other ranks walk their weights with it; rank 0's
        BroadcastOutcome. Only the version, the handles and the outcome cross the driver."""
        handles = {n: e.handle for n, e in engines.items()}
        refs = [self.ranks[0].push_broadcast.remote(version, handles, verify)]
        refs += [rank.walk_push.remote() for rank in self.ranks[1:]]
        return (await asyncio.gather(*refs))[0]

    # Blocking: the controller calls these from a thread (trainer.run.checkpoint is synchronous).
    def save_state(self, folder: str | Path) -> None:
        ray.get([rank.save_state.remote(str(folder)) for rank in self.ranks])

    def load_state(self, folder: str | Path) -> None:
        ray.get([rank.load_state.remote(str(folder)) for rank in self.ranks])
        self.version = ray.get(self.ranks[0].version.remote())


def engine_handles(engines: Mapping[str, object]) -> dict[str, ray.actor.ActorHandle]:
    """The EngineActor handles behind RayEngineClients: what rank 0's push and the agent
    workers call directly."""
    from rollout.engine_actor import RayEngineClient

    handles = {}
    for name, engine in engines.items():
        if not isinstance(engine, RayEngineClient):
            raise TypeError(f"engine {name!r} is a {type(engine).__name__}, not a RayEngineClient: "
                            "the Ray-side weight push and the agent workers need its actor handle")
        handles[name] = engine.handle
    return handles


class RayTrainer:
    """The controller's TrainerSide: trains on the train group and pushes its weights to
    the engines behind `router`, verified; either way train rank 0 sends and the driver
    never holds the weights.

    CPU transport (`transport` None): `prepare_weights` gathers and encodes them on the
    ranks while rollout goes on, `push_weights` has rank 0 send them with the gates
    closed. Broadcast transport (nccl, gloo): rank 0 plans, broadcasts and verifies
    (`BroadcastTransport.push`); an engine that fails during the push is dropped from the
    router and the push goes on with the others."""

    def __init__(self, group: TrainGroup, router: Router, transport: BroadcastTransport | None,
                 verify: bool = True) -> None:
        self.group = group
        self.router = router
        self.transport = transport
        self.verify = verify
        self.last_push: Any = None  # the PushResult of the last push

    async def prepare_weights(self, version: int) -> None:
        if self.transport is None:
            await asyncio.gather(*(r.prepare_push.remote(version) for r in self.group.ranks))

    async def train(self, batch: TrainBatch) -> TrainOutcome:
        result = await self.group.train_step(batch)
        return TrainOutcome({**result.metrics.to_log(), "perf/train_tokens_per_s": result.tokens_per_s,
                             "loss/grad_norm": result.grad_norm})

    async def push_weights(self, version: int) -> PushOutcome:
        if self.transport is None:
            handles = engine_handles(self.router.engines)
            self.last_push = await self.group.ranks[0].send_push.remote(version, handles,
                                                                       self.verify)
            for name in self.last_push.failed_engines:  # rank 0 found it failed: stop routing to it
                self.router.remove(name, WeightSyncError(f"{name} failed during the push of version {version}"))
        else:
            self.last_push = await self.transport.push(self.router, version, verify=self.verify)
        return PushOutcome(tuple(self.last_push.failed_engines), self.last_push.attempts)

    def save_state(self, folder: str | Path) -> None:
        self.group.save_state(folder)

    def load_state(self, folder: str | Path) -> None:
        self.group.load_state(folder)
