"""Which prompt prefixes each engine holds in its KV cache, from vLLM's own KV cache
events (`kv_events_config`: blocks stored, blocks removed, all cleared), for routing a
turn to the engine that holds most of its prefix (rollout.routing=residency).

- Engine side (`KvEventLog`, fed by VLLMEngine from vLLM's event stream): vLLM's block
  hashes are turned into keys of the blocks' content (`block_keys`: the token ids of the
  block and of every block before it, and the request's cache salt), which a router can
  compute from a prompt alone. Each batch gets a sequence number; the log keeps the last
  `max_batches` of them. An engine with an offload tier (rollout.kv_offload) publishes
  the tier's stores and removals too, under their medium ("CPU", "STORAGE"; the pool's is
  "GPU"): a key is held while any medium holds it, since a prefix in the tier is loaded,
  not recomputed. Stores and removals are counted per medium, as vLLM asks of a consumer
  (a tier announces a block once per chunk it is part of).
- Router side (`ResidencyView`): per engine, the set of keys it holds, updated from
  `KvEventLog.since(seq)` deltas on the router's load poll and, at once, with the blocks of
  the prompts it sends there (they are stored when the prefill runs). The view is bounded
  and approximate by design: a lost or late event costs a prefix-cache miss, never a wrong
  answer; an engine whose cache salt changes (a weight push under kv_after_push=recompute,
  where the older blocks are never hit again) starts an empty view.

Keys are Python hashes of int tuples: the same in every process of one Python build (a
string's hash is not: the salt enters as its CRC32)."""

from __future__ import annotations

import itertools
import threading
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

ROOT_KEY = 0x5C1CE  # the parent of every prompt's first block
POOL_MEDIUM = "GPU"  # vLLM's medium of the engine's own KV pool (its events' default)


def salt_code(salt: str | None) -> int:
    """The int a cache salt enters a first block's key as (0: no salt)."""
    return zlib.crc32(salt.encode()) if salt else 0


