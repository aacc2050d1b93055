"""The mHC family of the cpu back end's C kernels (`NativeMhcKernels`, part of `NativeCpuKernels`):
DeepSeek-V4's hyper-connection sites (hc_pre alone or with the sub-layer's rms_norm, hc_post, the two
between sites in one call, hc_head), with the sites' fn transposed for the 4-row tiles, reused output
buffers for decode-sized steps (batch-invariant mode's: fixed_order.py)."""
from __future__ import annotations

import functools

import torch

from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.native_base import NativeKernelsBase


class NativeMhcKernels(NativeKernelsBase):
    def _hc_fn_t(self, streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor | None:
        """fn's transposed copy for bf16 calls with a 4-row tile (None below 4 rows: one row reads fn itself).
        The tiles sum in another order than the dot products on fn: fp32 streams (the reference dtype) keep
        the dot products."""
        if streams.dtype != torch.bfloat16 or streams.shape[0] < 4 or fn.shape[0] != native.TRANSPOSED_MIXES:
            return None
        table = self.hc_weights
        return None if table is None else table.lookup(fn)

    def hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lib = self.native_library
        out = None if lib is None else native.run(lib, native.hc_pre_arguments(
            lib, streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, fn_t=self._hc_fn_t(streams, fn)))
        return super().hc_pre(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps) if out is None else out

    def hc_pre_norm(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    sinkhorn_iters: int, eps: float, norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lib, out = self.native_library, None
        if lib is not None:  # the two C kernels in one call
            out = native.run(lib, native.hc_pre_arguments(lib, streams, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                                          norm_weight, rms_eps, self._hc_fn_t(streams, fn)))
        if out is not None:
            return out
        return super().hc_pre_norm(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight, rms_eps)

    def hc_post(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        lib = self.native_library
        out = None if lib is None else native.hc_post(lib, y, streams, post, comb)
        return super().hc_post(y, streams, post, comb) if out is None else out

    def hc_post_pre_norm(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                         fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, eps: float,
                         norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        lib, out = self.native_library, None
        if lib is not None:  # hc_post and hc_pre_norm's C kernels in one call
            out = native.run(lib, native.hc_post_pre_norm_arguments(
                lib, y, streams, post, comb, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight, rms_eps,
                self._hc_fn_t(streams, fn), self._hc_outputs(streams)))
        if out is not None:
            return out
        return super().hc_post_pre_norm(y, streams, post, comb, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                        norm_weight, rms_eps)

    @functools.cached_property
    def _hc_sets(self) -> native.OutputSets:
        return native.OutputSets(native.hc_outputs, "streams")

    def _hc_outputs(self, streams: torch.Tensor) -> native.HcOutputs | None:
        """hc_post_pre_norm's output buffers for decode-sized calls (native.OutputSets), None (new tensors) above
        tuning.hc_reuse_max_rows rows: no prefill-sized buffers kept."""
        if streams.dim() != 3 or streams.shape[0] > self.tuning.hc_reuse_max_rows:
            return None
        return self._hc_sets.other_than(streams, streams)

    def hc_head(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                eps: float, norm_eps: float) -> torch.Tensor:
        lib = self.native_library
        out = None if lib is None else native.hc_head(lib, streams, fn, base, scale, eps, norm_eps)
        return super().hc_head(streams, fn, base, scale, eps, norm_eps) if out is None else out
