"""How a model declares its per-sequence state, and the allocator that preallocates it.

State comes in two kinds:
- *slot state*: a constant size per sequence (window rings, compressor raw-row rings), one slot
  per running sequence;
- *block groups*: what grows with the context (compressed entries, indexer keys, a full KV cache),
  paged in fixed-size blocks of entries; a group with `tokens_per_entry = m` holds floor(T / m)
  entries.

Each `StateTensor` names the layers that OWN a copy (`owners`: one copy each is allocated) and the
layers that READ another layer's copy (`readers`: reader layer -> owner layer; no memory of their
own; `view(layer)` gives a reader its owner's tensor, so a reader sees every write of its owner).
Memory accounting (`bytes_per_unit`, `bytes_per_entry`, `bytes_per_slot`, and so the cache
manager's pool sizing) counts owners only.

Rings are indexed by absolute position modulo their size, and their size covers the attention
window plus `max_rollback` positions, so dropping the last k <= max_rollback tokens (speculative
decoding) is exact: the engine just sets the sequence length back.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateTensor:
    """One tensor of state: allocated as `[len(owners), count, *shape]`, copy `k` owned by layer
    `owners[k]`; a layer in `readers` reads the copy of the owner it maps to.

    `readers` may be given as a mapping `{reader layer: owner layer}` or as (reader, owner) pairs;
    it is stored as sorted pairs (the dataclass stays hashable)."""

    name: str
    shape: tuple[int, ...]  # per slot (slot state) or per entry (block groups)
    dtype: torch.dtype
    owners: tuple[int, ...]  # model layer indices that own one copy each
    readers: Mapping[int, int] | tuple[tuple[int, int], ...] = ()  # reader layer -> owner layer

    def __post_init__(self) -> None:
        owners = tuple(int(i) for i in self.owners)
        pairs: Iterable = self.readers.items() if isinstance(self.readers, Mapping) else self.readers
        readers = tuple(sorted((int(r), int(o)) for r, o in pairs))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "readers", readers)
        if not owners:
            raise ValueError(f"state tensor {self.name!r} has no owner layer; give at least one")
        if len(set(owners)) != len(owners):
            raise ValueError(f"state tensor {self.name!r}: owner layers {list(owners)} repeat a layer")
        reader_layers = [r for r, _ in readers]
        if len(set(reader_layers)) != len(reader_layers):
            raise ValueError(f"state tensor {self.name!r}: reader layers {reader_layers} repeat a layer")
        for r, o in readers:
            if r in owners:
                raise ValueError(f"state tensor {self.name!r}: layer {r} is both an owner and a reader")
            if o not in owners:
                raise ValueError(f"state tensor {self.name!r}: reader layer {r} reads layer {o}, which owns no copy "
                                 f"(owners: {list(owners)})")

    @property
    def reader_map(self) -> dict[int, int]:
        return dict(self.readers)

    @property
    def layers(self) -> tuple[int, ...]:
        """Every layer that uses the tensor (owners, then readers); only owners take memory."""
        return self.owners + tuple(r for r, _ in self.readers)

    def owner_of(self, layer: int) -> int:
        if layer in self.owners:
            return layer
        owner = self.reader_map.get(layer)
        if owner is None:
            raise ValueError(f"layer {layer} neither owns nor reads state tensor {self.name!r} (owners "
                             f"{list(self.owners)}, readers {self.reader_map})")
        return owner

    def index_of(self, layer: int) -> int:
        """The copy (first index of the allocated tensor) that `layer` owns or reads."""
        return self.owners.index(self.owner_of(layer))

    def view(self, allocated: torch.Tensor, layer: int) -> torch.Tensor:
        """`layer`'s view `[count, *shape]` of the allocated tensor: its own copy, or its owner's."""
        return allocated[self.index_of(layer)]

    def bytes_per_copy(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def bytes_per_unit(self) -> int:
        """Bytes per slot (or per entry) over all owned copies; readers add nothing."""
        return self.bytes_per_copy() * len(self.owners)


def _unique(kind: str, names: list[str]) -> None:
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{kind} names must be unique; repeated: {repeated}")


@dataclass(frozen=True)
class BlockGroup:
    """Growing state paged in blocks; one block table per sequence per group."""

    name: str
    tokens_per_entry: int  # compression ratio m: one entry per m tokens
    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        if self.tokens_per_entry < 1:
            raise ValueError(f"block group {self.name!r}: tokens_per_entry must be >= 1, got {self.tokens_per_entry}")
        _unique(f"tensor (block group {self.name!r})", [t.name for t in self.tensors])

    def entries_for(self, num_tokens: int) -> int:
        return num_tokens // self.tokens_per_entry

    def bytes_per_entry(self) -> int:
        return sum(t.bytes_per_unit() for t in self.tensors)

    def tensor(self, name: str) -> StateTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"block group {self.name!r} has no tensor {name!r}; it has {[t.name for t in self.tensors]}")


@dataclass(frozen=True)
class CacheLayout:
    slot_tensors: tuple[StateTensor, ...]
    block_groups: tuple[BlockGroup, ...]
    max_rollback: int  # positions that can be dropped exactly after they were written

    def __post_init__(self) -> None:
        object.__setattr__(self, "slot_tensors", tuple(self.slot_tensors))
        object.__setattr__(self, "block_groups", tuple(self.block_groups))
        _unique("slot tensor", [t.name for t in self.slot_tensors])
        _unique("block group", [g.name for g in self.block_groups])

    def bytes_per_slot(self) -> int:
        return sum(t.bytes_per_unit() for t in self.slot_tensors)

    def slot_tensor(self, name: str) -> StateTensor:
        for t in self.slot_tensors:
            if t.name == name:
                return t
        raise KeyError(f"the layout has no slot tensor {name!r}; it has {[t.name for t in self.slot_tensors]}")

    def group(self, name: str) -> BlockGroup:
        for g in self.block_groups:
            if g.name == name:
                return g
        raise KeyError(f"the layout has no block group {name!r}; it has {[g.name for g in self.block_groups]}")

    def check(self, cache: CacheTensors, allocate_hint: str) -> None:
        """Refuse (ValueError) allocated tensors that do not match this layout: the model would read
        the wrong bytes. `allocate_hint` names the call that allocates a matching cache."""
        for t in self.slot_tensors:
            got = cache.slot.get(t.name)
            if got is None or tuple(got.shape[2:]) != t.shape or got.shape[0] != len(t.owners) or got.dtype != t.dtype:
                raise ValueError(f"cache slot tensor {t.name!r} does not match the layout (expected "
                                 f"[{len(t.owners)}, slots, {', '.join(map(str, t.shape))}] {t.dtype}); allocate "
                                 f"the cache from {allocate_hint}")
        for g in self.block_groups:
            for t in g.tensors:
                got = cache.blocks.get(g.name, {}).get(t.name)
                if got is None or tuple(got.shape[2:]) != t.shape or got.shape[0] != len(t.owners):
                    raise ValueError(f"cache block tensor {g.name}/{t.name} does not match the layout; allocate "
                                     f"the cache from {allocate_hint}")


@dataclass
class CacheTensors:
    """The preallocated state, bound to the model once: name -> `[len(owners), count, *shape]`."""

    slot: dict[str, torch.Tensor]
    blocks: dict[str, dict[str, torch.Tensor]]  # group name -> tensor name -> tensor
    block_size: int  # entries per block
    layout: CacheLayout | None = None  # what it was allocated from (allocate_cache_tensors sets it)
    num_slots: int | None = None  # sequences the slot tensors hold (allocate_cache_tensors sets it)

    def _layout(self) -> CacheLayout:
        if self.layout is None:
            raise ValueError("these cache tensors carry no layout; allocate them with allocate_cache_tensors()")
        return self.layout

    def slot_view(self, name: str, layer: int) -> torch.Tensor:
        """`layer`'s `[num_slots, *shape]` view of slot tensor `name` (its owner's copy for a reader)."""
        return self._layout().slot_tensor(name).view(self.slot[name], layer)

    def block_view(self, group: str, name: str, layer: int) -> torch.Tensor:
        """`layer`'s `[num_blocks * block_size, *shape]` view of tensor `name` of block group `group`."""
        return self._layout().group(group).tensor(name).view(self.blocks[group][name], layer)


