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

Under SWA bounded replay (replay.py) the encoder layers and the decoder's prepass (the first
decoder layer's compressor, whose inputs are gathered) run split like any layer; then the step's
per-row state is gathered once, and the decoder's kept rows are split anew over the group (when
a kept chunk is at least `cp_min_tokens` long; else the decoder runs whole on every rank).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from deepinfer.models.batch import ForwardBatch
from deepinfer.parallel.context_parallel import ContextParallel, RowSplit


def step_split(cp: ContextParallel | None, batch: ForwardBatch, min_tokens: int,
               device: torch.device | str) -> RowSplit | None:
    """The step's zig-zag split over `cp`, or None when the step runs whole on every rank: no CP
    group, or no chunk of at least `min_tokens` new tokens (decode, verification, short chunks).
    Every rank sees the same batch, so all decide alike."""
    if cp is None or max((int(n) for n in batch.query_lens), default=0) < min_tokens:
        return None
    return cp.split([int(n) for n in batch.query_lens], torch.device(device))


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


def gather_outputs(split: RowSplit, streams: torch.Tensor, pre: torch.Tensor,
                   capture: dict[int, torch.Tensor | None] | None, layers: Iterable[int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor | None] | None]:
    """The streams, the mHC `pre` the next site collapses with and the captured DSpark features of
    the whole step (one all-gather) from this rank's rows of them. The captures of `layers` (None:
    all) are replaced in `capture` itself (the step's dict, which the model reads afterwards)."""
    parts = {"streams": streams, "pre": pre}
    mine = [] if capture is None else [layer for layer in capture if layers is None or layer in layers]
    parts.update({f"capture.{layer}": capture[layer] for layer in mine})
    full = gather_parts(split, parts)
    for layer in mine:
        capture[layer] = full[f"capture.{layer}"]
    return full["streams"], full["pre"], capture
