"""CpuKernels with its fast paths: fused C functions (native/*.c), one call and one pass over
memory instead of tens of torch ops, for
- the element-wise kernels: rms_norm, rotary (and the two in one call), hc_pre (alone or with the
  sub-layer's rms_norm), hc_post, hc_post_pre_norm (between two mHC sites), hc_head, swiglu;
- a decode step's whole MoE sub-layer (router, top-k, dispatch, experts, combine, shared expert);
- decode-sized products: the bf16 GEMV of one token, LM head included (it streams weights faster
  than torch.mv on every tier: AVX512-BF16, AVX2+FMA, portable), the grouped output projection of a few tokens, the routed experts of decode-sized
  batches (each expert weight streamed once; bf16 in experts.c, FP4/FP8 codes in quant_experts.c),
  and, where the CPU has AMX, the linears of decode batches (tile products instead of oneDNN's calls);
- the MoE dispatch and combine (a counting sort and a weighted row sum, ~10 torch ops each);
- decode attention (16 heads per vector lane set, no horizontal sums);
- DeepSeek-V4.1's own ops (`CpuDeepseekV41Ops`): its single-pass mHC sites, its MXFP4 indexer and its
  decode attention over the FP8 / NVFP4-coded caches, decoded as they are read;
- greedy sampling's argmax with the log-sum-exp, in one pass over the logits.
Each method falls back to the pure-torch reference when the library is unavailable (no compiler,
DEEPINFER_CPU_NATIVE=0) or the input is outside what the C code handles.

Decode-batch bf16 linears (2 to 64 rows; on AVX512-BF16 one row too; on AVX2+FMA every multi-row one,
prefill included) run on C register tiles over copies of the weights packed for them
(native/packed_gemm.c), the other multi-row ones on oneDNN-packed copies (packed_weights.py);
DEEPINFER_CPU_PACKED_WEIGHTS=0 turns both copies off (the plain weights through the C GEMVs and torch).

Batch-invariant mode (`set_batch_invariant(True)`, the batch_invariant feature; needs the library):
every product (linears, grouped projections, experts, mHC mixes, indexer scores) runs through one
fixed-order C dot product whatever the row count (`linear_rows`), every attention call through the
C attention with each sequence's keys in a canonical order (`sink_attention_invariant`), and the
element-wise and per-row kernels (norms, rotary, swiglu, mHC, MoE combine, argmax/log-sum-exp)
through the C kernels, which already reduce each row on its own. A row's result is then the same
bits alone, in any batch, in any prefill chunk or at decode (docs/batch_invariance.md)."""
from __future__ import annotations

import ctypes
import functools
import threading

import torch

from deepinfer.accelerator.interface import MoEDispatch
from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops
from deepinfer.models.deepseek_v41.kv_quant import FP8_WINDOW, NVFP4_COMPRESSED, KVFormat
from deepinfer.models.deepseek_v41.ops import FAMILY as DEEPSEEK_V41, CandidateBlocks, DeepseekV41Ops
from deepinfer.program import Program
from deepinfer_plugins.cpu import native, packed_weights
from deepinfer_plugins.cpu.program import V41_BINDERS, PreparedProgram
from deepinfer_plugins.cpu.kernels import _SKINNY_ROWS, CpuKernels, _pad_rows
from deepinfer_plugins.cpu.packed_weights import PackedWeights

# The crossovers these thresholds were set from are in docs/performance.md ("The cpu back end's tuning
# thresholds").

# Rows per expert (on average) up to which the C expert kernel runs on AMX tiles (1.96x torch at 1,024
# rows, equal at 256 rows per expert), and rows in all on the portable dot products.
_EXPERT_ROWS_PER_EXPERT_AMX = 192
_EXPERT_MAX_ROWS_DOT = 48

# Tokens up to which the grouped output projection runs on AMX tiles (~230 -> ~60 us at 32 tokens).
_GROUPED_AMX_MAX_TOKENS = 64

# Decode-batch linears (2-32 rows) of weights up to 8 M elements on AMX tiles (from 64 rows, and for the
# LM head, the packed oneDNN path is faster).
_LINEAR_AMX_MAX_ROWS = 32
_LINEAR_AMX_MAX_ELEMENTS = 8 << 20

# Decode-batch linears (2 to this many rows) on the C multi-token GEMV instead of oneDNN, per GEMV tier.
_GEMV_TOKENS_MAX_ROWS = {"avx512-bf16": 8, "avx2-fma": 16, "portable": 1}
# Row counts (inclusive) whose bf16 linears run on the C register tiles over weights packed for them
# (packed_gemm.c, packed at a weight's second use in that range), per tier; on AVX2+FMA prefill too
# (oneDNN has no AVX2 bf16 kernel: 2.5-3.7x torch), with the routed experts' rows and the grouped output
# projection above the expert kernel's and the GEMV's limits (_tile_experts, _tile_grouped).
_PACKED_GEMM_ROWS = {"avx512-bf16": (1, 64), "avx2-fma": (2, 1 << 62), "portable": (0, 0)}
# Weight elements from which one row (decode at batch 1) also runs on the tiles on AVX2+FMA: the LM head
# (1.26x the GEMV on the loaded weight at two threads).
_AVX2_ONE_ROW_TILES_MIN_ELEMENTS = 32 << 20
# Expert rows per expert (on average) up to which the C expert kernel runs on the AVX2+FMA and
# AVX512-BF16 tiers, each expert weight streamed once (1.45-2.83x torch at 16).
_EXPERT_ROWS_PER_EXPERT_DOT = 16

# Tokens up to which the router's top-k runs in C (one thread, k passes over the experts: ~10 torch ops
# fewer per layer at decode; prefill-sized batches keep torch's parallel top-k)
_ROUTE_MAX_TOKENS = 64

# The fused MoE sub-layer (moe_layer.c) of a bf16 decode batch: up to the multi-token GEMV's rows, and with
# the register tiles (packed_gemm.c) up to _MOE_FUSED_MAX_TOKENS. Its routed experts run on the tiles over
# packed copies of the expert weights (as many bytes again) from this many rows per expert on average, per
# tier, else on the expert kernel's GEMVs.
_MOE_TILES_ROWS_PER_EXPERT = {"avx512-bf16": 3, "avx2-fma": 4, "portable": 1 << 62}
_MOE_FUSED_MAX_TOKENS = 64

# Token rows up to which hc_post_pre_norm writes into reused output tensors (the allocation costs as much
# as the call's work at a few rows; prefill-sized buffers would stay allocated between steps)
_HC_REUSE_MAX_ROWS = 64

# Elements below which swiglu stays on torch's four ops (cheaper than the call: 5.9 vs 6.6 us for one
# 512-wide row); the fused MoE rounds its shared expert's swiglu as they do below it
_SWIGLU_TORCH_MAX = 4096

# Queries per sequence up to which attention runs in the C kernel (decode, speculative verification):
# 2.2x the two fp32 bmms at 32 sequences x 256 keys, 6x at one sequence.
_DECODE_QUERIES = 16
# Rows up to which a product on FP4/FP8 weights runs on the codes (quant_gemv.c, each weight group decoded
# once per 4 rows; above, dequantising tiles for a GEMM is cheaper: 56 vs 100 ms at 128 rows), and rows
# per expert up to which the routed experts on the codes take one C call for all experts.
_QUANT_MAX_ROWS = 128


