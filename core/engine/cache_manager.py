"""Cache pool sizing and bookkeeping: per-sequence slots plus paged block groups.

The model declares its state as a `CacheLayout` (docs/model.md, "Cache layout"): constant-size state per
sequence (window rings, compressor rows) lives in one *slot* per running sequence; state that grows
with the context (compressed entries, indexer keys) lives in fixed-size *blocks*, one pool per block
group. The pool is sized once from the memory budget and preallocated once (first-touch allocation
costs ~0.3 s/GB on the CPU machine); after that this class only hands out and takes back indices.
Sizing counts each state tensor's owner layers only: a layer that reads another layer's copy
(`StateTensor.readers`) takes no memory (`StateTensor.bytes_per_unit`).

A prefix cache (the `prefix_cache` feature) attaches here (`attach_prefix_cache`, from its
`deepinfer_engine_start` hook): the scheduler then asks it for the longest cached prefix of a
request it admits and for snapshots at block boundaries; the copies themselves run on the step's
executor, in step order (`PrefixHit.restore`, `PrefixCapture.copy`), so they never race a step in
flight. The protocols below are the whole contract; the core never imports the feature.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from pydantic import BaseModel

from deepinfer.engine.request import Request
from deepinfer.models.interface import CacheLayout, CacheTensors

GiB = 1 << 30


@dataclass(frozen=True)
class PoolSize:
    num_slots: int
    num_blocks: dict[str, int]
    block_size: int
    total_bytes: int
    bytes_per_max_request: int  # one sequence of max_model_len tokens: slot + its blocks


def _blocks_for(entries: int, block_size: int) -> int:
    return -(-entries // block_size)


def bytes_for_request(layout: CacheLayout, num_tokens: int, block_size: int) -> int:
    """Cache bytes one sequence of `num_tokens` tokens needs (its slot plus its blocks)."""
    total = layout.bytes_per_slot()
    for group in layout.block_groups:
        total += _blocks_for(group.entries_for(num_tokens), block_size) * group.bytes_per_entry() * block_size
    return total


def size_pool(layout: CacheLayout, *, budget_bytes: int, max_model_len: int, max_num_seqs: int,
              block_size: int) -> PoolSize:
    """How many slots and blocks fit in `budget_bytes`, never more than max_num_seqs sequences of
    max_model_len tokens can use. Raises ValueError when not even one such sequence fits."""
    slot_bytes = layout.bytes_per_slot()
    block_bytes = {g.name: g.bytes_per_entry() * block_size for g in layout.block_groups}
    max_blocks = {g.name: _blocks_for(g.entries_for(max_model_len), block_size) for g in layout.block_groups}
    one_request = bytes_for_request(layout, max_model_len, block_size)
    if budget_bytes < one_request:
        raise ValueError(
            f"the cache budget of {budget_bytes / GiB:.3f} GiB is too small: one request of "
            f"max_model_len={max_model_len} tokens needs {one_request / GiB:.3f} GiB "
            f"({slot_bytes / GiB:.3f} GiB of per-sequence state plus its compressed-entry blocks). "
            f"Set cache_memory_gb >= {math.ceil(one_request / GiB * 1000) / 1000}, raise "
            f"gpu_memory_utilization, or lower max_model_len.")

    if budget_bytes >= max_num_seqs * one_request:
        num_slots = max_num_seqs
        num_blocks = {name: n * max_num_seqs for name, n in max_blocks.items()}
    else:
        one_request_blocks = one_request - slot_bytes
        num_slots = max(1, min(max_num_seqs, (budget_bytes - one_request_blocks) // max(slot_bytes, 1)))
        remaining = budget_bytes - num_slots * slot_bytes
        # Split the rest so every group holds the same number of tokens of context.
        bytes_per_token = sum(g.bytes_per_entry() / g.tokens_per_entry for g in layout.block_groups)
        capacity_tokens = remaining / bytes_per_token if bytes_per_token else 0
        num_blocks = {}
        for g in layout.block_groups:
            fit = int(capacity_tokens // (g.tokens_per_entry * block_size))
            num_blocks[g.name] = max(max_blocks[g.name], fit)
    total = num_slots * slot_bytes + sum(num_blocks[n] * block_bytes[n] for n in num_blocks)
    return PoolSize(num_slots=num_slots, num_blocks=num_blocks, block_size=block_size,
                    total_bytes=total, bytes_per_max_request=one_request)


class PrefixCacheStats(BaseModel):
    """A prefix cache's counters (`LLM.stats().prefix_cache`, the server's /metrics)."""

    hits: int = 0  # admissions that restored a cached prefix
    misses: int = 0  # admissions that found none
    evictions: int = 0  # cached blocks dropped to stay within the capacity
    prefill_tokens_saved: int = 0  # prompt tokens restored instead of computed
    prefill_tokens_total: int = 0  # tokens admissions had to bring into the cache (saved included)
    blocks: int = 0  # cached blocks now
    bytes_used: int = 0
    bytes_capacity: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)


class PrefixHit(Protocol):
    """What the cache knows of a request's prefix: the length it can restore, the copy that puts it
    into the request's cache, and a longer prefix that other requests shared but whose state was
    never snapshotted (the first chunk then ends there, so that the next request sharing it hits)."""

    num_tokens: int  # restorable tokens, a multiple of the cache's block_tokens (0: none)
    split_at: int  # 0, or a block boundary past num_tokens worth a snapshot

    def restore(self, tensors: CacheTensors, slot: int, block_ids: dict[str, list[int]]) -> None:
        """Write the prefix's state into `slot` and the entries of `block_ids` (runs before the forward)."""


