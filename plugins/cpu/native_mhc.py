"""The mHC family of the cpu back end's C kernels (`NativeMhcKernels`, part of `NativeCpuKernels`):
DeepSeek-V4's hyper-connection sites (hc_pre alone or with the sub-layer's rms_norm, hc_post, the two
between sites in one call, hc_head), with the sites' fn transposed for the 4-row tiles, reused output
buffers for decode-sized steps, and batch-invariant mode's fixed-order coefficients."""
from __future__ import annotations

import functools
import threading

import torch

from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.fixed_order import lanewise, sum_fixed
from deepinfer_plugins.cpu.native_base import NativeKernelsBase
from deepinfer_plugins.cpu.packed_weights import PackedWeights


class NativeMhcKernels(NativeKernelsBase):
    @functools.cached_property
    def hc_weights(self) -> PackedWeights | None:
        """The mHC sites' fn transposed for hc_pre's 4-row tiles (native.transpose_fn): decode batches
        2.5x faster than the dot products on fn itself."""
        if self.native_library is None or not self.pack_weights:
            return None
        return PackedWeights(pack=native.transpose_fn, dtype=torch.float32)

    def _hc_fn_t(self, streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor | None:
        """fn's transposed copy for bf16 calls with a 4-row tile (None below 4 rows: one row reads fn itself).
        The tiles sum in another order than the dot products on fn, and the copy exists only from the
        site's second call: fp32 streams (the reference dtype) keep the dot products, so running the same
        fp32 tokens twice gives the same bits."""
        if streams.dtype != torch.bfloat16 or streams.shape[0] < 4 or fn.shape[0] != native.TRANSPOSED_MIXES:
            return None
        table = self.hc_weights
        return None if table is None else table.lookup(fn)

    def hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.invariant:
            streams_f = streams.float()
            pre, post, comb = self._hc_coefficients_invariant(streams_f, fn, base, scale, sinkhorn_iters, eps, norm_eps)
            collapsed = sum_fixed(streams_f * pre.unsqueeze(-1), -2).squeeze(-2).to(streams.dtype)
            return collapsed, post, comb
        lib = self.native_library
        out = None if lib is None else native.run(lib, native.hc_pre_arguments(
            lib, streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, fn_t=self._hc_fn_t(streams, fn)))
        return super().hc_pre(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps) if out is None else out

    def hc_pre_norm(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    sinkhorn_iters: int, eps: float, norm_eps: float, norm_weight: torch.Tensor, rms_eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lib, out = self.native_library, None
        if lib is not None and not self.invariant:  # the two C kernels in one call
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
        if lib is not None and not self.invariant:  # hc_post and hc_pre_norm's C kernels in one call
            out = native.run(lib, native.hc_post_pre_norm_arguments(
                lib, y, streams, post, comb, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight, rms_eps,
                self._hc_fn_t(streams, fn), self._hc_outputs(streams)))
        if out is not None:
            return out
        return super().hc_post_pre_norm(y, streams, post, comb, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                        norm_weight, rms_eps)

    @functools.cached_property
    def _hc_buffers(self) -> threading.local:
        return threading.local()

    def _hc_outputs(self, streams: torch.Tensor) -> native.HcOutputs | None:
        """hc_post_pre_norm's output buffers for decode-sized calls: two sets per streams shape and dtype (the
        last used in this thread), taken in turn: never the set `streams` is, so a chain of calls each
        reading the one before's results (the block loop) allocates nothing, where 4 new tensors cost ~6 us
        a call. None (new tensors) above tuning.hc_reuse_max_rows rows: no prefill-sized buffers kept."""
        if streams.dim() != 3 or streams.shape[0] > self.tuning.hc_reuse_max_rows:
            return None
        local = self._hc_buffers
        key = (streams.shape, streams.dtype)
        if getattr(local, "key", None) != key:
            T, n, D = streams.shape
            local.key, local.sets = key, (native.hc_outputs(T, n, D, streams.dtype),
                                          native.hc_outputs(T, n, D, streams.dtype))
        first, second = local.sets
        return second if streams is first.streams else first

    def _hc_mix(self, streams_f: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
        if not self.invariant:
            return super()._hc_mix(streams_f, fn, norm_eps)
        flat = streams_f.flatten(-2)
        # the mean square as a fixed-order dot product with ones, like every other reduction here
        ones = torch.ones((1, flat.shape[-1]), dtype=torch.float32)
        inv = torch.rsqrt(self._rows(flat.square(), ones, torch.float32) / flat.shape[-1] + norm_eps)
        return self._rows(flat, fn.float(), torch.float32).mul_(inv)

    def _hc_coefficients_invariant(self, streams_f: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                                   scale: torch.Tensor, sinkhorn_iters: int, eps: float, norm_eps: float
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC (pre, post, comb) with fixed-order sums and vector-path transcendentals (the math of
        `DeepseekV4Ops._hc_coefficients`); the C hc_pre reduces a row differently once the streams are
        wider than its 512-element chunks, depending on its row block."""
        n = streams_f.shape[1]
        pre_b, post_b, comb_b = base.float().split([n, n, n * n])
        scale = scale.float()
        mixes = self._hc_mix(streams_f, fn, norm_eps)
        pre = lanewise(torch.sigmoid, mixes[:, :n] * scale[0] + pre_b) + eps
        post = 2 * lanewise(torch.sigmoid, mixes[:, n:2 * n] * scale[1] + post_b)
        logits = mixes[:, 2 * n:].unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n)
        comb = lanewise(torch.exp, logits - logits.amax(dim=-1, keepdim=True))
        comb = comb / sum_fixed(comb, -1) + eps
        comb = comb / (sum_fixed(comb, -2) + eps)
        for _ in range(sinkhorn_iters - 1):
            comb = comb / (sum_fixed(comb, -1) + eps)
            comb = comb / (sum_fixed(comb, -2) + eps)
        return pre, post, comb

    def hc_head(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                eps: float, norm_eps: float) -> torch.Tensor:
        if not self.invariant:
            lib = self.native_library
            out = None if lib is None else native.hc_head(lib, streams, fn, base, scale, eps, norm_eps)
            return super().hc_head(streams, fn, base, scale, eps, norm_eps) if out is None else out
        streams_f = streams.float()
        pre = lanewise(torch.sigmoid, self._hc_mix(streams_f, fn, norm_eps) * scale.float() + base.float()) + eps
        return sum_fixed(pre.unsqueeze(-1) * streams_f, -2).squeeze(-2).to(streams.dtype)
