"""A DeepSeek-V4 decoder block of a decode step as its C calls prepared once (the V4 op `decode_block`).

Module by module, a block of a decode step makes the same C calls every step: the mHC site before
attention, the attention's input projections, the compressors' ring writes (none in a sliding layer,
the indexer's too in a CSA one), the attention output, the mHC site before the MoE and the MoE
sub-layer. Around them ran ~250 us of Python: the model's glue, the wrappers' checks, new output
tensors, ctypes matching ~25 keyword arguments a call. A `DecodeBlockRunner` checks and binds those
calls once (each wrapper's own `*_arguments`, with the kernel choices the composed ops make for the
step's token count), owns their outputs, and per step only replaces the arguments that change (the
incoming streams, the RoPE tables, the step plan's rows) before calling them: the same calls on the
same inputs, so the same bits. What stays in torch between them is the model's own code: a window's
pooling when one completes (`Compressor.pool_stored`) and a CSA layer's indexer top-k
(`Attention._decode_keys`).

A block runs this way in a step of decode tokens only (one per sequence, up to MAX_TOKENS, no
context-parallel split; the calls are prepared per token count), with its weights held whole (no
expert parallelism; bf16, or kept quantised: the `*_quant` calls), V4's two mHC sites and nothing
else, and every product on the kernel the composed op would pick for it (the packed copies it would
read exist: checked every step, since they appear after a weight's first uses). Anything else runs
module by module. `DEEPINFER_CPU_DECODE_BLOCKS=0` turns it off.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer import envs
from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.models.common.weights import split_fused
from deepinfer.models.deepseek_v4.attention import Attention
from deepinfer.models.deepseek_v4.block import ATTN, FFN, DecoderBlock, HyperConnected, StepInputs
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.native.attention_layer import check_output_status
from deepinfer_plugins.cpu.native.binding import PreparedCall, threads

if TYPE_CHECKING:
    from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels


def enabled() -> bool:
    """DEEPINFER_CPU_DECODE_BLOCKS (default on): decode steps run each eligible block as its prepared C
    calls."""
    return envs.get_bool("DEEPINFER_CPU_DECODE_BLOCKS", True)


def _parts(block: DecoderBlock) -> tuple[HyperConnected, Attention, HyperConnected, MoE] | None:
    """The block's (attention site, attention, MoE site, MoE) if it is exactly V4's two mHC sites."""
    mods = block.modules
    if (len(mods) != 2 or not all(type(m) is HyperConnected for m in mods) or mods[0].name != ATTN
            or mods[1].name != FFN or type(mods[0].layer) is not Attention or type(mods[1].layer) is not MoE):
        return None
    return mods[0], mods[0].layer, mods[1], mods[1].layer


def block_eligible(block: DecoderBlock) -> bool:
    """What never changes between steps: the block's structure and weights (bf16, whole)."""
    parts = _parts(block)
    if parts is None:
        return False
    _, attn, _, moe = parts
    weights = (attn.w["fused_x.weight"], attn.w["fused_qr.weight"], attn.wo_a, attn.w["wo_b.weight"], moe.w13, moe.w2,
               *(moe.shared or ()))
    return (moe.ep is None and (not moe.is_hash or moe.tid2eid.dtype == torch.int64)
            and all(isinstance(w, QuantizedWeight) or type(w) is torch.Tensor and w.dtype == torch.bfloat16
                    for w in weights))


def _quantised(*weights) -> bool:
    return any(isinstance(w, QuantizedWeight) for w in weights)


#: the most tokens of a step whose blocks run as prepared calls (the mHC sites' and the MoE's one-call sizes)
MAX_TOKENS = 64


def plan_eligible(plan) -> bool:
    """The step (`StepPlan`): decode tokens only (one per sequence, in row order), unsplit, up to MAX_TOKENS."""
    if not plan.decode_only or plan.T > MAX_TOKENS or plan.split is not None:
        return False
    groups = plan.groups
    return len(groups) == 1 and groups[0].in_row_order


def inputs_eligible(streams: torch.Tensor, waiting: tuple | None, tokens: int) -> bool:
    """The streams and the waiting site's output as the C calls read them."""
    if (streams.dtype != torch.bfloat16 or streams.dim() != 3 or streams.shape[0] != tokens
            or not streams.is_contiguous()):
        return False
    if waiting is None:
        return True
    _, y, post, comb = waiting
    return (y.is_contiguous() and post.is_contiguous() and comb.is_contiguous() and y.dtype == torch.bfloat16
            and post.dtype == torch.float32 and comb.dtype == torch.float32)