def _lanewise(op, x: torch.Tensor) -> torch.Tensor:
    """`op` (an element-wise torch function) of `x` with every element on torch's vector path. torch
    computes the last `numel % 16` elements of a tensor (and of each thread's share) with the scalar
    libm function, which may differ from the vector one in the last bit; zero padding to a multiple
    of 64 elements per thread keeps an element's bits independent of the tensor's size."""
    flat = x.reshape(-1)
    pad = -flat.numel() % (64 * torch.get_num_threads())
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return op(flat)[:x.numel()].view(x.shape)


def _row_strided(y: torch.Tensor) -> torch.Tensor:
    """`y` (values unchanged) as a view whose rows are a multiple of 16 elements apart when its last
    dimension is not. torch runs an element-wise op over a contiguous tensor as one flat loop whose
    last `numel % 16` elements take the scalar libm path; over rows that cannot be merged it loops
    row by row, so every row takes the same path whatever the row count. The model's own element-wise
    math on narrow products (e.g. the router's softplus over 8 experts) then stays batch-invariant."""
    width = y.shape[-1]
    if width % 16 == 0 or y.dim() < 2:
        return y
    padded = y.new_empty((*y.shape[:-1], width + (-width % 16)))
    padded[..., :width] = y
    return padded[..., :width]


