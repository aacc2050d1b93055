"""oneDNN-blocked copies of the bf16 weights that multi-row linears read.

`F.linear` on a plain `[N, K]` bf16 weight re-blocks the weight for the AMX/AVX-512 kernel on every
call; a weight packed once with oneDNN's own layout skips that pass. Measured with cold weights
(200 distinct 1024 x 1024 matrices, 2 threads): 1.3-1.7x faster from 2 to 512 rows; at one row the
plain weight and the C GEMV stream as fast, so decode at batch 1 keeps using them.

A weight is packed at its second multi-row use by the same tensor object, so the model's weights
(long-lived) are packed once, and the per-call views and temporaries that pass through `linear` are
never packed. Entries go away with their weight. The cost is the packed weights' size again in RAM.
The same table keeps the C kernels' packed copies (native.pack_bf16, the decode batches' register tiles)
when given that packing function, and the mHC sites' fp32 fn transposed for hc_pre's tiles
(native.transpose_fn, a table of fp32 weights).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

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
    """Packed copies keyed by the weight tensor's identity (held weakly and checked on every hit, so a
    reused id never returns another tensor's copy); `pack` makes a copy (default: oneDNN's layout) of
    weights in `dtype` (default bf16); `stacks`: it also packs 3-D weights, stacks of matrices (the routed
    experts)."""

    def __init__(self, pack: Callable[[torch.Tensor], torch.Tensor] = _onednn_pack,
                 dtype: torch.dtype = torch.bfloat16, stacks: bool = False) -> None:
        self._pack, self._dtype = pack, dtype
        self._dims = (2, 3) if stacks else (2,)
        # id(weight) -> (weak reference, packed copy or None after the first use)
        self._entries: dict[int, tuple[weakref.ref, torch.Tensor | None]] = {}
        #: how many times the table changed (a use counted, a copy made, an entry dropped): an answer read
        #: from it holds while this stays the same
        self.changes = 0

    def __len__(self) -> int:
        return sum(packed is not None for _, packed in self._entries.values())

    def lookup(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of a contiguous 2-D `weight` of the table's dtype (or 3-D, a stack of them, with
        `stacks`), or None on its first use (and for any other weight)."""
        if (weight.dtype != self._dtype or weight.dim() not in self._dims or not weight.is_contiguous()
                or weight.requires_grad or weight.numel() == 0):
            return None
        key = id(weight)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is weight:
            if entry[1] is not None:
                return entry[1]
            packed = self._pack(weight)
            self._entries[key] = (entry[0], packed)
            self.changes += 1
            return packed
        self._entries[key] = (weakref.ref(weight, self._forget(key)), None)
        self.changes += 1
        return None

    def peek(self, weight: torch.Tensor) -> torch.Tensor | None:
        """`weight`'s packed copy if it exists, without counting a use (a fused call that runs only where
        the composed calls' `lookup`s would already find the copy)."""
        entry = self._entries.get(id(weight))
        return entry[1] if entry is not None and entry[0]() is weight else None

    def _forget(self, key: int):
        owner = weakref.ref(self)  # the callback must not keep this table alive

        def drop(ref: weakref.ref) -> None:
            table = owner()
            if table is not None and key in table._entries and table._entries[key][0] is ref:
                del table._entries[key]
                table.changes += 1
        return drop
