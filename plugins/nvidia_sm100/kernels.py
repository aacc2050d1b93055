"""torch-CUDA kernels of the NVIDIA back end, with the vendor fast paths chosen at construction.

The generic kernels are core's plain-torch reference kernels
(`deepinfer.accelerator.reference.TorchKernels`): they are device-agnostic (every tensor they
create follows its inputs' device, nothing goes through NumPy), so they run unchanged on CUDA
tensors on SM80 and newer. DeepSeek-V4's own ops (mHC, compressor pooling, indexer) are the
model's plain-torch defaults (no override is declared). Two kernels have fast paths, each used
only for inputs its library supports (otherwise the generic kernel runs):

- `sink_attention` -> FlashMLA sparse MQA (`flash_mla_attention.py`): bf16, 64/128 heads, d = 512;
- `moe_experts` -> DeepGEMM M-grouped GEMM (`deep_gemm_experts.py`): bf16, 128-aligned dims; with
  FP8 precision also FP8 `QuantizedWeight` experts in 128x128 blocks (`keep_fp8_weights`).

Quantised weights (only `fp8_block128`, and only when the accelerator declares it) otherwise take
the reference path: dequantised tile by tile on the GPU.

`sample` and `rejection_sample` are the reference ones, which check that every per-row generator
is on the probabilities' device; the reference `moe_dispatch` counts rows per expert without a
host synchronisation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.accelerator.interface import MoEDispatch
from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.accelerator.reference import TorchKernels
from deepinfer_plugins.nvidia_sm100 import deep_gemm_experts, flash_mla_attention
from deepinfer_plugins.nvidia_sm100.probe import FAST_PATH_MODULES


@dataclass
class FastPaths:
    """The vendor implementations in use; None = the generic kernel."""

    attention: Any = None  # FlashMlaAttention
    experts: Any = None  # DeepGemmExperts
    names: tuple[str, ...] = field(default_factory=tuple)


def build_fast_paths(names: tuple[str, ...], kernels: "CudaKernels", expert_precision: str = "bf16") -> FastPaths:
    """Import and set up the named fast paths; an installed library that fails to import is an error."""
    unknown = sorted(set(names) - set(FAST_PATH_MODULES))
    if unknown:
        raise ValueError(f"unknown NVIDIA fast path(s) {unknown}; known: {sorted(FAST_PATH_MODULES)}")
    paths = FastPaths(names=tuple(names))
    try:
        if "flash_mla" in names:
            paths.attention = flash_mla_attention.FlashMlaAttention()
        if "deep_gemm" in names:
            paths.experts = deep_gemm_experts.DeepGemmExperts(kernels.swiglu, precision=expert_precision)
    except ImportError as exc:
        raise RuntimeError(f"an NVIDIA fast-path library is installed but does not import ({exc}); fix or "
                           f"uninstall it, or construct NvidiaAccelerator(fast_paths=()) for the generic "
                           f"kernels") from exc
    return paths


class CudaKernels(TorchKernels):
    """The reference kernels plus the fast paths in `self.fast` (set by the accelerator)."""

    fast: FastPaths = FastPaths()

    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                       sinks: torch.Tensor, scale: float) -> torch.Tensor:
        if self.fast.attention is not None and flash_mla_attention.eligible(q, kv):
            return self.fast.attention(q, kv, mask, sinks, scale)
        return super().sink_attention(q, kv, mask, sinks, scale)

    def moe_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor | QuantizedWeight,
                    w2: torch.Tensor | QuantizedWeight, swiglu_limit: float) -> torch.Tensor:
        if self.fast.experts is not None and deep_gemm_experts.eligible(rows, w13, w2, self.fast.experts.precision):
            return self.fast.experts(rows, plan, w13, w2, swiglu_limit)
        return super().moe_experts(rows, plan, w13, w2, swiglu_limit)


