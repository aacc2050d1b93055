"""CpuKernels with its fast paths: fused C functions (native/*.c), one call and one pass over
memory instead of tens of torch ops, for
- the element-wise kernels: rms_norm, rotary (and the two in one call), hc_pre (alone or with the
  sub-layer's rms_norm), hc_post, hc_post_pre_norm (between two mHC sites), hc_head, swiglu;
- a decode step's whole MoE sub-layer (router, top-k, dispatch, experts, combine, shared expert);
- decode-sized products: the bf16 GEMV of one token, LM head included (it streams weights faster
  than torch.mv on every tier: AVX512-BF16, AVX2+FMA, portable), the grouped output projection of a
  few tokens, the routed experts of decode-sized batches (each expert weight streamed once; bf16 in
  experts.c, FP4/FP8 codes in quant_experts.c), and, where the CPU has AMX, the linears of decode
  batches (tile products instead of oneDNN's calls);
- the MoE dispatch and combine (a counting sort and a weighted row sum, ~10 torch ops each);
- decode attention (16 heads per vector lane set, no horizontal sums);
- DeepSeek-V4.1's own ops (`CpuDeepseekV41Ops`, ops_v41.py): its single-pass mHC sites, its MXFP4 indexer
  and its decode attention over the FP8 / NVFP4-coded caches, decoded as they are read;
- greedy sampling's argmax with the log-sum-exp, in one pass over the logits.
The MoE family's methods are in native_moe.py, the mHC family's in native_mhc.py, what every family
shares in native_base.py. Each method falls back to the pure-torch reference when the library is
unavailable (no compiler, DEEPINFER_CPU_NATIVE=0) or the input is outside what the C code handles.
Where each choice between paths switches (row counts, sizes) is one table per tier, `self.tuning`
(tuning.py).

Decode-batch bf16 linears (2 to 64 rows; on AVX512-BF16 one row too; on AVX2+FMA every multi-row one,
prefill included) run on C register tiles over copies of the weights packed for them
(native/packed_gemm.c), the other multi-row ones on oneDNN-packed copies (packed_weights.py);
DEEPINFER_CPU_PACKED_WEIGHTS=0 turns both copies off (the plain weights through the C GEMVs and torch).

Batch-invariant mode (`set_batch_invariant(True)`, the batch_invariant feature; needs the library) is a
table of its own, fixed_order.py's, installed over the methods here that differ in it: these methods
never ask which mode they are in."""
from __future__ import annotations

import torch

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops
from deepinfer.models.deepseek_v41.ops import FAMILY as DEEPSEEK_V41
from deepinfer_plugins.cpu import native, packed_weights
from deepinfer_plugins.cpu.kernels import _SKINNY_ROWS, _pad_rows
from deepinfer_plugins.cpu.native_mhc import NativeMhcKernels
from deepinfer_plugins.cpu.native_moe import NativeMoEKernels
from deepinfer_plugins.cpu.ops_v41 import CpuDeepseekV41Ops


