"""The cpu back end's tuning thresholds, one table: where each path choice switches, per GEMV tier.

The C kernels and torch / oneDNN are picked by row counts and sizes; each value is where the measured
crossover lay (docs/performance.md, "The cpu back end's tuning thresholds", has the measurements).
`Tuning` holds every threshold; `TUNING` gives the values of each tier the native library is built for
(native.gemv_tier: "avx512-bf16", "avx2-fma", "portable"; no library: "portable"; "avx512-bf16" with usable
AMX tiles: "amx"). The kernels read
them once, from `NativeCpuKernels.tuning`, so a test or an experiment replaces one value with
`dataclasses.replace`.
"""
from __future__ import annotations

from dataclasses import dataclass

NEVER = 1 << 62  # a threshold that is never reached


@dataclass(frozen=True)
class Tuning:
    """Every threshold of the cpu back end's path choices (the defaults: those of every tier)."""

    #: rows per expert (on average) up to which the C expert kernel runs on AMX tiles
    expert_rows_per_expert_amx: int = 192
    #: rows in all up to which the portable expert dot products run (no AVX2 or AVX-512)
    expert_max_rows_dot: int = 48
    #: rows per expert up to which the C expert kernel runs on the GEMV tiers (AVX2+FMA, AVX512-BF16)
    expert_rows_per_expert_dot: int = 16
    #: tokens up to which the grouped output projection runs on AMX tiles
    grouped_amx_max_tokens: int = 64
    #: decode-batch linears (2 to this many rows) on AMX tiles, where the register tiles do not take them
    linear_amx_max_rows: int = 32
    #: tokens up to which the router's top-k runs in C (one thread; prefill keeps torch's parallel top-k)
    route_max_tokens: int = 64
    #: decode batches up to this many tokens take the fused MoE sub-layer (moe_layer.c)
    moe_fused_max_tokens: int = 64
    #: token rows up to which the mHC site calls write into reused output buffers
    hc_reuse_max_rows: int = 64
    #: elements below which swiglu stays on torch's four ops (cheaper than the C call)
    swiglu_torch_max: int = 4096
    #: queries per sequence up to which attention runs in the C kernel (decode, speculative verification)
    decode_queries: int = 16
    #: rows up to which a product on FP4 / FP8 weights runs on the codes (quant_gemv.c, quant_experts.c)
    quant_max_rows: int = 128
    # ----- per tier -----
    #: decode-batch linears (2 to this many rows) on the C multi-token GEMV instead of oneDNN
    gemv_tokens_max_rows: int = 1
    #: row counts (inclusive) whose bf16 linears run on the C register tiles over packed weights
    #: (packed_gemm.c); (0, 0): none
    packed_gemm_rows: tuple[int, int] = (0, 0)
    #: weight elements from which one row (decode at batch 1) also runs on the tiles (the AVX2 LM head)
    one_row_tiles_min_elements: int = NEVER
    #: rows per expert (on average) from which the fused MoE's routed experts run on the tiles
    moe_tiles_rows_per_expert: int = NEVER


TUNING = {
    # the tiles from one row (the GEMV's limit 8); the MoE's experts on the tiles from 3 rows per expert
    "avx512-bf16": Tuning(gemv_tokens_max_rows=8, packed_gemm_rows=(1, 64), moe_tiles_rows_per_expert=3),
    # with AMX: the register tiles up to 6 rows, AMX's from 7 to 32, oneDNN's from 33 (the tiles 2.6-4.5x
    # slower than either there); AMX's expert and grouped kernels take their rows
    "amx": Tuning(gemv_tokens_max_rows=8, packed_gemm_rows=(1, 6), moe_tiles_rows_per_expert=3),
    # oneDNN has no AVX2 bf16 kernel: the tiles from 2 rows up, prefill too, and the LM head's one row
    "avx2-fma": Tuning(gemv_tokens_max_rows=16, packed_gemm_rows=(2, NEVER), one_row_tiles_min_elements=32 << 20,
                       moe_tiles_rows_per_expert=4),
    "portable": Tuning(),  # not measured: its products stay where they were
}