def _flat(t: tuple | list) -> list:
    out = []
    for x in t:
        out.extend(_flat(x) if isinstance(x, (tuple, list)) else (x,))
    return out


class DecodeBlockRunner:
    """One block's prepared calls for decode steps of `tokens` tokens (built by `build` from a step it then
    runs)."""

    def __init__(self, kernels: NativeCpuKernels, block: DecoderBlock, tokens: int):
        self.kernels, self.lib, self.T = kernels, kernels.native_library, tokens
        self.attn_site, self.attn, self.ffn_site, self.moe = _parts(block)
        self.state = self.attn.state  # the cache binding its calls address
        self.calls: list[PreparedCall] = []
        self.choices: list = []  # kernel_choices' flattened, as built
        self.first = False  # no site waiting before it: the attention site is hc_pre_norm, not hc_post_pre_norm

    def kernel_choices(self, streams: torch.Tensor) -> list | None:
        """The products the composed ops would pick for this step's tokens (the packed copies, by identity, and
        flags), or None where one of them would not be the C call. Once per step: the lookups count uses, as
        the composed ops' would (a copy is made at a weight's second)."""
        k, a, m, T = self.kernels, self.attn, self.moe, self.T
        fx, fqr, wo_b = a.w["fused_x.weight"], a.w["fused_qr.weight"], a.w["wo_b.weight"]
        if _quantised(fx, fqr):
            projections = k._quant_linear_copies(T, fx, fqr)
        else:
            projections = None if T > 1 and k.native_amx else k._linear_copies(T, fx, fqr)
        if projections is None:
            return None
        if _quantised(a.wo_a, wo_b):
            output = k._quant_output_products(T, a.wo_a, wo_b)
        else:
            output = None if k.native_amx else k._decode_output_products(T, a.wo_a, wo_b)
        if output is None:
            return None
        shared = (None, None) if m.shared is None else m.shared
        if _quantised(m.w13, m.w2, *shared):
            moe = k.quant_moe_layer_products(T, m.w13, m.w2, *shared)
        else:
            moe = k.moe_layer_products(T, torch.bfloat16, m.w13, m.w2, *shared, m.c.num_experts_per_tok)
        if moe is None:
            return None
        # the mHC sites' transposed fn (from 4 rows), as their composed calls look it up
        return [projections, output, moe, k._hc_fn_t(streams, self.attn_site.fn), k._hc_fn_t(streams, self.ffn_site.fn)]

    def ready(self, choices: list, first: bool) -> bool:
        """Built for these choices (the same copies) and this position in the chain."""
        if not self.calls or first != self.first:
            return False
        flat = _flat(choices)
        return len(flat) == len(self.choices) and all(x is y for x, y in zip(flat, self.choices))

    # ----- building -----
    def build(self, streams: torch.Tensor, waiting: tuple | None, step: StepInputs, choices: list) -> bool:
        """Check and bind every call on this step's inputs (nothing computed yet); False: not this way."""
        lib, a, site_a, site_b, moe = self.lib, self.attn, self.attn_site, self.ffn_site, self.moe
        self.calls, self.choices, self.first = [], _flat(choices), waiting is None
        copies, products, moe_products, fn_t_a, fn_t_b = choices
        c, plan, st, w = a.c, step.plan, self.state, a.w
        cos, sin = step.cos_sin[a.rope_kind]
        icos, isin = step.cos_sin["compress"] if a.indexer_compressor is not None else (cos, sin)
        n, D = streams.shape[1], streams.shape[2]
        hc = (c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        if self.first:
            pre = native.hc_pre_arguments(lib, streams, site_a.fn, site_a.base, site_a.scale, *hc, site_a.norm,
                                          c.rms_norm_eps, fn_t_a)
            if pre is None:
                return False
            x, post_a, comb_a = pre.outputs
            streams_a = streams
        else:
            _, y, post, comb = waiting
            pre = native.hc_post_pre_norm_arguments(
                lib, y, streams, post, comb, site_a.fn, site_a.base, site_a.scale, *hc, site_a.norm, c.rms_norm_eps,
                fn_t_a, native.hc_outputs(self.T, n, D, streams.dtype))
            if pre is None:
                return False
            streams_a, x, post_a, comb_a = pre.outputs
        Hi = c.index_n_heads if a.indexer_compressor is not None else 0
        projections = (native.attention_projections_quant_arguments
                       if _quantised(w["fused_x.weight"], w["fused_qr.weight"]) else
                       native.attention_projections_arguments)
        proj = projections(lib, x, w["fused_x.weight"], a.q_rank, w["q_norm.weight"], w["fused_qr.weight"],
                           c.num_attention_heads, w["kv_norm.weight"], c.rms_norm_eps, cos, sin, Hi,
                           icos if Hi else None, isin if Hi else None, *copies)
        # the RoPE tables read where they are (no fp32 copy made per step)
        if proj is None or [proj.values[n] for n in ("cos_t", "sin_t", "icos", "isin")] != [
                t.data_ptr() for t in (cos, sin, icos, isin)]:
            return False
        self.half, self.ihalf = proj.values["half"], proj.values["ihalf"]
        px, q, kv, self.iq = proj.outputs
        parts = split_fused(px, a.x_parts) if a.key_inputs or Hi else {}
        self.compressors, stores = [], []
        for prefix, comp, rows, entries in (("", a.compressor, st.rows, st.entries),
                                            ("indexer.", a.indexer_compressor, st.indexer_rows, st.indexer_keys)):
            if comp is None:
                continue
            flat_kv, flat_score = comp._flat_rows(*rows)
            store = native.compress_store_arguments(
                lib, parts[f"{prefix}compressor.wkv.weight"], parts[f"{prefix}compressor.wgate.weight"], comp.ape,
                plan.position_mod(comp.rate), plan.ring_write(rows[0].shape[1]).ring_row, flat_kv, flat_score)
            if store is None:
                return False
            stores.append(store)
            self.compressors.append((comp, rows, entries))
        self.index_weights = parts["indexer.weights_proj.weight"] if Hi else None
        g = plan.groups[0]
        window_flat = a._window_flat(st.window)
        caches, rows, masks = (window_flat,), (g.key_ring_row_all,), (g.window_mask,)
        if a.rate:  # entries: built on the visible ones, the indexer's picks (CSA) replace them every step
            ev = plan.entry_view(0, a.rate)
            caches, rows, masks = (window_flat, st.entries), (*rows, ev.flat), (*masks, ev.visible)
        self.caches = caches
        output = (native.attention_output_quant_arguments if _quantised(a.wo_a, w["wo_b.weight"]) else
                  native.attention_output_arguments)
        out = output(lib, q, kv, g.new_key_ring_row, caches, rows, masks, w["attn_sink"], c.head_dim ** -0.5, cos,
                     sin, a.wo_a, w["wo_b.weight"], *products)
        if out is None or out.values["cos_t"] != cos.data_ptr() or out.values["sin_t"] != sin.data_ptr():
            return False
        post_b = native.hc_post_pre_norm_arguments(
            lib, out.outputs, streams_a, post_a, comb_a, site_b.fn, site_b.base, site_b.scale, *hc, site_b.norm,
            c.rms_norm_eps, fn_t_b, native.hc_outputs(self.T, n, D, streams.dtype))
        if post_b is None:
            return False
        self.streams_b, self.x_b, self.post_b, self.comb_b = post_b.outputs
        hash_ids = moe.tid2eid.index_select(0, step.input_ids) if moe.is_hash else None
        sw13, sw2 = (None, None) if moe.shared is None else moe.shared
        mc = moe.c
        layer_inputs = (lib, self.x_b, moe.gate, moe.bias, hash_ids, moe.w13, moe.w2, sw13, sw2, mc.num_experts_per_tok,
                        mc.routed_scaling_factor, mc.scoring_func, mc.swiglu_limit)
        if _quantised(moe.w13, moe.w2, sw13, sw2):
            packed_shared, round_silu = moe_products
            layer = native.moe_layer_quant_arguments(*layer_inputs, round_silu, packed_shared)
        else:
            experts, packed_shared, round_silu = moe_products
            layer = native.moe_layer_arguments(*layer_inputs, round_silu, experts, packed_shared)
        if layer is None:
            return False
        self.y = layer.outputs
        self.pre, self.projections, self.output, self.post_pre, self.moe_layer = (
            b.prepared(lib) for b in (pre, proj, out, post_b, layer))
        self.stores = [b.prepared(lib) for b in stores]
        self.calls = [self.pre, self.projections, *self.stores, self.output, self.post_pre, self.moe_layer]
        self.threads = threads()
        self._index_arguments()
        return True

    def _index_arguments(self) -> None:
        """Where each call takes the inputs that change between steps."""
        self.pre_inputs = [self.pre.index(n) for n in (("streams",) if self.first else
                                                        ("y", "streams", "post_in", "comb_in"))]
        self.rope = [self.projections.index(n) for n in ("cos_t", "sin_t", "icos", "isin")]
        self.store_inputs = [(s.index("position_mod"), s.index("ring_row")) for s in self.stores]
        self.out_inputs = [self.output.index(n) for n in ("key_rows", "rows0", "mask0", "L0", "rows1", "mask1", "L1",
                                                          "cos_t", "sin_t")]
        self.post_pre_streams = self.post_pre.index("streams")
        self.hash_index = self.moe_layer.index("hash_ids")
        self.thread_inputs = [(call, call.index("num_threads")) for call in self.calls if "num_threads" in call.names]

    # ----- a step -----
    def run(self, streams: torch.Tensor, waiting: tuple | None, step: StepInputs
            ) -> tuple[torch.Tensor, tuple] | None:
        """The block on this step (`decode_block`'s result; the caller checked `ready`), or None: run it
        module by module (a RoPE table not as built, a compressor row the C write refuses)."""
        plan, a = step.plan, self.attn
        cos, sin = step.cos_sin[a.rope_kind]
        icos, isin = step.cos_sin["compress"] if self.iq is not None else (cos, sin)
        if not all(t.dtype == torch.float32 and t.is_contiguous() and t.shape == (self.T, h)
                   for t, h in ((cos, self.half), (sin, self.half), (icos, self.ihalf), (isin, self.ihalf))):
            return None
        rope = [t.data_ptr() for t in (cos, sin, icos, isin)]
        if threads() != self.threads:  # torch's thread count changed: the calls use it, as the composed ops do
            self.threads = threads()
            for call, i in self.thread_inputs:
                call.arguments[i] = self.threads
        pre = self.pre.arguments
        if self.first:
            pre[self.pre_inputs[0]] = streams.data_ptr()
        else:
            _, y, post, comb = waiting
            for i, t in zip(self.pre_inputs, (y, streams, post, comb)):
                pre[i] = t.data_ptr()
        proj = self.projections.arguments
        for i, v in zip(self.rope, rope):
            proj[i] = v
        self.pre()
        self.projections()
        for store, (i_mod, i_row), (comp, rows, entries) in zip(self.stores, self.store_inputs, self.compressors):
            store.arguments[i_mod] = plan.position_mod(comp.rate).data_ptr()
            store.arguments[i_row] = plan.ring_write(rows[0].shape[1]).ring_row.data_ptr()
            if store():
                return None  # not written: the composed path reports the row
            comp.pool_stored(plan, step.rope, *rows, entries)
        g = plan.groups[0]
        values = [g.new_key_ring_row, g.key_ring_row_all, g.window_mask]
        if self.iq is not None:  # CSA: the indexer's picks
            _, rows, masks = a._decode_keys(g, 0, plan, self.caches[0], self.iq, a.index_weights(self.index_weights))
            values += [rows[1], masks[1]]
        elif a.rate:
            ev = plan.entry_view(0, a.rate)
            values += [ev.flat, ev.visible]
        else:
            values += [g.key_ring_row_all, g.window_mask]
        if not all(t.is_contiguous() for t in values):
            return None
        key_rows, rows0, mask0, rows1, mask1 = values
        out = self.output.arguments
        for i, v in zip(self.out_inputs, (key_rows.data_ptr(), rows0.data_ptr(), mask0.data_ptr(), rows0.shape[1],
                                          rows1.data_ptr(), mask1.data_ptr(), rows1.shape[1] if a.rate else 0,
                                          rope[0], rope[1])):
            out[i] = v
        check_output_status(self.output(), self.caches)
        if self.first:  # the attention site left the streams as they came
            self.post_pre.arguments[self.post_pre_streams] = streams.data_ptr()
        self.post_pre()
        moe = self.moe
        hash_ids = moe.tid2eid.index_select(0, step.input_ids) if moe.is_hash else None
        self.moe_layer.arguments[self.hash_index] = None if hash_ids is None else hash_ids.data_ptr()
        # a bad hash id: the composed path reports it
        y = self.y if self.moe_layer() == 0 else moe.forward(self.x_b, step.input_ids)
        return self.streams_b, (self.ffn_site, y, self.post_b, self.comb_b)
