"""How DeepSeek-V4.1's text model treats the positions of an image span.

- Embeddings (`ImageEmbedder`): a span position's embedding is the tower's row for it
  (vision.py: aligner rows at IMAGE, the learned delimiters at START / NEWLINE / END) instead of
  the token embedding of `image_token_id`, before the mHC streams are expanded. A step holds the
  rows of a span that fall in its chunk (chunked prefill may split a span); the tower runs once per
  image and its rows are kept in a small encoder cache keyed on the pixels' digest, so the later
  chunks (and another request with the same image) reuse them.
- Routing (`VisionRoutedMoE`): a span position selects its experts with `gate.bias_vl` instead of
  `gate.bias`; the weights are still the unbiased sqrt-softplus scores, normalised (the selection
  reaches the accelerator's MoE as precomputed expert ids, the way hash routing does).
- Engram (engram.py): span positions are dead in the n-gram stream (no n-gram crosses an image)
  and get no Engram contribution.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import torch

from deepinfer.accelerator.interface import routing_scores
from deepinfer.models.batch import ForwardBatch
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.models.deepseek_v41.vision import VisionTower


class ImageEmbedder:
    """The span rows of a step, from the tower, with an encoder cache of `capacity` images."""

    def __init__(self, tower: VisionTower, capacity: int = 16):
        self.tower, self.capacity = tower, capacity
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        #: when a list (benchmarks set one), each tower run is timed, the device synchronised around
        #: it, and its seconds appended; None (the default): not timed
        self.tower_timings: list[float] | None = None

    def encode(self, image) -> torch.Tensor:
        """`[num_tokens, hidden]`: the tower's span rows for one image, not cached (timed when
        `tower_timings` is a list)."""
        if self.tower_timings is None:
            return self.tower.span_embeddings(image)
        self.tower.accel.synchronize()
        start = time.perf_counter()
        rows = self.tower.span_embeddings(image)
        self.tower.accel.synchronize()
        self.tower_timings.append(time.perf_counter() - start)
        return rows

    def span(self, image) -> torch.Tensor:
        """`[num_tokens, hidden]`: the embeddings of one image's span (cached by digest)."""
        hit = self._cache.get(image.digest)
        if hit is not None:
            self._cache.move_to_end(image.digest)
            return hit
        rows = self.encode(image)
        self._cache[image.digest] = rows
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return rows

    def step_rows(self, batch: ForwardBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows `[K]` int64 of the step's span positions, their embeddings `[K, hidden]`)."""
        starts = [0]
        for q in batch.query_lens:
            starts.append(starts[-1] + q)
        rows, values = [], []
        for item in batch.images or ():
            ctx, q = batch.context_lens[item.seq], batch.query_lens[item.seq]
            first, last = max(item.start, ctx), min(item.start + item.image.num_tokens, ctx + q)
            if first >= last:
                continue  # the span lies outside this step's chunk
            span = self.span(item.image)
            rows.append(torch.arange(first, last, device=device) - ctx + starts[item.seq])
            values.append(span[first - item.start:last - item.start])
        if not rows:
            return torch.empty(0, dtype=torch.long, device=device), None
        return torch.cat(rows), torch.cat(values)


class VisionRoutedMoE(MoE):
    """V4's MoE whose span positions select experts with `gate.bias_vl` (module docstring)."""

    def __init__(self, config, weights: dict[str, torch.Tensor], accel):
        super().__init__(config, False, weights, accel)
        self.bias_vl = weights["gate.bias_vl"]

    def run(self, x: torch.Tensor, step) -> torch.Tensor:
        span = getattr(step, "span_rows", None)
        if span is None:
            return super().run(x, step)
        a, c = self.accel, self.c
        scores = routing_scores(a.linear(x.float(), self.gate), c.scoring_func)
        bias = torch.where(span.unsqueeze(-1), self.bias_vl, self.bias)
        ids = (scores + bias).topk(c.num_experts_per_tok, dim=-1).indices
        if self.ep is not None:  # the chosen experts travel the expert-parallel exchange like hash ids
            if self.cp is not None and step.cp_split is None:
                return self._shared_over_cp(x, step.input_ids, chosen=ids)
            return self._exchange(x, step.input_ids, chosen=ids)
        shared_w13, shared_w2 = (None, None) if self.shared is None else self.shared
        return a.moe_sublayer(x, self.gate, None, ids, self.w13, self.w2, shared_w13, shared_w2,
                              c.num_experts_per_tok, c.routed_scaling_factor, c.scoring_func, c.swiglu_limit)
