"""CSA2 attention of DeepSeek-V4.1: V4's shared-KV MQA with sinks, with compressed state shared
across layers.

Every layer: `q = RoPE(wq_b(q_norm(wq_a(x))))` (no per-head query norm), window key
`kv = FP8(RoPE(kv_norm(wkv(x))))`, one sink attention over the window (<= sliding_window keys)
plus, in compressed layers, <= index_topk selected compressed entries; output through the grouped
`wo_a` and `wo_b` after inverse RoPE. Ratio-0 layers rotate with the main RoPE, compressed layers
(queries, window keys, entries, indexer q/k) with the compress RoPE.

Layer roles (config.py):
- **Full** (a KV source) owns a compressor: ratio r > 1 pools each non-overlapping group of r tokens
  with a per-channel softmax over `wgate` scores of the `wkv` rows (fp32), ratio 1 is `wkv` alone;
  then `latent = norm(pooled)`. It publishes `compressed_kv = NVFP4(RoPE(latent, j*r))` and
  `index_keys = MXFP4(RoPE(k_norm(wk(latent)), j*r))` into its block group, and runs its indexer.
- **Reindex** runs only an indexer query over its KV source's index keys.
- **Reuse** attends over the latest index source's selection of its KV source's entries.
The indexer: `score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])` with
`q = MXFP4(RoPE(indexer.wq_b(q_norm(wq_a(x)))))` at the query's own position and
`w = weights_proj(x) / sqrt(index_head_dim * index_n_heads)`; a query at position t sees the
`(t + 1) // r` complete entries; top-k = min(index_topk, visible), picks sorted by position.
The candidate source additionally publishes a candidate pool: blocks of `candidate_block_size`
entries ranked by their maximum score, the block holding the newest visible entry always kept,
the best `candidate_topk_blocks` kept; index sources after it score only inside that pool.

Index-key publication: the owner's keys are read from its block group at every step, so a layer
always scores against its own KV source's current keys. (DeepSeek's reference code republishes the
shared index-key pointer only when the owner has just completed a group, so on decode steps where
a ratio-2 source has half a group pending, its indexer scores against the keys the last publisher
left, those of the ratio-1 source; its decode then disagrees with its own prefill. We do not
reproduce that.)

The selection and the candidate pool live on the step (`step.selection`, `step.candidates`), per
attention group of the step plan, written by each index source and read by the layers after it.
"""
from __future__ import annotations

import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.models.common.ragged import take_rows
from deepinfer.models.common.weights import WeightUses, fused_parts, group_rows, split_fused
from deepinfer.models.deepseek_v41.config import FULL, REINDEX, SLIDING, DeepseekV41Config
from deepinfer.models.deepseek_v41.context_parallel import gather_parts
from deepinfer.models.deepseek_v41.kv_quant import FP8_WINDOW, MXFP4_INDEX, NVFP4_COMPRESSED, decode, encode
from deepinfer.models.deepseek_v41.ops import CandidateBlocks, DeepseekV41Ops
from deepinfer.models.deepseek_v4.attention import lower_projections, selected_entry_keys, window_inputs
from deepinfer.program import Builder, Ref

# projections of the attention input fused into one matrix at load (model.FUSED_PROJECTIONS order)
X_PARTS = ("attn.wq_a.weight", "attn.wkv.weight", "attn.indexer.weights_proj.weight")
QR_PARTS = ("attn.wq_b.weight", "attn.indexer.wq_b.weight")