def _sum_fixed(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over a short `dim` as one add after another, in index order (keepdim)."""
    total = x.narrow(dim, 0, 1).clone()
    for i in range(1, x.shape[dim]):
        total += x.narrow(dim, i, 1)
    return total


class CpuDeepseekV41Ops(DeepseekV41Ops):
    """DeepSeek-V4.1's op table on the cpu back end: its C kernels (the single-pass mHC sites' entries, the
    fused attention projections without the per-head query norm, the MXFP4 indexer, the decode attention
    over the FP8 window and NVFP4 entries), and in batch-invariant mode the composed ops over the invariant
    kernels, with versions whose every reduction has a fixed order (the kernels' fixed-order products,
    sums one add after another, transcendental functions on torch's vector path only)."""

    program_binders = V41_BINDERS  # how the prepared programs bind its ops (program.py)

    def __init__(self, kernels: NativeCpuKernels):
        super().__init__(kernels)
        self._site_buffers = threading.local()

    def _site_outputs(self, streams: torch.Tensor, pre_in: torch.Tensor) -> native.SiteOutputs | None:
        """The site calls' output buffers for decode-sized steps (as NativeCpuKernels._hc_outputs): two sets
        per streams shape and dtype in this thread, taken in turn, never the one `pre_in` is in (a site
        chain reads the previous call's results); None (new tensors) above _HC_REUSE_MAX_ROWS rows."""
        if streams.dim() != 3 or streams.shape[0] > _HC_REUSE_MAX_ROWS:
            return None
        local = self._site_buffers
        key = (streams.shape, streams.dtype)
        if getattr(local, "key", None) != key:
            local.key, local.sets = key, (native.site_outputs(*streams.shape, streams.dtype),
                                          native.site_outputs(*streams.shape, streams.dtype))
        first, second = local.sets
        return second if pre_in is first.pre else first

    def hc_mix_collapse_norm(self, streams: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor,
                             base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, eps: float,
                             norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        k = self.kernels
        lib = k.native_library
        if lib is not None and not k.invariant:  # hc_mix, hc_collapse and rms_norm in one C call
            out = native.hc_mix_collapse_norm(lib, streams, pre_in, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                              norm_weight, rms_eps, self._site_outputs(streams, pre_in))
            if out is not None:
                return out.normed, out.pre, out.post, out.comb
        return super().hc_mix_collapse_norm(streams, pre_in, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                            norm_weight, rms_eps)

    def hc_post_mix_collapse_norm(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                                  comb: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                                  scale: torch.Tensor, sinkhorn_iters: int, eps: float, norm_eps: float,
                                  norm_weight: torch.Tensor, rms_eps: float
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        k = self.kernels
        lib = k.native_library
        if lib is not None and not k.invariant:  # hc_post and the next site's entry in one C call
            out = native.run(lib, native.hc_post_mix_collapse_norm_arguments(
                y, streams, post, comb, pre_in, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight, rms_eps,
                self._site_outputs(streams, pre_in)))
            if out is not None:
                return out
        return super().hc_post_mix_collapse_norm(y, streams, post, comb, pre_in, fn, base, scale, sinkhorn_iters, eps,
                                                 norm_eps, norm_weight, rms_eps)

    def hc_mix(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.kernels.invariant:
            return super().hc_mix(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps)
        return self.kernels._hc_coefficients_invariant(streams.float(), fn, base, scale, sinkhorn_iters, eps,
                                                       norm_eps)

    def hc_collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        if not self.kernels.invariant:
            return super().hc_collapse(streams, pre)
        return _sum_fixed(streams.float() * pre.float().unsqueeze(-1), -2).squeeze(-2).to(streams.dtype)

    def hc_post(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return self.kernels.hc_post(y, streams, post, comb)  # the C kernel: one token at a time

    def attention_projections(self, x: torch.Tensor, fused_x: torch.Tensor | QuantizedWeight, rank: int,
                              q_norm: torch.Tensor, fused_qr: torch.Tensor | QuantizedWeight, heads: int,
                              kv_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                              index_heads: int = 0, index_cos: torch.Tensor | None = None,
                              index_sin: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        out = self.kernels.fused_attention_projections(x, fused_x, rank, q_norm, fused_qr, heads, kv_norm, eps, cos,
                                                       sin, index_heads, index_cos, index_sin, q_head_norm=False)
        if out is not None:
            return out
        return super().attention_projections(x, fused_x, rank, q_norm, fused_qr, heads, kv_norm, eps, cos, sin,
                                             index_heads, index_cos, index_sin)

    def index_select(self, q: torch.Tensor, weights: torch.Tensor, weight_scale: float, index_keys: torch.Tensor,
                     rows: torch.Tensor, visible: torch.Tensor, k: int, candidates: torch.Tensor | None = None,
                     pool: CandidateBlocks | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        # decode-sized queries in one C call (indexer.c): every query's scores, pool and picks, each key
        # decoded as it is read; prefill blocks keep the batched products
        lib, out = self.kernels.native_library, None
        if lib is not None and not self.kernels.invariant and q.dim() == 4 and q.shape[1] <= _DECODE_QUERIES:
            out = native.index_select(lib, q, weights, weight_scale, index_keys, rows, visible, k, candidates,
                                      None if pool is None else (pool.size, pool.keep, pool.rate, pool.positions))
        if out is not None:
            return out
        return super().index_select(q, weights, weight_scale, index_keys, rows, visible, k, candidates, pool)

    def decode_attention_output(self, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                                caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                                masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float,
                                cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor | QuantizedWeight,
                                wo_b: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        k = self.kernels
        lib = k.native_library
        if lib is None or k.invariant:
            return super().decode_attention_output(q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, wo_a,
                                                   wo_b)
        # bf16 with the products the composed path would pick: one C call (attention_layer.c), V4's own
        out = k.fused_decode_attention_output(q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, wo_a,
                                              wo_b, coded_keys=True)
        if out is not None:
            return out
        # else the own keys' write and the attention over the packed keys in C (kv_cache.c, attention.c: the
        # bits of the decoded keys' attention), the output projections composed
        if native.kv_store(lib, kv, FP8_WINDOW, caches[0], key_rows):
            att = native.sink_attention_rows(lib, q.unsqueeze(1), caches, rows, masks, sinks, scale,
                                             (FP8_WINDOW, NVFP4_COMPRESSED)[:len(caches)])
            if att is not None:
                B = q.shape[0]
                o = k.rotary(att.squeeze(1), cos, sin, True).view(B, wo_a.shape[0], -1)
                return k.linear(k.grouped_linear(o, wo_a).reshape(B, -1), wo_b)
        # (the default stores the same codes again where kv_store did)
        return super().decode_attention_output(q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, wo_a,
                                               wo_b)

    def cache_store(self, x: torch.Tensor, fmt: KVFormat, cache: torch.Tensor, rows: torch.Tensor) -> None:
        lib = self.kernels.native_library  # one pass per row (kv_cache.c): the same bytes in every mode
        if lib is None or not native.kv_store(lib, x, fmt, cache, rows):
            super().cache_store(x, fmt, cache, rows)

    def compress_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        if not self.kernels.invariant:
            return super().compress_pool(kv, score)
        return self.kernels.compress_pool(kv, score)

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                     mask: torch.Tensor, k: int) -> torch.Tensor:
        if not self.kernels.invariant:
            return super().indexer_topk(q, weights, keys, mask, k)
        return self.kernels.indexer_topk(q, weights, keys, mask, k)


class NativeCpuKernels(CpuKernels):
    invariant: bool = False  # batch-invariant mode (set_batch_invariant)

    def set_batch_invariant(self, enabled: bool) -> None:
        if enabled and self.native_library is None:
            raise RuntimeError("the cpu back end's batch-invariant mode runs on its C kernels, which are not "
                               "available (DEEPINFER_CPU_NATIVE=0, or no C compiler: see the warning logged at "
                               "start-up); enable them or disable the batch_invariant feature")
        self.invariant = enabled

    def _rows(self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The batch-invariant product `x @ weight^T` (batch-invariant mode only)."""
        if weight.dtype != x.dtype and out_dtype is None:
            weight = weight.to(x.dtype)  # rounded like the default path
        y = native.linear_rows(self.native_library, x, weight, out_dtype)
        if y is None:
            raise RuntimeError(f"batch-invariant mode: no fixed-order product for x {x.dtype} {tuple(x.shape)} and "
                               f"weight {weight.dtype} {tuple(weight.shape)} on {x.device} (fp32 or bf16 CPU "
                               f"tensors only); disable the batch_invariant feature for this model")
        return y

    @functools.cached_property
    def native_library(self) -> ctypes.CDLL | None:
        """Decided once per instance (the first kernel call): the loaded library or None."""
        return native.active_library()

    @functools.cached_property
    def packed_weights(self) -> PackedWeights | None:
        return PackedWeights() if self.pack_weights and packed_weights.onednn_bf16() else None

    @functools.cached_property
    def tile_weights(self) -> PackedWeights | None:
        """The weights packed for the C register tiles (packed_gemm.c) of decode batches."""
        lib = self.native_library
        if lib is None or not self.pack_weights:
            return None
        return PackedWeights(pack=functools.partial(native.pack_bf16, lib, huge=self.use_huge_pages), stacks=True)

    @functools.cached_property
    def hc_weights(self) -> PackedWeights | None:
        """The mHC sites' fn transposed for hc_pre's 4-row tiles (native.transpose_fn): decode batches
        2.5x faster than the dot products on fn itself."""
        if self.native_library is None or not self.pack_weights:
            return None
        return PackedWeights(pack=native.transpose_fn, dtype=torch.float32)

    # the switches, read once by the accelerator when it is made (nothing reads the environment in a step)
    prepared_programs: bool = True  # DEEPINFER_CPU_DECODE_BLOCKS
    pack_weights: bool = True  # DEEPINFER_CPU_PACKED_WEIGHTS
    use_huge_pages: bool = True  # DEEPINFER_CPU_HUGE_PAGES

    def prepare_program(self, program: Program) -> PreparedProgram | None:
        """A model's step program with its C calls bound once (program.py); None (run eagerly) without the
        library, in batch-invariant mode (its kernels are the composed ops'), or when switched off."""
        if self.native_library is None or self.invariant or not self.prepared_programs:
            return None
        return PreparedProgram(self, program)

    def _hc_fn_t(self, streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor | None:
        """fn's transposed copy for bf16 calls with a 4-row tile (None below 4 rows: one row reads fn itself).
        The tiles sum in another order than the dot products on fn, and the copy exists only from the
        site's second call: fp32 streams (the reference dtype) keep the dot products, so running the same
        fp32 tokens twice gives the same bits."""
        if streams.dtype != torch.bfloat16 or streams.shape[0] < 4 or fn.shape[0] != native.TRANSPOSED_MIXES:
            return None
        table = self.hc_weights
        return None if table is None else table.lookup(fn)

    @functools.cached_property
    def _packed_gemm_rows(self) -> tuple[int, int]:
        """Row counts (inclusive) whose bf16 linears run on the packed C tiles on this tier ((0, 0): none)."""
        lib = self.native_library
        return (0, 0) if lib is None else _PACKED_GEMM_ROWS[native.gemv_tier(lib)]

    @functools.cached_property
    def _one_row_tiles_min_elements(self) -> int:
        """Weight elements from which one row runs on the tiles although the tier's rows start above one."""
        lib = self.native_library
        avx2 = lib is not None and native.gemv_tier(lib) == "avx2-fma"
        return _AVX2_ONE_ROW_TILES_MIN_ELEMENTS if avx2 else 1 << 62

    def linear_tiles(self, rows: int, dtype: torch.dtype, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy `linear` multiplies `rows` rows by on the C register tiles, or None (another
        path; at a weight's first use in the tiles' row range: the lookup counts it, the copy is made at
        the second)."""
        low, high = self._packed_gemm_rows
        if rows == 1 and weight.numel() >= self._one_row_tiles_min_elements:
            low = 1  # the AVX2 tier's LM head
        tiles = self.tile_weights if low <= rows <= high and dtype == torch.bfloat16 else None
        return None if tiles is None else tiles.lookup(weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            y = self._quant_linear(x, weight)  # decode sizes: straight from the stored bytes
            return super().linear(x, weight) if y is None else y  # else CpuKernels tiles it through here
        if self.invariant:
            return _row_strided(self._rows(x, weight))
        rows, lib = x.numel() // max(x.shape[-1], 1), self.native_library
        packed = self.linear_tiles(rows, x.dtype, weight)
        if packed is not None:
            flat = x.dim() == 2  # already [rows, K] and the product [rows, N]: no reshape, no view (2 ops a call)
            y = native.packed_linear_bf16(lib, x if flat else x.reshape(rows, x.shape[-1]), packed, weight.shape)
            if y is not None:
                return y if flat else y.view(*x.shape[:-1], weight.shape[0])
        if lib is not None and rows == 1:  # one bf16 token (decode): straight to the C GEMV
            y = native.run(lib, native.gemv_bf16_arguments(lib, weight, x))
            if y is not None:
                return y.view(*x.shape[:-1], weight.shape[0])
        if lib is not None and 1 < rows <= _LINEAR_AMX_MAX_ROWS and weight.numel() <= _LINEAR_AMX_MAX_ELEMENTS:
            y = native.linear_amx_bf16(lib, x.reshape(rows, x.shape[-1]), weight)  # None without AMX
            if y is not None:
                return y.view(*x.shape[:-1], weight.shape[0])
        if lib is not None and 1 < rows <= self._gemv_tokens_max_rows:
            y = native.gemv_tokens_bf16(lib, x.reshape(rows, x.shape[-1]), weight)  # None unless bf16
            if y is not None:
                return y.view(*x.shape[:-1], weight.shape[0])
        table = self.packed_weights if rows > 1 and x.dtype == torch.bfloat16 and x.is_cpu else None
        packed = None if table is None else table.lookup(weight)
        if packed is None:
            return super().linear(x, weight)
        # oneDNN compiles a kernel per row count: bucket them as the plain GEMM path does
        y = packed_weights.linear(_pad_rows(x.reshape(rows, x.shape[-1])), packed)
        return y[:rows].view(*x.shape[:-1], weight.shape[0])

    def _quant_linear(self, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor | None:
        """`x @ weight^T` computed on the FP4/FP8 codes (quant_gemv.c) for up to _QUANT_MAX_ROWS rows,
        rounded once to x's dtype; None: the dequantising tile path (more rows, batch-invariant mode,
        no library)."""
        rows, lib = x.numel() // max(x.shape[-1], 1), self.native_library
        if lib is None or self.invariant or rows > _QUANT_MAX_ROWS or weight.dim() != 2:
            return None
        y = native.quant_linear(lib, x.reshape(rows, x.shape[-1]), weight, out_dtype=x.dtype)
        return None if y is None else y.view(*x.shape[:-1], y.shape[1])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        lib = self.native_library
        out = None if lib is None else native.run(lib, native.rms_norm_arguments(lib, x, weight, eps))
        return super().rms_norm(x, weight, eps) if out is None else out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        lib = self.native_library
        out = None if lib is None else native.rotary(lib, x, cos, sin, inverse)
        return super().rotary(x, cos, sin, inverse) if out is None else out

    def rms_norm_rotary(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
        lib = self.native_library
        out = None if lib is None else native.rms_norm_rotary(lib, x, weight, eps, cos, sin)
        return super().rms_norm_rotary(x, weight, eps, cos, sin) if out is None else out

    def hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.invariant:
            streams_f = streams.float()
            pre, post, comb = self._hc_coefficients_invariant(streams_f, fn, base, scale, sinkhorn_iters, eps, norm_eps)
            collapsed = _sum_fixed(streams_f * pre.unsqueeze(-1), -2).squeeze(-2).to(streams.dtype)
            return collapsed, post, comb
        lib = self.native_library
        out = None if lib is None else native.run(lib, native.hc_pre_arguments(
            lib, streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, fn_t=self._hc_fn_t(streams, fn)))
        return super().hc_pre(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps) if out is None else out

    def hc_pre_norm(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    sinkhorn_iters: int, eps: float, norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lib, out = self.native_library, None
        if lib is not None and not self.invariant:  # the two C kernels in one call
            out = native.run(lib, native.hc_pre_arguments(lib, streams, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                                          norm_weight, rms_eps, self._hc_fn_t(streams, fn)))
        if out is not None:
            return out
        return super().hc_pre_norm(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight, rms_eps)

    def compress_store(self, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, position_mod: torch.Tensor,
                       ring_row: torch.Tensor, rows_kv: torch.Tensor, rows_score: torch.Tensor) -> bool:
        # copies and one fp32 add per element: the same bits in batch-invariant mode
        lib = self.native_library
        return lib is not None and native.compress_store(lib, kv, score, ape, position_mod, ring_row, rows_kv,
                                                         rows_score)

    def hc_post(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        lib = self.native_library
        out = None if lib is None else native.hc_post(lib, y, streams, post, comb)
        return super().hc_post(y, streams, post, comb) if out is None else out

    def hc_post_pre_norm(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                         fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, eps: float,
                         norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        lib, out = self.native_library, None
        if lib is not None and not self.invariant:  # hc_post and hc_pre_norm's C kernels in one call
            out = native.run(lib, native.hc_post_pre_norm_arguments(
                lib, y, streams, post, comb, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight, rms_eps,
                self._hc_fn_t(streams, fn), self._hc_outputs(streams)))
        if out is not None:
            return out
        return super().hc_post_pre_norm(y, streams, post, comb, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                        norm_weight, rms_eps)

    @functools.cached_property
    def _hc_buffers(self) -> threading.local:
        return threading.local()

    def _hc_outputs(self, streams: torch.Tensor) -> native.HcOutputs | None:
        """hc_post_pre_norm's output buffers for decode-sized calls: two sets per streams shape and dtype (the
        last used in this thread), taken in turn: never the set `streams` is, so a chain of calls each
        reading the one before's results (the block loop) allocates nothing, where 4 new tensors cost ~6 us
        a call. None (new tensors) above _HC_REUSE_MAX_ROWS rows: no prefill-sized buffers kept."""
        if streams.dim() != 3 or streams.shape[0] > _HC_REUSE_MAX_ROWS:
            return None
        local = self._hc_buffers
        key = (streams.shape, streams.dtype)
        if getattr(local, "key", None) != key:
            T, n, D = streams.shape
            local.key, local.sets = key, (native.hc_outputs(T, n, D, streams.dtype),
                                          native.hc_outputs(T, n, D, streams.dtype))
        first, second = local.sets
        return second if streams is first.streams else first

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        lib = self.native_library
        # a few rows: torch's four ops cost less than the call (5.9 vs 6.6 us for one 512-wide row); not
        # in batch-invariant mode: torch computes the last few elements of a tensor with the scalar exp,
        # the others with the vector one, so an element's bits would depend on the tensor's size
        small = gate.numel() < _SWIGLU_TORCH_MAX and not self.invariant
        out = None if lib is None or small else native.swiglu(lib, gate, up, limit)
        return super().swiglu(gate, up, limit) if out is None else out

    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                       sinks: torch.Tensor, scale: float) -> torch.Tensor:
        lib = self.native_library
        if self.invariant:
            out = native.sink_attention_invariant(lib, q, kv, mask, sinks, scale)
            if out is None:
                raise RuntimeError(f"batch-invariant mode: no canonical-order attention for q {q.dtype} "
                                   f"{tuple(q.shape)}, kv {kv.dtype} {tuple(kv.shape)} (fp32 or bf16 CPU tensors)")
            return out
        out = None
        if lib is not None and q.shape[1] <= _DECODE_QUERIES:  # prefill blocks: flash attention
            out = native.sink_attention_decode(lib, q, kv, mask, sinks, scale)
        return super().sink_attention(q, kv, mask, sinks, scale) if out is None else out

    def sink_attention_rows(self, q: torch.Tensor, caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                            masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float) -> torch.Tensor:
        lib, out = self.native_library, None
        # decode-sized queries read their keys in place (attention.c), the same C attention the
        # composed path runs on the gathered keys; batch-invariant mode keeps the composed path
        if lib is not None and not self.invariant and q.dim() == 4 and q.shape[1] <= _DECODE_QUERIES:
            out = native.sink_attention_rows(lib, q, caches, rows, masks, sinks, scale)
        return super().sink_attention_rows(q, caches, rows, masks, sinks, scale) if out is None else out

    def fused_decode_attention_output(self, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                                      caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                                      masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float,
                                      cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor | QuantizedWeight,
                                      wo_b: torch.Tensor | QuantizedWeight, coded_keys: bool = False
                                      ) -> torch.Tensor | None:
        """V4's `decode_attention_output` in one C call where it runs so, else None (the composed calls).
        `coded_keys`: DeepSeek-V4.1's caches (the FP8 window ring, the NVFP4 entries; kv_quant.py)."""
        # bf16 decode steps in one C call (attention_layer.c) where every stage is a C kernel the composed
        # path would pick: one token (grouped GEMV, then the tiles if wo_b has its packed copy, else the
        # GEMV), or _SKINNY_ROWS and more on the tiles. It runs only once the packed copies the composed
        # calls would read exist (`peek` does not count a use): before, those calls run and count the
        # uses that pack them, so both paths switch products at the same step.
        lib, out = self.native_library, None
        quantised = isinstance(wo_a, QuantizedWeight) or isinstance(wo_b, QuantizedWeight)
        if quantised and lib is not None and not self.invariant and q.dtype == torch.bfloat16 and q.dim() == 3:
            products = self._quant_output_products(q.shape[0], wo_a, wo_b)  # the same call, on the codes
            if products is not None:
                out = native.attention_output_quant(lib, q, kv, key_rows, caches, rows, masks, sinks, scale, cos,
                                                    sin, wo_a, wo_b, *products, coded_keys)
        elif (lib is not None and not self.invariant and q.dtype == torch.bfloat16 and q.dim() == 3
                and not self.native_amx):
            products = self._decode_output_products(q.shape[0], wo_a, wo_b)
            if products is not None:
                out = native.attention_output_bf16(lib, q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin,
                                                   wo_a, wo_b, *products, coded_keys)
        return out

    def fused_attention_projections(self, x: torch.Tensor, fused_x: torch.Tensor | QuantizedWeight, rank: int,
                                    q_norm: torch.Tensor, fused_qr: torch.Tensor | QuantizedWeight, heads: int,
                                    kv_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                                    index_heads: int = 0, index_cos: torch.Tensor | None = None,
                                    index_sin: torch.Tensor | None = None, q_head_norm: bool = True
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """V4's `attention_projections` in one C call where it runs so, else None (the composed calls).
        Without `q_head_norm` the query heads are only rotated (DeepSeek-V4.1's)."""
        # bf16 decode steps in one C call (attention_layer.c) where both products run on the kernels `linear`
        # would pick (the tiles once the copies exist, or the GEMV for one token), see decode_attention_output
        lib, out = self.native_library, None
        quantised = isinstance(fused_x, QuantizedWeight) or isinstance(fused_qr, QuantizedWeight)
        if quantised and lib is not None and not self.invariant and x.dtype == torch.bfloat16 and x.dim() == 2:
            copies = self._quant_linear_copies(x.shape[0], fused_x, fused_qr)  # the same call, on the codes
            if copies is not None:
                out = native.run(lib, native.attention_projections_quant_arguments(
                    lib, x, fused_x, rank, q_norm, fused_qr, heads, kv_norm, eps, cos, sin, index_heads, index_cos,
                    index_sin, *copies, q_head_norm))
        elif (lib is not None and not self.invariant and x.dtype == torch.bfloat16 and x.dim() == 2
                and (x.shape[0] == 1 or not self.native_amx)):
            copies = self._linear_copies(x.shape[0], fused_x, fused_qr)
            if copies is not None:
                out = native.run(lib, native.attention_projections_arguments(
                    lib, x, fused_x, rank, q_norm, fused_qr, heads, kv_norm, eps, cos, sin, index_heads, index_cos,
                    index_sin, *copies, q_head_norm))
        return out

    def _linear_copies(self, tokens: int, *weights: torch.Tensor) -> tuple[torch.Tensor | None, ...] | None:
        """The packed copies (or None: the plain weight, one token's GEMV) that `linear` reads for `tokens`
        bf16 rows by each weight, where it runs on the C tiles or GEMV and the copies it needs exist; None
        otherwise. `peek` counts no use: until the copies exist the composed calls run and count the uses
        that make them, so the fused and the composed path switch products at the same step."""
        low, high = self._packed_gemm_rows
        tiles = self.tile_weights if low <= tokens <= high else None
        if tiles is None:
            return (None,) * len(weights) if tokens == 1 else None
        copies = tuple(tiles.peek(w) for w in weights)
        return None if any(c is None for c in copies) else copies

    def _quant_linear_copies(self, tokens: int, *weights: torch.Tensor | QuantizedWeight
                             ) -> tuple[torch.Tensor | None, ...] | None:
        """`_linear_copies` where some weights are kept quantised: None (the codes) for those, where `linear`
        runs on them (up to _QUANT_MAX_ROWS tokens), and the bf16 ones' copies as there; None otherwise."""
        plain = [w for w in weights if not isinstance(w, QuantizedWeight)]
        if tokens > _QUANT_MAX_ROWS or plain and tokens > 1 and self.native_amx:
            return None
        if not plain:
            return (None,) * len(weights)
        copies = iter(self._linear_copies(tokens, *plain) or ())
        out = tuple(None if isinstance(w, QuantizedWeight) else next(copies, False) for w in weights)
        return None if any(c is False for c in out) else out

    def _quant_output_products(self, tokens: int, wo_a: torch.Tensor | QuantizedWeight,
                               wo_b: torch.Tensor | QuantizedWeight) -> tuple[torch.Tensor | None, ...] | None:
        """`_decode_output_products` where wo_a or wo_b is kept quantised: None (the codes) for it, where
        `grouped_linear` / `linear` run on them (up to _QUANT_MAX_ROWS tokens); None otherwise."""
        copies = self._quant_linear_copies(tokens, wo_b)
        if copies is None or isinstance(wo_a, QuantizedWeight):
            return None if copies is None else (None, *copies)
        # a bf16 wo_a: as _decode_output_products picks its product (one token: the grouped GEMV)
        if self.native_amx or tokens == 1:
            return None if self.native_amx else (None, *copies)
        low, high = self._packed_gemm_rows
        packed_a = self.tile_weights.peek(wo_a) if max(low, _SKINNY_ROWS) <= tokens <= high else None
        return None if packed_a is None or packed_a.dim() != 5 else (packed_a, *copies)

    def _decode_output_products(self, tokens: int, wo_a: torch.Tensor, wo_b: torch.Tensor
                                ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """The packed copies (or None: the plain weight) of wo_a and wo_b that `grouped_linear` and `linear`
        would read for `tokens` bf16 rows, where both run in C with the copies they need already made;
        None otherwise."""
        copies = self._linear_copies(tokens, wo_b)
        if copies is None:
            return None
        if tokens == 1:
            return None, copies[0]
        low, high = self._packed_gemm_rows
        if tokens < max(low, _SKINNY_ROWS):  # tokens in the tiles' range (copies): wo_a on torch's bmm below
            return None
        packed_a = self.tile_weights.peek(wo_a)
        return None if packed_a is None or packed_a.dim() != 5 else (packed_a, copies[0])

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            lib, out = self.native_library, None
            if lib is not None and not self.invariant and x.shape[0] <= _QUANT_MAX_ROWS:
                # decode sizes: each group quant_linear's products (the per-group linears' bits), one call
                out = native.quant_grouped_linear(lib, x, weight, out_dtype=x.dtype)
            return super().grouped_linear(x, weight) if out is None else out  # one (tiled) linear per group
        if self.invariant:  # a few groups: one fixed-order product each
            return torch.stack([self._rows(x[:, g], weight[g]) for g in range(weight.shape[0])], dim=1)
        lib, out = self.native_library, None
        if lib is not None and x.shape[0] == 1:
            out = native.grouped_gemv_bf16(lib, x, weight)
        elif lib is not None and x.shape[0] <= _GROUPED_AMX_MAX_TOKENS:
            out = native.grouped_amx_bf16(lib, x, weight)  # None without AMX
        if out is None and lib is not None:
            out = self._tile_grouped(x, weight)
        return super().grouped_linear(x, weight) if out is None else out

    def _tile_grouped(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """x [T, G, K] by each group's weight [G, N, K] on the packed register tiles (the stack packed
        once, from its second use) where the tier's tile rows cover T, from _SKINNY_ROWS tokens; None
        otherwise. One thread, tiles against torch's batched products (cold weights): AVX2 2.1-3.3x at
        16-64 tokens and 4.6-5.1x at 512 on 2 x 64 x 256 (the 161 M V4's) and 8 x 1024 x 4096, 0.5-0.65x
        at 2-4 tokens on the small one (a call per group); AVX512-BF16 1.0-1.9x at 16-64 tokens."""
        low, high = self._packed_gemm_rows
        tiles = self.tile_weights
        if (tiles is None or x.dtype != torch.bfloat16 or x.dim() != 3
                or not max(low, _SKINNY_ROWS) <= x.shape[0] <= high):
            return None
        packed = tiles.lookup(weight)
        if packed is None or packed.dim() != 5:
            return None
        out = torch.empty((x.shape[0], weight.shape[0], weight.shape[1]), dtype=x.dtype)
        for g in range(weight.shape[0]):
            y = native.packed_linear_bf16(self.native_library, x[:, g], packed[g], weight.shape[1:])
            if y is None:
                return None
            out[:, g] = y
        return out

    def moe_route(self, scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling_factor: float,
                  hash_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        lib, out = self.native_library, None
        # batch-invariant mode: always C, so that a token's weights are the same bits at any batch size
        if lib is not None and (scores.shape[0] <= _ROUTE_MAX_TOKENS or self.invariant):
            out = native.moe_route_rows(lib, scores, bias, top_k, routed_scaling_factor, hash_ids)
        return super().moe_route(scores, bias, top_k, routed_scaling_factor, hash_ids) if out is None else out

    def moe_dispatch(self, x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, MoEDispatch]:
        lib = self.native_library
        out = None if lib is None else native.moe_dispatch_rows(lib, x, ids, num_experts)
        if out is None:
            return super().moe_dispatch(x, ids, num_experts)
        rows, counts, source_token, source_slot = out
        return rows, MoEDispatch(tokens_per_expert=counts, source_token=source_token, source_slot=source_slot,
                                 num_tokens=ids.shape[0])

    def moe_combine(self, out_rows: torch.Tensor, plan: MoEDispatch, weights: torch.Tensor) -> torch.Tensor:
        lib = self.native_library
        # None unless every choice is present (one row per (token, choice), no subset)
        out = None if lib is None else native.moe_combine_rows(lib, out_rows, plan.source_token, plan.source_slot,
                                                               weights)
        return super().moe_combine(out_rows, plan, weights) if out is None else out

    def moe_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor | QuantizedWeight,
                    w2: torch.Tensor | QuantizedWeight, swiglu_limit: float) -> torch.Tensor:
        if isinstance(w13, QuantizedWeight) or isinstance(w2, QuantizedWeight):
            out = self._quant_experts(rows, plan, w13, w2, swiglu_limit)
            # else per expert, through this linear (more rows: dequantised tiles)
            return super().moe_experts(rows, plan, w13, w2, swiglu_limit) if out is None else out
        if self.invariant:
            return self._experts_invariant(rows, plan, w13, w2, swiglu_limit)
        lib = self.native_library
        out = None
        if lib is not None and rows.shape[0] <= self._native_expert_rows(w13.shape[0]):
            out = native.experts_bf16(lib, rows, plan.tokens_per_expert, w13, w2, swiglu_limit)
        elif lib is not None:
            out = self._tile_experts(rows, plan, w13, w2, swiglu_limit)
        return super().moe_experts(rows, plan, w13, w2, swiglu_limit) if out is None else out

    def _tile_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor, w2: torch.Tensor,
                      swiglu_limit: float) -> torch.Tensor | None:
        """Each expert's rows through the packed register tiles (both expert stacks packed once, from
        their second use), rounded where the composed path rounds: gate/up, swiglu, output. None where
        the tier's tile rows do not cover the largest expert's rows (or at the first use). On the AVX2
        tier this is prefill's MoE: torch's bf16 GEMMs there (no oneDNN bf16 kernel) ran the 161 M V4
        checkpoint's 16 experts at 128 rows each at ~3 GFLOP/s, two thirds of a 512-token prefill (one
        thread); the tiles run them 3.8-5.2x faster. AVX512-BF16 (up to 64 rows per expert): 1.3-1.8x
        torch's oneDNN GEMMs at 24-64 rows per expert."""
        counts = plan.tokens_per_expert.tolist()
        low, high = self._packed_gemm_rows
        tiles = self.tile_weights
        if tiles is None or rows.dtype != torch.bfloat16 or not counts or not low <= max(counts) <= high:
            return None
        p13, p2 = tiles.lookup(w13), tiles.lookup(w2)  # both looked up: each counts its uses
        if p13 is None or p2 is None:
            return None
        lib, inter = self.native_library, w2.shape[2]
        out = torch.empty((rows.shape[0], w2.shape[1]), dtype=rows.dtype)
        start = 0
        for e, count in enumerate(counts):
            if count:
                gate_up = native.packed_linear_bf16(lib, rows[start:start + count], p13[e], w13.shape[1:])
                if gate_up is None:
                    return None
                h = self.swiglu(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
                y = native.packed_linear_bf16(lib, h, p2[e], w2.shape[1:])
                if y is None:
                    return None
                out[start:start + count] = y
            start += count
        return out

    def _quant_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor | QuantizedWeight,
                       w2: torch.Tensor | QuantizedWeight, swiglu_limit: float) -> torch.Tensor | None:
        """All routed experts on their FP4/FP8 codes in one C call (quant_experts.c) while no expert has
        more than _QUANT_MAX_ROWS rows (the per-expert path's products on the codes go to that size too);
        None: the per-expert path (more rows, batch-invariant mode, no library, mixed formats)."""
        lib = self.native_library
        if lib is None or self.invariant:
            return None
        if rows.shape[0] > _QUANT_MAX_ROWS and int(plan.tokens_per_expert.max()) > _QUANT_MAX_ROWS:
            return None
        return native.quant_experts(lib, rows, plan.tokens_per_expert, w13, w2, swiglu_limit)

    def moe_sublayer(self, x: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor | None,
                     hash_ids: torch.Tensor | None, w13: torch.Tensor | QuantizedWeight,
                     w2: torch.Tensor | QuantizedWeight, shared_w13: torch.Tensor | None,
                     shared_w2: torch.Tensor | None, top_k: int, routed_scaling_factor: float, scoring_func: str,
                     swiglu_limit: float) -> torch.Tensor:
        lib, out, rows = self.native_library, None, x.shape[0]
        quantised = any(isinstance(w, QuantizedWeight) for w in (w13, w2, shared_w13, shared_w2))
        if quantised:
            out = self._quant_moe_sublayer(x, gate, gate_bias, hash_ids, w13, w2, shared_w13, shared_w2, top_k,
                                           routed_scaling_factor, scoring_func, swiglu_limit)
            if out is not None:
                return out
        # decode-sized bf16 batches in one C call (moe_layer.c): the C stages the composed path runs (router
        # top-k, dispatch, expert kernel, combine), the router on a C dot product (its fp32 sums in another
        # order than torch's), the shared expert's products on the kernels the composed path's linear picks
        # (the packed register tiles in this tier's _PACKED_GEMM_ROWS, else the C GEMVs: the same bits).
        # From _MOE_TILES_ROWS_PER_EXPERT the routed experts run on the tiles over their packed copies: the
        # expert kernel's roundings, its fp32 sums in another order (other last bits than the composed
        # path's, within the tests' tolerance). Not with AMX tiles.
        products = None if quantised or x.dim() != 2 else self.moe_layer_products(rows, x.dtype, w13, w2, shared_w13,
                                                                                  shared_w2, top_k)
        if products is not None:
            experts, shared, round_silu = products
            out = native.moe_layer_bf16(lib, x, gate, gate_bias, hash_ids, w13, w2, shared_w13, shared_w2, top_k,
                                        routed_scaling_factor, scoring_func, swiglu_limit, round_silu,
                                        packed_experts=experts, packed_shared=shared)
        if out is not None:
            return out
        return super().moe_sublayer(x, gate, gate_bias, hash_ids, w13, w2, shared_w13, shared_w2, top_k,
                                    routed_scaling_factor, scoring_func, swiglu_limit)

    def moe_layer_products(self, rows: int, dtype: torch.dtype, w13: torch.Tensor, w2: torch.Tensor,
                           shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None, top_k: int
                           ) -> tuple[tuple | None, tuple | None, bool] | None:
        """Whether the bf16 MoE sub-layer of `rows` tokens runs as one C call (moe_layer_bf16), and on what:
        (the routed experts' packed copies or None, the shared expert's or None, round_silu); None: the
        composed path. Its lookups count uses, as the composed products' would (a copy is made at the second)."""
        if (self.native_library is None or self.invariant or (rows != 1 and self.native_amx)
                or rows * top_k > self._native_expert_rows(w13.shape[0])):
            return None
        low, high = self._packed_gemm_rows
        tiles = self.tile_weights if low <= rows <= high and dtype == torch.bfloat16 else None
        experts = None
        if tiles is not None and rows * top_k >= self._moe_tiles_rows_per_expert * w13.shape[0]:
            experts = tiles.lookup(w13), tiles.lookup(w2)  # None at the weights' first use
            experts = None if any(p is None for p in experts) else experts
        if not (rows <= self._gemv_tokens_max_rows or (tiles is not None and rows <= _MOE_FUSED_MAX_TOKENS)):
            return None
        shared = None if tiles is None or shared_w13 is None else (tiles.lookup(shared_w13), tiles.lookup(shared_w2))
        return experts, shared, shared_w2 is not None and rows * shared_w2.shape[1] < _SWIGLU_TORCH_MAX

    def _quant_moe_sublayer(self, x: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor | None,
                            hash_ids: torch.Tensor | None, w13: torch.Tensor | QuantizedWeight,
                            w2: torch.Tensor | QuantizedWeight, shared_w13: torch.Tensor | QuantizedWeight | None,
                            shared_w2: torch.Tensor | QuantizedWeight | None, top_k: int, routed_scaling_factor: float,
                            scoring_func: str, swiglu_limit: float) -> torch.Tensor | None:
        """The MoE sub-layer of a bf16 decode batch (up to _MOE_FUSED_MAX_TOKENS tokens) with routed experts
        kept quantised in one C call (moe_layer_quant): the stages the composed path runs on them (the C
        router top-k, dispatch, quant_experts, combine; a quantised shared expert's products on quant_gemv.c,
        a bf16 one's on the kernels the composed linear picks), the router's fp32 sums on a C dot product (in
        another order than torch's, as moe_layer_bf16). None: the composed path."""
        if x.dim() != 2 or x.dtype != torch.bfloat16:
            return None
        products = self.quant_moe_layer_products(x.shape[0], w13, w2, shared_w13, shared_w2)
        if products is None:
            return None
        packed_shared, round_silu = products
        return native.moe_layer_quant(self.native_library, x, gate, gate_bias, hash_ids, w13, w2, shared_w13, shared_w2,
                                      top_k, routed_scaling_factor, scoring_func, swiglu_limit, round_silu,
                                      packed_shared=packed_shared)

    def quant_moe_layer_products(self, rows: int, w13: torch.Tensor | QuantizedWeight,
                                 w2: torch.Tensor | QuantizedWeight, shared_w13: torch.Tensor | QuantizedWeight | None,
                                 shared_w2: torch.Tensor | QuantizedWeight | None) -> tuple[tuple | None, bool] | None:
        """Whether the MoE sub-layer of `rows` bf16 tokens with quantised routed experts runs as one C call
        (moe_layer_quant), and on what: (a bf16 shared expert's packed copies or None, round_silu); None: the
        composed path. Its lookups count uses, as the composed products' would."""
        if (self.native_library is None or self.invariant or rows > _MOE_FUSED_MAX_TOKENS
                or not isinstance(w13, QuantizedWeight) or not isinstance(w2, QuantizedWeight)):
            return None
        packed_shared = None
        if shared_w13 is not None and not isinstance(shared_w13, QuantizedWeight):
            if isinstance(shared_w2, QuantizedWeight):  # a mixed pair (w1, w3 off block rows): composed path
                return None
            low, high = self._packed_gemm_rows
            tiles = self.tile_weights if low <= rows <= high else None
            if (rows > 1 and self.native_amx) or (tiles is None and rows > self._gemv_tokens_max_rows):
                return None  # the composed linear would take oneDNN's or the AMX products
            if tiles is not None:
                packed_shared = tiles.lookup(shared_w13), tiles.lookup(shared_w2)
        return packed_shared, shared_w2 is not None and rows * shared_w2.shape[1] < _SWIGLU_TORCH_MAX

    def _experts_invariant(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor, w2: torch.Tensor,
                           swiglu_limit: float) -> torch.Tensor:
        """Each expert's rows through the fixed-order product: a token's expert output does not depend
        on which other tokens chose that expert (the combine then sums a token's k outputs in slot order)."""
        out = torch.empty((rows.shape[0], w2.shape[1]), dtype=rows.dtype, device=rows.device)
        inter, start = w2.shape[2], 0
        for e, count in enumerate(plan.tokens_per_expert.tolist()):
            if count:
                gate_up = self._rows(rows[start:start + count], w13[e])
                out[start:start + count] = self._rows(self.swiglu(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit),
                                                      w2[e])
            start += count
        return out

    def _hc_mix(self, streams_f: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
        if not self.invariant:
            return super()._hc_mix(streams_f, fn, norm_eps)
        flat = streams_f.flatten(-2)
        # the mean square as a fixed-order dot product with ones, like every other reduction here
        ones = torch.ones((1, flat.shape[-1]), dtype=torch.float32)
        inv = torch.rsqrt(self._rows(flat.square(), ones, torch.float32) / flat.shape[-1] + norm_eps)
        return self._rows(flat, fn.float(), torch.float32).mul_(inv)

    def _hc_coefficients_invariant(self, streams_f: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                                   scale: torch.Tensor, sinkhorn_iters: int, eps: float, norm_eps: float
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC (pre, post, comb) with fixed-order sums and vector-path transcendentals (the math of
        `DeepseekV4Ops._hc_coefficients`); the C hc_pre reduces a row differently once the streams are
        wider than its 512-element chunks, depending on its row block."""
        n = streams_f.shape[1]
        pre_b, post_b, comb_b = base.float().split([n, n, n * n])
        scale = scale.float()
        mixes = self._hc_mix(streams_f, fn, norm_eps)
        pre = _lanewise(torch.sigmoid, mixes[:, :n] * scale[0] + pre_b) + eps
        post = 2 * _lanewise(torch.sigmoid, mixes[:, n:2 * n] * scale[1] + post_b)
        logits = mixes[:, 2 * n:].unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n)
        comb = _lanewise(torch.exp, logits - logits.amax(dim=-1, keepdim=True))
        comb = comb / _sum_fixed(comb, -1) + eps
        comb = comb / (_sum_fixed(comb, -2) + eps)
        for _ in range(sinkhorn_iters - 1):
            comb = comb / (_sum_fixed(comb, -1) + eps)
            comb = comb / (_sum_fixed(comb, -2) + eps)
        return pre, post, comb

    def hc_head(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                eps: float, norm_eps: float) -> torch.Tensor:
        if not self.invariant:
            lib = self.native_library
            out = None if lib is None else native.hc_head(lib, streams, fn, base, scale, eps, norm_eps)
            return super().hc_head(streams, fn, base, scale, eps, norm_eps) if out is None else out
        streams_f = streams.float()
        pre = _lanewise(torch.sigmoid, self._hc_mix(streams_f, fn, norm_eps) * scale.float() + base.float()) + eps
        return _sum_fixed(pre.unsqueeze(-1) * streams_f, -2).squeeze(-2).to(streams.dtype)

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                     mask: torch.Tensor, k: int) -> torch.Tensor:
        lib = self.native_library
        if not self.invariant and lib is not None and keys.shape[1] and q.shape[1] <= _DECODE_QUERIES:
            score = native.indexer_scores(lib, q, weights, keys, mask)  # -inf where not visible
            if score is not None:
                vals, idx = score.topk(min(k, keys.shape[1]), dim=-1)
                picks = idx.masked_fill_(vals == float("-inf"), -1)
                return picks if picks.shape[-1] == k else torch.nn.functional.pad(picks, (0, k - picks.shape[-1]),
                                                                                  value=-1)
        if not self.invariant or keys.shape[1] == 0:
            return super().indexer_topk(q, weights, keys, mask, k)
        B, S, Hi, _ = q.shape
        E, kk = keys.shape[1], min(k, keys.shape[1])
        # per sequence: every (query, head, entry) score as a fixed-order dot product; the head sum in order
        dots = torch.stack([self._rows(q[b].float(), keys[b].float(), torch.float32) for b in range(B)]).relu_()
        w = weights.float()
        score = dots[:, :, 0] * w[:, :, 0, None]
        for h in range(1, Hi):
            score += dots[:, :, h] * w[:, :, h, None]
        score = score.masked_fill(~mask, float("-inf"))
        # ties (common with quantised keys) go to the lower entry index: topk breaks them differently
        # depending on the number of (padded) entries, i.e. on the batch
        idx = score.sort(dim=-1, descending=True, stable=True).indices[..., :kk]
        picks = torch.where(mask.gather(-1, idx), idx, torch.full_like(idx, -1))
        return picks if kk == k else torch.nn.functional.pad(picks, (0, k - kk), value=-1)

    def compress_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        if not self.invariant:
            return super().compress_pool(kv, score)
        # the softmax over the slots and the weighted sum, one slot after another
        score = score.float()
        top = score.amax(dim=-2, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all slots empty: weights 0
        e = _lanewise(torch.exp, score - top)
        return (_sum_fixed(e * kv.float(), -2) / _sum_fixed(e, -2)).squeeze(-2)

    def model_ops(self, family: str) -> DeepseekV4Ops | None:
        """V4's table (CpuKernels), and for V4.1 one that the batch-invariant mode switches."""
        return CpuDeepseekV41Ops(self) if family == DEEPSEEK_V41 else super().model_ops(family)

    def _native_expert_rows(self, num_experts: int) -> int:
        if self.native_amx:
            return _EXPERT_ROWS_PER_EXPERT_AMX * num_experts
        if native.gemv_tier(self.native_library) in ("avx2-fma", "avx512-bf16"):
            return _EXPERT_ROWS_PER_EXPERT_DOT * num_experts
        return _EXPERT_MAX_ROWS_DOT

    @functools.cached_property
    def _gemv_tokens_max_rows(self) -> int:
        """Rows up to which a decode batch's linear runs on the C multi-token GEMV (its tier's limit)."""
        lib = self.native_library
        return 1 if lib is None else _GEMV_TOKENS_MAX_ROWS[native.gemv_tier(lib)]

    @functools.cached_property
    def _moe_tiles_rows_per_expert(self) -> int:
        """Expert rows per expert (on average) from which the fused MoE's routed experts run on the tiles."""
        lib = self.native_library
        return 1 << 62 if lib is None else _MOE_TILES_ROWS_PER_EXPERT[native.gemv_tier(lib)]

    @functools.cached_property
    def native_amx(self) -> bool:
        """The C expert kernel runs on AMX tiles (built for an AMX CPU, and Linux granted the state): it
        decides how many rows the expert kernel takes; the AMX wrappers check it themselves."""
        return self.native_library is not None and native.amx_usable(self.native_library)

    def argmax_logsumexp(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lib = self.native_library
        out = None if lib is None else native.argmax_logsumexp(lib, logits)
        return super().argmax_logsumexp(logits) if out is None else out

    def _matvec(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # every size: with its prefetching the C GEMV streams the 129,280 x 512 LM head from memory at
        # 2.9x torch.mv's rate with AVX512-BF16 and 1.0-1.2x with AVX2 (one thread, AMD EPYC)
        lib = self.native_library
        out = None if lib is None else native.run(lib, native.gemv_bf16_arguments(lib, weight, x))
        return super()._matvec(weight, x) if out is None else out
