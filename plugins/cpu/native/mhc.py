"""hc_pre (hc_pre_norm: with the sub-layer's RMSNorm), hc_post, hc_post_pre_norm (one site's hc_post and
the next site's hc_pre_norm in one call) and hc_head, the mHC (hyper-connection) kernels (mhc.c)."""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from deepinfer_plugins.cpu.native.binding import Bound, Kernel, dtype_code, f32, new_like, threads

_HC_PRE = Kernel("hc_pre")
_HC_PRE_NORM = Kernel("hc_pre_norm")
_HC_HEAD = Kernel("hc_head")
_HC_POST = Kernel("hc_post")
_HC_POST_PRE_NORM = Kernel("hc_post_pre_norm")

# The mixes (n * (n + 2), n = 4 streams) whose tiles read fn transposed (mhc.c: HC_T_MIXES).
TRANSPOSED_MIXES = 24


def _fn_t_address(fn_t: torch.Tensor | None, n: int, D: int) -> int | None | bool:
    """The address of `fn_t` (transpose_fn's copy of fn, `[n * D, TRANSPOSED_MIXES]` fp32) for the C call,
    None where there is none (the call reads fn), False where it is not that layout."""
    if fn_t is None:
        return None
    if fn_t.shape != (n * D, TRANSPOSED_MIXES) or fn_t.dtype is not torch.float32 or not fn_t.is_contiguous():
        return False
    return fn_t.data_ptr()

def transpose_fn(fn: torch.Tensor) -> torch.Tensor:
    """hc_pre's `fn_t`: fn `[24, n*D]` transposed to `[n*D, 24]` fp32, what the C tiles of 4 token rows
    read (one copy per weight, kept by the caller)."""
    return fn.detach().float().t().contiguous()


def hc_pre_arguments(lib: ctypes.CDLL, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                     scale: torch.Tensor, sinkhorn_iters: int, eps: float, norm_eps: float,
                     norm_weight: torch.Tensor | None = None, rms_eps: float = 0.0, fn_t: torch.Tensor | None = None
                     ) -> Bound | None:
    """hc_pre's (collapsed, post, comb); with `norm_weight` `[D]` (hc_pre_norm) the collapse RMS-normalised
    (eps `rms_eps`) in its place. `fn_t`: `transpose_fn(fn)` where the caller keeps one (multi-row calls then
    run on it, 2.5x faster), else None. The checked call (outputs: collapsed or normed, post, comb), not made
    (binding.run makes it); None: not handled."""
    dtype = dtype_code(streams)
    if dtype is None or streams.dim() != 3:
        return None
    T, n, D = streams.shape
    mixes = n * (n + 2)
    if streams.numel() == 0 or fn.shape != (mixes, n * D) or base.numel() != mixes or scale.numel() < 3:
        return None
    if not (fn.is_cpu and base.is_cpu and scale.is_cpu):
        return None
    if norm_weight is not None:
        w_dtype = dtype_code(norm_weight)
        if w_dtype is None or norm_weight.shape != (D,):
            return None
    t_ptr = _fn_t_address(fn_t, n, D)
    if t_ptr is False:
        return None
    s = streams if streams.is_contiguous() else streams.contiguous()
    f, b, sc = f32(fn), f32(base), f32(scale)
    out = torch.empty((T, D), dtype=streams.dtype)
    post = torch.empty((T, n), dtype=torch.float32)
    comb = torch.empty((T, n, n), dtype=torch.float32)
    common = dict(streams=s.data_ptr(), fn=f.data_ptr(), fn_t=t_ptr, base=b.data_ptr(), scale=sc.data_ptr(),
                  post=post.data_ptr(), comb=comb.data_ptr(), T=T, n=n, D=D, sinkhorn_iters=sinkhorn_iters, eps=eps,
                  norm_eps=norm_eps, dtype=dtype, num_threads=threads())
    held = (s, f, b, sc)
    if norm_weight is not None:
        w = norm_weight if norm_weight.is_contiguous() else norm_weight.contiguous()
        return Bound(_HC_PRE_NORM, dict(common, normed=out.data_ptr(), norm_weight=w.data_ptr(), w_dtype=w_dtype,
                                        rms_eps=rms_eps), (out, post, comb), (*held, w))
    return Bound(_HC_PRE, dict(common, collapsed=out.data_ptr()), (out, post, comb), held)