class NativeCpuKernels(NativeMoEKernels, NativeMhcKernels):
    """The cpu back end's kernels: the MoE (native_moe.py) and mHC (native_mhc.py) families and, here, the
    products, norms, rotaries, attention, the compressor's and indexer's kernels and sampling; what they
    share (library, mode, packed copies, tuning) is native_base.py's."""

    def linear_tiles(self, rows: int, dtype: torch.dtype, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy `linear` multiplies `rows` rows by on the C register tiles, or None (another
        path, or a weight without a copy: not given to `prepare_weights`)."""
        low, high = self.tuning.packed_gemm_rows
        if rows == 1 and weight.numel() >= self.tuning.one_row_tiles_min_elements:
            low = 1  # the AVX2 tier's LM head
        tiles = self.tile_weights if low <= rows <= high and dtype == torch.bfloat16 else None
        return None if tiles is None else tiles.lookup(weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            y = self._quant_linear(x, weight)  # decode sizes: straight from the stored bytes
            return super().linear(x, weight) if y is None else y  # else CpuKernels tiles it through here
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
        if lib is not None and 1 < rows <= self.tuning.linear_amx_max_rows:
            y = native.linear_amx_bf16(lib, x.reshape(rows, x.shape[-1]), weight)  # None without AMX
            if y is not None:
                return y.view(*x.shape[:-1], weight.shape[0])
        if lib is not None and 1 < rows <= self.tuning.gemv_tokens_max_rows:
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
        """`x @ weight^T` computed on the FP4/FP8 codes (quant_gemv.c) for up to tuning.quant_max_rows rows,
        rounded once to x's dtype; None: the dequantising tile path (more rows, no library)."""
        rows, lib = x.numel() // max(x.shape[-1], 1), self.native_library
        if lib is None or rows > self.tuning.quant_max_rows or weight.dim() != 2:
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

    def compress_store(self, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, position_mod: torch.Tensor,
                       ring_row: torch.Tensor, rows_kv: torch.Tensor, rows_score: torch.Tensor) -> bool:
        # copies and one fp32 add per element: batch-invariant as it is
        lib = self.native_library
        return lib is not None and native.compress_store(lib, kv, score, ape, position_mod, ring_row, rows_kv,
                                                         rows_score)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        lib = self.native_library
        # a few rows: torch's four ops cost less than the call (5.9 vs 6.6 us for one 512-wide row)
        small = gate.numel() < self.tuning.swiglu_torch_max
        out = None if lib is None or small else native.swiglu(lib, gate, up, limit)
        return super().swiglu(gate, up, limit) if out is None else out

    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                       sinks: torch.Tensor, scale: float) -> torch.Tensor:
        lib, out = self.native_library, None
        if lib is not None and q.shape[1] <= self.tuning.decode_queries:  # prefill blocks: flash attention
            out = native.sink_attention_decode(lib, q, kv, mask, sinks, scale)
        return super().sink_attention(q, kv, mask, sinks, scale) if out is None else out

    def sink_attention_rows(self, q: torch.Tensor, caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                            masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float) -> torch.Tensor:
        lib, out = self.native_library, None
        # decode-sized queries read their keys in place (attention.c), the same C attention the
        # composed path runs on the gathered keys
        if lib is not None and q.dim() == 4 and q.shape[1] <= self.tuning.decode_queries:
            out = native.sink_attention_rows(lib, q, caches, rows, masks, sinks, scale)
        return super().sink_attention_rows(q, caches, rows, masks, sinks, scale) if out is None else out

    def fused_decode_attention_output(self, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                                      caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                                      masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float,
                                      cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor | QuantizedWeight,
                                      wo_b: torch.Tensor | QuantizedWeight, coded_keys: bool = False
                                      ) -> torch.Tensor | None:
        """V4's `decode_attention_output` in one C call (attention_layer.c) where it runs so (bf16 queries, the
        products the composed calls would pick: `fused_copies`), else None (the composed calls).
        `coded_keys`: DeepSeek-V4.1's caches (the FP8 window ring, the NVFP4 entries; kv_quant.py)."""
        lib = self.native_library
        if lib is None or q.dtype != torch.bfloat16 or q.dim() != 3:
            return None
        products = self.fused_copies(q.shape[0], ("grouped_linear", wo_a), ("linear", wo_b))
        return None if products is None else native.attention_output(lib, q, kv, key_rows, caches, rows, masks, sinks,
                                                                     scale, cos, sin, wo_a, wo_b, *products,
                                                                     coded_keys)

    def fused_attention_projections(self, x: torch.Tensor, fused_x: torch.Tensor | QuantizedWeight, rank: int,
                                    q_norm: torch.Tensor, fused_qr: torch.Tensor | QuantizedWeight, heads: int,
                                    kv_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                                    index_heads: int = 0, index_cos: torch.Tensor | None = None,
                                    index_sin: torch.Tensor | None = None, q_head_norm: bool = True
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """V4's `attention_projections` in one C call (attention_layer.c) where it runs so (bf16 tokens, the
        products `linear` would pick: `fused_copies`), else None (the composed calls). Without
        `q_head_norm` the query heads are only rotated (DeepSeek-V4.1's)."""
        lib = self.native_library
        if lib is None or x.dtype != torch.bfloat16 or x.dim() != 2:
            return None
        copies = self.fused_copies(x.shape[0], ("linear", fused_x), ("linear", fused_qr))
        return None if copies is None else native.run(lib, native.attention_projections_arguments(
            lib, x, fused_x, rank, q_norm, fused_qr, heads, kv_norm, eps, cos, sin, index_heads, index_cos, index_sin,
            *copies, q_head_norm))

    def fused_copies(self, tokens: int, *uses: tuple[str, torch.Tensor | QuantizedWeight]
                     ) -> tuple[torch.Tensor | None, ...] | None:
        """What a fused C call (attention_layer.c) reads for each (op, weight) product of `tokens` bf16 rows,
        where the composed op (`linear`, `grouped_linear`) runs that product on the same C kernel: the
        weight's register-tile copy (made at load), or None (its codes, kept quantised, up to
        tuning.quant_max_rows rows; one row's GEMV on the plain weight). None where some product runs on
        another kernel (AMX tiles for multi-row products, oneDNN, torch): then the composed calls."""
        operands = tuple(self._fused_operand(tokens, op, weight) for op, weight in uses)
        return None if any(o is False for o in operands) else operands

    def _fused_operand(self, tokens: int, op: str, weight: torch.Tensor | QuantizedWeight
                       ) -> torch.Tensor | None | bool:
        """One product's part of `fused_copies`: its copy, None, or False (another kernel)."""
        if isinstance(weight, QuantizedWeight):
            return None if tokens <= self.tuning.quant_max_rows else False
        if tokens > 1 and self.native_amx:
            return False
        low, high = self.tuning.packed_gemm_rows
        if op == "grouped_linear":  # one token: the grouped GEMV; the tiles from _SKINNY_ROWS (_tile_grouped)
            if tokens == 1:
                return None
            low = max(low, _SKINNY_ROWS)
        tiles = self.tile_weights if low <= tokens <= high else None
        if tiles is None:
            return None if tokens == 1 else False
        copy = tiles.lookup(weight)
        return False if copy is None or op == "grouped_linear" and copy.dim() != 5 else copy

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            lib, out = self.native_library, None
            if lib is not None and x.shape[0] <= self.tuning.quant_max_rows:
                # decode sizes: each group quant_linear's products (the per-group linears' bits), one call
                out = native.quant_grouped_linear(lib, x, weight, out_dtype=x.dtype)
            return super().grouped_linear(x, weight) if out is None else out  # one (tiled) linear per group
        lib, out = self.native_library, None
        if lib is not None and x.shape[0] == 1:
            out = native.grouped_gemv_bf16(lib, x, weight)
        elif lib is not None and x.shape[0] <= self.tuning.grouped_amx_max_tokens:
            out = native.grouped_amx_bf16(lib, x, weight)  # None without AMX
        if out is None and lib is not None:
            out = self._tile_grouped(x, weight)
        return super().grouped_linear(x, weight) if out is None else out

    def _tile_grouped(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """x [T, G, K] by each group's weight [G, N, K] on the packed register tiles (the stack packed
        once, at load) where the tier's tile rows cover T, from _SKINNY_ROWS tokens; None
        otherwise. One thread, tiles against torch's batched products (cold weights): AVX2 2.1-3.3x at
        16-64 tokens and 4.6-5.1x at 512 on 2 x 64 x 256 (the 161 M V4's) and 8 x 1024 x 4096, 0.5-0.65x
        at 2-4 tokens on the small one (a call per group); AVX512-BF16 1.0-1.9x at 16-64 tokens."""
        low, high = self.tuning.packed_gemm_rows
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

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                     mask: torch.Tensor, k: int) -> torch.Tensor:
        lib = self.native_library
        if lib is not None and keys.shape[1] and q.shape[1] <= self.tuning.decode_queries:
            score = native.indexer_scores(lib, q, weights, keys, mask)  # -inf where not visible
            if score is not None:
                vals, idx = score.topk(min(k, keys.shape[1]), dim=-1)
                picks = idx.masked_fill_(vals == float("-inf"), -1)
                return picks if picks.shape[-1] == k else torch.nn.functional.pad(picks, (0, k - picks.shape[-1]),
                                                                                  value=-1)
        return super().indexer_topk(q, weights, keys, mask, k)

    def model_ops(self, family: str) -> DeepseekV4Ops | None:
        """V4's table (CpuKernels), and for V4.1 its own, with a batch-invariant table of its own."""
        return self.with_fixed_order(CpuDeepseekV41Ops(self)) if family == DEEPSEEK_V41 else super().model_ops(family)

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
