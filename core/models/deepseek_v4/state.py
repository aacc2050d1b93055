"""Per-sequence decode state of DeepSeek-V4 (docs/model.md, "State") and the per-step addressing plan.

Slot state (one slot per running sequence), rings indexed by absolute position mod ring size:
- `window_kv` `[Rw, d]`, every layer (MTP block included): post-norm, post-RoPE kv of the last
  positions; `Rw = sliding_window + max_rollback`.
- compressor raw rows, per compressor: `*_rows_kv` (c_t) and `*_rows_score` (z_t + ape[t mod m]),
  fp32, `[Rc, coff * d_c]`; CSA (main and indexer): `Rc = 2m + max_rollback` (the previous
  window's Ca half is needed by the overlap), HCA: `Rc = m + max_rollback`.
Block groups (one per distinct compression rate m, named "c{m}"), one entry per m tokens:
- `compressed_kv` `[d]` (CSA and HCA layers of that rate), `indexer_keys` `[index_head_dim]` (CSA).

A window entry is pooled from the raw rows when its last token arrives, so state is a pure
function of the tokens: truncating the last k <= max_rollback tokens is exact by setting the
length back (stale entries beyond floor(T/m) are invisible and recomputed when reached again).

Every state tensor is owned by the layers listed (no layer of V4 reads another's state). The
family-independent part of the step plan (batch checks, per-sequence index tensors, ring writes,
block-table addressing) is `common.ragged.RaggedPlan`; `StepPlan` adds V4's attention groups,
compressed-entry views and compression windows.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from deepinfer.models.batch import ForwardBatch, long_tensor
from deepinfer.models.cache_layout import BlockGroup, CacheLayout, StateTensor
from deepinfer.models.common.ragged import RaggedPlan, RingWrite, take_rows  # noqa: F401  (re-exported)
from deepinfer.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from deepinfer.parallel.context_parallel import RowSplit

WINDOW_KV = "window_kv"
CSA_ROWS = ("csa_rows_kv", "csa_rows_score")
INDEXER_ROWS = ("indexer_rows_kv", "indexer_rows_score")
HCA_ROWS = ("hca_rows_kv", "hca_rows_score")
COMPRESSED_KV = "compressed_kv"
INDEXER_KEYS = "indexer_keys"


def group_name(rate: int) -> str:
    return f"c{rate}"


@dataclass(frozen=True)
class RingSizes:
    window: int
    csa_rows: int
    hca_rows: int


def ring_sizes(config: DeepseekV4Config, max_rollback: int) -> RingSizes:
    if max_rollback < 0:
        raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
    return RingSizes(window=config.sliding_window + max_rollback,
                     csa_rows=2 * config.csa_compress_rate + max_rollback,
                     hca_rows=config.hca_compress_rate + max_rollback)


def build_cache_layout(config: DeepseekV4Config, dtype: torch.dtype, max_rollback: int) -> CacheLayout:
    rings = ring_sizes(config, max_rollback)
    L, d, di = config.num_hidden_layers, config.head_dim, config.index_head_dim
    mtp = tuple(range(L, L + config.num_nextn_predict_layers))
    csa = tuple(i for i in range(L) if config.layer_types[i] == CSA)
    hca = tuple(i for i in range(L) if config.layer_types[i] == HCA)
    slot = [StateTensor(WINDOW_KV, (rings.window, d), dtype, tuple(range(L)) + mtp)]
    if csa:
        slot += [StateTensor(n, (rings.csa_rows, 2 * d), torch.float32, csa) for n in CSA_ROWS]
        slot += [StateTensor(n, (rings.csa_rows, 2 * di), torch.float32, csa) for n in INDEXER_ROWS]
    if hca:
        slot += [StateTensor(n, (rings.hca_rows, d), torch.float32, hca) for n in HCA_ROWS]
    compressed: dict[int, list[int]] = {}
    for i in csa:
        compressed.setdefault(config.csa_compress_rate, []).append(i)
    for i in hca:
        compressed.setdefault(config.hca_compress_rate, []).append(i)
    groups = []
    for rate, layers in sorted(compressed.items()):
        tensors = [StateTensor(COMPRESSED_KV, (d,), dtype, tuple(sorted(layers)))]
        if rate == config.csa_compress_rate and csa:
            tensors.append(StateTensor(INDEXER_KEYS, (di,), dtype, csa))
        groups.append(BlockGroup(group_name(rate), rate, tuple(tensors)))
    return CacheLayout(slot_tensors=tuple(slot), block_groups=tuple(groups), max_rollback=max_rollback)


@dataclass
class AttnGroup:
    """Query blocks of one or more sequences attended in one padded kernel call.

    Item b covers new tokens [a_b, b_b) of sequence seq[b]; its window keys are the contiguous
    positions [max(0, pos_a - W + 1), pos_b), read from the new rows or from the ring."""

    seq: torch.Tensor  # [B] batch sequence index
    rows: torch.Tensor  # [B, S] token rows (clamped where padded)
    q_valid: torch.Tensor  # [B, S]
    q_pos: torch.Tensor  # [B, S]
    key_is_new: torch.Tensor  # [B, Lw]
    key_new_row: torch.Tensor  # [B, Lw]
    key_ring_row: torch.Tensor  # [B, Lw] flat index into [num_slots * Rw]
    window_mask: torch.Tensor  # [B, S, Lw]
    end_pos: torch.Tensor  # [B] one past the item's last position
    # Decode groups (each item a sequence's only new token) store that key in the ring first: it
    # replaces position pos - Rw, outside the window (Rw >= W), so every key is one ring gather.
    new_key_ring_row: torch.Tensor | None = None  # [B] where the query's own key goes
    key_ring_row_all: torch.Tensor | None = None  # [B, Lw] every key's ring row (0 where invalid)
    in_row_order: bool = False  # rows are exactly 0..T-1 (a step of decode tokens only): no gather
    first_row: int | None = None  # a single prefill block: its rows are first_row .. first_row + S - 1
    end_list: list[int] | None = None  # end_pos on the host
    seq_list: list[int] | None = None  # seq on the host

    @property
    def decode(self) -> bool:
        """Every item is one sequence's only new token."""
        return self.key_ring_row_all is not None

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s rows of this group's queries, `[B, S, ...]` (a view for a single prefill block and for
        a step of decode tokens in row order)."""
        if self.first_row is not None:
            return t[self.first_row:self.first_row + self.rows.shape[1]].unsqueeze(0)
        if self.in_row_order:
            return t.unsqueeze(1)
        return take_rows(t, self.rows)

    def scatter(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """Write the group's valid query rows of `values` `[B, S, ...]` into `out` `[T, ...]`."""
        if self.first_row is not None:
            out[self.first_row:self.first_row + values.shape[1]] = values[0]
        else:
            out[self.rows[self.q_valid]] = values[self.q_valid]


