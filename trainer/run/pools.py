"""Resource pools: the recipe's four Ray placement groups (rollout, train, judge, sandbox).

`plan_pools` is a pure function of the config (used by `--dry-run`, no Ray import);
`build_pools` places the plan on a live Ray cluster and fails with the missing resources
named instead of hanging. On a CPU machine the same plan has zero GPUs.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from trainer.run.config import SluiceConfig
from trainer.run.sizing import resolve_agent_workers

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

log = logging.getLogger(__name__)
T = TypeVar("T")

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One pool: `num_bundles` identical bundles of Ray resources, placed with `strategy`."""

    name: str
    num_bundles: int
    bundle: tuple[tuple[str, float], ...]  # (resource, amount) pairs of one bundle
    strategy: Strategy
    role: str  # what runs in each bundle, for people reading the plan
    config_keys: tuple[str, ...]  # keys that size this pool, named in errors

    def bundles(self) -> list[dict[str, float]]:
        return [dict(self.bundle) for _ in range(self.num_bundles)]

    def total(self, resource: str) -> float:
        return self.num_bundles * dict(self.bundle).get(resource, 0.0)


def _bundle(cpus: float, gpus: int, **custom: float) -> tuple[tuple[str, float], ...]:
    items = [("CPU", float(cpus))]
    if gpus:
        items.append(("GPU", float(gpus)))
    items.extend((k, float(v)) for k, v in custom.items())
    return tuple(items)


def plan_pools(cfg: SluiceConfig) -> tuple[PoolSpec, ...]:
    """The pools a recipe needs; GPU counts are zero when cluster.device is cpu. The
    agent-loop workers take no pool of their own: they share the sandbox bundles."""
    gpu = cfg.cluster.device == "cuda"
    r, t, e, j = cfg.rollout, cfg.train, cfg.envs, cfg.reward.judge
    pools = [
        PoolSpec("rollout", r.num_engines, _bundle(r.cpus_per_engine, r.tp_size if gpu else 0),
                 "PACK", f"vLLM engine (tp={r.tp_size})",
                 ("rollout.num_engines", "rollout.tp_size", "rollout.cpus_per_engine")),
        PoolSpec("train", t.num_ranks, _bundle(t.cpus_per_rank, 1 if gpu else 0),
                 "PACK", f"DeepSpeed rank (ZeRO-{t.zero_stage})",
                 ("train.num_ranks", "train.cpus_per_rank")),
    ]
    if j.enabled:
        pools.append(PoolSpec("judge", j.num_engines, _bundle(j.cpus_per_engine, j.tp_size if gpu else 0),
                              "PACK", f"judge vLLM engine (tp={j.tp_size})",
                              ("reward.judge.num_engines", "reward.judge.tp_size",
                               "reward.judge.cpus_per_engine")))
    # Agent-loop workers live beside the sandboxes they use and grade with: each bundle
    # hosts one SandboxWorker and its node's share of the AgentLoopWorkers (given or auto).
    per_node = resolve_agent_workers(cfg).per_node
    cpus = e.cpus_per_sandbox_worker + per_node * r.cpus_per_agent_worker
    pools.append(PoolSpec("sandbox", e.num_sandbox_workers,
                          _bundle(cpus, 0, **{cfg.cluster.sandbox_resource: 1}),
                          "SPREAD", f"SandboxWorker (<= {e.sandboxes_per_worker} sandboxes) + "
                          f"{per_node} AgentLoopWorker{'s' if per_node > 1 else ''}",
                          ("envs.num_sandbox_workers", "envs.cpus_per_sandbox_worker",
                           "rollout.num_agent_workers", "rollout.trajectories_per_agent_worker",
                           "rollout.cpus_per_agent_worker")))
    return tuple(pools)


def format_pool_plan(pools: tuple[PoolSpec, ...]) -> str:
    """A table of the plan, with per-resource totals."""
    rows = [f"{'pool':<8} {'bundles':>7}  {'each':<28} {'strategy':<8} runs"]
    totals: dict[str, float] = {}
    for p in pools:
        each = ", ".join(f"{k}={v:g}" for k, v in p.bundle)
        rows.append(f"{p.name:<8} {p.num_bundles:>7}  {each:<28} {p.strategy:<8} {p.role}")
        for k, _ in p.bundle:
            totals[k] = totals.get(k, 0.0) + p.total(k)
    rows.append("total    " + ", ".join(f"{k}={v:g}" for k, v in totals.items()))
    return "\n".join(rows)