def hc_post(lib: ctypes.CDLL, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor | None:
    dtype, y_dtype = dtype_code(streams), dtype_code(y)
    if dtype is None or y_dtype is None or streams.dim() != 3 or streams.numel() == 0:
        return None
    T, n, D = streams.shape
    if y.shape != (T, D) or post.shape != (T, n) or comb.shape != (T, n, n) or not (post.is_cpu and comb.is_cpu):
        return None
    s, yc, p, c = streams.contiguous(), y.contiguous(), f32(post), f32(comb)
    out = new_like(s)
    _HC_POST(lib, y=yc.data_ptr(), y_dtype=y_dtype, streams=s.data_ptr(), post=p.data_ptr(), comb=c.data_ptr(),
             out=out.data_ptr(), T=T, n=n, D=D, dtype=dtype, num_threads=threads())
    return out


def hc_head(lib: ctypes.CDLL, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            eps: float, norm_eps: float) -> torch.Tensor | None:
    """The output head's collapse of streams `[T, n, D]` (fn `[n, nD]`, base `[n]`, scale `[1]`) -> `[T, D]`."""
    dtype = dtype_code(streams)
    if dtype is None or streams.dim() != 3 or streams.numel() == 0:
        return None
    T, n, D = streams.shape
    if fn.shape != (n, n * D) or base.numel() != n or scale.numel() != 1 or not (fn.is_cpu and base.is_cpu
                                                                                  and scale.is_cpu):
        return None
    s, f, b, sc = streams.contiguous(), f32(fn), f32(base), f32(scale)
    out = torch.empty((T, D), dtype=streams.dtype)
    _HC_HEAD(lib, streams=s.data_ptr(), fn=f.data_ptr(), base=b.data_ptr(), scale=sc.data_ptr(), out=out.data_ptr(),
             T=T, n=n, D=D, eps=eps, norm_eps=norm_eps, dtype=dtype, num_threads=threads())
    return out


class HcOutputs(NamedTuple):
    """hc_post_pre_norm's results: the streams after the first site, the second site's normalised input
    and its post and comb."""

    streams: torch.Tensor  # [T, n, D], the streams' dtype
    normed: torch.Tensor  # [T, D], the streams' dtype
    post: torch.Tensor  # [T, n] fp32
    comb: torch.Tensor  # [T, n, n] fp32


def hc_outputs(T: int, n: int, D: int, dtype: torch.dtype) -> HcOutputs:
    """Empty tensors for hc_post_pre_norm's `out`."""
    return HcOutputs(torch.empty((T, n, D), dtype=dtype), torch.empty((T, D), dtype=dtype),
                     torch.empty((T, n), dtype=torch.float32), torch.empty((T, n, n), dtype=torch.float32))


class OutputSets:
    """Two sets of a call's output tensors (`make(T, n, D, dtype)`) for one streams shape and dtype at a time
    per thread, taken in turn: never the set whose `field` is the call's input, so a chain of calls each
    reading the one before's results (the block loop) allocates nothing, where 4 new tensors cost ~6 us a
    call."""

    def __init__(self, make: Callable[..., Any], field: str):
        self.make, self.field, self.local = make, field, threading.local()

    def other_than(self, streams: torch.Tensor, given: torch.Tensor) -> Any:
        local, key = self.local, (*streams.shape, streams.dtype)
        if getattr(local, "key", None) != key:
            local.key, local.sets = key, (self.make(*key), self.make(*key))
        first, second = local.sets
        return second if given is getattr(first, self.field) else first


def hc_post_pre_norm_arguments(lib: ctypes.CDLL, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                               comb: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                               sinkhorn_iters: int, eps: float, norm_eps: float, norm_weight: torch.Tensor,
                               rms_eps: float, fn_t: torch.Tensor | None = None, out: HcOutputs | None = None
                               ) -> Bound | None:
    """`hc_post(y, streams, post, comb)` then `hc_pre(..., norm_weight, rms_eps)` of the next site (fn, base,
    scale, fn_t as there) on its result, in one call with their bits. `out`: `hc_outputs(T, n, D, streams.dtype)`
    to write into (none of them may be an input), else new tensors. The checked call (outputs: the
    HcOutputs), not made (binding.run makes it); None: not handled (fall back)."""
    dtype, y_dtype, w_dtype = dtype_code(streams), dtype_code(y), dtype_code(norm_weight)
    if dtype is None or y_dtype is None or w_dtype is None or streams.dim() != 3 or streams.numel() == 0:
        return None
    T, n, D = streams.shape
    mixes = n * (n + 2)
    if (y.shape != (T, D) or post.shape != (T, n) or comb.shape != (T, n, n) or fn.shape != (mixes, n * D)
            or base.numel() != mixes or scale.numel() < 3 or norm_weight.shape != (D,)):
        return None
    if not (post.is_cpu and comb.is_cpu and fn.is_cpu and base.is_cpu and scale.is_cpu):
        return None
    t_ptr = _fn_t_address(fn_t, n, D)
    if t_ptr is False:
        return None
    if out is None:
        out = hc_outputs(T, n, D, streams.dtype)
    elif out.streams.shape != streams.shape or out.streams.dtype is not streams.dtype:
        return None
    s = streams if streams.is_contiguous() else streams.contiguous()
    yc = y if y.is_contiguous() else y.contiguous()
    w = norm_weight if norm_weight.is_contiguous() else norm_weight.contiguous()
    p, c, f, b, sc = f32(post), f32(comb), f32(fn), f32(base), f32(scale)
    values = dict(y=yc.data_ptr(), y_dtype=y_dtype, streams=s.data_ptr(), post_in=p.data_ptr(), comb_in=c.data_ptr(),
                  streams_out=out.streams.data_ptr(), fn=f.data_ptr(), fn_t=t_ptr, base=b.data_ptr(),
                  scale=sc.data_ptr(), normed=out.normed.data_ptr(), post=out.post.data_ptr(), comb=out.comb.data_ptr(),
                  T=T, n=n, D=D, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps, norm_weight=w.data_ptr(),
                  w_dtype=w_dtype, rms_eps=rms_eps, dtype=dtype, num_threads=threads())
    return Bound(_HC_POST_PRE_NORM, values, out, (s, yc, w, p, c, f, b, sc))


# ----- DeepSeek-V4.1's single-pass sites -----

_HC_MIX_COLLAPSE_NORM = Kernel("hc_mix_collapse_norm")
_HC_POST_MIX_COLLAPSE_NORM = Kernel("hc_post_mix_collapse_norm")


class SiteOutputs(NamedTuple):
    """A V4.1 site's results: the streams arriving at it (the previous site's hc_post applied), its
    sub-layer's normalised input and its pre, post and comb."""

    streams: torch.Tensor  # [T, n, D], the streams' dtype
    normed: torch.Tensor  # [T, D], the streams' dtype
    pre: torch.Tensor  # [T, n] fp32
    post: torch.Tensor  # [T, n] fp32
    comb: torch.Tensor  # [T, n, n] fp32


def site_outputs(T: int, n: int, D: int, dtype: torch.dtype, streams: bool = True) -> SiteOutputs:
    """Empty tensors for the site calls' `out` (`streams`: with the new streams' tensor, which only
    hc_post_mix_collapse_norm writes)."""
    return SiteOutputs(torch.empty((T, n, D) if streams else (0,), dtype=dtype), torch.empty((T, D), dtype=dtype),
                       torch.empty((T, n), dtype=torch.float32), torch.empty((T, n), dtype=torch.float32),
                       torch.empty((T, n, n), dtype=torch.float32))


def _site_values(streams: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                 scale: torch.Tensor, sinkhorn_iters: int, eps: float, norm_eps: float, norm_weight: torch.Tensor,
                 rms_eps: float, out: SiteOutputs | None, new_streams: bool
                 ) -> tuple[dict, SiteOutputs, tuple] | None:
    """The arguments both site calls share (their outputs in `out` or new tensors), the outputs and the
    tensors made for the call; None where the C code does not take these inputs."""
    dtype, w_dtype = dtype_code(streams), dtype_code(norm_weight)
    if dtype is None or w_dtype is None or streams.dim() != 3 or streams.numel() == 0:
        return None
    T, n, D = streams.shape
    mixes = n * (n + 2)
    if (pre_in.shape != (T, n) or not pre_in.is_cpu or fn.shape != (mixes, n * D) or base.numel() != mixes
            or scale.numel() < 3 or norm_weight.shape != (D,) or not (fn.is_cpu and base.is_cpu and scale.is_cpu)):
        return None
    if out is None:
        out = site_outputs(T, n, D, streams.dtype, new_streams)
    elif out.normed.shape != (T, D) or out.normed.dtype is not streams.dtype or out.pre.shape != (T, n):
        return None
    p, f, b, sc = f32(pre_in), f32(fn), f32(base), f32(scale)
    if p.data_ptr() == out.pre.data_ptr():
        return None  # the C call reads pre_in while it writes pre
    w = norm_weight if norm_weight.is_contiguous() else norm_weight.contiguous()
    values = dict(pre_in=p.data_ptr(), fn=f.data_ptr(), base=b.data_ptr(), scale=sc.data_ptr(),
                  normed=out.normed.data_ptr(), pre=out.pre.data_ptr(), post=out.post.data_ptr(),
                  comb=out.comb.data_ptr(), T=T, n=n, D=D, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps,
                  norm_weight=w.data_ptr(), w_dtype=w_dtype, rms_eps=rms_eps, dtype=dtype, num_threads=threads())
    return values, out, (p, f, b, sc, w)


def hc_mix_collapse_norm(lib: ctypes.CDLL, streams: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor,
                         base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, eps: float, norm_eps: float,
                         norm_weight: torch.Tensor, rms_eps: float, out: SiteOutputs | None = None
                         ) -> SiteOutputs | None:
    """A V4.1 site of streams `[T, n, D]`: its coefficients (hc_pre's, with fn, base, scale as there; each
    row computed alone, so never over hc_pre's transposed fn)
    and its sub-layer's input, the streams collapsed with the previous site's `pre_in` `[T, n]` and
    RMS-normalised (`norm_weight`, `rms_eps`). Returns `out` (or new tensors) written, with `streams` the
    given ones; None: not handled (fall back)."""
    bound = hc_mix_collapse_norm_arguments(streams, pre_in, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                           norm_weight, rms_eps, out)
    if bound is None:
        return None
    bound.call(lib)
    return bound.outputs._replace(streams=streams)


def hc_mix_collapse_norm_arguments(streams: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                                   scale: torch.Tensor, sinkhorn_iters: int, eps: float, norm_eps: float,
                                   norm_weight: torch.Tensor, rms_eps: float, out: SiteOutputs | None = None
                                   ) -> Bound | None:
    """`hc_mix_collapse_norm`'s checked call (outputs: the SiteOutputs, their streams field empty), not made."""
    s = streams if streams.is_contiguous() else streams.contiguous()
    shared = _site_values(s, pre_in, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight, rms_eps, out,
                          False)
    if shared is None:
        return None
    values, outputs, held = shared
    return Bound(_HC_MIX_COLLAPSE_NORM, dict(values, streams=s.data_ptr()), outputs, (*held, s))


def hc_post_mix_collapse_norm_arguments(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                                        comb: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                                        scale: torch.Tensor, sinkhorn_iters: int, eps: float, norm_eps: float,
                                        norm_weight: torch.Tensor, rms_eps: float, out: SiteOutputs | None = None
                                        ) -> Bound | None:
    """`hc_post(y, streams, post, comb)` of the previous site, then `hc_mix_collapse_norm` of this one on its
    result, in one call with their bits; every field of the result written. The checked call (outputs: the
    SiteOutputs), not made (binding.run makes it); None: not handled."""
    y_dtype = dtype_code(y)
    if y_dtype is None or streams.dim() != 3:
        return None
    T, n, D = streams.shape
    if y.shape != (T, D) or post.shape != (T, n) or comb.shape != (T, n, n) or not (post.is_cpu and comb.is_cpu):
        return None
    s = streams if streams.is_contiguous() else streams.contiguous()
    shared = _site_values(s, pre_in, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight, rms_eps, out,
                          True)
    if shared is None:
        return None
    values, outputs, held = shared
    if outputs.streams.shape != s.shape or outputs.streams.dtype is not s.dtype:
        return None
    if outputs.streams.data_ptr() == s.data_ptr():
        return None  # the streams are read token by token while the new ones are written
    yc = y if y.is_contiguous() else y.contiguous()
    p, c = f32(post), f32(comb)
    values = dict(values, y=yc.data_ptr(), y_dtype=y_dtype, streams=s.data_ptr(), post_in=p.data_ptr(),
                  comb_in=c.data_ptr(), streams_out=outputs.streams.data_ptr())
    return Bound(_HC_POST_MIX_COLLAPSE_NORM, values, outputs, (*held, s, yc, p, c))
