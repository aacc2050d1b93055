"""The prefix store: model state at block boundaries, keyed by a chained hash of the tokens.

A *node* stands for block k of some token sequence (tokens [(k-1)B, kB)); its key hashes its
parent's key with the block's tokens, so one key names a whole prefix. A node holds

- the block's entries of every block group (its B/m compressed entries and indexer keys of each
  rate m; B is a multiple of every m, so a block boundary is also an entry boundary), and
- optionally the slot state (window rings, compressor raw rows, n-gram history) at length kB.

A cached prefix is a chain of nodes from the first block whose last node has slot state: restoring
it copies the slot state into the request's slot and the chain's entries into its blocks, which is
exactly the state a prefill of those kB tokens leaves (the model's state is a pure function of the
tokens: rings are indexed by absolute position and the compressor's pending window is empty at a
multiple of every ratio). Nothing here depends on the model family: it copies the tensors of the
`CacheLayout` as they are (quantised bytes included).

Eviction is least-recently-used by bytes; a lookup or insert refreshes a chain leaf first, so an
ancestor is always more recent than its descendants, and evicting a node drops its descendants
(they could no longer be reached). All of this runs on the engine thread; the copies run on the
executor through `Hit.restore` and `Capture.copy`, which hold their tensors themselves.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.engine.cache_manager import PrefixCacheStats
from deepinfer.engine.prefix_keys import chain_keys
from deepinfer.models.interface import CacheLayout, CacheTensors

Entries = dict[str, dict[str, torch.Tensor]]  # group -> tensor -> [owners, entries, *shape]
Slot = dict[str, torch.Tensor]  # slot tensor -> [owners, *shape]
HOST = torch.device("cpu")


@dataclass
class Node:
    key: bytes
    parent: bytes | None  # None: the first block
    depth: int  # k: the node covers tokens [(k-1)B, kB)
    entries: Entries
    slot: Slot | None = None
    children: set[bytes] = field(default_factory=set)
    dirty: bool = True  # not yet written to the persistence directory

    @property
    def nbytes(self) -> int:
        tensors = [t for g in self.entries.values() for t in g.values()] + list((self.slot or {}).values())
        return sum(t.numel() * t.element_size() for t in tensors)


def entry_rows(block_ids: list[int], block_size: int, first: int, last: int, device: torch.device) -> torch.Tensor:
    """Rows of entries [first, last) of a sequence in its block group's tensor."""
    e = torch.arange(first, last)
    table = torch.tensor(block_ids, dtype=torch.int64)
    return (table[e // block_size] * block_size + e % block_size).to(device)


def _check_names(what: str, got: object, want: dict) -> None:
    if not isinstance(got, dict) or set(got) != set(want):
        held = sorted(map(str, got)) if isinstance(got, dict) else type(got).__name__
        raise ValueError(f"its {what} are {held}, not this engine's {sorted(want)}")


def _check_tensors(what: str, got: object, want: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    _check_names(f"{what} tensors", got, want)
    for name, (shape, dtype) in want.items():
        t = got[name]
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device != HOST:
            raise ValueError(f"{what} {name!r} is not a dense host tensor")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{what} {name!r} is {t.dtype} {list(t.shape)}, not this engine's {dtype} {list(shape)}")
        if t.is_floating_point() and not torch.isfinite(t.float()).all():
            raise ValueError(f"{what} {name!r} holds non-finite values")


class Hit:
    """A cached prefix found by `lookup`: it keeps its own references to the chain's tensors, so an
    eviction before the step runs changes nothing."""

    def __init__(self, store: PrefixStore, chain: list[Node], split_at: int):
        self.num_tokens = len(chain) * store.block_tokens
        self.split_at = split_at
        self._store = store
        self._entries = [n.entries for n in chain]
        self._slot = chain[-1].slot if chain else None

    def restore(self, tensors: CacheTensors, slot: int, block_ids: dict[str, list[int]]) -> None:
        for name, value in self._slot.items():
            tensors.slot[name][:, slot].copy_(value)
        for group in self._store.layout.block_groups:
            n = self._store.entries_per_block[group.name] * len(self._entries)
            rows = entry_rows(block_ids[group.name], tensors.block_size, 0, n, tensors.blocks[group.name][
                group.tensors[0].name].device)
            for t in group.tensors:
                src = torch.cat([e[group.name][t.name] for e in self._entries], dim=1)
                tensors.blocks[group.name][t.name].index_copy_(1, rows, src.to(rows.device))


class Capture:
    """A snapshot at `end` of a request whose blocks before `first_block` are already cached: `copy`
    takes the new blocks' entries and the slot state (after the step's forward), `commit` stores them
    under the request's tokens."""

    def __init__(self, store: PrefixStore, first_block: int, end: int):
        self.end = end
        self._store = store
        self._first = first_block
        self._entries: Entries | None = None
        self._slot: Slot | None = None

    def copy(self, tensors: CacheTensors, slot: int, block_ids: dict[str, list[int]]) -> None:
        store, k = self._store, self.end // self._store.block_tokens
        self._slot = {name: t[:, slot].to(HOST, copy=True) for name, t in tensors.slot.items()}
        self._entries = {}
        for group in store.layout.block_groups:
            per = store.entries_per_block[group.name]
            rows = entry_rows(block_ids[group.name], tensors.block_size, self._first * per, k * per,
                              tensors.blocks[group.name][group.tensors[0].name].device)
            self._entries[group.name] = {t.name: tensors.blocks[group.name][t.name].index_select(1, rows).to(HOST)
                                         for t in group.tensors}

    def commit(self, token_ids: Sequence[int]) -> None:
        if self._slot is not None:  # None: the step failed before copying
            self._store.insert(token_ids, self._first, self.end, self._entries, self._slot)


class PrefixStore:
    def __init__(self, layout: CacheLayout, block_tokens: int, capacity_bytes: int, seed: bytes = b""):
        bad = [g.name for g in layout.block_groups if block_tokens % g.tokens_per_entry]
        if bad:
            rates = sorted({g.tokens_per_entry for g in layout.block_groups})
            raise ValueError(f"prefix cache block_tokens={block_tokens} is not a multiple of the compression ratios "
                             f"{rates} (block groups {bad}); choose a multiple of all of them")
        self.layout = layout
        self.block_tokens = block_tokens
        self.capacity_bytes = capacity_bytes
        self.entries_per_block = {g.name: block_tokens // g.tokens_per_entry for g in layout.block_groups}
        self._seed = seed
        self.nodes: OrderedDict[bytes, Node] = OrderedDict()  # least recently used first
        self.bytes_used = 0
        self._counts = PrefixCacheStats(bytes_capacity=capacity_bytes)
        self._lock = threading.Lock()  # counters: read by the server's /metrics thread

    # -- the PrefixCache protocol (cache_manager.py) ----------------------------------------------

    def lookup(self, token_ids: Sequence[int], max_tokens: int) -> Hit | None:
        chain = self._chain(chain_keys(token_ids, max_tokens // self.block_tokens, self.block_tokens, self._seed))
        shared = len(chain) * self.block_tokens  # tokens other requests had in common with this one
        while chain and chain[-1].slot is None:
            chain.pop()
        if not shared:
            return None
        self._touch(chain)
        return Hit(self, chain, split_at=shared if shared > len(chain) * self.block_tokens else 0)

    def capture(self, token_ids: Sequence[int], end: int) -> Capture | None:
        k = end // self.block_tokens
        known = min(len(token_ids) // self.block_tokens, k)
        chain = self._chain(chain_keys(token_ids, known, self.block_tokens, self._seed))
        if len(chain) == k and chain[-1].slot is not None:
            self._touch(chain)
            return None  # already cached
        return Capture(self, len(chain), end)  # the blocks before len(chain) are cached already

    def record_admission(self, num_tokens: int, hit_tokens: int) -> None:
        with self._lock:
            c = self._counts
            c.hits += bool(hit_tokens)
            c.misses += not hit_tokens
            c.prefill_tokens_saved += hit_tokens
            c.prefill_tokens_total += num_tokens

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return self._counts.model_copy(update={"blocks": len(self.nodes), "bytes_used": self.bytes_used})

    # -- blocks read from disk ---------------------------------------------------------------------

    def _expected(self) -> tuple[dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]],
                                 dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        """(entries, slot): each tensor's shape and dtype in a block of this store."""
        entries = {g.name: {t.name: ((len(t.owners), self.entries_per_block[g.name], *t.shape), t.dtype)
                            for t in g.tensors} for g in self.layout.block_groups}
        slot = {t.name: ((len(t.owners), *t.shape), t.dtype) for t in self.layout.slot_tensors}
        return entries, slot

    @property
    def max_block_bytes(self) -> int:
        """The tensor bytes of one block with slot state: a cache file cannot hold more."""
        return (sum(self.entries_per_block[g.name] * g.bytes_per_entry() for g in self.layout.block_groups)
                + self.layout.bytes_per_slot())

    def check_block(self, node: Node) -> None:
        """ValueError naming what does not fit this store's layout in a block read from disk: its
        groups and tensors, their shapes and dtypes, and finite floating-point values. Only a block
        that passes is ever restored, so a bad file can neither fail a step nor change an output
        by holding NaN."""
        entries, slot = self._expected()
        _check_names("block groups", node.entries, entries)
        for group, tensors in entries.items():
            _check_tensors(f"block group {group!r}", node.entries[group], tensors)
        if node.slot is not None:
            _check_tensors("slot state", node.slot, slot)

    # -- the store --------------------------------------------------------------------------------

    def _chain(self, keys: list[bytes]) -> list[Node]:
        """The cached nodes of the longest prefix of `keys`."""
        chain = []
        for key in keys:
            node = self.nodes.get(key)
            if node is None:
                break
            chain.append(node)
        return chain

    def _touch(self, chain: list[Node]) -> None:
        for node in reversed(chain):  # the leaf first: ancestors end up more recent
            self.nodes.move_to_end(node.key)

    def insert(self, token_ids: Sequence[int], first_block: int, end: int, entries: Entries, slot: Slot) -> None:
        """Store blocks [first_block, end // B) of `token_ids` (their entries, laid end to end in
        `entries`) and the slot state at `end`; blocks before first_block must still be cached."""
        k = end // self.block_tokens
        keys = chain_keys(token_ids, k, self.block_tokens, self._seed)
        if len(self._chain(keys[:first_block])) < first_block:
            return  # an ancestor was evicted since the snapshot was planned: it cannot be reached
        for depth in range(first_block + 1, k + 1):
            key = keys[depth - 1]
            if key in self.nodes:
                continue  # cached meanwhile by another request (the same tokens give the same state)
            i = depth - 1 - first_block
            block = {g: {t: v[:, i * self.entries_per_block[g]:(i + 1) * self.entries_per_block[g]].clone()
                         for t, v in ts.items()} for g, ts in entries.items()}
            self.add(Node(key, keys[depth - 2] if depth > 1 else None, depth, block))
        leaf = self.nodes[keys[k - 1]]
        if leaf.slot is None:
            leaf.slot = slot
            leaf.dirty = True
            self.bytes_used += sum(t.numel() * t.element_size() for t in slot.values())
        self._touch(self._chain(keys))
        self.trim()

    def add(self, node: Node) -> None:
        """Add a node whose parent is cached (or that has none)."""
        if node.parent is not None:
            self.nodes[node.parent].children.add(node.key)
        self.nodes[node.key] = node
        self.bytes_used += node.nbytes

    def trim(self) -> None:
        """Evict least recently used blocks until the store fits its capacity."""
        while self.bytes_used > self.capacity_bytes and self.nodes:
            self._drop(next(iter(self.nodes)))

    def _drop(self, key: bytes) -> None:
        node = self.nodes.pop(key)
        self.bytes_used -= node.nbytes
        with self._lock:
            self._counts.evictions += 1
        for child in list(node.children):
            if child in self.nodes:
                self._drop(child)
        parent = self.nodes.get(node.parent) if node.parent is not None else None
        if parent is not None:
            parent.children.discard(key)
