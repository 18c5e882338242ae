"""`python -m launch.doctor recipe=NAME.yaml [section.key=value ...] [--address ADDR]`:
checks a running Ray cluster against a recipe before a run, and prints what is missing.

    resources   every pool of the recipe (trainer.run.pools.plan_pools) packed onto the live
                nodes at once, bundle by bundle: a pool whose bundles do not fit is named
                with the count that does not and what one bundle needs
    sandbox     on every node offering cluster.sandbox_resource: the sandbox backend works
                (a container engine for `container`, bubblewrap for `local`), every image the
                tasks name is present (images are never pulled during a run), and the tasks'
                source folders exist
    paths       model.path (and the judge's) on every node that hosts engines or train
                ranks; logging.output_dir (and the cache, when a warm start writes to it)
                shared: every node reads a marker file the driver wrote there
    gpu stack   on every GPU node: the NVIDIA driver is new enough for the CUDA torch was
                built for (else what to install, or CUDA forward compatibility), and the
                NCCL and nvcc versions beside it (launch.gpu_stack)
    ports       GPU nodes accept TCP connections from each other on kernel-picked ports
                (NCCL, DeepSpeed's rendezvous and the weight group's store use such ports)
    collective  the weight group's own code (rollout.weight_group) forms a group of one
                rank per node that would join it, with the run's transport (NCCL between
                GPU nodes, gloo on a CPU cluster) and the NCCL/gloo settings the driver
                forwards, and broadcasts a tensor that every rank must receive intact,
                bounded by sync.timeout_s; GPU nodes without a CUDA device (logical GPUs)
                are reported as skipped, with what would be checked

Exit status 0 when nothing is missing, 1 otherwise, 2 for a recipe error, 3 when no Ray
cluster answers at the address. The checks are
plain functions over what the probes report; the probes are small Ray tasks pinned to
each node (`NodeAffinitySchedulingStrategy`).
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launch.checks import Check
from launch.gpu_stack import GpuStack, check_gpu_stacks, probe_gpu_stack
from trainer.run.config import SluiceConfig
from trainer.run.local_models import is_local_model
from trainer.run.pools import PoolSpec, plan_pools

if TYPE_CHECKING:
    from envs.sandbox.engine import ContainerEngine
    from rollout.weight_group import CommBackend

MAX_IMAGES = 200  # distinct task images probed per node
MAX_SOURCE_DIRS = 50  # task source folders probed per sandbox node
CONNECT_TIMEOUT_S = 3.0
MAX_PORT_PAIRS = 400

USAGE = """usage: python -m launch.doctor recipe=NAME.yaml [section.key=value ...] [--address ADDR]

  --address ADDR   the Ray cluster to check (default: the recipe's cluster.address; 'local'
                   is not a cluster, so 'auto' is used then)
"""


@dataclass(frozen=True, slots=True)
class Node:
    """One alive Ray node as the doctor sees it."""

    node_id: str
    ip: str
    resources: Mapping[str, float]  # totals the node offers

    def offers(self, resource: str) -> float:
        return float(self.resources.get(resource, 0.0))




# --- resources ------------------------------------------------------------------------------

def check_pool_resources(pools: Sequence[PoolSpec], nodes: Sequence[Node]) -> list[Check]:
    """Place every bundle of every pool onto the nodes' totals, pool after pool in the order
    trainer.run.pools.build_pools places them, each bundle on the first node it fits: what a
    run's placement groups need together. One Check per pool."""
    free = [dict(n.resources) for n in nodes]
    placed: dict[str, int] = {p.name: 0 for p in pools}
    for pool, bundle in ((p, dict(p.bundle)) for p in pools for _ in range(p.num_bundles)):
        for capacity in free:
            if all(capacity.get(k, 0.0) >= v for k, v in bundle.items()):
                for k, v in bundle.items():
                    capacity[k] -= v
                placed[pool.name] += 1
                break
    checks = []
    for pool in pools:
        each = ", ".join(f"{k}={v:g}" for k, v in pool.bundle)
        missing = pool.num_bundles - placed[pool.name]
        if not missing:
            checks.append(Check(True, f"pool {pool.name}", f"{pool.num_bundles} x {{{each}}} fit"))
            continue
        hosts = sum(1 for n in nodes if all(n.offers(k) >= v for k, v in pool.bundle))
        checks.append(Check(False, f"pool {pool.name}",
                            f"{missing} of {pool.num_bundles} bundles {{{each}}} do not fit "
                            f"beside the other pools ({hosts} node(s) could hold one alone); "
                            f"add nodes offering {each} or lower {', '.join(pool.config_keys)}"))
    return checks


