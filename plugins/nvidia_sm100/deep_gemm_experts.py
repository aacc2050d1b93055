"""`moe_experts` through DeepGEMM's M-grouped GEMMs (deepseek-ai/DeepGEMM, SM90/SM100).

DeepGEMM groups the rows of all experts into one "contiguous layout": each expert's rows start at
a multiple of `get_mk_alignment_for_contiguous_layout()`, and `grouped_layout[row]` names the
expert of every row (-1 for padding rows, which the kernel skips). `moe_dispatch` already sorts
rows by expert, so this module only scatters them to aligned offsets, runs

    gate_up = m_grouped_*_gemm_nt_contiguous(rows, w13)      # [M, 2I] = rows @ w13[e].T
    h       = clamped SwiGLU(gate_up)                        # the accelerator's own swiglu
    out     = m_grouped_*_gemm_nt_contiguous(h, w2)          # [M, D]

and gathers the rows back into dispatch order.

Two precisions:
- "bf16" (default): `m_grouped_bf16_gemm_nt_contiguous` on the bf16 weights; numerically the
  reference computation (fp32 accumulation), so the conformance tolerances hold.
- "fp8": `m_grouped_fp8_gemm_nt_contiguous` with weights quantised once to 128x128-block FP8
  (cached per weight tensor) and activations per token in 1x128 groups; scales are powers of two so
  SM100's UE8M0 scale format represents them exactly. Faster, lossy: opt-in only
  (`NvidiaAccelerator(expert_precision="fp8")`). Experts that arrive as FP8 `QuantizedWeight`s
  (128x128 blocks, the checkpoint's own values: V4-Flash-Base's experts, with
  `NvidiaAccelerator(keep_fp8_weights=True)`) go to the FP8 GEMM as stored, scales as fp32, with no
  re-quantisation.

`deep_gemm` is imported only in `DeepGemmExperts.__init__`; the layout and quantisation helpers
are plain torch and tested on CPU.
"""
from __future__ import annotations

from typing import Callable

import torch

from deepinfer.accelerator.interface import MoEDispatch
from deepinfer.accelerator.quantized_weight import FP8_BLOCK128, QuantizedWeight

FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANT_BLOCK = 128  # DeepGEMM's scale granularity along K (and along N for weights)


