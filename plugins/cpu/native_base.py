"""What every op family of the cpu back end's C kernels shares (`NativeKernelsBase`): the library,
batch-invariant mode (its tables, fixed_order.py, installed over the kernels and the op tables), the
switches the accelerator sets once, the tables of packed weight copies (made at load: `prepare_weights`),
the tuning table of the tier, and the prepared programs. The families are native_kernels.py (products,
norms, attention, sampling), native_moe.py and native_mhc.py; `NativeCpuKernels` is all of them."""
from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from deepinfer.program import Program
from deepinfer_plugins.cpu import native, packed_weights
from deepinfer_plugins.cpu.fixed_order import FixedOrderKernels, install
from deepinfer_plugins.cpu.kernels import CpuKernels
from deepinfer_plugins.cpu.packed_weights import PackedWeights
from deepinfer_plugins.cpu.program import PreparedProgram
from deepinfer_plugins.cpu.tuning import NEVER, TUNING, Tuning


class NativeKernelsBase(CpuKernels):
    invariant: bool = False  # batch-invariant mode (set_batch_invariant)
    fixed_order: FixedOrderKernels | None = None  # its kernels, installed over these (fixed_order.py)

    # the switches, read once by the accelerator when it is made (nothing reads the environment in a step)
    prepared_programs: bool = True  # DEEPINFER_CPU_DECODE_BLOCKS
    pack_weights: bool = True  # DEEPINFER_CPU_PACKED_WEIGHTS
    use_huge_pages: bool = True  # DEEPINFER_CPU_HUGE_PAGES

    def set_batch_invariant(self, enabled: bool) -> None:
        if enabled and self.native_library is None:
            raise RuntimeError("the cpu back end's batch-invariant mode runs on its C kernels, which are not "
                               "available (DEEPINFER_CPU_NATIVE=0, or no C compiler: see the warning logged at "
                               "start-up); enable them or disable the batch_invariant feature")
        self.invariant = enabled
        self.fixed_order = install(self, FixedOrderKernels, enabled)
        for table in list(self._op_tables):
            self.with_fixed_order(table)

    @functools.cached_property
    def _op_tables(self) -> weakref.WeakSet:
        """The family op tables made by `model_ops` that have a batch-invariant table of their own."""
        return weakref.WeakSet()

    def with_fixed_order(self, table: Any) -> Any:
        """`table` (a family op table this object made, with `fixed_order_ops`: its batch-invariant table's
        class) switched with this object's mode from now on, its fixed-order ops installed while it is on."""
        self._op_tables.add(table)
        install(table, table.fixed_order_ops, self.invariant)
        return table

    @functools.cached_property
    def native_library(self) -> ctypes.CDLL | None:
        """Decided once per instance (the first kernel call): the loaded library or None."""
        return native.active_library()

    @functools.cached_property
    def packed_weights(self) -> PackedWeights | None:
        return PackedWeights() if self.pack_weights and packed_weights.onednn_bf16() else None

    @functools.cached_property
    def tile_weights(self) -> PackedWeights | None:
        """The weights packed for the C register tiles (packed_gemm.c) of decode batches."""
        lib = self.native_library
        if lib is None or not self.pack_weights:
            return None
        return PackedWeights(pack=functools.partial(native.pack_bf16, lib, huge=self.use_huge_pages), stacks=True)

    def prepare_weights(self, uses: Iterable[tuple[str, Any]]) -> None:
        """The packed copies, made once here (the model's weights by the op that reads them, at load), each
        only where a kernel of this build reads it: the linears' on the C register tiles and in oneDNN's
        layout (not where the tiles take every multi-row product: AVX2), the attention's grouped output
        projection's and the routed experts' on the tiles (not where AMX tiles take those products), V4's
        mHC fn transposed for hc_pre's tiles. Products of weights not given here read the plain weight."""
        tables = self._tables_by_use
        for op, weight in uses:
            for table in tables.get(op, ()):
                if table is not None:
                    table.add(weight)

    @functools.cached_property
    def _tables_by_use(self) -> dict[str, tuple[PackedWeights | None, ...]]:
        """The tables that keep a copy of a weight of each use: those whose copy a kernel choice of this
        build's tier reads (tuning.py), decided once."""
        high = self.tuning.packed_gemm_rows[1]
        tiles = self.tile_weights if high >= 1 else None
        amx = self.native_amx  # AMX's expert kernel and grouped products take the rows the tiles would
        return {"linear": (self.packed_weights if high < NEVER else None, tiles),
                "grouped_linear": (None if amx and self.tuning.grouped_amx_max_tokens >= high else tiles,),
                "moe_experts": (None if amx else tiles,),
                "hc_pre": (self.hc_weights,)}

    @functools.cached_property
    def hc_weights(self) -> PackedWeights | None:
        """V4's mHC sites' fn `[24, n*D]` transposed for hc_pre's 4-row tiles (native.transpose_fn): decode
        batches 2.5x faster than the dot products on fn itself."""
        if self.native_library is None or not self.pack_weights:
            return None
        return PackedWeights(pack=_transposed_mixes, dtype=torch.float32)

    @functools.cached_property
    def tuning(self) -> Tuning:
        """The path choices' thresholds of the tier the library was built for (tuning.py; no library: portable;
        usable AMX tiles: amx)."""
        lib = self.native_library
        return TUNING["portable" if lib is None else "amx" if self.native_amx else native.gemv_tier(lib)]

    @functools.cached_property
    def native_amx(self) -> bool:
        """The C expert kernel runs on AMX tiles (built for an AMX CPU, and Linux granted the state): it
        decides how many rows the expert kernel takes; the AMX wrappers check it themselves."""
        return self.native_library is not None and native.amx_usable(self.native_library)

    def prepare_program(self, program: Program) -> PreparedProgram | None:
        """A model's step program with its C calls bound once (program.py); None (run eagerly) without the
        library or when switched off (and in batch-invariant mode: fixed_order.py declines it)."""
        if self.native_library is None or not self.prepared_programs:
            return None
        return PreparedProgram(self, program)


def _transposed_mixes(fn: torch.Tensor) -> torch.Tensor | None:
    """hc_pre's tiles' copy of an mHC site's fn: for the mix count the C tiles take, else none."""
    return native.transpose_fn(fn) if fn.shape[0] == native.TRANSPOSED_MIXES else None