# --- what each node reports -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NodeProbe:
    """What one node reports (plain data: it travels back through Ray)."""

    paths: dict[str, bool] = field(default_factory=dict)  # key -> the path exists here
    markers: dict[str, bool] = field(default_factory=dict)  # key -> the driver's marker reads back
    backend: str | None = None  # sandbox nodes: why the sandbox backend fails here, None if it works
    images: dict[str, bool] = field(default_factory=dict)  # sandbox nodes: image -> present
    source_dirs: dict[str, bool] = field(default_factory=dict)  # sandbox nodes: folder -> present


def probe_node(paths: Mapping[str, str], markers: Mapping[str, tuple[str, str]],
               sandbox_backend: str | None, images: Sequence[str],
               source_dirs: Sequence[str]) -> NodeProbe:
    """Runs on one node: which `paths` exist, which shared-folder markers it reads with the
    expected token, and (on sandbox nodes) the backend, images and task folders."""
    found = {k: Path(p).expanduser().exists() for k, p in paths.items()}
    seen = {}
    for key, (path, token) in markers.items():
        try:
            seen[key] = Path(path).read_text() == token
        except OSError:
            seen[key] = False
    if sandbox_backend is None:
        return NodeProbe(paths=found, markers=seen)
    backend, engine = _probe_backend(sandbox_backend)
    if engine is not None:
        from envs.sandbox.engine import image_exists

        present = {image: image_exists(engine, image) for image in images}
    else:
        present = {image: False for image in images}
    return NodeProbe(paths=found, markers=seen, backend=backend, images=present,
                     source_dirs={d: Path(d).is_dir() for d in source_dirs})


def _probe_backend(backend: str) -> tuple[str | None, ContainerEngine | None]:
    """(None if the backend works else why, the container engine or None)."""
    try:
        if backend == "container":
            from envs.sandbox.engine import detect_engine

            return None, detect_engine()
        from envs.sandbox.bwrap import detect_host_runtime

        detect_host_runtime()
        return None, None
    except (ValueError, OSError) as exc:
        return str(exc), None


def check_sandbox_nodes(reports: Mapping[str, NodeProbe], backend: str,
                        resource: str) -> list[Check]:
    """Checks from the probes of the sandbox nodes (keyed by node address)."""
    if not reports:
        return [Check(False, "sandbox nodes", f"no node offers the '{resource}' resource; start "
                      f"CPU nodes with launch/ray_start.sh sandbox (cluster.sandbox_resource)")]
    checks = []
    broken = {ip: r.backend for ip, r in reports.items() if r.backend}
    checks.append(Check(not broken, f"sandbox backend {backend}",
                        f"works on {len(reports) - len(broken)} of {len(reports)} sandbox nodes"
                        + (f"; {_first(broken)}" if broken else "")))
    for kind, what in (("images", "image"), ("source_dirs", "task folder")):
        found = {ip: r.images if kind == "images" else r.source_dirs for ip, r in reports.items()}
        names = sorted({n for present in found.values() for n in present})
        for name in names:
            lacking = sorted(ip for ip, present in found.items() if not present.get(name))
            if lacking:
                checks.append(Check(False, f"{what} {name}", f"absent on {len(lacking)} of "
                                    f"{len(reports)} sandbox nodes ({_few(lacking)}); "
                                    + ("load it into each node's container storage "
                                       "(images are never pulled during a run)"
                                       if kind == "images" else "put it on the shared filesystem")))
        if names and all(all(present.get(n) for n in names) for present in found.values()):
            checks.append(Check(True, f"{what}s", f"all {len(names)} present on every sandbox node"))
    return checks


