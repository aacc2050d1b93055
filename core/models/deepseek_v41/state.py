"""Per-sequence state of DeepSeek-V4.1 as a cache layout with owners and readers.

Slot state (one slot per running sequence), rings indexed by absolute position mod ring size:
- `window_kv` `[Rw, 528]` uint8 in every layer: the FP8 window key (512 e4m3 codes + 16 ue8m0
  scales, `kv_quant.FP8_WINDOW`); `Rw = sliding_window + max_rollback`;
- `c{r}_rows_kv` / `c{r}_rows_score` `[r + max_rollback, head_dim]` fp32 in each KV-source layer of
  ratio r > 1: the raw compressor rows of the pending (incomplete) group;
- `engram_history` `[max_ngram - 1 + max_rollback]` int64: the compressed token ids of the last
  positions, which the n-gram hashes of the next tokens read (owned by the first Engram layer; the
  hashes of every Engram layer are computed from it once per step).
Block groups, one per compression ratio r (`c{r}`, one entry per r tokens):
- `compressed_kv` `[288]` uint8 (512-d NVFP4: e2m1 codes + e4m3 scales per 16, `NVFP4_COMPRESSED`),
  owned by the KV sources of ratio r and READ by the other layers of ratio r (Reuse, Reindex);
- `index_keys` `[68]` uint8 (128-d MXFP4, `MXFP4_INDEX`), owned by the KV sources and read by the
  Reindex layers.
A Reuse layer therefore stores nothing but its window. With the released schedule this is
3 x (288 + 68) / 2 + (288 + 68) = 890 bytes per token of context, and 40 x 128 x 528 = 2,703,360
bytes of window rings per sequence.

The top-k selections and the candidate pool are recomputed every step (not state). Every entry is
written once, when the last token of its group arrives, from state that is a pure function of the
tokens, so dropping the last k <= max_rollback tokens is exact by setting the length back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.models.cache_layout import BlockGroup, CacheLayout, StateTensor
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.kv_quant import FP8_WINDOW, MXFP4_INDEX, NVFP4_COMPRESSED

WINDOW_KV = "window_kv"
ENGRAM_HISTORY = "engram_history"
COMPRESSED_KV = "compressed_kv"
INDEX_KEYS = "index_keys"


def group_name(ratio: int) -> str:
    return f"c{ratio}"


def rows_names(ratio: int) -> tuple[str, str]:
    return f"c{ratio}_rows_kv", f"c{ratio}_rows_score"


@dataclass(frozen=True)
class RingSizes:
    window: int
    engram: int
    rows: dict[int, int]  # ratio -> compressor raw-row ring


def ring_sizes(config: DeepseekV41Config, max_rollback: int) -> RingSizes:
    if max_rollback < 0:
        raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
    ratios = {config.compress_ratio(i) for i in config.kv_source_layer_ids}
    return RingSizes(window=config.sliding_window + max_rollback,
                     engram=config.engram_max_ngram_size - 1 + max_rollback,
                     rows={r: r + max_rollback for r in sorted(ratios) if r > 1})


def build_cache_layout(config: DeepseekV41Config, max_rollback: int) -> CacheLayout:
    rings = ring_sizes(config, max_rollback)
    L, d, di = config.num_hidden_layers, config.head_dim, config.index_head_dim
    slot = [StateTensor(WINDOW_KV, (rings.window, FP8_WINDOW.bytes_per_vector(d)), torch.uint8, tuple(range(L)))]
    for r, ring in rings.rows.items():
        owners = tuple(i for i in config.kv_source_layer_ids if config.compress_ratio(i) == r)
        slot += [StateTensor(name, (ring, d), torch.float32, owners) for name in rows_names(r)]
    if config.engram_layer_ids:
        first, *rest = config.engram_layer_ids
        slot.append(StateTensor(ENGRAM_HISTORY, (rings.engram,), torch.int64, (first,),
                                readers={i: first for i in rest}))
    groups = []
    for r in sorted({config.compress_ratio(i) for i in config.kv_source_layer_ids}):
        owners = tuple(i for i in config.kv_source_layer_ids if config.compress_ratio(i) == r)
        kv_readers = {i: o for i, o in config.kv_owner.items() if config.compress_ratio(i) == r and i not in owners}
        key_readers = {i: o for i, o in kv_readers.items() if i in config.index_source_layer_ids}
        groups.append(BlockGroup(group_name(r), r, (
            StateTensor(COMPRESSED_KV, (NVFP4_COMPRESSED.bytes_per_vector(d),), torch.uint8, owners, kv_readers),
            StateTensor(INDEX_KEYS, (MXFP4_INDEX.bytes_per_vector(di),), torch.uint8, owners, key_readers),
        )))
    return CacheLayout(slot_tensors=tuple(slot), block_groups=tuple(groups), max_rollback=max_rollback)


def context_bytes_per_token(layout: CacheLayout) -> float:
    """Bytes of block-group state one more token of context costs (owners only)."""
    return sum(g.bytes_per_entry() / g.tokens_per_entry for g in layout.block_groups)