class PrefixCapture(Protocol):
    """A snapshot of a request's state at a block boundary: copied after the step's forward on
    the executor, then committed (keyed by the request's tokens) on the engine thread."""

    end: int  # the prefix length the snapshot holds

    def copy(self, tensors: CacheTensors, slot: int, block_ids: dict[str, list[int]]) -> None: ...

    def commit(self, token_ids: Sequence[int]) -> None:
        """`token_ids`: the request's first `end` tokens (all known by the time the step is applied)."""


class PrefixCache(Protocol):
    block_tokens: int  # snapshots sit at multiples of this many tokens

    def lookup(self, token_ids: Sequence[int], max_tokens: int) -> PrefixHit | None:
        """The longest cached prefix of `token_ids` of at most `max_tokens` tokens (None: nothing known)."""

    def capture(self, token_ids: Sequence[int], end: int) -> PrefixCapture | None:
        """A snapshot at `end` (a multiple of block_tokens) of a request whose known tokens are
        `token_ids` (the last of the first `end` may not be known yet); None if already cached."""

    def record_admission(self, num_tokens: int, hit_tokens: int) -> None:
        """Count an admission of `num_tokens` tokens of which `hit_tokens` came from the cache."""

    def stats(self) -> PrefixCacheStats: ...


def copy_sequence_state(tensors: CacheTensors, src_slot: int, src_blocks: dict[str, list[int]], dst_slot: int,
                        dst_blocks: dict[str, list[int]]) -> None:
    """Make sequence `dst` hold `src`'s state: its slot, and its blocks' entries in `dst`'s blocks
    (as many blocks as both hold). A fork of a prompt's samples (scheduler) runs it on the executor,
    after the step that wrote `src`."""
    for t in tensors.slot.values():
        t[:, dst_slot].copy_(t[:, src_slot])
    size = tensors.block_size
    for group, by_name in tensors.blocks.items():
        src, dst = src_blocks.get(group, []), dst_blocks.get(group, [])
        k = min(len(src), len(dst))
        if not k:
            continue
        offsets = torch.arange(size)
        device = next(iter(by_name.values())).device
        src_rows = (torch.tensor(src[:k]).unsqueeze(1) * size + offsets).view(-1).to(device)
        dst_rows = (torch.tensor(dst[:k]).unsqueeze(1) * size + offsets).view(-1).to(device)
        for t in by_name.values():
            t.index_copy_(1, dst_rows, t.index_select(1, src_rows))


