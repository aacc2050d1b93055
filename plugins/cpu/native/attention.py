"""sink_attention_decode, decode attention with a per-head sink, sink_attention_rows, the same over
keys read by index from cache tensors (plain, or packed in DeepSeek-V4.1's cache formats), and
sink_attention_invariant, the same with each sequence's keys in a canonical order (attention.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer.models.deepseek_v41.kv_quant import KVFormat
from deepinfer_plugins.cpu.native.binding import Kernel, dtype_code, f32, threads
from deepinfer_plugins.cpu.native.kv_cache import KV_CODES, codes_fit

_SINK_ATTENTION_DECODE = Kernel("sink_attention_decode")
_SINK_ATTENTION_INVARIANT = Kernel("sink_attention_invariant")
_SINK_ATTENTION_CODED_ROWS = Kernel("sink_attention_coded_rows")


def _call(kernel: Kernel, lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
          sinks: torch.Tensor, scale: float) -> torch.Tensor | None:
    dtype = dtype_code(q)
    if (dtype is None or q.dim() != 4 or kv.dim() != 3 or kv.dtype != q.dtype or not kv.is_cpu
            or kv.shape[0] != q.shape[0] or kv.shape[2] != q.shape[3] or mask.shape != (q.shape[0], q.shape[1], kv.shape[1])
            or mask.dtype != torch.bool or sinks.shape != (q.shape[2],)):
        return None
    B, S, H, d = q.shape
    qc, kvc, m, s = q.contiguous(), kv.contiguous(), mask.contiguous(), f32(sinks)
    out = torch.empty((B, S, H, d), dtype=q.dtype)
    kernel(lib, q=qc.data_ptr(), kv=kvc.data_ptr(), mask=m.data_ptr(), sinks=s.data_ptr(), scale=scale,
           out=out.data_ptr(), B=B, S=S, H=H, L=kv.shape[1], d=d, dtype=dtype, num_threads=threads())
    return out


def sink_attention_decode(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                          sinks: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Sink attention of `q [B, S, H, d]` over `kv [B, L, d]` (see the interface), or None for input
    the C code does not handle."""
    return _call(_SINK_ATTENTION_DECODE, lib, q, kv, mask, sinks, scale)


def sink_attention_invariant(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                             sinks: torch.Tensor, scale: float) -> torch.Tensor | None:
    """`sink_attention_decode` with each sequence's keys visited in a canonical order (sorted by their
    bytes), so a query's result depends only on its query and its set of visible keys: not on their
    order in `kv`, on padding, or on the other sequences and queries of the call."""
    return _call(_SINK_ATTENTION_INVARIANT, lib, q, kv, mask, sinks, scale)


# attention.c's key forms: KEYS_PLAIN, or kv_codes.h's formats of keys (by kv_quant's name)
_KEYS_PLAIN = -1
_KEY_CODES = {name: KV_CODES[name] for name in ("fp8", "nvfp4")}


def _rows_part(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor,
               fmt: KVFormat | None) -> bool:
    """Whether one (cache, rows, mask) part is what sink_attention_rows reads: a contiguous cache
    `[n, d]` of q's dtype (`fmt` given: uint8 `[n, fmt.bytes_per_vector(d)]` packed keys), int64 rows
    `[B, L]`, bool mask `[B, S, L]`."""
    B, S, _, d = q.shape
    if fmt is None:
        dtype, width = q.dtype, d
    elif codes_fit(fmt, d) and fmt.name in _KEY_CODES:
        dtype, width = torch.uint8, fmt.bytes_per_vector(d)
    else:
        return False
    return (cache.dtype == dtype and cache.dim() == 2 and cache.shape[1] == width and cache.is_cpu
            and cache.is_contiguous() and rows.dtype == torch.int64 and rows.dim() == 2 and rows.shape[0] == B
            and mask.dtype == torch.bool and mask.shape == (B, S, rows.shape[1]))


def sink_attention_rows(lib: ctypes.CDLL, q: torch.Tensor, caches: tuple[torch.Tensor, ...],
                        rows: tuple[torch.Tensor, ...], masks: tuple[torch.Tensor, ...], sinks: torch.Tensor,
                        scale: float, formats: tuple[KVFormat | None, ...] | None = None) -> torch.Tensor | None:
    """`sink_attention_decode` of `q [B, S, H, d]` over the keys `caches[i][rows[i]]` of one or two
    parts, masks `masks[i]` (the interface's `sink_attention_rows`), read by index in C; with `formats`,
    a part whose format is given holds DeepSeek-V4.1's packed rows (kv_quant's FP8 window or NVFP4
    entries), each decoded to q's dtype as `kv_quant.decode` would. None for input the C code does not
    handle. IndexError for a row outside its cache."""
    dtype = dtype_code(q)
    formats = (None,) * len(caches) if formats is None else formats
    if (dtype is None or q.dim() != 4 or not 1 <= len(caches) <= 2 or len(rows) != len(caches)
            or len(masks) != len(caches) or len(formats) != len(caches) or sinks.shape != (q.shape[2],)
            or not all(_rows_part(q, c, r, m, f) for c, r, m, f in zip(caches, rows, masks, formats))):
        return None
    B, S, H, d = q.shape
    parts = [(c, r.contiguous(), m.contiguous()) for c, r, m in zip(caches, rows, masks)]
    c0, r0, m0 = parts[0]
    c1, r1, m1 = parts[1] if len(parts) == 2 else (c0, r0[:, :0], m0[..., :0])
    code0, code1 = (_KEYS_PLAIN if f is None else _KEY_CODES[f.name] for f in (formats[0], formats[-1]))
    qc, s = q.contiguous(), f32(sinks)
    out = torch.empty((B, S, H, d), dtype=q.dtype)
    status = _SINK_ATTENTION_CODED_ROWS(lib, q=qc.data_ptr(), cache0=c0.data_ptr(), rows0=r0.data_ptr(),
                                        mask0=m0.data_ptr(), n0=c0.shape[0], L0=r0.shape[1], code0=code0,
                                        cache1=c1.data_ptr(), rows1=r1.data_ptr(), mask1=m1.data_ptr(),
                                        n1=c1.shape[0], L1=r1.shape[1], code1=code1, sinks=s.data_ptr(), scale=scale,
                                        out=out.data_ptr(), B=B, S=S, H=H, d=d, dtype=dtype, num_threads=threads())
    if status != 0:
        raise IndexError(f"sink_attention_rows: a row index is outside its cache (sizes "
                         f"{[c.shape[0] for c in caches]}); the step plan's key rows must address the bound cache")
    return out