class CacheViews:
    """One layer's views of the bound cache (a reader's are its owner's tensors)."""

    def __init__(self, window: torch.Tensor, entries: torch.Tensor | None = None,
                 index_keys: torch.Tensor | None = None,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.window = window  # [num_slots, Rw, 528] uint8
        self.window_flat = window.view(-1, window.shape[-1])  # [num_slots * Rw, 528]: ring rows
        self.entries = entries  # [num_entries, 288] uint8 (the KV source's)
        self.index_keys = index_keys  # [num_entries, 68] uint8 (the KV source's)
        self.rows = rows  # compressor raw rows (kv, score) [num_slots, Rc, d] fp32 (Full, ratio > 1)


class Attention:
    def __init__(self, config: DeepseekV41Config, layer: int, weights: dict[str, torch.Tensor],
                 accel: Accelerator, ops: DeepseekV41Ops):
        """`weights`: the layer's tensors relative to `attn.`, with `fused_x.weight` and
        `fused_qr.weight` (X_PARTS, QR_PARTS) and the compressor weights in fp32."""
        self.c, self.layer, self.accel, self.ops, self.w = config, layer, accel, ops, weights
        self.role = config.layer_roles[layer]
        self.rate = config.compress_ratio(layer)
        self.rope_kind = "main" if self.role == SLIDING else "compress"
        self.topk_owner = config.topk_owner.get(layer)
        self.is_candidate_source = layer == config.candidate_source_layer_id
        self.uses_candidates = config.uses_candidates(layer)
        self.x_parts = fused_parts(weights, X_PARTS, "attn.")
        self.q_rank = self.x_parts[1][0]  # wq_a's output width (fused_x starts with wq_a, then wkv)
        self.wo_a = group_rows(weights["wo_a.weight"], config.o_groups)  # [G, R, in] for grouped_linear
        # the indexer's head weights: its projection's columns of fused_x, times this scale
        self.index_scale = config.index_n_heads ** -0.5 * config.index_head_dim ** -0.5
        # the ratio-1 compressor's projection in the model's dtype (it reads x in it), made once
        self.compress_wkv = None
        if self.role == FULL and self.rate == 1:
            self.compress_wkv = weights["compressor.wkv.weight"].to(weights["wo_b.weight"].dtype)
        self.state: CacheViews | None = None

    def weight_uses(self) -> WeightUses:
        """The tensors this layer passes to the ops, by op (`SmallOps.prepare_weights`)."""
        w = self.w
        for name in ("fused_x.weight", "fused_qr.weight", "wo_b.weight", "indexer.wk.weight"):
            if name in w:
                yield "linear", w[name]
        yield "grouped_linear", self.wo_a
        if self.compress_wkv is not None:
            yield "linear", self.compress_wkv
        elif "compressor.wkv.weight" in w:
            yield "linear", w["compressor.wkv.weight"]
            yield "linear", w["compressor.wgate.weight"]

    @property
    def indexes(self) -> bool:
        return self.role in (FULL, REINDEX)

    def run(self, x: torch.Tensor, step) -> torch.Tensor:
        """x `[T, D]` (normalised attention input) -> `[T, D]`."""
        if self.state is None:
            raise RuntimeError("no cache bound: call bind_cache() before forward()")
        a, c, w, st, plan = self.accel, self.c, self.w, self.state, step.plan
        T, H, d, eps = x.shape[0], c.num_attention_heads, c.head_dim, c.rms_norm_eps
        cos, sin = step.cos_sin[self.rope_kind]
        Hi = c.index_n_heads if self.indexes else 0
        px, q, kv, iq = self.ops.attention_projections(
            x, w["fused_x.weight"], self.q_rank, w["q_norm.weight"], w["fused_qr.weight"], H, w["kv_norm.weight"],
            eps, cos, sin, Hi, *(step.cos_sin["compress"] if Hi else (None, None)))
        compress = self.role == FULL and not step.kv_published  # bounded replay ran it on every row (replay.py)
        if len(plan.groups) == 1 and plan.groups[0].in_row_order and plan.split is None:
            # a step of decode tokens: the keys are written as they are read, the rest in one op
            if compress:
                self.compress_decode(x, step)
            return self._decode(q, kv, iq, px, step, cos, sin)
        index_w = split_fused(px, self.x_parts)["indexer.weights_proj.weight"] if Hi else None

        keyed = {"kv": encode(kv, FP8_WINDOW)}  # what other tokens read: the window key, compressor inputs
        if compress:
            keyed.update(self._compressor_inputs(x))
        if plan.split is not None:  # context parallelism: every rank's rows of it (context_parallel.py)
            keyed = gather_parts(plan.split, keyed)
        kv_codes = keyed["kv"]
        kv = decode(kv_codes, FP8_WINDOW, d, kv.dtype)  # the FP8 window key, as every reader sees it

        if compress:
            self._compress(keyed, x.dtype, step)
        window_flat = st.window_flat
        out = torch.empty_like(q)
        for gi, g in enumerate(plan.groups):
            if g.key_ring_row_all is not None:  # decode: own key into the ring first, then one gather
                window_flat.index_copy_(0, g.new_key_ring_row, take_rows(kv_codes, g.rows[:, 0]))
                keys = decode(take_rows(window_flat, g.key_ring_row_all), FP8_WINDOW, d, kv.dtype)
            else:
                old = decode(take_rows(window_flat, g.key_ring_row), FP8_WINDOW, d, kv.dtype)
                keys = torch.where(g.key_is_new.unsqueeze(-1), take_rows(kv, g.key_new_row), old)
            mask = g.window_mask
            if self.rate:
                ev = plan.entry_view(gi, self.rate)
                ckeys, cmask = selected_entry_keys(self._read_entries, g, ev,
                                                   self._picks(gi, g, ev, iq, index_w, step))
                keys, mask = torch.cat((keys, ckeys), dim=1), torch.cat((mask, cmask), dim=2)
            g.scatter(out, a.sink_attention(g.gather(q), keys, mask, w["attn_sink"], d ** -0.5))

        if not (len(plan.groups) == 1 and plan.groups[0].key_ring_row_all is not None):
            write = plan.ring_write(st.window.shape[1])
            window_flat[write.ring_row] = kv_codes[write.rows]

        o = a.rotary(out, cos, sin, True).view(T, c.o_groups, -1)
        grouped = a.grouped_linear(o, self.wo_a)
        return a.linear(grouped.reshape(T, -1), w["wo_b.weight"])

    def _decode(self, q: torch.Tensor, kv: torch.Tensor, iq: torch.Tensor | None, px: torch.Tensor, step,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A step of decode tokens (one group, every row one sequence's only query, no context-parallel
        split): `ops.decode_attention_output` over the window and this layer's picked entries."""
        c, w, st, g = self.c, self.w, self.state, step.plan.groups[0]
        caches, rows, masks = (st.window_flat,), (g.key_ring_row_all,), (g.window_mask,)
        if self.rate:
            caches, (picked, mask) = (*caches, st.entries), self.decode_picks(px, iq, step)
            rows, masks = (*rows, picked), (*masks, mask)
        return self.ops.decode_attention_output(q, kv, g.new_key_ring_row, caches, rows, masks, w["attn_sink"],
                                                c.head_dim ** -0.5, cos, sin, self.wo_a, w["wo_b.weight"])

    def lower_decode(self, b: Builder, x: Ref, step: Ref) -> Ref:
        """`run` on a step of decode tokens (as `_decode` runs it) as program calls: the projections, a KV
        source's compressor, the picks of a compressed layer, the attention output; the same ops in the
        same order on the same values. The step's addressing and RoPE tables come in as program inputs."""
        if self.state is None:
            raise RuntimeError("no cache bound: call bind_cache() before building a decode program")
        c, w, st = self.c, self.w, self.state
        px, q, kv, iq, cos, sin = lower_projections(b, x, w, self.q_rank, c.num_attention_heads, c.rms_norm_eps,
                                                    self.rope_kind, c.index_n_heads if self.indexes else 0)
        if self.role == FULL:
            b.call(self.compress_decode, 0, x=x, step=step)
        ring_rows, window_mask, key_rows = window_inputs(b)
        caches, rows, masks = (st.window_flat,), (ring_rows,), (window_mask,)
        if self.rate:
            picked, mask = b.call(self.decode_picks, 2, px=px, iq=iq, step=step)
            caches, rows, masks = (*caches, st.entries), (*rows, picked), (*masks, mask)
        return b.call("ops.decode_attention_output", q=q, kv=kv, key_rows=key_rows, caches=caches, rows=rows,
                      masks=masks, sinks=w["attn_sink"], scale=c.head_dim ** -0.5, cos=cos, sin=sin, wo_a=self.wo_a,
                      wo_b=w["wo_b.weight"])

    def compress_decode(self, x: torch.Tensor, step) -> None:
        """A KV source's compressor over a decode step's rows `x` `[T, D]` (`_compress` of its inputs)."""
        self._compress(self._compressor_inputs(x), x.dtype, step)

    def decode_picks(self, px: torch.Tensor, iq: torch.Tensor | None, step) -> tuple[torch.Tensor, torch.Tensor]:
        """A compressed layer's picked entries for a step of decode tokens, from the fused projection `px`
        and the indexer's query `iq` (an index source's; else its top-k owner's picks on the step): (entry
        rows `[B, k']`, their mask `[B, 1, k']`), the part its attention reads after the window's."""
        key = (self.topk_owner, self.rate)  # the layers reading one owner's picks at one rate read the same rows
        if not self.indexes and key in step.picked:
            return step.picked[key]
        plan = step.plan
        g, ev = plan.groups[0], plan.entry_view(0, self.rate)
        index_w = split_fused(px, self.x_parts)["indexer.weights_proj.weight"] if self.indexes else None
        picks = self._picks(0, g, ev, iq, index_w, step)[:, 0, :ev.flat.shape[1]]  # -1s beyond E only
        step.picked[key] = ev.flat.gather(1, picks.clamp(min=0)), (picks >= 0).unsqueeze(1)
        return step.picked[key]

    def _picks(self, gi: int, g, ev, iq: torch.Tensor | None, index_w: torch.Tensor | None, step) -> torch.Tensor:
        """The top-k entry ids `[B, S, k]` of the group's queries this layer attends over: its own
        indexer's (an index source, which leaves them on the step), else its top-k owner's."""
        if self.indexes:
            step.selection[gi] = (self.layer, self._select(gi, g, ev, iq, index_w, step))
        owner, sel = step.selection[gi]
        if owner != self.topk_owner:
            raise RuntimeError(f"layer {self.layer} expects the top-k of layer {self.topk_owner} but the step "
                               f"holds layer {owner}'s; layers must run in order")
        return sel

    def _read_entries(self, rows: torch.Tensor) -> torch.Tensor:
        """Dequantised compressed entries at block-group rows `rows` (any shape) -> `[*rows.shape, d]`."""
        return decode(take_rows(self.state.entries, rows), NVFP4_COMPRESSED, self.c.head_dim,
                      self.w["wo_b.weight"].dtype)

    # ----- compressor (Full layers) -----
    def publish_kv(self, x: torch.Tensor, step) -> None:
        """Only this KV source's compressor and index keys over `x` `[T, D]` (bounded replay's prepass)."""
        if self.role != FULL:
            raise ValueError(f"layer {self.layer} is a {self.role} layer, not a KV source: it has no compressor")
        inputs = self._compressor_inputs(x)
        if step.plan.split is not None:  # context parallelism: every rank's rows of them
            inputs = gather_parts(step.plan.split, inputs)
        self._compress(inputs, x.dtype, step)

    def _compressor_inputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-row projections the compressor pools (`x` `[T, D]`): `wkv` in the model dtype at
        ratio 1; `wkv` and `wgate` in fp32 at ratio > 1."""
        a, w = self.accel, self.w
        if self.rate == 1:
            return {"compressor.wkv": a.linear(x, self.compress_wkv.to(x.dtype))}
        xf = x.float()
        return {"compressor.wkv": a.linear(xf, w["compressor.wkv.weight"]),
                "compressor.wgate": a.linear(xf, w["compressor.wgate.weight"])}

    def _compress(self, inputs: dict[str, torch.Tensor], dtype: torch.dtype, step) -> None:
        """Write the entries of the groups completed in this step (compressed KV and index keys)
        from the step's `_compressor_inputs` (every row of the step); `dtype`: the model's."""
        a, c, w, st, plan = self.accel, self.c, self.w, self.state, step.plan
        r, eps = self.rate, c.rms_norm_eps
        if r == 1:
            cp = plan.compress_plan(1, 1, False)
            if not cp.num_windows:
                return
            raw = inputs["compressor.wkv"]
            latent = a.rms_norm(raw[cp.new_row[:, 0]], w["compressor.norm.weight"], eps)
        else:
            rows_kv, rows_score = st.rows
            ring = rows_kv.shape[1]
            kv_raw, score_raw = inputs["compressor.wkv"], inputs["compressor.wgate"]
            flat_kv, flat_score = rows_kv.view(-1, rows_kv.shape[-1]), rows_score.view(-1, rows_score.shape[-1])
            cp = plan.compress_plan(r, ring, False)
            if cp.num_windows:
                new = cp.is_new.unsqueeze(-1)
                src_kv = torch.where(new, take_rows(kv_raw, cp.new_row), take_rows(flat_kv, cp.ring_row))
                src_score = torch.where(new, take_rows(score_raw, cp.new_row), take_rows(flat_score, cp.ring_row))
                pooled = self.ops.compress_pool(src_kv, src_score).to(dtype)
                latent = a.rms_norm(pooled, w["compressor.norm.weight"], eps)
            write = plan.ring_write(ring)
            write.store(flat_kv, kv_raw)
            write.store(flat_score, score_raw)
            if not cp.num_windows:
                return
        cos, sin = step.rope.cos_sin(cp.rope_pos, "compress")
        self.ops.cache_store(a.rotary(latent, cos, sin, False), NVFP4_COMPRESSED, st.entries, cp.entry_row)
        key = a.rms_norm(a.linear(latent, w["indexer.wk.weight"]), w["indexer.k_norm.weight"], eps)
        self.ops.cache_store(a.rotary(key, cos, sin, False), MXFP4_INDEX, st.index_keys, cp.entry_row)

    # ----- indexer (Full and Reindex layers) -----
    def _select(self, gi: int, g, ev, iq: torch.Tensor, index_w: torch.Tensor, step) -> torch.Tensor:
        """Top-k entry ids `[B, S, k]` (sorted by position, -1 = none) of the group's queries (`ops.index_select`
        over the KV source's index keys); the candidate source leaves its pool on the step."""
        c = self.c
        pool = None
        if self.is_candidate_source:
            pool = CandidateBlocks(c.candidate_block_size, c.candidate_topk_blocks, self.rate, g.q_pos)
        candidates = step.candidates[gi] if self.uses_candidates and pool is None else None
        picks, pooled = self.ops.index_select(g.gather(iq), g.gather(index_w), self.index_scale, self.state.index_keys,
                                              ev.flat, ev.visible, c.index_topk, candidates, pool)
        if pooled is not None:
            step.candidates[gi] = pooled
        return picks
