"""DeepSeek-V4's quantised weight formats (docs/checkpoints.md): FP8 blocks and packed FP4 experts.

The formats are not V4-specific; they live in `deepinfer.models.common.quant`, re-exported here
for the code that imports them from this path.
"""
from __future__ import annotations

from deepinfer.models.common.quant import (  # noqa: F401  (re-exported)
    _FP4_TABLE, FP4_DTYPES, FP4_E2M1_VALUES, FP4_GROUP, FP8_BLOCK, FP8_DTYPES, _check_scale, _pow2_scale, dequantize,
    dequantize_fp4, dequantize_fp8_block, dequantized_shape, expected_scale_shape, quant_format, quantize_fp4,
    quantize_fp8_block, scale_to_float, unpack_fp4,
)
