"""Shared-KV MQA with sinks over a sliding window plus compressed entries (docs/model.md,
"Execution on ragged batches").

One class serves the three layer types: sliding (window only, main RoPE), HCA (window + all
visible entries of rate m) and CSA (window + the lightning indexer's top-k of the overlapping
rate-4 entries). Queries are processed in the groups of `StepPlan.groups` (all decode tokens
together, prefill in bounded query blocks).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.models.common.ragged import take_rows
from deepinfer.models.common.weights import (WeightUses, fused_part, fused_parts, group_rows, split_fused,
                                             strip_prefix)
from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops, resolve_ops
from deepinfer.models.deepseek_v4.rope import RotaryTables
from deepinfer.models.deepseek_v4.state import StepPlan
from deepinfer.models.deepseek_v4.weights import FUSED_PROJECTIONS
from deepinfer.program import Builder, Ref
from deepinfer.parallel.context_parallel import RowSplit


@dataclass
class AttentionState:
    """This layer's views of the bound cache."""

    window: torch.Tensor  # [num_slots, Rw, d]
    rows: tuple[torch.Tensor, torch.Tensor] | None = None  # main compressor raw rows (kv, score)
    entries: torch.Tensor | None = None  # [num_entries, d]
    indexer_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    indexer_keys: torch.Tensor | None = None  # [num_entries, index_head_dim]


