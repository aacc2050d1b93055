"""Context parallelism for DeepSeek-V4.1: which steps split, and the one all-gather per layer.

The split itself is DeepSeek-V4's (`deepinfer.parallel.context_parallel`): each sequence's new
tokens are cut zig-zag over the CP group, every rank runs the embedding, Engram look-ups, mHC,
projections and MoE on its own rows only, and each attention layer gathers from the group what
other tokens read, so that every rank writes the whole step's cache exactly as one rank would:

- every layer: the FP8 window key codes (every layer owns a window ring);
- a KV source (Full layer): also its compressor inputs (the `wkv` and, at ratio > 1, `wgate`
  rows; fp32), so that every rank pools, normalises and publishes the same compressed KV and
  index keys, which the Reuse and Reindex layers after it read from the cache.

Selections, candidate pools and indexer scores are per query row: each rank computes them for its
own rows (the attention groups of its chunks), over the cache every rank holds alike. The Engram
n-gram hashes read the tokens before each row and write the history ring, so they are computed for
the whole step on every rank (integer work on the token ids); only the table look-ups and the
mixing run on own rows. After the last layer the residual streams, the mHC `pre` weights the head
collapses with and (when asked) the DSpark target features are gathered, so every rank computes
the same logits and drafts the same tokens.

A step that SWA bounded replay changes (a prefill chunk with rows below its sequence's floor)
is not split: it runs whole on every rank (correct, not faster), because its decoder runs a
different row set with a floored plan after a prepass over every row.
"""
from __future__ import annotations

import math

import torch

from deepinfer.models.batch import ForwardBatch
from deepinfer.parallel.context_parallel import ContextParallel, RowSplit


def step_split(cp: ContextParallel | None, batch: ForwardBatch, min_tokens: int, replayed: bool) -> RowSplit | None:
    """The step's zig-zag split over `cp`, or None when the step runs whole on every rank: no CP
    group, no chunk of at least `min_tokens` new tokens (decode, verification, short chunks), or
    a step bounded replay changes (`replayed`). Every rank sees the same batch, so all decide alike."""
    if cp is None or replayed or max((int(n) for n in batch.query_lens), default=0) < min_tokens:
        return None
    return cp.split([int(n) for n in batch.query_lens], batch.input_ids.device)


def gather_parts(split: RowSplit, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's rows of several per-row tensors (any dtypes and trailing shapes) -> the whole
    step's rows of each, in row order, with one all-gather of their bytes side by side (so FP8
    codes travel as they are and are never re-quantised)."""
    names = list(parts)
    rows = {parts[n].shape[0] for n in names}
    if len(rows) != 1:
        raise ValueError(f"gather_parts needs one row count for every part; got {({n: parts[n].shape[0] for n in names})}")
    T = rows.pop()
    widths = [math.prod(parts[n].shape[1:]) * parts[n].element_size() for n in names]
    local = torch.cat([parts[n].contiguous().view(torch.uint8).reshape(T, w) for n, w in zip(names, widths)], dim=1)
    full = split.gather(local)
    out = {}
    for n, part in zip(names, full.split(widths, dim=1)):
        t = parts[n]
        out[n] = part.contiguous().view(t.dtype).reshape(full.shape[0], *t.shape[1:])
    return out