def allocate_cache_tensors(layout: CacheLayout, num_slots: int, num_blocks: dict[str, int], block_size: int,
                           device: torch.device | str) -> CacheTensors:
    """Preallocate (zeroed) the state described by `layout`, one copy per owner layer.

    - slot tensor `name`: `[len(t.owners), num_slots, *t.shape]`;
    - block-group tensor `name` of group `g`: `[len(t.owners), num_blocks[g] * block_size, *t.shape]`,
      where entry `e` of a sequence lives at row `block_table[e // block_size] * block_size +
      e % block_size` (`block_table` = the sequence's row of `ForwardBatch.block_tables[g]`).

    Reader layers get no copy: `CacheTensors.slot_view` / `block_view` hand them their owner's.
    """
    if num_slots < 1 or block_size < 1:
        raise ValueError(f"num_slots ({num_slots}) and block_size ({block_size}) must be positive")
    missing = [g.name for g in layout.block_groups if g.name not in num_blocks]
    if missing:
        raise ValueError(f"num_blocks has no count for block groups {missing}; give one per group "
                         f"({[g.name for g in layout.block_groups]})")
    slot = {t.name: torch.zeros((len(t.owners), num_slots, *t.shape), dtype=t.dtype, device=device)
            for t in layout.slot_tensors}
    blocks = {g.name: {t.name: torch.zeros((len(t.owners), num_blocks[g.name] * block_size, *t.shape),
                                           dtype=t.dtype, device=device) for t in g.tensors}
              for g in layout.block_groups}
    return CacheTensors(slot=slot, blocks=blocks, block_size=block_size, layout=layout, num_slots=num_slots)