def block_keys(token_ids: Sequence[int] | np.ndarray, block_size: int, salt: str | None,
               known: Sequence[int] = ()) -> list[int]:
    """The keys of every full block of `token_ids`, chained from the first. `known`: the
    keys of a prefix of those blocks already computed (a turn's prompt is the last
    prompt plus its output and observation): only the blocks after it are hashed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else list(token_ids)
    full = len(ids) // block_size
    keys = list(known[:full])
    parent = keys[-1] if keys else None
    for b in range(len(keys), full):
        chunk = ids[b * block_size:(b + 1) * block_size]
        parent = hash((ROOT_KEY, salt_code(salt), *chunk) if parent is None else (parent, *chunk))
        keys.append(parent)
    return keys


@dataclass(frozen=True, slots=True)
class KvResidencyDelta:
    """What an engine stored and removed after batch `since` up to batch `seq`."""

    seq: int  # the last batch included: the next call's `since`
    block_size: int  # 0 until the engine published its first stored block
    salt: str | None  # the cache salt the engine's requests carry now
    stored: tuple[int, ...]  # keys held at `seq` that were stored since, oldest first
    removed: tuple[int, ...]  # keys gone at `seq` (disjoint from stored)
    cleared: bool  # the engine dropped every block (a prefix-cache reset) before `stored`
    lost: bool  # batches after `since` were dropped by the log's bound: the view is behind


class KvEventLog:
    """vLLM's KV events of one engine as keys (engine side). Thread-safe: vLLM's event
    stream is read on a thread of its own, the router asks on the event loop."""

    def __init__(self, max_batches: int = 4096, max_blocks: int = 1 << 20) -> None:
        self._lock = threading.Lock()
        self._keys: OrderedDict[int | bytes, int] = OrderedDict()  # vLLM's block hash -> key
        self._holders: dict[int, dict[str, int]] = {}  # key -> medium -> stores not yet removed
        self._max_blocks = max_blocks
        # (seq, stored, removed, cleared, gap): gap when vLLM's own sequence skipped
        # before this batch (its publisher drops batches past its high-water mark)
        self._log: deque[tuple[int, tuple[int, ...], tuple[int, ...], bool, bool]] = deque(maxlen=max_batches)
        self._seq = 0
        self.block_size = 0
        self.num_unchained = 0  # stored blocks whose parent was never seen (skipped)
        # Stored blocks without token ids (a tier's events without vLLM's
        # self_describing_kv_events): they cannot be keyed, so they are skipped.
        self.num_undescribed = 0

    def add_batch(self, events: Iterable[tuple], gap: bool = False) -> None:
        """One batch of vLLM's events, each ("stored", parent_hash, block_hashes,
        token_ids, block_size, extra_keys[, medium]), ("removed", block_hashes[, medium]) or
        ("cleared",) (the pool's blocks); medium None is the pool's. `gap`: batches before
        it never arrived."""
        held: dict[int, bool] = {}  # key -> stored (True) or removed (False), in event order
        cleared = False
        with self._lock:
            for event in events:
                kind = event[0]
                if kind == "stored":
                    medium = (event[6] if len(event) > 6 else None) or POOL_MEDIUM
                    _net(held, self._hold(self._stored(*event[1:6]), medium), True)
                elif kind == "removed":
                    medium = (event[2] if len(event) > 2 else None) or POOL_MEDIUM
                    _net(held, self._unhold(event[1], medium), False)
                elif kind == "cleared":
                    if all(set(m) == {POOL_MEDIUM} for m in self._holders.values()):
                        self._keys.clear()
                        self._holders.clear()
                        held, cleared = {}, True
                    else:  # the tier keeps its blocks: only those held by the pool alone go
                        _net(held, self._unhold([h for h, k in self._keys.items()
                                                 if POOL_MEDIUM in self._holders.get(k, {})],
                                                POOL_MEDIUM, every=True), False)
            self._append(held, cleared, gap)

    def _hold(self, keys: list[int], medium: str) -> list[int]:
        """Count a store of `keys` in `medium`; the keys no medium held before."""
        new = []
        for key in keys:
            media = self._holders.setdefault(key, {})
            if not media:
                new.append(key)
            media[medium] = media.get(medium, 0) + 1
        return new

    def _unhold(self, hashes: Iterable[int | bytes], medium: str, every: bool = False) -> list[int]:
        """Count a removal of `hashes` from `medium` (`every`: all of its stores); the keys
        no medium holds any more. A hash never stored (or forgotten) is ignored."""
        gone = []
        for h in hashes:
            key = self._keys.get(h)
            media = self._holders.get(key) if key is not None else None
            if key is None or not media or medium not in media:
                continue
            media[medium] = 0 if every else media[medium] - 1
            if media[medium] <= 0:
                del media[medium]
            if not media:
                del self._holders[key]
                del self._keys[h]
                gone.append(key)
        return gone

    def add_keys(self, stored: Sequence[int], removed: Sequence[int], cleared: bool = False) -> None:
        """One batch already in keys (an engine that is not vLLM: the simulator's); a clear
        comes before the batch's removals, and removals before its stores."""
        held: dict[int, bool] = {}
        _net(held, removed, False)
        _net(held, stored, True)
        with self._lock:
            self._append(held, cleared, False)

    def _append(self, held: dict[int, bool], cleared: bool, gap: bool) -> None:
        self._seq += 1
        self._log.append((self._seq, tuple(k for k, v in held.items() if v),
                          tuple(k for k, v in held.items() if not v), cleared, gap))

    def _stored(self, parent_hash: int | bytes | None, block_hashes: Sequence[int | bytes],
                token_ids: Sequence[int], block_size: int,
                extra_keys: Sequence[tuple | None] | None) -> list[int]:
        if block_size <= 0 or len(token_ids) < len(block_hashes) * block_size:
            self.num_undescribed += len(block_hashes)
            return []
        self.block_size = block_size
        parent = None
        if parent_hash is not None:
            parent = self._keys.get(parent_hash)
            if parent is None:  # its parent's event was missed: these cannot be keyed
                self.num_unchained += len(block_hashes)
                return []
        keys = []
        for b, h in enumerate(block_hashes):
            chunk = token_ids[b * block_size:(b + 1) * block_size]
            if parent is None and h in self._keys:  # a first block another medium keyed
                # (a tier's event has no cache salt in its extra keys; the pool's had it)
                parent = self._keys[h]
            elif parent is None:  # a first block: vLLM puts the request's cache salt in its extra keys
                # (after a LoRA name, which would be the first string: no LoRA is served here)
                extra = extra_keys[b] if extra_keys else None
                salt = next((x for x in extra or () if isinstance(x, str)), None)
                parent = hash((ROOT_KEY, salt_code(salt), *chunk))
            else:
                parent = hash((parent, *chunk))
            self._keys[h] = parent
            self._keys.move_to_end(h)
            keys.append(parent)
        while len(self._keys) > self._max_blocks:
            self._holders.pop(self._keys.popitem(last=False)[1], None)
        return keys

    def since(self, seq: int, salt: str | None) -> KvResidencyDelta:
        """The batches after `seq` (0: from the start of the log); `salt`: the cache salt
        of the engine's requests now."""
        with self._lock:
            # Sequence numbers are contiguous: the first batch after `seq` is found by index.
            first = self._log[0][0] if self._log else self._seq + 1
            batches = list(itertools.islice(self._log, max(0, seq + 1 - first), None))
            lost = (seq < self._seq and (not batches or batches[0][0] > seq + 1)) or any(b[4] for b in batches)
            cleared_at = max((i for i, b in enumerate(batches) if b[3]), default=-1)
            if cleared_at >= 0:  # what came before a clear no longer matters
                batches = batches[cleared_at:]
            # The net effect, batch by batch: a block stored and then evicted between two
            # reads is gone, and one evicted and then stored again is held.
            held: dict[int, bool] = {}
            for _, stored, removed, _, _ in batches:
                _net(held, removed, False)
                _net(held, stored, True)
            return KvResidencyDelta(
                seq=self._seq, block_size=self.block_size, salt=salt,
                stored=tuple(k for k, v in held.items() if v),
                removed=tuple(k for k, v in held.items() if not v),
                cleared=cleared_at >= 0, lost=lost)


def _net(held: dict[int, bool], keys: Iterable[int], stored: bool) -> None:
    """Record the latest of a key's events (stored or removed), keeping event order."""
    for key in keys:
        held.pop(key, None)
        held[key] = stored


class ResidencyView:
    """Per engine, the keys of the blocks it holds as far as this router knows (router
    side). At most `max_blocks` per engine: past that the oldest are forgotten."""

    def __init__(self, max_blocks: int = 1 << 18) -> None:
        self._max_blocks = max_blocks
        self._held: dict[str, OrderedDict[int, None]] = {}
        self._seq: dict[str, int] = {}
        self._block_size: dict[str, int] = {}
        self._salt: dict[str, str | None] = {}
        self.num_lost = 0  # deltas that said events were dropped before this router read them

    def seq(self, engine: str) -> int:
        return self._seq.get(engine, 0)

    def knows(self, engine: str) -> bool:
        """The engine published a block size: keys can be computed for it."""
        return self._block_size.get(engine, 0) > 0

    def block_size(self, engine: str) -> int:
        return self._block_size.get(engine, 0)

    def salt(self, engine: str) -> str | None:
        return self._salt.get(engine)

    def num_blocks(self) -> int:
        return sum(len(h) for h in self._held.values())

    def apply(self, engine: str, delta: KvResidencyDelta) -> None:
        held = self._held.setdefault(engine, OrderedDict())
        if delta.cleared or delta.salt != self._salt.get(engine, delta.salt):
            held.clear()  # a reset, or blocks of another salt that are never hit again
        self.num_lost += delta.lost
        self._seq[engine] = delta.seq
        self._salt[engine] = delta.salt
        if delta.block_size:
            self._block_size[engine] = delta.block_size
        for key in delta.removed:
            held.pop(key, None)
        self.add(engine, delta.stored)

    def add(self, engine: str, keys: Iterable[int]) -> None:
        """Blocks the engine holds now or will once the prefill just sent runs."""
        held = self._held.setdefault(engine, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self._max_blocks:
            held.popitem(last=False)

    def held_blocks(self, engine: str, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first, the engine holds (a prefix cache hits only
        a prefix)."""
        held = self._held.get(engine)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def drop(self, engine: str) -> None:
        """Forget an engine that left the router."""
        for table in (self._held, self._seq, self._block_size, self._salt):
            table.pop(engine, None)
