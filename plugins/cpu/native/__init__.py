"""The fused C kernels of the cpu back end: one C file per op family next to this package, compiled
together into one cached library (build.py), and one Python binding per family that declares its C
prototypes (binding.Kernel) next to its typed tensor wrappers:

    norm_rope.c / .py   rms_norm, rotary, rms_norm_rotary
    mhc.c / .py         hc_pre (+ hc_pre_norm), hc_post, hc_post_pre_norm (+ hc_outputs, HcOutputs), hc_head;
                        V4.1's hc_mix_collapse_norm, hc_post_mix_collapse_norm (+ site_outputs, SiteOutputs)
    activation.c / .py  swiglu
    gemv.c / .py        gemv_bf16, gemv_tokens_bf16, gemv_tier(_for), grouped_gemv_bf16, grouped_amx_bf16, linear_amx_bf16,
                        amx_usable, linear_rows (batch-invariant)
    experts.c / .py     experts_bf16; experts_packed_bf16 (on the register tiles, called by moe_layer.c only)
    attention.c / .py   sink_attention_decode, sink_attention_rows (keys read by index), sink_attention_invariant
                        (batch-invariant)
    moe_rows.c / .py    moe_dispatch_rows, moe_combine_rows
    sampling.c / .py    argmax_logsumexp
    selection.c / .py   indexer_scores (the lightning indexer's scores), moe_route_rows (the MoE router's top-k)
    packed_gemm.c / .py pack_bf16, packed_linear_bf16 (decode batches on weights packed for register tiles),
                        packed_cols, packed_shape; packed_group_products (one product per expert, in C only)
    moe_layer.c / .py   moe_layer_bf16 (a decode step's MoE sub-layer in one call, from the stages above),
                        moe_layer_quant (the same with FP4 / FP8 experts as stored)
    compressor.c / .py  compress_store (the compressor's ring writes of a decode step)
    attention_layer.c / .py  attention_projections, attention_output (a decode step's attention sub-layer in
                        two calls, from the stages above; each weight bf16 or FP8 / FP4 codes as stored)
    quant_gemv.c / .py  quant_linear (fp4_linear, fp8_linear: FP4 / FP8-block weights as stored),
                        quant_grouped_linear, quant_simd
    quant_experts.c / .py  quant_experts (all routed experts of a step on FP4 / FP8-block weights, one call)
    kv_cache.c / .py    kv_store (rows encoded in DeepSeek-V4.1's cache formats into cache rows)
    indexer.c / .py     index_select (DeepSeek-V4.1's lightning indexer: scores, candidate pool, top-k)
    isa.c               build_isa (its wrapper is in build.py)
    common.h, gemv.h,   what the C files share (bf16 conversions, ISA checks, the bf16 products,
    quant.h, kv_codes.h the products on FP4 / FP8 codes, V4.1's cache formats bit-exact)
    sink_attention.h    attention.c's sink attention for one lane count (included once per lane count)

A wrapper takes the library and torch tensors and returns new tensors, or None when the input is
outside what the C code handles (device, dtype, layout), so the caller falls back to the reference
kernel. Where it would only make the call, the family has its `*_arguments` function alone (the checked
call, binding.Bound), made by `run(lib, foo_arguments(lib, ...))`.
"""
from deepinfer_plugins.cpu.native.activation import swiglu
from deepinfer_plugins.cpu.native.attention import sink_attention_decode, sink_attention_invariant, sink_attention_rows
from deepinfer_plugins.cpu.native.attention_layer import (attention_output, attention_output_arguments,
                                                          attention_projections_arguments)
from deepinfer_plugins.cpu.native.binding import run
from deepinfer_plugins.cpu.native.build import (BUILD_VARIANTS, FLAGS, SOURCES, SWITCHED_OFF, CacheError, CompilerError,
                                                _build, _compile, _compiler, _cpu_features, _load, active_library,
                                                build_flags, build_isa, build_variant, enabled, library, planned_isa,
                                                planned_target)
from deepinfer_plugins.cpu.native.compressor import compress_store, compress_store_arguments
from deepinfer_plugins.cpu.native.experts import experts_bf16
from deepinfer_plugins.cpu.native.gemv import (amx_usable, gemv_bf16_arguments, gemv_tier, gemv_tier_for,
                                               gemv_tokens_bf16, grouped_amx_bf16, grouped_gemv_bf16, linear_amx_bf16,
                                               linear_rows)
from deepinfer_plugins.cpu.native.indexer import index_select
from deepinfer_plugins.cpu.native.kv_cache import kv_store
from deepinfer_plugins.cpu.native.mhc import (
    TRANSPOSED_MIXES, HcOutputs, OutputSets, SiteOutputs, hc_head, hc_mix_collapse_norm, hc_mix_collapse_norm_arguments,
    hc_outputs, hc_post, hc_post_mix_collapse_norm_arguments, hc_post_pre_norm_arguments, hc_pre_arguments,
    site_outputs, transpose_fn,
)
from deepinfer_plugins.cpu.native.moe_layer import (moe_layer_arguments, moe_layer_bf16, moe_layer_quant,
                                                    moe_layer_quant_arguments)
from deepinfer_plugins.cpu.native.moe_rows import moe_combine_rows, moe_dispatch_rows
from deepinfer_plugins.cpu.native.norm_rope import rms_norm_arguments, rms_norm_rotary, rotary
from deepinfer_plugins.cpu.native.packed_gemm import (pack_bf16, packed_cols, packed_linear_arguments,
                                                      packed_linear_bf16, packed_shape)
from deepinfer_plugins.cpu.native.quant_experts import quant_experts
from deepinfer_plugins.cpu.native.quant_gemv import quant_grouped_linear, quant_linear, quant_simd
from deepinfer_plugins.cpu.native.sampling import argmax_logsumexp
from deepinfer_plugins.cpu.native.selection import indexer_scores, moe_route_rows

__all__ = [
    "BUILD_VARIANTS", "FLAGS", "SOURCES", "SWITCHED_OFF", "TRANSPOSED_MIXES", "CacheError", "CompilerError",
    "HcOutputs", "OutputSets", "SiteOutputs", "active_library", "amx_usable", "argmax_logsumexp", "attention_output",
    "attention_output_arguments", "attention_projections_arguments", "build_flags", "build_isa",
    "build_variant", "compress_store", "compress_store_arguments", "enabled", "experts_bf16", "gemv_bf16_arguments",
    "gemv_tier", "gemv_tier_for", "gemv_tokens_bf16", "grouped_amx_bf16", "grouped_gemv_bf16", "hc_head",
    "hc_mix_collapse_norm", "hc_mix_collapse_norm_arguments", "hc_outputs", "hc_post",
    "hc_post_mix_collapse_norm_arguments", "hc_post_pre_norm_arguments", "hc_pre_arguments", "index_select",
    "indexer_scores", "kv_store", "library", "linear_amx_bf16", "linear_rows", "moe_combine_rows", "moe_dispatch_rows",
    "moe_layer_arguments", "moe_layer_bf16", "moe_layer_quant", "moe_layer_quant_arguments", "moe_route_rows",
    "pack_bf16", "packed_cols", "packed_linear_arguments", "packed_linear_bf16", "packed_shape", "planned_isa",
    "planned_target", "quant_experts", "quant_grouped_linear", "quant_linear", "quant_simd", "rms_norm_arguments",
    "rms_norm_rotary", "rotary", "run", "sink_attention_decode", "sink_attention_invariant", "sink_attention_rows",
    "site_outputs", "swiglu", "transpose_fn",
]
