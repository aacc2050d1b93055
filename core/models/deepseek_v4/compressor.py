"""The gated-softmax compressor over per-position raw rows (an entry is the window's rows
weighted per channel by a softmax of their scores over the slots).

Every token stores its raw row (c_t, z_t + ape[t mod m]) in a per-slot ring. When the last token
of window w arrives, entry w is pooled from the rows of that window (HCA: m slots) or of that
window plus the previous window's Ca half (CSA, "overlap": 2m slots, slots of position < 0 are
empty), RMS-normalised, rotated at position m*w with the compress RoPE and written to the
block group. Used for the main CSA/HCA entries and for the indexer keys.
"""
from __future__ import annotations

import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.models.common.ragged import take_rows
from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops, resolve_ops
from deepinfer.models.deepseek_v4.rope import RotaryTables
from deepinfer.models.deepseek_v4.state import CompressPlan, StepPlan
from deepinfer.program import Builder, Ref


class Compressor:
    def __init__(self, accel: Accelerator, weights: dict[str, torch.Tensor], rate: int, overlap: bool,
                 out_dim: int, eps: float, ops: DeepseekV4Ops | None = None):
        self.accel, self.rate, self.overlap, self.out_dim, self.eps = accel, rate, overlap, out_dim, eps
        self.ops = resolve_ops(accel) if ops is None else ops  # compress_store, compress_pool
        self.ape, self.norm = weights["ape"], weights["norm.weight"]
        self._flat: tuple[torch.Tensor, ...] = ()  # (rows_kv, rows_score, their flat views) of the bound rows

    def flat_rows(self, rows_kv: torch.Tensor, rows_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw-row rings `[num_slots, Rc, w]` as `[num_slots * Rc, w]` (the views made once per binding)."""
        if not self._flat or self._flat[0] is not rows_kv or self._flat[1] is not rows_score:
            self._flat = (rows_kv, rows_score, rows_kv.view(-1, rows_kv.shape[-1]),
                          rows_score.view(-1, rows_score.shape[-1]))
        return self._flat[2], self._flat[3]

    def update(self, kv: torch.Tensor, score: torch.Tensor, plan: StepPlan, rope: RotaryTables,
               rows_kv: torch.Tensor, rows_score: torch.Tensor, entries: torch.Tensor) -> None:
        """kv, score `[T, coff*d_c]`: the attention input times `wkv` and `wgate` (computed by the
        caller in one fused projection); rows_* `[num_slots, Rc, coff*d_c]` fp32 (this layer);
        entries `[num_entries, d_c]` (this layer's block-group tensor)."""
        ring = rows_kv.shape[1]
        flat_kv, flat_score = self.flat_rows(rows_kv, rows_score)
        write = plan.ring_write(ring)
        completed = plan.windows_completed(self.rate)
        if plan.decode_only or (write.all_rows and not completed):
            # the ring writes first; at decode a completed window's rows are then all in the ring (the
            # new row replaces position ctx - Rc, older than the window's first), read from there
            self.ops.compress_store(kv, score, self.ape, plan.position_mod(self.rate), write.ring_row, flat_kv,
                                    flat_score)
            self.pool_stored(plan, rope, rows_kv, rows_score, entries)
            return
        kv = kv.float()
        score = self.ape.index_select(0, plan.position_mod(self.rate)).float().add_(score)  # z_t + ape[t mod m], fp32
        if completed:
            cp = plan.compress_plan(self.rate, ring, self.overlap)
            new = cp.is_new.unsqueeze(-1)
            src_kv = torch.where(new, take_rows(kv, cp.new_row), take_rows(flat_kv, cp.ring_row))
            src_score = torch.where(new, take_rows(score, cp.new_row), take_rows(flat_score, cp.ring_row))
            self._pool(src_kv, src_score, cp, rope, entries)
        write.store(flat_kv, kv)
        write.store(flat_score, score)

    def lower_decode(self, b: Builder, kv: Ref, score: Ref, rows: tuple[torch.Tensor, torch.Tensor],
                     entries: torch.Tensor, plan: Ref, rope: Ref) -> None:
        """`update` on a step of decode tokens as program calls: the ring write (`compress_store`, its
        position bias and ring rows as program inputs), then `pool_stored`."""
        rate, ring = self.rate, rows[0].shape[1]
        flat_kv, flat_score = self.flat_rows(*rows)
        b.call("ops.compress_store", 0, kv=kv, score=score, ape=self.ape,
               position_mod=b.input(f"position_mod.{rate}", lambda s: s.plan.position_mod(rate)),
               ring_row=b.input(f"ring_row.{ring}", lambda s: s.plan.ring_write(ring).ring_row),
               rows_kv=flat_kv, rows_score=flat_score)
        b.call(self.pool_stored, 0, plan=plan, rope=rope, rows_kv=rows[0], rows_score=rows[1], entries=entries)

    def pool_stored(self, plan: StepPlan, rope: RotaryTables, rows_kv: torch.Tensor, rows_score: torch.Tensor,
                    entries: torch.Tensor) -> None:
        """The entries of the windows this step completes, from their raw rows once all are in the ring (the
        step's rows stored first: at decode a window's rows are then all there, the new row replacing
        position ctx - Rc, older than the window's first)."""
        if plan.windows_completed(self.rate):
            flat_kv, flat_score = self.flat_rows(rows_kv, rows_score)
            cp = plan.compress_plan(self.rate, rows_kv.shape[1], self.overlap)
            self._pool(take_rows(flat_kv, cp.ring_row_all), take_rows(flat_score, cp.ring_row_all), cp, rope, entries)

    def _pool(self, src_kv: torch.Tensor, src_score: torch.Tensor, cp: CompressPlan, rope: RotaryTables,
              entries: torch.Tensor) -> None:
        """The completed windows' entries from their raw rows `[Nw, slots, coff*d_c]` (fp32; score
        with the position bias): pooled, normalised, rotated and written to `entries`."""
        a = self.accel
        if self.overlap:  # previous window's Ca (first half of channels), own window's Cb
            m, d = self.rate, self.out_dim
            src_kv = torch.cat((src_kv[:, :m, :d], src_kv[:, m:, d:]), dim=1)
            src_score = torch.cat((src_score[:, :m, :d], src_score[:, m:, d:]), dim=1)
        if cp.has_empty:  # slots before position 0 (a first CSA window) take no part
            empty = cp.empty.unsqueeze(-1)
            src_kv = src_kv.masked_fill(empty, 0.0)
            src_score = src_score.masked_fill(empty, float("-inf"))
        pooled = self.ops.compress_pool(src_kv, src_score).to(entries.dtype)
        normed = a.rms_norm(pooled, self.norm, self.eps)
        if cp.cos_sin is None:  # the same windows for every compressor of this rate in the step: once
            cp.cos_sin = rope.cos_sin(cp.rope_pos, "compress")
        entries.index_copy_(0, cp.entry_row, a.rotary(normed, *cp.cos_sin, False))  # distinct rows