class Attention:
    def __init__(self, config: DeepseekV4Config, layer_type: str, weights: dict[str, torch.Tensor],
                 accel: Accelerator, ops: DeepseekV4Ops | None = None):
        """`weights`: this block's tensors under official names relative to `attn.`, plus the fused
        projections `fused_x.weight` and `fused_qr.weight` (weights.fuse_rows). `ops`: the model's V4
        op table (None: resolved from `accel`)."""
        self.c, self.accel, self.type = config, accel, layer_type
        self.ops = resolve_ops(accel) if ops is None else ops
        self.w = weights
        self.x_parts = fused_parts(weights, FUSED_PROJECTIONS["attn.fused_x.weight"], "attn.")
        qr_parts = fused_parts(weights, FUSED_PROJECTIONS["attn.fused_qr.weight"], "attn.")
        if self.x_parts[0][:2] != ["wq_a.weight", "wkv.weight"] or qr_parts[0][:1] != ["wq_b.weight"]:
            raise ValueError(f"attention weights: fused_x must start with wq_a and wkv, fused_qr with wq_b "
                             f"(weights.FUSED_PROJECTIONS); got {self.x_parts[0]} and {qr_parts[0]}")
        self.q_rank = self.x_parts[1][0]  # wq_a's output width
        self.wo_a = group_rows(weights["wo_a.weight"], config.o_groups)  # [G, R, in] for grouped_linear
        self.rope_kind = "main" if layer_type == SLIDING else "compress"
        self.rate = config.compress_ratio_for(layer_type)
        eps = config.rms_norm_eps
        self.compressor = None
        if layer_type in (CSA, HCA):
            self.compressor = Compressor(accel, strip_prefix(weights, "compressor."), self.rate, layer_type == CSA,
                                         config.head_dim, eps, self.ops)
        self.indexer_compressor = None
        if layer_type == CSA:
            self.indexer_compressor = Compressor(accel, strip_prefix(weights, "indexer.compressor."), self.rate, True,
                                                 config.index_head_dim, eps, self.ops)
        self.state: AttentionState | None = None
        #: per-token projections that other tokens' attention reads (through the compressors); with
        #: the window key, what a context-parallel step gathers from the other ranks
        self.key_inputs = tuple(f"{prefix}compressor.{part}.weight"
                                for prefix, present in (("", self.compressor), ("indexer.", self.indexer_compressor))
                                if present is not None for part in ("wkv", "wgate"))
        self._reads_px = bool(self.key_inputs) or self.indexer_compressor is not None
        self._window_view: tuple[torch.Tensor, torch.Tensor] | None = None

    def _window_flat(self, window: torch.Tensor) -> torch.Tensor:
        """The bound window ring `[num_slots, Rw, d]` as `[num_slots * Rw, d]` (the view made once per binding)."""
        if self._window_view is None or self._window_view[0] is not window:
            self._window_view = (window, window.view(-1, window.shape[-1]))
        return self._window_view[1]

    def _gather(self, keyed: dict[str, torch.Tensor], split: RowSplit) -> dict[str, torch.Tensor]:
        """This rank's rows of the window key and compressor inputs -> the whole step's rows (one
        all-gather of them side by side)."""
        names = list(keyed)
        widths = [keyed[n].shape[-1] for n in names]
        dtype = keyed["kv"].dtype
        local = torch.cat([keyed[n].reshape(keyed[n].shape[0], -1).to(dtype) for n in names], dim=1)
        full = split.gather(local)
        return {n: part for n, part in zip(names, full.split(widths, dim=1))}

    def weight_uses(self) -> WeightUses:
        """The tensors this layer passes to the ops, by op (`SmallOps.prepare_weights`)."""
        for name in ("fused_x.weight", "fused_qr.weight", "wo_b.weight"):
            yield "linear", self.w[name]
        yield "grouped_linear", self.wo_a

    def run(self, x: torch.Tensor, step) -> torch.Tensor:
        """The block's sub-layer call (`block.StepInputs`): `forward` with the step's plan and RoPE."""
        return self.forward(x, step.plan, step.rope, step.cos_sin)

    def forward(self, x: torch.Tensor, plan: StepPlan, rope: RotaryTables,
                cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x `[T, D]` (normalised attention input) -> `[T, D]`."""
        if self.state is None:
            raise RuntimeError("no cache bound: call bind_cache() before forward()")
        a, c, w, st = self.accel, self.c, self.w, self.state
        T, H, d, eps = x.shape[0], c.num_attention_heads, c.head_dim, c.rms_norm_eps
        cos, sin = cos_sin[self.rope_kind]

        # one product over the fused projections of x (weights.FUSED_PROJECTIONS), then of qr (wq_b and
        # the indexer's wq_b), with the query's and key's norms and rotaries
        Hi = c.index_n_heads if self.indexer_compressor is not None else 0
        px, q, kv, index_q = self.ops.attention_projections(
            x, w["fused_x.weight"], self.q_rank, w["q_norm.weight"], w["fused_qr.weight"], H,
            w["kv_norm.weight"], eps, cos, sin, Hi, *(cos_sin["compress"] if Hi else (None, None)))
        # the parts other than wq_a and wkv (already consumed by the C call): none in a sliding layer
        px = split_fused(px, self.x_parts) if self._reads_px else None
        keyed = {"kv": kv, **{name: px[name] for name in self.key_inputs}}
        if plan.split is not None:  # context parallelism: every rank's rows of what other tokens read
            keyed = self._gather(keyed, plan.split)
        kv = keyed["kv"]

        if self.compressor is not None:
            self.compressor.update(keyed["compressor.wkv.weight"], keyed["compressor.wgate.weight"], plan, rope,
                                   st.rows[0], st.rows[1], st.entries)
        index_w = None
        if self.indexer_compressor is not None:
            self.indexer_compressor.update(keyed["indexer.compressor.wkv.weight"],
                                           keyed["indexer.compressor.wgate.weight"],
                                           plan, rope, st.indexer_rows[0], st.indexer_rows[1], st.indexer_keys)
            index_w = self.index_weights(px["indexer.weights_proj.weight"])

        window_flat = self._window_flat(st.window)
        decode_only = len(plan.groups) == 1 and plan.groups[0].in_row_order  # keys written as they are read
        if decode_only and plan.split is None:  # the rest of the sub-layer in one (fusable) call
            g = plan.groups[0]
            caches, rows, masks = self._decode_keys(g, 0, plan, window_flat, index_q, index_w)
            return self.ops.decode_attention_output(q, kv, g.new_key_ring_row, caches, rows, masks, w["attn_sink"],
                                             d ** -0.5, cos, sin, self.wo_a, w["wo_b.weight"])
        out = None if decode_only else torch.empty_like(q)  # every query row belongs to one group
        for gi, g in enumerate(plan.groups):
            if g.key_ring_row_all is not None:  # decode: own key into the ring first, then keys read in place
                window_flat.index_copy_(0, g.new_key_ring_row, kv if g.in_row_order else take_rows(kv, g.rows[:, 0]))
                if g.in_row_order:  # the step's tokens in row order: no scatter (gather is a view)
                    out = self._decode_attention(g.gather(q), g, gi, plan, window_flat, index_q, index_w).squeeze(1)
                else:
                    g.scatter(out, self._decode_attention(g.gather(q), g, gi, plan, window_flat, index_q, index_w))
                continue
            keys = torch.where(g.key_is_new.unsqueeze(-1), take_rows(kv, g.key_new_row),
                               take_rows(window_flat, g.key_ring_row))
            mask = g.window_mask
            if self.rate:
                ev = plan.entry_view(gi, self.rate)
                if self.type == CSA:
                    ckeys, cmask = self._selected_entries(g, ev, index_q, index_w)
                else:
                    ckeys, cmask = take_rows(st.entries, ev.flat), ev.visible
                keys, mask = torch.cat((keys, ckeys), dim=1), torch.cat((mask, cmask), dim=2)
            g.scatter(out, a.sink_attention(g.gather(q), keys, mask, w["attn_sink"], d ** -0.5))

        if not decode_only:
            plan.ring_write(st.window.shape[1]).store(window_flat, kv)

        o = a.rotary(out, cos, sin, True).view(T, c.o_groups, -1)
        grouped = a.grouped_linear(o, self.wo_a)
        return a.linear(grouped.reshape(T, -1), w["wo_b.weight"])

    def lower_decode(self, b: Builder, x: Ref, step: Ref) -> Ref:
        """`forward` on a step of decode tokens only (one per sequence, in row order, not split) as program
        calls: the projections, each compressor's ring write and pooling, a CSA layer's indexer
        selection, the attention output; the same ops, in the same order, on the same values. The
        step's addressing (the plan's rows and masks, the RoPE tables) comes in as program inputs."""
        if self.state is None:
            raise RuntimeError("no cache bound: call bind_cache() before building a decode program")
        c, w, st = self.c, self.w, self.state
        Hi = c.index_n_heads if self.indexer_compressor is not None else 0
        px, q, kv, index_q, cos, sin = lower_projections(b, x, w, self.q_rank, c.num_attention_heads, c.rms_norm_eps,
                                                         self.rope_kind, Hi)

        def part(name: str) -> Ref:
            return b.call(fused_part, view=True, out=px, parts=self.x_parts, name=name)

        plan, rope = b.input("plan", lambda s: s.plan), b.input("rope", lambda s: s.rope)
        for prefix, comp, rows, entries in (("", self.compressor, st.rows, st.entries),
                                            ("indexer.", self.indexer_compressor, st.indexer_rows, st.indexer_keys)):
            if comp is not None:
                comp.lower_decode(b, part(f"{prefix}compressor.wkv.weight"), part(f"{prefix}compressor.wgate.weight"),
                                  rows, entries, plan, rope)
        window_flat = self._window_flat(st.window)
        caches = (window_flat,)
        ring_rows, window_mask, key_rows = window_inputs(b)
        rows, masks = (ring_rows,), (window_mask,)
        if self.rate:
            if self.type == CSA:
                index_w = b.call(self.index_weights, weights_proj=part("indexer.weights_proj.weight"))
                picked = b.call(self.decode_selection, 2, plan=plan, index_q=index_q, index_w=index_w)
            else:
                rate = self.rate
                picked = (b.input(f"entry_rows.{rate}", lambda s: s.plan.entry_view(0, rate).flat),
                          b.input(f"entry_visible.{rate}", lambda s: s.plan.entry_view(0, rate).visible))
            caches, rows, masks = (window_flat, st.entries), (*rows, picked[0]), (*masks, picked[1])
        return b.call("ops.decode_attention_output", q=q, kv=kv, key_rows=key_rows, caches=caches, rows=rows,
                      masks=masks, sinks=w["attn_sink"], scale=c.head_dim ** -0.5, cos=cos, sin=sin, wo_a=self.wo_a,
                      wo_b=w["wo_b.weight"])

    def decode_selection(self, plan: StepPlan, index_q: torch.Tensor, index_w: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """A CSA layer's picked entries for a step of decode tokens only: (entry rows `[B, k']`, their mask
        `[B, 1, k']`), the rows and mask its attention reads after the window's."""
        g = plan.groups[0]
        return self._selected_entries(g, plan.entry_view(0, self.rate), index_q, index_w, lambda r: r)

    def index_weights(self, weights_proj: torch.Tensor) -> torch.Tensor:
        """The indexer's per-head weights `[T, Hi]` fp32 from their projection (its part of the fused one)."""
        c = self.c
        return weights_proj.float() * (c.index_n_heads ** -0.5 * c.index_head_dim ** -0.5)

    def _decode_attention(self, q: torch.Tensor, g, gi: int, plan: StepPlan, window_flat: torch.Tensor,
                          index_q: torch.Tensor | None, index_w: torch.Tensor | None) -> torch.Tensor:
        """A decode group's attention, q `[B, 1, H, d]` (one query per sequence, own key already in
        the ring) -> `[B, 1, H, d]`: one `sink_attention_rows` over `_decode_keys`."""
        caches, rows, masks = self._decode_keys(g, gi, plan, window_flat, index_q, index_w)
        return self.accel.sink_attention_rows(q, caches, rows, masks, self.w["attn_sink"], self.c.head_dim ** -0.5)

    def _decode_keys(self, g, gi: int, plan: StepPlan, window_flat: torch.Tensor, index_q: torch.Tensor | None,
                     index_w: torch.Tensor | None
                     ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """A decode group's key set as `sink_attention_rows` parts (caches, rows, masks): the window
        ring rows, then the visible (HCA) or picked (CSA) compressed entries, read by index from the cache."""
        caches, rows, masks = [window_flat], [g.key_ring_row_all], [g.window_mask]
        if self.rate:
            ev = plan.entry_view(gi, self.rate)
            if self.type == CSA:
                entry_rows, entry_mask = self._selected_entries(g, ev, index_q, index_w, lambda r: r)  # the rows
            else:
                entry_rows, entry_mask = ev.flat, ev.visible
            caches.append(self.state.entries)
            rows.append(entry_rows)
            masks.append(entry_mask)
        return tuple(caches), tuple(rows), tuple(masks)

    def _selected_entries(self, g, ev, index_q: torch.Tensor, index_w: torch.Tensor,
                          read: Callable[[torch.Tensor], torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer top-k per query, then the union of the picks of each item as its key set (`read`
        of its entry rows, `selected_entry_keys`; default: the entries' keys)."""
        st = self.state
        read = (lambda rows: take_rows(st.entries, rows)) if read is None else read
        # [B, S, k], -1 = none
        sel = self.ops.indexer_topk(g.gather(index_q), g.gather(index_w),
                                      take_rows(st.indexer_keys, ev.flat), ev.visible, self.c.index_topk)
        return selected_entry_keys(read, g, ev, sel)


def rope_inputs(b: Builder, kind: str) -> tuple[Ref, Ref]:
    """The step's RoPE tables of one frequency set (`StepInputs.cos_sin[kind]`) as program inputs."""
    return (b.input(f"cos.{kind}", lambda s: s.cos_sin[kind][0]), b.input(f"sin.{kind}", lambda s: s.cos_sin[kind][1]))


def lower_projections(b: Builder, x: Ref, w: dict[str, torch.Tensor], rank: int, heads: int, eps: float,
                      rope_kind: str, index_heads: int) -> tuple[Ref, Ref, Ref, Ref, Ref, Ref]:
    """A decode step's `ops.attention_projections` of `x` as a program call, over the layer's weights `w`
    (`fused_x`, `q_norm`, `fused_qr`, `kv_norm`) with its RoPE tables (`rope_kind`; the indexer's at the
    compress frequencies) as program inputs: (px, q, kv, the indexer's q, cos, sin)."""
    cos, sin = rope_inputs(b, rope_kind)
    icos, isin = rope_inputs(b, "compress") if index_heads else (None, None)
    px, q, kv, index_q = b.call(
        "ops.attention_projections", 4, x=x, fused_x=w["fused_x.weight"], rank=rank, q_norm=w["q_norm.weight"],
        fused_qr=w["fused_qr.weight"], heads=heads, kv_norm=w["kv_norm.weight"], eps=eps, cos=cos, sin=sin,
        index_heads=index_heads, index_cos=icos, index_sin=isin)
    return px, q, kv, index_q, cos, sin


def window_inputs(b: Builder) -> tuple[Ref, Ref, Ref]:
    """A decode step's window addressing as program inputs: the ring rows of each query's window keys, their
    mask and the ring rows the own keys are written to."""
    def read(name: str) -> Ref:  # a field of the step's one attention group
        return b.input(name, lambda s: getattr(s.plan.groups[0], name))
    return read("key_ring_row_all"), read("window_mask"), read("new_key_ring_row")


def selected_entry_keys(read: Callable[[torch.Tensor], torch.Tensor], g, ev, sel: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed keys a group attends over and their mask, from per-query picks `sel`
    `[B, S, k]` (entry ids, -1 = none): decode (S = 1) attends over its own picks; a prefill block
    over the union of its queries' picks, each query masked to its own. `read(rows)` returns the
    entries at block-group rows `rows` (any shape) as `[*rows.shape, d]`."""
    B, S, E = ev.visible.shape
    if E == 0:
        empty = read(ev.flat)
        return empty, ev.visible
    if S == 1:  # decode: the picks themselves are the key set
        picks = sel[:, 0, :E]  # beyond E all are -1 (k > E early on): no masked keys to attend over
        return read(ev.flat.gather(1, picks.clamp(min=0))), (picks >= 0).unsqueeze(1)
    picked = torch.zeros((B, S, E + 1), dtype=torch.bool, device=sel.device)
    picked.scatter_(2, torch.where(sel >= 0, sel, E), True)
    picked = picked[..., :E] & g.q_valid.unsqueeze(-1)
    used = picked.any(dim=1)  # [B, E]
    counts = used.sum(dim=1)
    U = int(counts.max()) if B else 0
    order = torch.argsort((~used).to(torch.int8), dim=1, stable=True)[:, :U]  # used entries first
    u_valid = torch.arange(U, device=sel.device) < counts.unsqueeze(1)
    keys = read(ev.flat.gather(1, order))
    mask = picked.gather(2, order.unsqueeze(1).expand(B, S, U)) & u_valid.unsqueeze(1)
    return keys, mask