def check_paths(reports: Mapping[str, NodeProbe], paths: Mapping[str, str],
                markers: Mapping[str, tuple[str, str]]) -> list[Check]:
    """Paths every engine/train node must see, and folders every node must share."""
    checks = []
    for key, path in paths.items():
        lacking = sorted(ip for ip, r in reports.items() if not r.paths.get(key))
        checks.append(Check(not lacking, key, f"{path} " + (
            f"absent on {len(lacking)} of {len(reports)} nodes ({_few(lacking)}); put it on "
            f"the shared filesystem at the same path" if lacking else
            f"present on all {len(reports)} engine/train nodes")))
    for key, (path, _) in markers.items():
        folder = str(Path(path).parent)
        blind = sorted(ip for ip, r in reports.items() if not r.markers.get(key))
        checks.append(Check(not blind, f"{key} shared", f"{folder} " + (
            f"is not the driver's folder on {len(blind)} of {len(reports)} nodes "
            f"({_few(blind)}); mount the shared filesystem there" if blind else
            f"is the same folder on all {len(reports)} nodes")))
    return checks


def check_ports(results: Mapping[tuple[str, str], bool]) -> list[Check]:
    """(from ip, to ip) -> connected, for GPU node pairs."""
    if not results:
        return [Check(True, "ports", "fewer than two GPU nodes: no node-to-node traffic to check")]
    failed = sorted(pair for pair, ok in results.items() if not ok)
    if not failed:
        return [Check(True, "ports", f"GPU nodes reach each other on kernel-picked TCP ports "
                      f"({len(results)} pairs)")]
    shown = ", ".join(f"{a} -> {b}" for a, b in failed[:5])
    return [Check(False, "ports", f"{len(failed)} of {len(results)} GPU node pairs cannot "
                  f"connect on a kernel-picked TCP port ({shown}); NCCL, DeepSpeed and the "
                  f"weight group need every TCP port open between GPU nodes")]


def _few(items: Sequence[str], k: int = 3) -> str:
    return ", ".join(items[:k]) + (f" and {len(items) - k} more" if len(items) > k else "")


def _first(problems: Mapping[str, str]) -> str:
    ip, why = next(iter(sorted(problems.items())))
    return f"{len(problems)} failing, e.g. {ip}: {why}"


def format_checks(checks: Sequence[Check]) -> str:
    lines = [f"  {'ok' if c.ok else 'MISSING':<8} {c.what}: {c.detail}" for c in checks]
    missing = sum(not c.ok for c in checks)
    lines.append(f"{missing} missing" if missing else "nothing missing: the cluster can run the recipe")
    return "\n".join(lines)


# --- the run against a live cluster ---------------------------------------------------------

def _task_inputs(cfg: SluiceConfig) -> tuple[list[str], list[str]]:
    """Distinct images and source folders the recipe's tasks name (read on the driver)."""
    from envs.tasks import read_tasks

    tasks, _ = read_tasks(cfg.envs.tasks, cfg.envs.task_format)
    images = sorted({t.image for t in tasks if t.image})[:MAX_IMAGES]
    dirs = sorted({t.source_dir for t in tasks if t.source_dir})[:MAX_SOURCE_DIRS]
    return images, dirs


def _model_paths(cfg: SluiceConfig) -> dict[str, str]:
    paths = {}
    for key, path in (("model.path", cfg.model.path),
                      ("reward.judge.model_path",
                       cfg.reward.judge.model_path if cfg.reward.judge.enabled else None)):
        if path and not is_local_model(path):  # built on each node from code
            paths[key] = str(Path(path) / "config.json")
    return paths


def _write_markers(cfg: SluiceConfig) -> dict[str, tuple[str, str]]:
    """Marker files the driver writes into folders every node must share."""
    from envs.cache import default_cache_dir

    folders = {"logging.output_dir": Path(cfg.logging.output_dir).expanduser().resolve()}
    if cfg.model.warm_start is not None:  # the warm-started model is written to the cache
        folders["cache (SLUICE_CACHE_DIR)"] = default_cache_dir()
    markers = {}
    for key, folder in folders.items():
        folder.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(8)
        marker = folder / f".sluice-doctor-{token}"
        marker.write_text(token)
        markers[key] = (str(marker), token)
    return markers