@dataclass
class CacheStats:
    slots_used: int
    slots_total: int
    blocks_used: dict[str, int]
    blocks_total: dict[str, int]
    peak_usage: float  # highest `usage` seen so far
    prefix_cache: PrefixCacheStats | None = None  # None: no prefix cache

    @property
    def usage(self) -> float:
        """Fraction of the scarcest resource in use (slots or any block group)."""
        parts = [self.slots_used / max(self.slots_total, 1)]
        parts += [self.blocks_used[n] / max(self.blocks_total[n], 1) for n in self.blocks_total]
        return max(parts)


class CacheManager:
    """Hands out slots and blocks to requests; all-or-nothing, so a failed allocation changes nothing."""

    def __init__(self, layout: CacheLayout, num_slots: int, num_blocks: dict[str, int], block_size: int,
                 tensors: CacheTensors | None = None):
        self.layout = layout
        #: the preallocated state the pool indexes (None for pools built without one, e.g. in tests)
        self.tensors = tensors
        #: the prefix cache a feature attached (None: off)
        self.prefix_cache: PrefixCache | None = None
        self.block_size = block_size
        self.groups = {g.name: g for g in layout.block_groups}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._free_blocks = {name: list(range(n - 1, -1, -1)) for name, n in num_blocks.items()}
        self.num_slots = num_slots
        self.num_blocks = dict(num_blocks)
        self._peak = 0.0

    def blocks_needed(self, request: Request, num_tokens: int) -> dict[str, int]:
        """Extra blocks per group for the request to hold `num_tokens` tokens of state."""
        need = {}
        for name, group in self.groups.items():
            want = _blocks_for(group.entries_for(num_tokens), self.block_size)
            need[name] = max(0, want - len(request.block_ids.get(name, ())))
        return need

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self._fits(request, self.blocks_needed(request, num_tokens))

    def _fits(self, request: Request, need: dict[str, int]) -> bool:
        if request.slot is None and not self._free_slots:
            return False
        return all(len(self._free_blocks[n]) >= k for n, k in need.items())

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Make the request hold a slot and blocks for `num_tokens` tokens. False if they do not fit."""
        need = self.blocks_needed(request, num_tokens)
        if not self._fits(request, need):
            return False
        if request.slot is not None and not any(need.values()):
            return True  # most decode steps: nothing new to hold, the peak is unchanged
        if request.slot is None:
            request.slot = self._free_slots.pop()
        for name, k in need.items():
            table = request.block_ids.setdefault(name, [])
            for _ in range(k):
                table.append(self._free_blocks[name].pop())
        self._peak = max(self._peak, self._stats(with_prefix=False).usage)
        return True

    def free(self, request: Request) -> None:
        """Give back everything the request holds (finish or preemption)."""
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None
        for name, table in request.block_ids.items():
            self._free_blocks[name].extend(reversed(table))
        request.block_ids = {}

    def attach_prefix_cache(self, prefix_cache: PrefixCache) -> None:
        """Let the scheduler reuse cached prefixes (called by the prefix_cache feature at engine start)."""
        if self.tensors is None:
            raise ValueError("a prefix cache needs the pool's cache tensors; build the CacheManager with tensors=")
        for g in self.layout.block_groups:
            if prefix_cache.block_tokens % g.tokens_per_entry:
                raise ValueError(f"prefix cache block_tokens={prefix_cache.block_tokens} is not a multiple of block "
                                 f"group {g.name!r}'s {g.tokens_per_entry} tokens per entry")
        self.prefix_cache = prefix_cache

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def stats(self) -> CacheStats:
        return self._stats(with_prefix=True)

    def _stats(self, with_prefix: bool) -> CacheStats:
        return CacheStats(
            slots_used=self.num_slots - len(self._free_slots), slots_total=self.num_slots,
            blocks_used={n: self.num_blocks[n] - len(f) for n, f in self._free_blocks.items()},
            blocks_total=dict(self.num_blocks), peak_usage=self._peak,
            prefix_cache=self.prefix_cache.stats() if with_prefix and self.prefix_cache is not None else None)
