"""CpuKernels with its fast paths: fused C functions (native/*.c), one call and one pass over
memory instead of tens of torch ops, for
- the element-wise kernels: rms_norm, rotary, hc_pre, hc_post, swiglu;
- decode-sized products: the bf16 GEMV of weights up to 8 M elements (it streams them faster than
  torch.mv), the grouped output projection of a few tokens, the routed experts of decode-sized
  batches (each expert weight streamed once), and, where the CPU has AMX, the linears of decode
  batches (tile products instead of oneDNN's calls);
- the MoE dispatch and combine (a counting sort and a weighted row sum, ~10 torch ops each);
- decode attention (16 heads per vector lane set, no horizontal sums);
- greedy sampling's argmax with the log-sum-exp, in one pass over the logits.
Each method falls back to the pure-torch reference when the library is unavailable (no compiler,
DEEPINFER_CPU_NATIVE=0) or the input is outside what the C code handles.

Multi-row bf16 linears run on oneDNN-packed copies of the weights (packed_weights.py) unless
DEEPINFER_CPU_PACKED_WEIGHTS=0."""
from __future__ import annotations

import ctypes
import functools

import torch

from deepinfer.accelerator.interface import MoEDispatch
from deepinfer_plugins.cpu import native, packed_weights
from deepinfer_plugins.cpu.kernels import CpuKernels, _pad_rows
from deepinfer_plugins.cpu.packed_weights import PackedWeights

# Above this many weight elements torch.mv streams as fast or faster (the 129,280 x 1024 LM head:
# 29 vs 25 GB/s); below it the C GEMV is 10-30 % faster (measured with cold weights, 2 threads).
_NATIVE_GEMV_MAX_ELEMENTS = 8 << 20

# When the C expert kernel beats the torch paths (32 experts of 1024 x 512, top-4, 2 threads).
# With AMX tiles: 1.4-1.7x at 4-32 rows (cold weights), 1.05-1.1x at 64-128 (all experts touched,
# both stream the weights at ~23 GB/s), 1.96x at 1,024 rows, 1.65x at 2,048, 1.35x at 4,096, equal
# at 8,192 (256 rows per expert): up to 192 rows per expert on average.
# With AVX512-BF16 dot products only: 1.25-1.45x at 4-48 rows, compute-bound from ~64 (0.87x at 96).
_EXPERT_ROWS_PER_EXPERT_AMX = 192
_EXPERT_MAX_ROWS_DOT = 48

# Tokens up to which the grouped output projection runs on AMX tiles (4 groups of 256 x 512 at 32
# tokens: ~230 -> ~60 us; oneDNN's batched product takes over for prefill chunks).
_GROUPED_AMX_MAX_TOKENS = 64

# Decode-batch linears (2-32 rows) of weights up to 8 M elements run on AMX tiles where available:
# at 8 sequences `linear` 20.6 -> 17.9 ms per step, at 32 24.0 -> 22.1 ms. From 64 rows the packed
# oneDNN path is faster (0.90x at 64, 0.60x at 256), and the LM head stays there too (AMX tiles
# stream it slower at 32 rows: 18.9 vs 21.1 GB/s).
_LINEAR_AMX_MAX_ROWS = 32
_LINEAR_AMX_MAX_ELEMENTS = 8 << 20

# Queries per sequence up to which attention runs in the C kernel (decode, speculative verification):
# 2.2x the two fp32 bmms at 32 sequences x 256 keys, 6x at one sequence.
_DECODE_QUERIES = 16


class NativeCpuKernels(CpuKernels):
    @functools.cached_property
    def native_library(self) -> ctypes.CDLL | None:
        """Decided once per instance (the first kernel call): the loaded library or None."""
        return native.active_library()

    @functools.cached_property
    def packed_weights(self) -> PackedWeights | None:
        return PackedWeights() if packed_weights.available() else None

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, lib = x.numel() // max(x.shape[-1], 1), self.native_library
        if lib is not None and 1 < rows <= _LINEAR_AMX_MAX_ROWS and weight.numel() <= _LINEAR_AMX_MAX_ELEMENTS:
            y = native.linear_amx_bf16(lib, x.reshape(rows, x.shape[-1]), weight)  # None without AMX
            if y is not None:
                return y.view(*x.shape[:-1], weight.shape[0])
        table = self.packed_weights if rows > 1 and x.dtype == torch.bfloat16 and x.is_cpu else None
        packed = None if table is None else table.lookup(weight)
        if packed is None:
            return super().linear(x, weight)
        # oneDNN compiles a kernel per row count: bucket them as the plain GEMM path does
        y = packed_weights.linear(_pad_rows(x.reshape(rows, x.shape[-1])), packed)
        return y[:rows].view(*x.shape[:-1], weight.shape[0])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        lib = self.native_library
        out = None if lib is None else native.rms_norm(lib, x, weight, eps)
        return super().rms_norm(x, weight, eps) if out is None else out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        lib = self.native_library
        out = None if lib is None else native.rotary(lib, x, cos, sin, inverse)
        return super().rotary(x, cos, sin, inverse) if out is None else out

    def hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lib = self.native_library
        out = None if lib is None else native.hc_pre(lib, streams, fn, base, scale, sinkhorn_iters, eps, norm_eps)
        return super().hc_pre(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps) if out is None else out

    def hc_post(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        lib = self.native_library
        out = None if lib is None else native.hc_post(lib, y, streams, post, comb)
        return super().hc_post(y, streams, post, comb) if out is None else out

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        lib = self.native_library
        # a few rows: torch's four ops cost less than the call (5.9 vs 6.6 us for one 512-wide row)
        out = None if lib is None or gate.numel() < 4096 else native.swiglu(lib, gate, up, limit)
        return super().swiglu(gate, up, limit) if out is None else out

    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                       sinks: torch.Tensor, scale: float) -> torch.Tensor:
        lib = self.native_library
        out = None
        if lib is not None and q.shape[1] <= _DECODE_QUERIES:  # prefill blocks: flash attention
            out = native.sink_attention_decode(lib, q, kv, mask, sinks, scale)
        return super().sink_attention(q, kv, mask, sinks, scale) if out is None else out

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        lib, out = self.native_library, None
        if lib is not None and x.shape[0] == 1:
            out = native.grouped_gemv_bf16(lib, x, weight)
        elif lib is not None and x.shape[0] <= _GROUPED_AMX_MAX_TOKENS:
            out = native.grouped_amx_bf16(lib, x, weight)  # None without AMX
        return super().grouped_linear(x, weight) if out is None else out

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

    def moe_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor, w2: torch.Tensor,
                    swiglu_limit: float) -> torch.Tensor:
        lib = self.native_library
        out = None
        if lib is not None and rows.shape[0] <= self._native_expert_rows(w13.shape[0]):
            out = native.experts_bf16(lib, rows, plan.tokens_per_expert, w13, w2, swiglu_limit)
        return super().moe_experts(rows, plan, w13, w2, swiglu_limit) if out is None else out

    def _native_expert_rows(self, num_experts: int) -> int:
        if self.native_amx:
            return _EXPERT_ROWS_PER_EXPERT_AMX * num_experts
        return _EXPERT_MAX_ROWS_DOT

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
        lib = self.native_library
        small = weight.numel() <= _NATIVE_GEMV_MAX_ELEMENTS
        out = native.gemv_bf16(lib, weight, x) if lib is not None and small else None
        return super()._matvec(weight, x) if out is None else out