class StartupError(RuntimeError):
    """A part of the system did not start (the Ray cluster, a pool, an engine, a worker);
    the message says what and what to try. trainer.main exits 4 with it."""


class PoolPlacementError(StartupError):
    """The cluster cannot place a pool; the message names the pool and what is missing."""


class ClusterConnectionError(ValueError):
    """cluster.address names a Ray cluster that cannot be reached; the message says what to
    change (a ValueError: trainer.main reports it as a config error, exit 2)."""


CONNECT_TIMEOUT_S = 10.0  # how long an explicit cluster.address may take to answer
# Ray gives a new local node 30 s (not configurable) to register; a loaded machine can miss
# that (2 of ~16 starts at high load in a trial), and the next attempt usually makes it.
LOCAL_START_ATTEMPTS = 3


def connect_cluster(cfg: SluiceConfig) -> None:
    """cluster.address=local: start a private Ray cluster offering the sandbox resource,
    never one already running on this machine (whatever RAY_ADDRESS says). Otherwise join
    the cluster at that address, failing within CONNECT_TIMEOUT_S when nothing answers."""
    import ray

    if ray.is_initialized():
        return
    c = cfg.cluster
    if c.address == "local":
        # address="local" makes ray.init start a new cluster. RAY_ADDRESS (what `ray start`
        # tells a shell to export) would still reach every process this one starts.
        os.environ.pop("RAY_ADDRESS", None)
        context = _start_local_cluster(
            lambda: ray.init(address="local", num_cpus=c.local_num_cpus, num_gpus=c.local_num_gpus,
                             resources={c.sandbox_resource: c.local_num_sandbox_slots},
                             include_dashboard=False, log_to_driver=True))
        # ray.init is annotated as returning BaseContext; a local start (never a ray://
        # client) returns a RayContext, whose address_info names the session folder.
        from ray._private.worker import RayContext

        assert isinstance(context, RayContext), type(context)
        session_dir = context.address_info["session_dir"]
        assert session_dir is not None, "ray.init started a cluster without a session folder"
        _record_private_cluster(session_dir)
        return
    join_cluster(c.address)


