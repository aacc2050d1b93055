"""oneDNN-blocked copies of the bf16 weights that multi-row linears read.

`F.linear` on a plain `[N, K]` bf16 weight re-blocks the weight for the AMX/AVX-512 kernel on every
call; a weight packed once with oneDNN's own layout skips that pass. Measured with cold weights
(200 distinct 1024 x 1024 matrices, 2 threads): 1.3-1.7x faster from 2 to 512 rows; at one row the
plain weight and the C GEMV stream as fast, so decode at batch 1 keeps using them.

The copies are made once, when the model gives its weights by the op that reads them
(`prepare_weights`, at load), so every call, the first included, takes the same path and gives the same
bits; the per-call views and temporaries that pass through `linear` have none. An entry goes with its
weight. The cost is the packed weights' size again in RAM (DEEPINFER_CPU_PACKED_WEIGHTS=0: none).
The same table keeps the C kernels' packed copies (native.pack_bf16, the decode batches' register tiles)
when given that packing function, and the mHC sites' fp32 fn transposed for hc_pre's tiles
(native.transpose_fn, a table of fp32 weights).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from deepinfer import envs


def enabled() -> bool:
    """Packed copies of weights are allowed (DEEPINFER_CPU_PACKED_WEIGHTS, default on): oneDNN's here
    and the C register tiles' (native/packed_gemm.c). Off, every product reads the plain weight."""
    return envs.get_bool("DEEPINFER_CPU_PACKED_WEIGHTS", True)


def available() -> bool:
    """oneDNN with bf16 support in this torch build, and not turned off (DEEPINFER_CPU_PACKED_WEIGHTS=0)."""
    return enabled() and onednn_bf16()


def onednn_bf16() -> bool:
    """This torch build has oneDNN's bf16 linear and its weight reorder."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise")
            and hasattr(mkldnn, "_reorder_linear_weight") and bool(mkldnn._is_mkldnn_bf16_supported()))


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ W^T` with `packed` from `PackedWeights.lookup`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 32)


class PackedWeights:
    """Packed copies of the weights given to `add`, found by the weight (a weak key: an entry goes with its
    tensor, and a reused id never finds another tensor's copy); `pack` makes a copy (default: oneDNN's
    layout) of weights in `dtype` (default bf16); `stacks`: it also packs 3-D weights, stacks of matrices
    (the routed experts)."""

    def __init__(self, pack: Callable[[torch.Tensor], torch.Tensor | None] = _onednn_pack,
                 dtype: torch.dtype = torch.bfloat16, stacks: bool = False) -> None:
        self._pack, self._dtype = pack, dtype
        self._dims = (2, 3) if stacks else (2,)
        self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __len__(self) -> int:
        return len(self._copies)

    def add(self, weight: object) -> None:
        """Make `weight`'s packed copy, if it is a contiguous 2-D tensor of the table's dtype (or 3-D, a
        stack of them, with `stacks`) and has none yet; anything else is left alone."""
        if (isinstance(weight, torch.Tensor) and weight.dtype == self._dtype and weight.dim() in self._dims
                and weight.is_contiguous() and not weight.requires_grad and weight.numel() > 0
                and weight not in self._copies):
            packed = self._pack(weight)
            if packed is not None:
                self._copies[weight] = packed

    def lookup(self, weight: torch.Tensor) -> torch.Tensor | None:
        """`weight`'s packed copy, or None (a weight never given to `add`, or one it left alone)."""
        return self._copies.get(weight)
