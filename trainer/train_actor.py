"""Thin Ray shell for training: one TrainRankActor per bundle of the train pool, hosting a
backend (DeepSpeed by default); `TrainGroup`, which drives all ranks with the same call
and splits each batch between them by tokens; and `RayTrainer`, the controller's
TrainerSide over a TrainGroup. All behaviour lives in trainer.backends."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from buffer.batch import TrainBatch
from envs.types import Trajectory
from rollout.router import Router
from trainer.config import SluiceConfig
from trainer.seams import TrainOutcome
from trainer.weight_sync import WeightTransport, push_weights


@ray.remote
class TrainRankActor:
    def __init__(self, cfg: SluiceConfig, model_path: str, rank: int, world_size: int,
                 master_addr: str, master_port: int) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        from trainer.backends import build_backend

        self.cfg = cfg
        self.backend = build_backend(cfg.train, model_path, dtype=cfg.model.dtype,
                                     device="cuda" if cfg.cluster.device == "cuda" else "cpu",
                                     temperature=cfg.rollout.temperature)
        self.sender: Any = None  # rank 0's WeightSender once the weight group is opened

    def train_step(self, trajectories: list[Trajectory], advantages: np.ndarray) -> Any:
        return self.backend.train_step(trajectories, advantages, self.cfg.loss)

    def state_dict_for_push(self) -> dict:
        return self.backend.state_dict_for_push()

    def version(self) -> int:
        return self.backend.version

    def open_weight_group(self, backend: str, timeout_s: float) -> tuple[str, int]:
        """Rank 0 only: bind the weight group's rendezvous on this node; (host, port)."""
        import torch

        from trainer.weight_sync_nccl import WeightSender

        device = torch.device("cuda", torch.cuda.current_device()) if self.cfg.cluster.device == "cuda" else "cpu"
        self.sender = WeightSender(backend, device, timeout_s)  # type: ignore[arg-type]
        return self.sender.listen(ray.util.get_node_ip_address())

    def connect_weight_group(self, world_size: int) -> None:
        self.sender.connect(world_size)

    def send_weights(self, wire: list[dict]) -> None:
        """Every rank walks the weights (a gather under ZeRO-3); rank 0 broadcasts them."""
        walk = getattr(self.backend, "iter_push_tensors", None)  # one full tensor at a time
        tensors = walk() if walk is not None else iter(self.backend.state_dict_for_push().items())
        if self.sender is None:
            for _ in tensors:
                pass
        else:
            self.sender.send(wire, tensors)

    def save_state(self, folder: str) -> None:
        self.backend.save_state(folder)

    def load_state(self, folder: str) -> None:
        self.backend.load_state(folder)


def _node_address_and_port() -> tuple[str, int]:
    """Rank 0's rendezvous address; runs on rank 0's node."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), int(s.getsockname()[1])


class TrainGroup:
    """All ranks of the train pool. Each call goes to every rank (the backends hold
    collectives); a batch is split into contiguous per-rank shards."""

    def __init__(self, cfg: SluiceConfig, model_path: str, placement_group: Any | None) -> None:
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
        self.ranks = [TrainRankActor.options(**options(i)).remote(cfg, model_path, i, world, addr, port)
                      for i in range(world)]
        self.version = 0

    async def train_step(self, batch: TrainBatch) -> Any:
        """Returns rank 0's StepResult; every rank trains on its shard (balanced by tokens:
        the step takes as long as its heaviest shard)."""
        refs = [rank.train_step.remote(list(shard.trajectories), shard.advantages)
                for rank, shard in zip(self.ranks, batch.shards(len(self.ranks)))]
        results = await asyncio.gather(*refs)
        self.version += 1
        return results[0]

    async def state_dict_for_push(self) -> dict:
        refs = [rank.state_dict_for_push.remote() for rank in self.ranks]
        return (await asyncio.gather(*refs))[0]  # a collective on every rank; rank 0's copy

    # The weight broadcast group (trainer.weight_sync_nccl.WeightSenderClient): rank 0 sends.
    async def open_weight_group(self, backend: str, timeout_s: float) -> tuple[str, int]:
        return await self.ranks[0].open_weight_group.remote(backend, timeout_s)

    async def connect_weight_group(self, world_size: int) -> None:
        await self.ranks[0].connect_weight_group.remote(world_size)

    async def send_weights(self, wire: list[dict]) -> None:
        await asyncio.gather(*(rank.send_weights.remote(wire) for rank in self.ranks))

    # Blocking: the controller calls these from a thread (trainer.checkpoint is synchronous).
    def save_state(self, folder: str | Path) -> None:
        ray.get([rank.save_state.remote(str(folder)) for rank in self.ranks])

    def load_state(self, folder: str | Path) -> None:
        ray.get([rank.load_state.remote(str(folder)) for rank in self.ranks])
        self.version = ray.get(self.ranks[0].version.remote())


class RayTrainer:
    """The controller's TrainerSide: trains on the train group and pushes its weights to
    the engines behind `router` through `transport` (verified)."""

    def __init__(self, group: TrainGroup, router: Router, transport: WeightTransport | None,
                 verify: bool = True) -> None:
        self.group = group
        self.router = router
        self.transport = transport
        self.verify = verify

    async def train(self, batch: TrainBatch) -> TrainOutcome:
        result = await self.group.train_step(batch)
        return TrainOutcome({**result.metrics.to_log(), "perf/train_tokens_per_s": result.tokens_per_s,
                             "loss/grad_norm": result.grad_norm})

    async def push_weights(self, version: int) -> None:
        state = await self.group.state_dict_for_push()
        await push_weights(self.router, state, version, verify=self.verify,
                           transport=self.transport)

    def save(self, folder: Path) -> None:
        self.group.save_state(folder)

    def load(self, folder: Path) -> None:
        self.group.load_state(folder)
