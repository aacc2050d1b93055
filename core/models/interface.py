"""The contract between the engine (runner, cache manager) and a model implementation.

A model declares its per-sequence state as a `CacheLayout`; the cache manager preallocates it once
from the memory budget and binds the tensors to the model. Every step the runner hands the model
a ragged `ForwardBatch` (many sequences, different lengths, no padding) and gets logits back.

State comes in two kinds (deepseek-v4.md §12):
- *slot state*: a constant size per sequence (window rings, compressor raw-row rings), one slot
  per running sequence;
- *block groups*: what grows with the context (compressed entries, indexer keys), paged in
  fixed-size blocks of entries; a group with `tokens_per_entry = m` holds floor(T / m) entries.

Rings are indexed by absolute position modulo their size, and their size covers the attention
window plus `max_rollback` positions, so dropping the last k <= max_rollback tokens (speculative
decoding) is exact: the engine just sets the sequence length back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StateTensor:
    """One tensor of state, per layer: allocated as `[num_layers_using_it, count, *shape]`."""

    name: str
    shape: tuple[int, ...]  # per slot (slot state) or per entry (block groups)
    dtype: torch.dtype
    layers: tuple[int, ...]  # model layer indices that own one copy each

    def bytes_per_unit(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size() * len(self.layers)


@dataclass(frozen=True)
class BlockGroup:
    """Growing state paged in blocks; one block table per sequence per group."""

    name: str
    tokens_per_entry: int  # compression ratio m: one entry per m tokens
    tensors: tuple[StateTensor, ...]

    def entries_for(self, num_tokens: int) -> int:
        return num_tokens // self.tokens_per_entry

    def bytes_per_entry(self) -> int:
        return sum(t.bytes_per_unit() for t in self.tensors)


@dataclass(frozen=True)
class CacheLayout:
    slot_tensors: tuple[StateTensor, ...]
    block_groups: tuple[BlockGroup, ...]
    max_rollback: int  # positions that can be dropped exactly after they were written

    def bytes_per_slot(self) -> int:
        return sum(t.bytes_per_unit() for t in self.slot_tensors)


@dataclass
class CacheTensors:
    """The preallocated state, bound to the model once: name -> `[num_layers, count, *shape]`."""

    slot: dict[str, torch.Tensor]
    blocks: dict[str, dict[str, torch.Tensor]]  # group name -> tensor name -> tensor
    block_size: int  # entries per block


@dataclass
class ForwardBatch:
    """One step's input, flattened over sequences (sequence i owns rows cu[i]:cu[i+1])."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions
    query_lens: list[int]  # new tokens per sequence this step
    context_lens: list[int]  # tokens already in the state before this step, per sequence
    slots: torch.Tensor  # [B] int64, slot index of each sequence
    block_tables: dict[str, torch.Tensor]  # group name -> [B, max_blocks] int64, -1 = unused
    logits_indices: torch.Tensor  # [L] int64 rows of T whose logits are returned
    return_streams: bool = False  # also return the final residual streams (for MTP drafting)
    stream_indices: torch.Tensor | None = None  # [S] int64 rows whose streams are returned; None: logits_indices
    extra: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [L, V] fp32
    streams: torch.Tensor | None = None  # [S, n, D] final residual streams at stream_indices (or logits_indices)


def allocate_cache_tensors(layout: CacheLayout, num_slots: int, num_blocks: dict[str, int], block_size: int,
                           device: torch.device | str) -> CacheTensors:
    """Preallocate (zeroed) the state described by `layout`.

    - slot tensor `name`: `[len(t.layers), num_slots, *t.shape]`;
    - block-group tensor `name` of group `g`: `[len(t.layers), num_blocks[g] * block_size, *t.shape]`,
      where entry `e` of a sequence lives at row `block_table[e // block_size] * block_size +
      e % block_size` (`block_table` = the sequence's row of `ForwardBatch.block_tables[g]`).
    """
    if num_slots < 1 or block_size < 1:
        raise ValueError(f"num_slots ({num_slots}) and block_size ({block_size}) must be positive")
    missing = [g.name for g in layout.block_groups if g.name not in num_blocks]
    if missing:
        raise ValueError(f"num_blocks has no count for block groups {missing}; give one per group "
                         f"({[g.name for g in layout.block_groups]})")
    slot = {t.name: torch.zeros((len(t.layers), num_slots, *t.shape), dtype=t.dtype, device=device)
            for t in layout.slot_tensors}
    blocks = {g.name: {t.name: torch.zeros((len(t.layers), num_blocks[g.name] * block_size, *t.shape),
                                           dtype=t.dtype, device=device) for t in g.tensors}
              for g in layout.block_groups}
    return CacheTensors(slot=slot, blocks=blocks, block_size=block_size)
