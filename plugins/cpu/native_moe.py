"""The MoE family of the cpu back end's C kernels (`NativeMoEKernels`, part of `NativeCpuKernels`): the
router's top-k, dispatch and combine, the routed experts (bf16 GEMVs, register tiles, FP4 / FP8 codes,
AMX where the CPU has it) and a decode step's whole MoE sub-layer in one call (moe_layer.c), each
falling back to the torch path of `CpuKernels` where the C code does not take the input."""
from __future__ import annotations

import torch

from deepinfer.accelerator.interface import MoEDispatch
from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.native_base import NativeKernelsBase


class NativeMoEKernels(NativeKernelsBase):
    def moe_route(self, scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling_factor: float,
                  hash_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        lib, out = self.native_library, None
        if lib is not None and scores.shape[0] <= self.tuning.route_max_tokens:
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
        lib = self.native_library
        out = None
        if lib is not None and rows.shape[0] <= self._native_expert_rows(w13.shape[0]):
            out = native.experts_bf16(lib, rows, plan.tokens_per_expert, w13, w2, swiglu_limit)
        elif lib is not None:
            out = self._tile_experts(rows, plan, w13, w2, swiglu_limit)
        return super().moe_experts(rows, plan, w13, w2, swiglu_limit) if out is None else out

    def _tile_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor, w2: torch.Tensor,
                      swiglu_limit: float) -> torch.Tensor | None:
        """Each expert's rows through the packed register tiles (both expert stacks packed once, at
        load), rounded where the composed path rounds: gate/up, swiglu, output. None where
        the tier's tile rows do not cover the largest expert's rows (or a stack has no copy). On the AVX2
        tier this is prefill's MoE: torch's bf16 GEMMs there (no oneDNN bf16 kernel) ran the 161 M V4
        checkpoint's 16 experts at 128 rows each at ~3 GFLOP/s, two thirds of a 512-token prefill (one
        thread); the tiles run them 3.8-5.2x faster. AVX512-BF16 (up to 64 rows per expert): 1.3-1.8x
        torch's oneDNN GEMMs at 24-64 rows per expert."""
        counts = plan.tokens_per_expert.tolist()
        low, high = self.tuning.packed_gemm_rows
        tiles = self.tile_weights
        if tiles is None or rows.dtype != torch.bfloat16 or not counts or not low <= max(counts) <= high:
            return None
        p13, p2 = tiles.lookup(w13), tiles.lookup(w2)
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
        more than tuning.quant_max_rows rows (the per-expert path's products on the codes go to that size too);
        None: the per-expert path (more rows, no library, mixed formats)."""
        lib = self.native_library
        if lib is None:
            return None
        most = self.tuning.quant_max_rows
        if rows.shape[0] > most and int(plan.tokens_per_expert.max()) > most:
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
        # (the packed register tiles in this tier's tuning.packed_gemm_rows, else the C GEMVs: the same bits).
        # From tuning.moe_tiles_rows_per_expert the routed experts run on the tiles over their packed copies: the
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
        composed path."""
        if (self.native_library is None or (rows != 1 and self.native_amx)
                or rows * top_k > self._native_expert_rows(w13.shape[0])):
            return None
        low, high = self.tuning.packed_gemm_rows
        tiles = self.tile_weights if low <= rows <= high and dtype == torch.bfloat16 else None
        experts = None
        if tiles is not None and rows * top_k >= self.tuning.moe_tiles_rows_per_expert * w13.shape[0]:
            experts = tiles.lookup(w13), tiles.lookup(w2)
            experts = None if any(p is None for p in experts) else experts
        tuning = self.tuning
        if not (rows <= tuning.gemv_tokens_max_rows or (tiles is not None and rows <= tuning.moe_fused_max_tokens)):
            return None
        shared = None if tiles is None or shared_w13 is None else (tiles.lookup(shared_w13), tiles.lookup(shared_w2))
        return experts, shared, shared_w2 is not None and rows * shared_w2.shape[1] < self.tuning.swiglu_torch_max

    def _quant_moe_sublayer(self, x: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor | None,
                            hash_ids: torch.Tensor | None, w13: torch.Tensor | QuantizedWeight,
                            w2: torch.Tensor | QuantizedWeight, shared_w13: torch.Tensor | QuantizedWeight | None,
                            shared_w2: torch.Tensor | QuantizedWeight | None, top_k: int, routed_scaling_factor: float,
                            scoring_func: str, swiglu_limit: float) -> torch.Tensor | None:
        """The MoE sub-layer of a bf16 decode batch (up to tuning.moe_fused_max_tokens tokens) with routed experts
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
        composed path."""
        if (self.native_library is None or rows > self.tuning.moe_fused_max_tokens
                or not isinstance(w13, QuantizedWeight) or not isinstance(w2, QuantizedWeight)):
            return None
        packed_shared = None
        if shared_w13 is not None and not isinstance(shared_w13, QuantizedWeight):
            if isinstance(shared_w2, QuantizedWeight):  # a mixed pair (w1, w3 off block rows): composed path
                return None
            low, high = self.tuning.packed_gemm_rows
            tiles = self.tile_weights if low <= rows <= high else None
            if (rows > 1 and self.native_amx) or (tiles is None and rows > self.tuning.gemv_tokens_max_rows):
                return None  # the composed linear would take oneDNN's or the AMX products
            if tiles is not None:
                packed_shared = tiles.lookup(shared_w13), tiles.lookup(shared_w2)
        return packed_shared, shared_w2 is not None and rows * shared_w2.shape[1] < self.tuning.swiglu_torch_max

    def _native_expert_rows(self, num_experts: int) -> int:
        if self.native_amx:
            return self.tuning.expert_rows_per_expert_amx * num_experts
        if native.gemv_tier(self.native_library) in ("avx2-fma", "avx512-bf16"):
            return self.tuning.expert_rows_per_expert_dot * num_experts
        return self.tuning.expert_max_rows_dot