def live_nodes() -> list[Node]:
    import ray

    return [Node(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {})))
            for n in ray.nodes() if n.get("Alive")]


def _on_node(node: Node, fn: Any, **options: Any) -> Any:  # Any: a Ray remote function or actor class, untyped
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return fn.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        node.node_id, soft=False), **options)


class _Listener:
    """A TCP listener on a kernel-picked port, accepting (and closing) connections."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("", 0))
        self.sock.listen(64)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            conn.close()

    def port(self) -> int:
        return self.sock.getsockname()[1]


def _connect(targets: list[tuple[str, int]]) -> list[bool]:
    out = []
    for host, port in targets:
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
            out.append(True)
        except OSError:
            out.append(False)
    return out


def node_labels(nodes: Sequence[Node]) -> dict[str, str]:
    """node id -> its address, with a node-id prefix where several nodes share one address
    (several Ray nodes on one machine)."""
    ips = [n.ip for n in nodes]
    return {n.node_id: n.ip if ips.count(n.ip) == 1 else f"{n.ip}/{n.node_id[:8]}" for n in nodes}


def probe_ports(gpu_nodes: Sequence[Node]) -> dict[tuple[str, str], bool]:
    """(from node, to node) -> whether a TCP connection to a kernel-picked port worked."""
    import ray

    if len(gpu_nodes) < 2:
        return {}
    listener_cls = ray.remote(_Listener)
    listeners = [_on_node(n, listener_cls).remote() for n in gpu_nodes]
    ports = ray.get([listener.port.remote() for listener in listeners])
    connect = ray.remote(_connect)
    results: dict[tuple[str, str], bool] = {}
    refs = []
    label = node_labels(gpu_nodes)
    for src in gpu_nodes:
        dsts = [(n, p) for n, p in zip(gpu_nodes, ports) if n.node_id != src.node_id]
        dsts = dsts[:max(1, MAX_PORT_PAIRS // len(gpu_nodes))]
        ref = _on_node(src, connect).remote([(n.ip, p) for n, p in dsts])
        refs.append((src, dsts, ref))
    for src, dsts, ref in refs:
        for (dst, _), ok in zip(dsts, ray.get(ref)):
            results[(label[src.node_id], label[dst.node_id])] = ok
    for listener in listeners:
        ray.kill(listener)
    return results


# --- collective ----------------------------------------------------------------------------

PROBE_VALUE = 7.0
PROBE_NUMEL = 1 << 20  # 4 MiB of float32: more than a socket buffer, so the bytes really move


class _GroupMember:
    """One rank of the doctor's test group, pinned to a node: rank 0 also serves the
    group's store. Runs the same join and broadcast as a weight push."""

    def __init__(self) -> None:
        self._store: Any = None

    def has_cuda(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def serve(self, timeout_s: float) -> tuple[str, int]:
        import ray

        from rollout.weight_group import build_store
        from trainer.train.weight_sync_nccl import open_listen_socket

        host = ray.util.get_node_ip_address()
        sock = open_listen_socket(host)
        port = int(sock.getsockname()[1])
        self._store = build_store(host, port, timeout_s, listen_socket=sock)
        return host, port

    def broadcast(self, backend: CommBackend, host: str, port: int, rank: int, world_size: int,
                  timeout_s: float) -> str | None:
        """None when this rank received the tensor intact; else what went wrong."""
        import torch

        from rollout.weight_group import (Deadline, abort_quietly, bounded_broadcast,
                                          build_store, build_weight_communicator)

        comm = None
        try:
            store = self._store or build_store(host, port, timeout_s)
            device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
            comm = build_weight_communicator(backend, store, rank, world_size, device, timeout_s)
            tensor = torch.full((PROBE_NUMEL,), PROBE_VALUE if rank == 0 else 0.0, device=device)
            bounded_broadcast(comm, tensor, Deadline(timeout_s))
            wrong = int((tensor != PROBE_VALUE).sum())
            return f"{wrong:,} of {PROBE_NUMEL:,} values arrived wrong" if wrong else None
        except Exception as exc:  # reported as the check's finding, per node
            return f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            abort_quietly(comm)


def collective_nodes(cfg: SluiceConfig, nodes: Sequence[Node]) -> tuple[str, list[Node]]:
    """The weight group's transport and the nodes that would join it: the GPU nodes for
    NCCL, the nodes without the sandbox resource for gloo, none for the cpu transport."""
    from trainer.train.weight_sync import resolve_transport

    try:
        transport = resolve_transport(cfg)
    except ValueError:
        return "nccl", []
    if transport == "nccl":
        return transport, [n for n in nodes if n.offers("GPU") > 0]
    if transport == "gloo":
        return transport, [n for n in nodes if n.offers(cfg.cluster.sandbox_resource) == 0
                           and n.offers("CPU") > 0]
    return transport, []


def probe_collective(cfg: SluiceConfig, nodes: Sequence[Node],
                     stacks: Mapping[str, GpuStack] | None = None) -> list[Check]:
    """A broadcast over the run's weight transport between one rank per node that joins it.
    `stacks` (node id -> its GPU stack, as the doctor probed it): NCCL nodes none of which
    has an NVIDIA driver are a skipped check at once, without starting a rank on each."""
    import ray

    from trainer.run.pools import collective_env

    transport, members = collective_nodes(cfg, nodes)
    if transport == "cpu":
        return [Check(True, "collective", "sync.transport resolves to cpu: the weights travel "
                      "through Ray, no collective group to check")]
    forwarded = collective_env(os.environ)  # what a run's driver would forward
    settings = ", ".join(f"{k}={v}" for k, v in sorted(forwarded.items())) or \
        "no NCCL_*/GLOO_SOCKET_IFNAME set on the driver"
    what = (f"a {transport} broadcast of {PROBE_NUMEL * 4 >> 20} MiB from one node to the "
            f"others ({settings})")
    if len(members) < 2:
        return [Check(True, "collective", f"fewer than two nodes join the weight group: would "
                      f"check {what}")]
    if transport == "nccl" and stacks is not None and members and \
            all(n.node_id in stacks and stacks[n.node_id].driver is None for n in members):
        labels = node_labels(members)
        return [Check(True, "collective", f"skipped: no GPU (no NVIDIA driver on "
                      f"{_few([labels[n.node_id] for n in members])}; logical GPUs only): would "
                      f"check {what}")]
    actor = ray.remote(_GroupMember)
    ranks = [_on_node(n, actor, num_gpus=1 if transport == "nccl" else 0,
                      runtime_env={"env_vars": forwarded}).remote() for n in members]
    timeout_s = cfg.sync.timeout_s
    try:
        if transport == "nccl":
            cuda = ray.get([r.has_cuda.remote() for r in ranks])
            if not all(cuda):
                labels = node_labels(members)
                without = [labels[n.node_id] for n, ok in zip(members, cuda) if not ok]
                return [Check(True, "collective", f"skipped: no GPU (CUDA sees no device on "
                              f"{_few(without)}; logical GPUs only): would check {what}")]
        host, port = ray.get(ranks[0].serve.remote(timeout_s))
        problems = ray.get([r.broadcast.remote(transport, host, port, i, len(ranks), timeout_s)
                            for i, r in enumerate(ranks)], timeout=timeout_s + 60)
    finally:
        for r in ranks:
            ray.kill(r)
    labels = node_labels(members)
    failed = {labels[n.node_id]: p for n, p in zip(members, problems) if p}
    if failed:
        return [Check(False, "collective", f"{what} failed on {len(failed)} of {len(members)} "
                      f"nodes ({_first(failed)}); check the interface (NCCL_SOCKET_IFNAME / "
                      f"GLOO_SOCKET_IFNAME), the firewall between nodes, NCCL_DEBUG=INFO's log")]
    return [Check(True, "collective", f"{what}: every one of {len(members)} nodes received it")]


def run_doctor(cfg: SluiceConfig) -> list[Check]:
    """Every check against the Ray cluster this process is connected to."""
    import ray

    nodes = live_nodes()
    checks = check_pool_resources(plan_pools(cfg), nodes)
    gpu = cfg.cluster.device == "cuda"
    sandbox_nodes = [n for n in nodes if n.offers(cfg.cluster.sandbox_resource) > 0]
    engine_nodes = [n for n in nodes if n.offers("GPU") > 0] if gpu else list(nodes)
    try:
        images, source_dirs = _task_inputs(cfg)
    except (OSError, ValueError) as exc:
        images, source_dirs = [], []
        checks.append(Check(False, "envs.tasks", f"cannot be read on the driver: {exc}"))
    markers = _write_markers(cfg)
    paths = _model_paths(cfg)
    probe = ray.remote(probe_node)
    try:
        refs = {}
        for n in nodes:
            is_sandbox = n in sandbox_nodes
            refs[n.node_id] = _on_node(n, probe).remote(
                paths if n in engine_nodes else {}, markers,
                cfg.envs.sandbox_backend if is_sandbox else None,
                images if is_sandbox else [], source_dirs if is_sandbox else [])
        reports = {n.node_id: ray.get(refs[n.node_id]) for n in nodes}
    finally:
        for marker, _ in markers.values():
            Path(marker).unlink(missing_ok=True)
    labels = node_labels(nodes)
    by_ip = {labels[n.node_id]: n for n in nodes}
    named = {ip: reports[n.node_id] for ip, n in by_ip.items()}
    checks += check_sandbox_nodes({ip: r for ip, r in named.items() if by_ip[ip] in sandbox_nodes},
                                  cfg.envs.sandbox_backend, cfg.cluster.sandbox_resource)
    checks += check_paths({ip: r for ip, r in named.items() if by_ip[ip] in engine_nodes},
                          paths, {})
    checks += check_paths(named, {}, markers)
    gpu_nodes = [n for n in nodes if n.offers("GPU") > 0]
    stacks: dict[str, GpuStack] | None = None
    if gpu:
        found = ray.get([_on_node(n, ray.remote(probe_gpu_stack)).remote() for n in gpu_nodes])
        stacks = {n.node_id: s for n, s in zip(gpu_nodes, found)}
        checks += check_gpu_stacks({labels[n.node_id]: s for n, s in zip(gpu_nodes, found)})
    checks += check_ports(probe_ports(gpu_nodes))
    checks += probe_collective(cfg, nodes, stacks)
    return checks


def parse_argv(argv: list[str]) -> tuple[str | None, list[str], str | None]:
    recipe, overrides, address = None, [], None
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            print(USAGE, end="")
            raise SystemExit(0)  # SystemExit(text) would print it to stderr and exit 1
        if arg == "--address":
            address = next(args, None)
            if address is None:
                raise ValueError("--address needs a value, e.g. --address auto")
        elif arg.startswith("--address="):
            address = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ValueError(f"unknown flag {arg!r}; see --help")
        elif arg.startswith("recipe="):
            recipe = arg.removeprefix("recipe=")
        else:
            overrides.append(arg)
    return recipe, overrides, address


def main(argv: list[str] | None = None) -> int:
    from trainer.run.recipe import load_config

    try:
        recipe, overrides, address = parse_argv(sys.argv[1:] if argv is None else argv)
        cfg = load_config(recipe, overrides)
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    import ray

    from trainer.run.pools import ClusterConnectionError, join_cluster

    address = address or (cfg.cluster.address if cfg.cluster.address != "local" else "auto")
    if not ray.is_initialized():
        try:
            join_cluster(address, log_to_driver=False)
        except ClusterConnectionError as exc:
            print(f"sluice doctor: no Ray cluster to check. {exc}\n(`--address ADDR` names "
                  "another one)", file=sys.stderr)
            return 3
    nodes = live_nodes()
    print(f"sluice doctor: recipe {recipe or '(defaults)'} against the Ray cluster at {address}: "
          f"{len(nodes)} nodes, {sum(n.offers('GPU') for n in nodes):g} GPUs, "
          f"{sum(n.offers(cfg.cluster.sandbox_resource) > 0 for n in nodes)} sandbox nodes "
          f"(run from {os.uname().nodename})")
    checks = run_doctor(cfg)
    print(format_checks(checks))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