def contiguous_layout(tokens_per_expert: torch.Tensor, num_rows: int, alignment: int,
                      padded_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each expert-sorted row goes in DeepGEMM's contiguous layout.

    Returns (dest `[N]` int64, the padded row of each grouped row; grouped_layout `[M]` int32, the
    expert of each padded row or -1). M is `padded_rows` when given (a static upper bound, so that
    no host synchronisation happens, e.g. under CUDA-graph capture), else the exact aligned total."""
    counts = tokens_per_expert.to(torch.int64)
    E = counts.numel()
    device = counts.device
    aligned = (counts + alignment - 1) // alignment * alignment
    aligned_start = torch.cumsum(aligned, 0) - aligned
    start = torch.cumsum(counts, 0) - counts
    expert_of_row = torch.repeat_interleave(torch.arange(E, device=device), counts, output_size=num_rows)
    row = torch.arange(num_rows, device=device)
    dest = aligned_start[expert_of_row] + (row - start[expert_of_row])
    if padded_rows is None:
        padded_rows = int(aligned.sum())
    layout = torch.full((padded_rows,), -1, dtype=torch.int32, device=device)
    layout[dest] = expert_of_row.to(torch.int32)
    return dest, layout


def static_padded_rows(num_rows: int, num_experts: int, alignment: int) -> int:
    """Upper bound of the aligned total, a multiple of `alignment`."""
    bound = num_rows + num_experts * (alignment - 1)
    return -(-bound // alignment) * alignment


def _scale(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    scale = amax.float().clamp(min=1e-4) / FP8_MAX
    if pow2:  # round up to a power of two: exact in UE8M0, never overflows FP8
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def quantize_per_token(x: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` (K a multiple of 128) -> (fp8 `[M, K]`, scales `[M, K/128]` fp32); x ~= fp8 * scale."""
    M, K = x.shape
    groups = x.float().view(M, K // QUANT_BLOCK, QUANT_BLOCK)
    scale = _scale(groups.abs().amax(-1), pow2)
    q = (groups / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.view(M, K), scale


def quantize_per_block(w: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w `[G, N, K]` (N, K multiples of 128) -> (fp8 `[G, N, K]`, scales `[G, N/128, K/128]` fp32)."""
    G, N, K = w.shape
    blocks = w.float().view(G, N // QUANT_BLOCK, QUANT_BLOCK, K // QUANT_BLOCK, QUANT_BLOCK)
    scale = _scale(blocks.abs().amax(dim=(2, 4)), pow2)
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(G, N, K), scale


def eligible(rows: torch.Tensor, w13: torch.Tensor | QuantizedWeight, w2: torch.Tensor | QuantizedWeight,
             precision: str = "bf16") -> bool:
    """bf16 CUDA rows with 128-aligned dims (the FP8 scale blocks and GEMM tiles need it), and either
    bf16 contiguous weights, or (FP8 precision only) both weights FP8 `QuantizedWeight`s in 128x128
    blocks, which the FP8 GEMM reads as stored."""
    if not (rows.is_cuda and rows.dtype == torch.bfloat16
            and rows.shape[-1] % QUANT_BLOCK == 0 and w2.shape[-1] % QUANT_BLOCK == 0):
        return False
    quantised = [isinstance(w, QuantizedWeight) for w in (w13, w2)]
    if any(quantised):
        return precision == "fp8" and all(quantised) and all(
            w.format == FP8_BLOCK128 and w.data.is_contiguous() and w.shape[-2] % QUANT_BLOCK == 0 for w in (w13, w2))
    return w13.dtype == w2.dtype == torch.bfloat16 and w13.is_contiguous() and w2.is_contiguous()


class DeepGemmExperts:
    """Callable with the `moe_experts` signature (minus self), backed by DeepGEMM."""

    PRECISIONS = ("bf16", "fp8")

    def __init__(self, swiglu: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
                 precision: str = "bf16", pow2_scales: bool = True) -> None:
        if precision not in self.PRECISIONS:
            raise ValueError(f"DeepGEMM expert precision {precision!r} is not one of {self.PRECISIONS}")
        import deep_gemm  # noqa: PLC0415 - optional library, imported only when this path is selected

        self._dg = deep_gemm
        self._swiglu = swiglu
        self.precision = precision
        self.pow2_scales = pow2_scales
        self.alignment = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
        self._fp8_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _fp8_weight(self, w: torch.Tensor | QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(w, QuantizedWeight):  # the checkpoint's FP8 blocks, as stored
            return w.data, w.scale.float()
        key = (w.data_ptr(), tuple(w.shape), w._version)
        if key not in self._fp8_cache:
            self._fp8_cache[key] = quantize_per_block(w, self.pow2_scales)
        return self._fp8_cache[key]

    def _grouped_gemm(self, a: torch.Tensor, w: torch.Tensor | QuantizedWeight, layout: torch.Tensor
                      ) -> torch.Tensor:
        d = torch.empty((a.shape[0], w.shape[1]), dtype=torch.bfloat16, device=a.device)
        if self.precision == "fp8":
            self._dg.m_grouped_fp8_gemm_nt_contiguous(quantize_per_token(a, self.pow2_scales),
                                                      self._fp8_weight(w), d, layout)
        else:
            self._dg.m_grouped_bf16_gemm_nt_contiguous(a, w, d, layout)
        return d

    def __call__(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor | QuantizedWeight,
                 w2: torch.Tensor | QuantizedWeight, swiglu_limit: float) -> torch.Tensor:
        N, D = rows.shape
        E, inter = w2.shape[0], w2.shape[2]
        capturing = rows.is_cuda and torch.cuda.is_current_stream_capturing()
        padded = static_padded_rows(N, E, self.alignment) if capturing else None
        dest, layout = contiguous_layout(plan.tokens_per_expert, N, self.alignment, padded)
        a = rows.new_zeros((layout.shape[0], D))
        a[dest] = rows
        gate_up = self._grouped_gemm(a, w13, layout)
        h = self._swiglu(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
        out = self._grouped_gemm(h.contiguous(), w2, layout)
        return out[dest]

