"""Cache pool sizing and bookkeeping: per-sequence slots plus paged block groups.

The model declares its state as a `CacheLayout` (docs/model.md, "Cache layout"): constant-size state per
sequence (window rings, compressor rows) lives in one *slot* per running sequence; state that grows
with the context (compressed entries, indexer keys) lives in fixed-size *blocks*, one pool per block
group. The pool is sized once from the memory budget and preallocated once (first-touch allocation
costs ~0.3 s/GB on the CPU machine); after that this class only hands out and takes back indices.
Sizing counts each state tensor's owner layers only: a layer that reads another layer's copy
(`StateTensor.readers`) takes no memory (`StateTensor.bytes_per_unit`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from deepinfer.engine.request import Request
from deepinfer.models.interface import CacheLayout

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


@dataclass
class CacheStats:
    slots_used: int
    slots_total: int
    blocks_used: dict[str, int]
    blocks_total: dict[str, int]
    peak_usage: float  # highest `usage` seen so far

    @property
    def usage(self) -> float:
        """Fraction of the scarcest resource in use (slots or any block group)."""
        parts = [self.slots_used / max(self.slots_total, 1)]
        parts += [self.blocks_used[n] / max(self.blocks_total[n], 1) for n in self.blocks_total]
        return max(parts)


class CacheManager:
    """Hands out slots and blocks to requests; all-or-nothing, so a failed allocation changes nothing."""

    def __init__(self, layout: CacheLayout, num_slots: int, num_blocks: dict[str, int], block_size: int):
        self.layout = layout
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
        if request.slot is None and not self._free_slots:
            return False
        need = self.blocks_needed(request, num_tokens)
        return all(len(self._free_blocks[n]) >= k for n, k in need.items())

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Make the request hold a slot and blocks for `num_tokens` tokens. False if they do not fit."""
        if not self.can_allocate(request, num_tokens):
            return False
        if request.slot is None:
            request.slot = self._free_slots.pop()
        for name, k in self.blocks_needed(request, num_tokens).items():
            table = request.block_ids.setdefault(name, [])
            for _ in range(k):
                table.append(self._free_blocks[name].pop())
        self._peak = max(self._peak, self.stats().usage)
        return True

    def free(self, request: Request) -> None:
        """Give back everything the request holds (finish or preemption)."""
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None
        for name, table in request.block_ids.items():
            self._free_blocks[name].extend(reversed(table))
        request.block_ids = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def stats(self) -> CacheStats:
        return CacheStats(
            slots_used=self.num_slots - len(self._free_slots), slots_total=self.num_slots,
            blocks_used={n: self.num_blocks[n] - len(f) for n, f in self._free_blocks.items()},
            blocks_total=dict(self.num_blocks), peak_usage=self._peak)