# Settings of the collective libraries (which network interface, which InfiniBand HCAs,
# how much NCCL logs). A Ray worker inherits the environment of its node's `ray start`, not
# the driver's, so a driver that joins a cluster hands these to every worker of its run.
FORWARDED_ENV_PREFIXES = ("NCCL_",)
FORWARDED_ENV_NAMES = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def collective_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` a joining driver forwards to its workers."""
    return {k: v for k, v in environ.items()
            if k.startswith(FORWARDED_ENV_PREFIXES) or k in FORWARDED_ENV_NAMES}


def join_cluster(address: str, *, log_to_driver: bool = True) -> None:
    """Join the running Ray cluster at `address` ('auto', 'host:port', 'ray://host:port'),
    forwarding the driver's collective settings (`collective_env`: they win over a node's
    own) to the run's workers; ClusterConnectionError, saying what to start or fix, when
    none answers there."""
    import ray

    _check_reachable(address)
    forwarded = collective_env(os.environ)
    runtime_env = {"env_vars": forwarded} if forwarded else None
    if forwarded:
        log.info("forwarding %s to every worker of this run", ", ".join(sorted(forwarded)))
    try:
        ray.init(address=address, log_to_driver=log_to_driver, runtime_env=runtime_env)
        return
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = exc
    # Ray sends this user's auth token only to clusters it finds itself, never to an
    # explicit address, while `ray start` turns token auth on by default: when the plain
    # join is refused and a token exists, retry the way Ray does for found clusters. Not
    # up front: a cluster started without auth (ray.cluster_utils, KubeRay defaults) then
    # cannot start this job's workers. (Private to Ray 2.60, which pyproject pins.)
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available)

    if maybe_enable_token_auth_if_token_available(warn_if_disabled=False):
        ray.shutdown()
        try:
            ray.init(address=address, log_to_driver=log_to_driver, runtime_env=runtime_env)
            return
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = exc
    raise ClusterConnectionError(
        f"cluster.address={address!r}: cannot join a Ray cluster there ({first}). Start "
        "the head first (`ray start --head` on it), fix the address, or set "
        "cluster.address=local for a private cluster on this machine") from None


def _start_local_cluster(init: Callable[[], T], attempts: int = LOCAL_START_ATTEMPTS) -> T:
    """`init()` (a local ray.init), tried again when Ray's node misses its start-up window;
    the processes a failed attempt started are killed first. StartupError after `attempts`."""
    import ray

    for attempt in range(1, attempts + 1):
        before = _descendants()
        try:
            return init()
        except Exception as exc:  # Ray raises a bare Exception when its node times out
            ray.shutdown()
            for pid in _descendants() - before:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if attempt == attempts:
                raise StartupError(
                    f"the local Ray cluster did not start ({attempts} attempts; the last: "
                    f"{type(exc).__name__}: {exc}). A loaded machine makes Ray miss its 30 s "
                    "start-up window: run again when it is quieter, or start Ray yourself "
                    "(`ray start --head`) and set cluster.address=auto") from exc
            log.warning("the local Ray cluster did not start (%s: %s); trying again (%d of %d)",
                        type(exc).__name__, exc, attempt + 1, attempts)
    raise AssertionError("unreachable")


def _descendants() -> set[int]:
    """The pids of this process's children, their children, and so on (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _check_reachable(address: str) -> None:
    """Fail fast for 'host:port' and 'ray://host:port' addresses nothing listens at:
    ray.init itself retries for minutes, printing warnings."""
    if address == "auto":
        return  # ray.init finds the running cluster, or raises ConnectionError at once
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterConnectionError(f"cluster.address={address!r} is not 'local', 'auto', "
                                     "'host:port' or 'ray://host:port'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ClusterConnectionError(
            f"cluster.address={address!r}: nothing answers at {host}:{port} "
            f"({exc.strerror or exc}). Start the head there (`ray start --head --port={port}`), "
            "fix the address, or set cluster.address=local for a private cluster on this "
            "machine") from None


def _record_private_cluster(session_dir: str) -> None:
    """Leave a record of the cluster this process owns, so that a later run's reaper
    (envs.reaper) stops its processes should this one be killed before it shuts Ray down."""
    from envs.reaper import forget_ray_session, record_ray_session

    try:
        record = record_ray_session(session_dir)
    except OSError as exc:  # a run must not fail for its clean-up note
        log.warning("cannot record the private Ray cluster for the reaper: %s", exc)
        return
    atexit.register(forget_ray_session, record)


def _shortfall(pool: PoolSpec) -> str:
    """What the live cluster lacks for `pool`: totals, free amounts, or a big-enough node."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    need: dict[str, float] = {k: pool.total(k) for k, _ in pool.bundle}
    problems = []
    for k, amount in need.items():
        if total.get(k, 0.0) < amount:
            problems.append(f"{k}: needs {amount:g}, the cluster has {total.get(k, 0.0):g} in all")
        elif free.get(k, 0.0) < amount:
            problems.append(f"{k}: needs {amount:g}, {free.get(k, 0.0):g} free (the rest is in use)")
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if not problems and not any(all(n.get(k, 0.0) >= v for k, v in pool.bundle) for n in nodes):
        problems.append(f"no single node offers one whole bundle {dict(pool.bundle)}")
    if not problems:
        problems.append("resources exist but could not be packed with strategy " + pool.strategy)
    return "; ".join(problems)


def build_pools(cfg: SluiceConfig, pools: tuple[PoolSpec, ...] | None = None) -> dict[str, "PlacementGroup"]:
    """Place every pool, waiting at most cluster.pool_ready_timeout_s each.

    On failure every group placed so far is removed (nothing is left reserved) and a
    PoolPlacementError names the pool, the missing resources and the keys that size it.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pools = plan_pools(cfg) if pools is None else pools
    placed: dict[str, PlacementGroup] = {}
    for pool in pools:
        start = time.monotonic()
        pg = placement_group(pool.bundles(), strategy=pool.strategy, name=f"sluice-{pool.name}")
        ready, _ = ray.wait([pg.ready()], timeout=cfg.cluster.pool_ready_timeout_s)
        if not ready:
            message = (f"pool {pool.name!r} ({pool.num_bundles} x {dict(pool.bundle)}) was not "
                       f"placed within cluster.pool_ready_timeout_s="
                       f"{cfg.cluster.pool_ready_timeout_s:g}: {_shortfall(pool)}. Add nodes "
                       f"with these resources or lower {', '.join(pool.config_keys)}.")
            for group in [pg, *placed.values()]:
                remove_placement_group(group)
            raise PoolPlacementError(message)
        placed[pool.name] = pg
        log.info("pool %s placed in %.2fs", pool.name, time.monotonic() - start)
    return placed


def release_pools(placed: dict[str, Any]) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in placed.values():
        remove_placement_group(pg)
