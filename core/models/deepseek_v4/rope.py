"""Partial interleaved RoPE with two frequency sets, main and compress.

*main* (sliding-only layers and the MTP block): base `rope_theta`, no scaling.
*compress* (CSA and HCA layers: queries, window keys, compressed entries, indexer q/k): base
`compress_rope_theta` with YaRN frequency interpolation (no mscale, attention factor 1).
Only the last `qk_rope_head_dim` dims of a vector rotate; cos/sin are `[T, r/2]` fp32.
"""
from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import torch

from deepinfer.models.deepseek_v4.config import DeepseekV4Config, YarnScaling


def inverse_frequencies(rope_dim: int, base: float, yarn: YarnScaling | None) -> torch.Tensor:
    """`[r/2]` fp32 inverse frequencies; YaRN blends interpolated (theta/factor) and original
    frequencies with a linear ramp between the beta_fast and beta_slow correction dims."""
    pos_freqs = base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    inv = 1.0 / pos_freqs
    if yarn is None:
        return inv

    def correction_dim(rotations: float) -> float:
        orig = yarn.original_max_position_embeddings
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return 1.0 / (yarn.factor * pos_freqs) * ramp + inv * (1 - ramp)


class RotaryTables:
    """cos/sin for absolute positions, per frequency set ("main" or "compress")."""

    def __init__(self, config: DeepseekV4Config, device: torch.device):
        r = config.qk_rope_head_dim
        self.inv_freq = {
            "main": inverse_frequencies(r, config.rope_theta, None).to(device),
            "compress": inverse_frequencies(r, config.compress_rope_theta, config.rope_scaling).to(device),
        }

    def cos_sin(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cos_sin(positions.to(torch.float32).unsqueeze(-1), kind)

    def cos_sin_all(self, positions: torch.Tensor | Sequence[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """`cos_sin(positions, kind)` of every frequency set (the positions cast once). `positions` may be a
        host list (a decode step's context lengths): its fp32 column is then made without a cast op (the
        same values: int -> double is exact, then one rounding to fp32 as the cast does)."""
        if isinstance(positions, torch.Tensor):
            column = positions.to(torch.float32).unsqueeze(-1)
        else:
            device = next(iter(self.inv_freq.values())).device
            column = torch.frombuffer(array("f", positions), dtype=torch.float32).view(-1, 1).to(device)
        return {kind: self._cos_sin(column, kind) for kind in self.inv_freq}

    def _cos_sin(self, column: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = column * self.inv_freq[kind]
        return freqs.cos(), freqs.sin()