@dataclass
class EntryView:
    """Compressed entries of rate m that exist for each item of a group."""

    flat: torch.Tensor  # [B, E] row in the block-group tensor (0 where invalid)
    visible: torch.Tensor  # [B, S, E] entry w visible to query t iff w < (t+1) // m


@dataclass
class CompressPlan:
    """Windows of rate m completed during this step and where their raw rows are."""

    num_windows: int
    is_new: torch.Tensor  # [Nw, slots] the row is produced in this step
    new_row: torch.Tensor  # [Nw, slots]
    ring_row: torch.Tensor  # [Nw, slots] flat index into [num_slots * Rc] (0 where new or empty)
    ring_row_all: torch.Tensor  # [Nw, slots] the same for new rows too, once stored (0 where empty)
    empty: torch.Tensor  # [Nw, slots] position < 0 (first CSA window: no previous Ca half)
    entry_row: torch.Tensor  # [Nw] row in the block-group tensor
    rope_pos: torch.Tensor  # [Nw] first position of the window (m * w)
    has_empty: bool = True  # some slot is empty (else `empty` is all False)
    #: the compress RoPE cos/sin at `rope_pos`, filled by the first compressor that pools (the
    #: others of the step's layers of this rate reuse them)
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None


class StepPlan(RaggedPlan):
    """Addressing for one ragged step, shared by all layers (built once per forward)."""

    def __init__(self, batch: ForwardBatch, config: DeepseekV4Config, rings: RingSizes, block_size: int,
                 num_slots: int, query_block: int = 256, split: RowSplit | None = None):
        """`split`: under context parallelism, the rows this rank computes (its attention groups
        cover only those query rows, read from its local tensors; keys and compressor rows are read
        from the whole step's gathered rows)."""
        super().__init__(batch, num_slots, block_size)
        self.config, self.rings, self.query_block, self.split = config, rings, query_block, split
        self._entry_views: dict[tuple[int, int], EntryView] = {}
        self._compress_plans: dict[tuple[int, int, bool], CompressPlan] = {}
        self._windows_completed: dict[int, int] = {}

    # ----- attention groups -----
    @cached_property
    def groups(self) -> list[AttnGroup]:
        """Decode tokens (query_len 1) of all sequences in one group; every other sequence in
        blocks of `query_block` queries (bounded key ranges, O(S * (W + block)) work). Under a
        context-parallel split: this rank's chunks only, each in blocks of `query_block`."""
        if self.split is not None:
            return [self._group([(c.seq, a, min(c.stop, a + self.query_block))], local_row=c.local_row + a - c.start)
                    for c in self.split.chunks for a in range(c.start, c.stop, self.query_block)]
        decode = [(i, 0, 1) for i in range(len(self.q_lens)) if self.q_lens[i] == 1]
        out = [self._group(decode, decode=True)] if decode else []
        for i, n in enumerate(self.q_lens):
            if n > 1:
                for a in range(0, n, self.query_block):
                    out.append(self._group([(i, a, min(n, a + self.query_block))]))
        return out

    def _group(self, items: list[tuple[int, int, int]], decode: bool = False,
               local_row: int | None = None) -> AttnGroup:
        """`decode`: every item is a sequence's only new token (its one new key is its own).
        `local_row` (one item, context parallelism): the row of its first query in this rank's
        local tensors (queries and outputs), while its new keys stay rows of the whole step."""
        if decode:
            return self._decode_group(items)
        dev, W, Rw = self.device, self.config.sliding_window, self.rings.window
        # per-item scalars on the host (no tensor op, no host sync): queries [a, b) of sequence i
        ctx_l = [self.ctx[i] for i, _, _ in items]
        a_l = [x for _, x, _ in items]
        end_l = [c + y for c, (_, _, y) in zip(ctx_l, items)]
        key_start_l = [max(0, c + x - (W - 1)) for c, x in zip(ctx_l, a_l)]
        S = max(y - x for _, x, y in items)
        Lw = max(e - k for e, k in zip(end_l, key_start_l))

        def col(values: list[int]) -> torch.Tensor:  # [B, 1]
            return torch.tensor(values, device=dev).unsqueeze(1)

        seq = torch.tensor([i for i, _, _ in items], device=dev)
        ctx, a, slot = col(ctx_l), col(a_l), col([self.slots[i] for i, _, _ in items])
        start = col([self.row_start[i] for i, _, _ in items])
        end = torch.tensor(end_l, device=dev)
        ar = torch.arange(S, device=dev)
        q_valid = ar < col([y - x for _, x, y in items])
        q_pos = ctx + a + ar
        rows = torch.where(q_valid, start + a + ar, 0)
        key_pos = col(key_start_l) + torch.arange(Lw, device=dev)
        k_valid = key_pos < end.unsqueeze(1)
        key_is_new = key_pos >= ctx
        key_new_row = torch.where(k_valid & key_is_new, start + key_pos - ctx, 0)
        ring_pos = slot * Rw + key_pos % Rw
        key_ring_row = torch.where(k_valid & ~key_is_new, ring_pos, 0)
        kp, qp = key_pos.unsqueeze(1), q_pos.unsqueeze(2)
        window_mask = k_valid.unsqueeze(1) & q_valid.unsqueeze(2) & (kp <= qp) & (kp > qp - W)
        group = AttnGroup(seq, rows, q_valid, q_pos, key_is_new, key_new_row, key_ring_row, window_mask, end,
                          end_list=end_l, seq_list=[i for i, _, _ in items])
        if local_row is not None:
            group.first_row = local_row
            group.rows = torch.where(q_valid, local_row + ar, 0)  # [1, S]: local rows
        elif len(items) == 1:
            group.first_row = self.row_start[items[0][0]] + items[0][1]
        return group

    def _decode_group(self, items: list[tuple[int, int, int]]) -> AttnGroup:
        """`_group(items, decode=True)` in about half the tensor ops: one query per item, at position
        ctx, whose valid keys are exactly [max(0, ctx - W + 1), ctx]; the per-item scalars go to the
        device as one tensor (the same values as the general construction)."""
        dev, W, Rw = self.device, self.config.sliding_window, self.rings.window
        seq_l = [i for i, _, _ in items]
        ctx_l = [self.ctx[i] for i in seq_l]
        slot_l = [self.slots[i] for i in seq_l]
        key_start_l = [max(0, c - (W - 1)) for c in ctx_l]
        end_l = [c + 1 for c in ctx_l]
        Lw = max(e - k for e, k in zip(end_l, key_start_l))
        B = len(items)
        seq, end, new_key_ring_row = long_tensor(
            [*seq_l, *end_l, *(s * Rw + c % Rw for s, c in zip(slot_l, ctx_l))], dev).view(3, B).unbind(0)
        ctx, slot_base, start, key_start = long_tensor(  # [B, 1] each
            [*ctx_l, *(s * Rw for s in slot_l), *(self.row_start[i] for i in seq_l), *key_start_l],
            dev).view(4, B, 1).unbind(0)
        # Rw = W + max_rollback >= W (ring_sizes): the own key replaces position ctx - Rw, outside the window
        key_pos = key_start + long_tensor(range(Lw), dev)
        k_valid = key_pos <= ctx
        key_is_new = key_pos >= ctx  # valid and new: the query's own key, row `start`
        ring_pos = key_pos % Rw + slot_base
        # an index times a mask is torch.where(mask, index, 0) in one op fewer (integers: exact)
        group = AttnGroup(seq, start, torch.ones_like(start, dtype=torch.bool), ctx, key_is_new,
                          start * (key_pos == ctx), ring_pos * (key_pos < ctx), k_valid.unsqueeze(1), end,
                          end_list=end_l, seq_list=seq_l)
        group.new_key_ring_row = new_key_ring_row
        group.key_ring_row_all = ring_pos * k_valid
        group.in_row_order = len(items) == self.T  # every token of the step is one of its queries
        return group

    @cached_property
    def decode_step(self) -> bool:
        """Every token is a sequence's only new token, in row order, and the step is not split over a
        context-parallel group: what a decode program runs (the model's `decode_program`)."""
        return (self.decode_only and self.split is None and len(self.groups) == 1 and self.groups[0].in_row_order)

    def entry_view(self, group_index: int, rate: int) -> EntryView:
        key = (group_index, rate)
        if key not in self._entry_views:
            g = self.groups[group_index]
            ends = g.end_list if g.end_list is not None else g.end_pos.tolist()
            flat, valid = self.first_entry_rows(group_name(rate), g.seq, [e // rate for e in ends], g.seq_list)
            if g.decode:  # the query is the item's last position: it sees every existing entry
                visible = valid.unsqueeze(1)
            else:
                e = torch.arange(valid.shape[1], device=self.device)
                visible = valid.unsqueeze(1) & g.q_valid.unsqueeze(2) & (e < ((g.q_pos + 1) // rate).unsqueeze(2))
            self._entry_views[key] = EntryView(flat, visible)
        return self._entry_views[key]

    # ----- compressor -----
    def windows_completed(self, rate: int) -> int:
        """How many compression windows of rate `rate` complete in this step (all sequences)."""
        if rate not in self._windows_completed:  # asked by every compressor of every layer
            self._windows_completed[rate] = sum((c + n) // rate - c // rate for c, n in zip(self.ctx, self.q_lens))
        return self._windows_completed[rate]

    def compress_plan(self, rate: int, ring: int, overlap: bool) -> CompressPlan:
        key = (rate, ring, overlap)
        if key in self._compress_plans:
            return self._compress_plans[key]
        dev = self.device
        seqs, ws = [], []
        for i, (c, n) in enumerate(zip(self.ctx, self.q_lens)):
            first, last = c // rate, (c + n) // rate  # windows [first, last) complete in this step
            seqs += [i] * (last - first)
            ws += range(first, last)
        # per-window scalars from the host as [Nw, 1] columns (two ops), broadcast over the slots
        first_offset = -rate if overlap else 0  # previous window's slots first (overlap)
        base, ctx, shift, slot_base = long_tensor(
            [*(rate * w for w in ws), *(self.ctx[i] for i in seqs), *(self.row_start[i] - self.ctx[i] for i in seqs),
             *(self.slots[i] * ring for i in seqs)], dev).view(4, len(ws), 1).unbind(0)
        pos = base + long_tensor(range(first_offset, rate), dev)  # [Nw, slots]
        empty = pos < 0
        is_new = pos >= ctx
        ring_pos = pos % ring + slot_base
        ring_row_all = ring_pos * (pos >= 0)  # an index times a mask: torch.where(mask, index, 0) (integers)
        plan = CompressPlan(len(ws), is_new, (pos + shift) * is_new, ring_row_all * (pos < ctx), ring_row_all, empty,
                            long_tensor(self.entry_row_list(group_name(rate), seqs, ws), dev),
                            long_tensor([rate * w for w in ws], dev), has_empty=overlap and 0 in ws)
        self._compress_plans[key] = plan
        return plan
