"""Engine model: one continuous-batching inference engine under a caller-driven clock.

Time per step follows the seed's accounts:
- a decode step reads this GPU's share of the weights and of every running sequence's KV
  from HBM: (weight bytes + running context tokens x KV bytes) / (tp x bandwidth);
- prefill is compute-bound, 2 FLOPs per parameter per computed token (the planner's formula).

Memory follows vLLM's block pool: the KV pool is cut into blocks of `block_tokens`, a
request takes the blocks of its whole context and output at admission, and when it ends
its full blocks stay cached, evictable in LRU order (a request's tail blocks before its
head), so the next turn of the same trajectory hits whatever of its prefix is still there.
The first `shared_tokens` of a request (the task prompt that a group's G trajectories
share) are cached under the task's key, so siblings hit them too.

After a weight push under rollout.kv_after_push=recompute (`new_salt`), cached blocks are
keyed by the salt (the version) they were computed under, as vLLM's cache_salt does: the
older ones are never hit again and age out in LRU order. Under reuse they keep hitting.

An offload tier (`tier_bytes`: rollout.kv_offload, a host-memory tier of vLLM's offload
connectors) holds, write-through and LRU, the full blocks of every finished request: a
prefix the pool evicted but the tier holds is loaded at `tier_bytes_per_s` instead of
being prefilled (counted as hits, and as tier hits). Loads run as vLLM's connectors run
them, asynchronously: the request waits for its load on the engine's one transfer channel
(loads queue there, in order) while the engine prefills and decodes the others, and it is
prefilled once its load is in. So a load costs its request latency, not engine time.

With `record_blocks`, the model also lists what happens to its cached entries
(`take_block_events`): an entry cached with n blocks, an entry cut to n blocks by
eviction (its tail first), every entry cleared; in the pool, and in the tier (its own
medium, as vLLM's connectors publish the tier's blocks). `SimEngine` turns them into the
KV events a residency router reads, as vLLM's `kv_events_config` publishes them.

Simplifications, and why they are small at the seed's scale:
- prefill runs ahead of decode, one request at a time, with decode paused (vLLM mixes
  them in chunks; the busy time is the same, a waiting request sees its prefill later or
  earlier by at most the queue in front of it);
- blocks for a turn's whole output are taken at admission, so nothing is preempted (the
  output is ~1% of a 40K context);
- at least one token of every request is computed, as in vLLM, and only full blocks hit.

Decode is fast-forwarded between events in closed form: with n sequences running, each
step adds n tokens of KV, so m steps take m*a + b*n*m(m-1)/2 seconds. Events are admissions,
prefill ends and completions, never single steps, so 80,000 turns simulate in seconds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from launch.plan import Plan, compute_prefill_s
from rollout.kv_residency import POOL_MEDIUM

TIER_MEDIUM = "CPU"  # the medium vLLM's host-memory tier publishes its blocks under


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine of `tp_size` GPUs: what sets its step times and the size of its KV pool."""

    params_b: float
    dtype_bytes: int
    kv_bytes_per_token: int
    kv_pool_bytes: float  # the whole engine's pool, over all its GPUs
    tp_size: int = 1
    hbm_bytes_per_s: float = 2e12  # achieved, per GPU
    gpu_flops: float = 989e12
    mfu_prefill: float = 0.5
    block_tokens: int = 16
    max_num_seqs: int = 256
    tier_bytes: float = 0.0  # the engine's offload tier (0: none)
    tier_bytes_per_s: float = 25e9  # loading from it (host memory over PCIe)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"kv_pool_bytes={self.kv_pool_bytes:g} holds no block of "
                             f"{self.block_tokens} tokens x {self.kv_bytes_per_token} bytes; "
                             "raise the KV pool")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")

    @property
    def num_blocks(self) -> int:
        return int(self.kv_pool_bytes // (self.kv_bytes_per_token * self.block_tokens))

    @property
    def num_tier_blocks(self) -> int:
        return int(self.tier_bytes // (self.kv_bytes_per_token * self.block_tokens))

    def tier_load_s(self, blocks: int) -> float:
        return blocks * self.block_tokens * self.kv_bytes_per_token / self.tier_bytes_per_s

    def decode_step_s(self, running_context_tokens: float) -> float:
        """One decode step over sequences holding `running_context_tokens` of KV in all."""
        weight_bytes = self.params_b * 1e9 * self.dtype_bytes
        return (weight_bytes + running_context_tokens * self.kv_bytes_per_token) \
            / (self.tp_size * self.hbm_bytes_per_s)

    def prefill_s(self, tokens: float) -> float:
        return compute_prefill_s(self.params_b * 1e9, tokens, self.tp_size, self.gpu_flops,
                                 self.mfu_prefill)


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One turn's generate call, by sizes: the ids are the agent loop's business."""

    request_id: str
    session: str  # the trajectory: its turns form one prefix chain
    context_tokens: int  # tokens sent (everything so far, prompt included)
    new_tokens: int  # tokens this turn generates (>= 1)
    shared_key: str | None = None  # the task: its group's trajectories share the prompt
    shared_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    submitted_s: float
    admitted_s: float  # KV blocks allocated (after waiting for room)
    first_token_s: float  # prefill done
    finished_s: float
    cached_tokens: int
    prefilled_tokens: int
    new_tokens: int


@dataclass(frozen=True, slots=True)
class EngineModelStats:
    """Counters like vLLM's (`vllm:prefix_cache_queries` / `_hits` are token counts)."""

    num_running: int
    num_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefill_tokens: int
    generated_tokens: int
    prefill_busy_s: float
    decode_busy_s: float
    num_decode_steps: int
    kv_used_blocks: int
    kv_cached_blocks: int
    kv_total_blocks: int
    evicted_blocks: int
    tier_hits: int = 0  # of prefix_cache_hits, tokens loaded from the offload tier
    tier_load_s: float = 0.0  # the transfer channel's busy time: not engine time


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """A cached entry's new size in `medium` (the pool, or the tier): `key` ("task" or
    "traj", the task or the trajectory, the salt) holds its first `blocks` blocks there
    now (0: gone). `key` None: all of the medium's cleared."""

    key: tuple[str, str, int] | None
    blocks: int
    medium: str = POOL_MEDIUM


@dataclass(slots=True)
class _Seq:
    request: SimRequest
    submitted_s: float
    admitted_s: float
    cached_tokens: int
    own_blocks: int
    shared_blocks: int
    first_token_s: float = 0.0
    kv_base: int = 0  # KV tokens at global step k are kv_base + k while it runs
    salt: int = 0  # the salt its blocks are cached under


class EngineModel:
    """A simulated engine: `submit` and `advance` take the current time, completions come
    back from `advance`; `next_event_s` says when to call it again if nothing arrives."""

    def __init__(self, spec: EngineSpec, record_blocks: bool = False) -> None:
        self.spec = spec
        self._block_events: list[BlockEvent] | None = [] if record_blocks else None
        self._clock = 0.0
        self._step = 0  # decode steps done so far
        self._waiting: deque[tuple[SimRequest, float]] = deque()
        # Admitted requests waiting for their prefill, by the time they are ready.
        self._ready: list[tuple[float, int, _Seq]] = []
        self._prefilling: _Seq | None = None
        self._prefill_end: float | None = None
        self._load_free_s = 0.0  # when the transfer channel from the tier is free
        self._running: list[tuple[int, int, _Seq]] = []  # heap of (done step, tiebreak, seq)
        self._kv_sum_base = 0  # running KV tokens at step k: _kv_sum_base + len(running) x k
        self._tiebreak = itertools.count()
        self._done: list[Completion] = []
        # KV blocks: in use by admitted requests, or cached (evictable, LRU first).
        self._used = 0
        self._cache: OrderedDict[tuple[str, str, int], int] = OrderedDict()  # (kind, key, salt)
        self._cached_total = 0
        self._shared_in_use: dict[tuple[str, int], list[int]] = {}  # (task, salt) -> [blocks, references]
        self._salt = 0
        self._tier: OrderedDict[tuple[str, str, int], int] = OrderedDict()  # write-through, LRU
        self._tier_total = 0
        self._tier_hits = 0
        self._tier_load_s = 0.0
        self._queries = self._hits = self._prefill_tokens = self._generated = 0
        self._prefill_busy_s = self._decode_busy_s = 0.0
        self._evicted = 0

    # --- the interface ---------------------------------------------------------------

    def submit(self, now: float, request: SimRequest) -> None:
        if request.new_tokens < 1 or request.context_tokens < 1:
            raise ValueError(f"{request.request_id}: context_tokens and new_tokens must be >= 1")
        need = math.ceil((request.context_tokens + request.new_tokens) / self.spec.block_tokens)
        if need > self.spec.num_blocks:
            raise ValueError(f"{request.request_id} needs {need} KV blocks, the engine has "
                             f"{self.spec.num_blocks}: raise the KV pool or shorten the context")
        self._run_until(now)
        self._waiting.append((request, now))
        self._admit_waiting()
        self._run_until(now)

    def advance(self, now: float) -> list[Completion]:
        """Run the engine up to `now`; the requests finished by then, in order."""
        self._run_until(now)
        done, self._done = self._done, []
        return done

    def next_event_s(self) -> float | None:
        """When the engine's state next changes by itself (None: idle)."""
        if self._prefill_end is not None:
            return self._prefill_end
        if self._running:
            return self._clock + self._steps_s(self._steps_to_next_event())
        if self._ready:  # idle until a load lands
            return self._ready[0][0]
        return None

    def new_salt(self) -> None:
        """Requests from now on carry a new cache salt (a push under recompute): no block
        cached before is hit again, in the pool or the tier."""
        self._salt += 1

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; like vLLM, refuse (False) while requests hold blocks."""
        if self._used or self._waiting:
            return False
        self._cache.clear()
        self._cached_total = 0
        self._note_blocks(None, 0)
        return True

    def take_block_events(self) -> list[BlockEvent]:
        """The cached entries' changes since the last call (none unless `record_blocks`)."""
        if not self._block_events:
            return []
        events, self._block_events = self._block_events, []
        return events

    def _note_blocks(self, key: tuple[str, str, int] | None, blocks: int,
                     medium: str = POOL_MEDIUM) -> None:
        if self._block_events is not None:
            self._block_events.append(BlockEvent(key, blocks, medium))

    def stats(self) -> EngineModelStats:
        return EngineModelStats(
            num_running=len(self._running) + len(self._ready) + (self._prefilling is not None),
            num_waiting=len(self._waiting), prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits, prefill_tokens=self._prefill_tokens,
            generated_tokens=self._generated, prefill_busy_s=self._prefill_busy_s,
            decode_busy_s=self._decode_busy_s, num_decode_steps=self._step,
            kv_used_blocks=self._used, kv_cached_blocks=self._cached_total,
            kv_total_blocks=self.spec.num_blocks, evicted_blocks=self._evicted,
            tier_hits=self._tier_hits, tier_load_s=self._tier_load_s)

    # --- time ------------------------------------------------------------------------

    def _run_until(self, now: float) -> None:
        while True:
            if self._prefill_end is not None:
                if self._prefill_end > now:
                    return
                self._clock = self._prefill_end
                self._finish_prefill()
                continue
            ready = self._ready[0][0] if self._ready else None
            if ready is not None and ready <= self._clock:
                self._start_prefill()
                continue
            if not self._running:
                if ready is not None and ready <= now:  # idle until its load landed
                    self._clock = ready
                    continue
                self._clock = max(self._clock, now)
                return
            m = self._steps_to_next_event()
            if self._clock + self._steps_s(m) > now:
                self._decode(self._steps_fitting(now - self._clock))
                return
            self._decode(m)

    def _steps_to_next_event(self) -> int:
        """Decode steps to the next completion, or to the first step boundary at or after
        a queued admission (prefill waits for the step in progress)."""
        m = self._running[0][0] - self._step
        if self._ready:  # the steps that end before it, then the one in progress
            m = min(m, max(1, self._steps_fitting(self._ready[0][0] - self._clock)))
        return m

    def _steps_s(self, m: int) -> float:
        """Seconds of the next m decode steps with the running set unchanged."""
        n = len(self._running)
        kv_now = self._kv_sum_base + n * self._step
        per_token = self.spec.decode_step_s(1) - self.spec.decode_step_s(0)
        return m * self.spec.decode_step_s(kv_now) + per_token * n * m * (m - 1) / 2

    def _steps_fitting(self, seconds: float) -> int:
        """The most whole decode steps that end within `seconds`."""
        if seconds <= 0:
            return 0
        n = len(self._running)
        a = self.spec.decode_step_s(self._kv_sum_base + n * self._step)
        c = (self.spec.decode_step_s(1) - self.spec.decode_step_s(0)) * n / 2
        if a <= 0 and c <= 0:  # zero-latency decode: any number of steps fits
            return self._running[0][0] - self._step
        m = int(seconds / a) if c == 0 else \
            int((-(a - c) + math.sqrt((a - c) ** 2 + 4 * c * seconds)) / (2 * c))
        while self._steps_s(m + 1) <= seconds:  # float rounding of the root
            m += 1
        while m > 0 and self._steps_s(m) > seconds:
            m -= 1
        return m

    def _decode(self, m: int) -> None:
        if m <= 0:
            return
        seconds = self._steps_s(m)
        self._clock += seconds
        self._decode_busy_s += seconds
        self._step += m
        self._generated += m * len(self._running)
        while self._running and self._running[0][0] == self._step:
            self._finish(heapq.heappop(self._running)[2])
        self._admit_waiting()

    def _start_prefill(self) -> None:
        seq = heapq.heappop(self._ready)[2]
        tokens = seq.request.context_tokens - seq.cached_tokens
        self._prefill_tokens += tokens
        seconds = self.spec.prefill_s(tokens)
        self._prefill_busy_s += seconds
        self._prefilling = seq
        self._prefill_end = self._clock + seconds

    def _finish_prefill(self) -> None:
        seq = self._prefilling
        assert seq is not None
        self._prefilling = None
        self._prefill_end = None
        seq.first_token_s = self._clock
        self._generated += 1  # the prefill step samples the first token
        left = seq.request.new_tokens - 1
        if left == 0:
            self._finish(seq)
            self._admit_waiting()
            return
        # KV at step k: the context, the first token, and one more per step since joining.
        seq.kv_base = seq.request.context_tokens + 1 - self._step
        self._kv_sum_base += seq.kv_base
        heapq.heappush(self._running, (self._step + left, next(self._tiebreak), seq))

    def _finish(self, seq: _Seq) -> None:
        r = seq.request
        self._kv_sum_base -= seq.kv_base  # 0 for a request that never decoded
        self._done.append(Completion(
            request_id=r.request_id, submitted_s=seq.submitted_s, admitted_s=seq.admitted_s,
            first_token_s=seq.first_token_s, finished_s=self._clock,
            cached_tokens=seq.cached_tokens, prefilled_tokens=r.context_tokens - seq.cached_tokens,
            new_tokens=r.new_tokens))
        self._release(seq)

    # --- KV blocks -------------------------------------------------------------------

    def _admit_waiting(self) -> None:
        while self._waiting and self._try_admit(*self._waiting[0]):
            self._waiting.popleft()  # FIFO: a request that does not fit holds the others

    def _try_admit(self, r: SimRequest, submitted_s: float) -> bool:
        if len(self._running) + len(self._ready) + (self._prefilling is not None) >= self.spec.max_num_seqs:
            return False
        bs = self.spec.block_tokens
        total = math.ceil((r.context_tokens + r.new_tokens) / bs)
        shared = min(r.shared_tokens, r.context_tokens) // bs if r.shared_key else 0
        task = r.shared_key or ""
        salt = self._salt
        shared_key, own_key = ("task", task, salt), ("traj", r.session, salt)
        in_use = shared > 0 and (task, salt) in self._shared_in_use
        shared_cached = self._cache.get(shared_key, 0) if shared and not in_use else 0
        shared_hit = shared if in_use else min(shared_cached, shared)
        own_cached = self._cache.get(own_key, 0)
        own_full = max(0, r.context_tokens // bs - shared)
        # The tier (a copy of every finished request's full blocks) serves what the pool
        # lacks: the rest of the shared head, then the own blocks after the pool's; after
        # a loaded head the own blocks come from the tier too (a hit is one prefix).
        shared_loaded = min(self._tier.get(shared_key, 0), shared) - shared_hit \
            if self._tier and shared_hit < shared else 0
        shared_loaded = max(0, shared_loaded)
        # The own blocks continue the shared ones: without the whole shared head they miss.
        head = shared_hit + shared_loaded == shared
        own_hit = min(own_cached, own_full) if head and shared_loaded == 0 else 0
        own_loaded = max(0, min(self._tier.get(own_key, 0), own_full) - own_hit) if head and self._tier else 0
        need = (total - shared) + (0 if in_use else shared)  # blocks this request adds to use
        # Cached blocks can always be evicted, so only blocks in use can stand in the way.
        if self._used + need > self.spec.num_blocks:
            return False
        # The reused entries leave the cache (their blocks become this request's), the
        # stale rest of them is freed; then evict LRU blocks until `need` are free.
        self._take_from_cache(own_key)
        if shared_cached:
            self._take_from_cache(shared_key)
        self._evict(need - (self.spec.num_blocks - self._used - self._cached_total))
        self._used += need
        if in_use:
            self._shared_in_use[(task, salt)][1] += 1
        elif shared:
            self._shared_in_use[(task, salt)] = [shared, 1]
        # vLLM computes at least the last token of the prompt, in whole blocks.
        limit = (r.context_tokens - 1) // bs * bs
        cached_tokens = min((shared_hit + own_hit + shared_loaded + own_loaded) * bs, limit)
        loaded = max(0, cached_tokens - min((shared_hit + own_hit) * bs, limit)) // bs
        for key in (shared_key, own_key):  # read: the most recent in the tier's LRU order
            if key in self._tier:
                self._tier.move_to_end(key)
        self._queries += r.context_tokens
        self._hits += cached_tokens
        self._tier_hits += loaded * bs
        admitted_s = max(self._clock, submitted_s)
        ready_s = admitted_s
        if loaded:
            load_s = self.spec.tier_load_s(loaded)
            self._tier_load_s += load_s
            ready_s = self._load_free_s = max(admitted_s, self._load_free_s) + load_s
        seq = _Seq(r, submitted_s, admitted_s, cached_tokens, total - shared, shared, salt=salt)
        heapq.heappush(self._ready, (ready_s, next(self._tiebreak), seq))
        return True

    def _take_from_cache(self, key: tuple[str, str, int]) -> None:
        self._cached_total -= self._cache.pop(key, 0)

    def _evict(self, blocks: int) -> None:
        while blocks > 0:
            key, count = next(iter(self._cache.items()))
            take = min(count, blocks)
            # Taking from the count drops the entry's tail blocks: its prefix stays valid.
            if take == count:
                del self._cache[key]
            else:
                self._cache[key] = count - take
            self._cached_total -= take
            self._evicted += take
            blocks -= take
            self._note_blocks(key, count - take)

    def _release(self, seq: _Seq) -> None:
        r, bs = seq.request, self.spec.block_tokens
        self._used -= seq.own_blocks
        # Only full blocks are cacheable; the own entry is evicted before the shared head.
        own_full = max(0, (r.context_tokens + r.new_tokens) // bs - seq.shared_blocks)
        self._cache_blocks(("traj", r.session, seq.salt), own_full)
        if seq.shared_blocks:
            task = (r.shared_key or "", seq.salt)
            entry = self._shared_in_use[task]
            entry[1] -= 1
            if entry[1] == 0:
                del self._shared_in_use[task]
                self._used -= entry[0]
                self._cache_blocks(("task", *task), entry[0])

    def _cache_blocks(self, key: tuple[str, str, int], blocks: int) -> None:
        if blocks <= 0:
            return
        self._cached_total += blocks - self._cache.pop(key, 0)
        self._cache[key] = blocks
        self._note_blocks(key, blocks)
        if self.spec.num_tier_blocks:  # write-through: the tier keeps a copy, LRU
            blocks = min(blocks, self.spec.num_tier_blocks)
            self._tier_total += blocks - self._tier.pop(key, 0)
            self._tier[key] = blocks
            self._note_blocks(key, blocks, TIER_MEDIUM)
            while self._tier_total > self.spec.num_tier_blocks:
                old, count = next(iter(self._tier.items()))
                take = min(count, self._tier_total - self.spec.num_tier_blocks)
                if take == count:
                    del self._tier[old]
                else:
                    self._tier[old] = count - take
                self._tier_total -= take
                self._note_blocks(old, count - take, TIER_MEDIUM)


def build_engine_spec(plan: Plan, block_tokens: int = 16, max_num_seqs: int = 256) -> EngineSpec:
    """One rollout engine of the plan: its tp_size GPUs' share of the KV pool, and the
    offload tier rollout.kv_offload gives it."""
    p = plan.inputs
    tier = plan.kv_offload_gb_per_engine * 1e9 if plan.kv_offload_tier != "none" else 0.0
    return EngineSpec(params_b=p.model_params_b, dtype_bytes=plan.dtype_bytes,
                      kv_bytes_per_token=p.kv_bytes_per_token,
                      kv_pool_bytes=p.kv_pool_gb_per_gpu * 1e9 * plan.tp_size,
                      tp_size=plan.tp_size, hbm_bytes_per_s=plan.hbm_bytes_per_s,
                      gpu_flops=p.gpu_flops, mfu_prefill=p.mfu_prefill,
                      block_tokens=block_tokens, max_num_seqs=max_num_seqs, tier_bytes=tier)
