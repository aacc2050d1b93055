"""Test mode: the target model drafts for itself (`drafter = "self"`).

A second model object over the same weight tensors (`model.twin()`) with a cache of its own runs
the target autoregressively: one catch-up pass over the tokens committed since its last call, then
one single-token pass per further draft. Under greedy sampling its drafts are exactly what the
target will pick, so every draft is accepted and every verification ends with a bonus token: the
full-acceptance bookkeeping is exercised. With `self_draft_error_rate` a deterministic share of the
greedy drafts is replaced by a wrong token, which exercises partial acceptance and rollback at
every draft position. It costs about (1 + num_draft_tokens) target forwards per step: a test tool,
not a speed-up.
"""
from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.engine.cache_manager import CacheManager
from deepinfer.engine.speculative import DraftRequest, Drafts
from deepinfer.models.interface import ForwardBatch, allocate_cache_tensors

from .proposer import choose_drafts


@dataclass(eq=False)
class _DraftSequence:
    """One request's place in the self drafter's own cache (duck-types what CacheManager needs)."""

    slot: int | None = None
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    num_computed: int = 0  # positions whose state is exact (committed tokens run through the twin)


class SelfDrafter:
    """A core `Drafter` that reads no target features (tokens only)."""

    features = None
    context_window = 0

    def __init__(self, model: Any, accelerator: Any, *, num_draft_tokens: int, max_num_seqs: int,
                 max_model_len: int, block_size: int, error_rate: float = 0.0,
                 shared_generator: torch.Generator | None = None):
        if not hasattr(model, "twin"):
            raise ValueError(f"drafter='self' needs a model that can share its weights with a second cache "
                             f"(a `twin()` method); {type(model).__name__} has none. Use drafter='mtp'")
        self.model = model.twin()
        self.accelerator = accelerator
        self.generator = shared_generator
        self.error_rate = error_rate
        self.vocab_size = model.config.vocab_size
        self.device = model.device
        layout = self.model.cache_layout(num_draft_tokens + 1)
        # room for a whole sequence plus the positions written while drafting past it
        tokens = max_model_len + num_draft_tokens + 1
        blocks = {g.name: max_num_seqs * -(-g.entries_for(tokens) // block_size) for g in layout.block_groups}
        self.model.bind_cache(allocate_cache_tensors(layout, max_num_seqs, blocks, block_size, self.device))
        self.cache = CacheManager(layout, max_num_seqs, blocks, block_size)
        self.group_names = [g.name for g in layout.block_groups]
        self._sequences: dict[str, _DraftSequence] = {}
        self._lock = threading.Lock()  # forget() runs on the engine thread, propose() on the worker

    def forget(self, request_id: str) -> None:
        with self._lock:
            seq = self._sequences.pop(request_id, None)
            if seq is not None:
                self.cache.free(seq)

    def _sequence(self, request_id: str, num_tokens: int) -> _DraftSequence:
        with self._lock:
            seq = self._sequences.setdefault(request_id, _DraftSequence())
            if not self.cache.allocate(seq, num_tokens):
                raise RuntimeError(f"the self drafter's cache has no room for request {request_id} "
                                   f"({num_tokens} tokens); it is sized for max_num_seqs sequences of max_model_len")
            return seq

    def _forward(self, seqs: list[_DraftSequence], ids: list[list[int]], starts: list[int]) -> torch.Tensor:
        dev = self.device
        tables = {}
        for name in self.group_names:
            width = max([len(s.block_ids.get(name, ())) for s in seqs] + [1])
            table = torch.full((len(seqs), width), -1, dtype=torch.int64)
            for i, s in enumerate(seqs):
                owned = s.block_ids.get(name, [])
                if owned:
                    table[i, :len(owned)] = torch.tensor(owned, dtype=torch.int64)
            tables[name] = table.to(dev)
        lens = [len(x) for x in ids]
        ends = torch.tensor(lens, device=dev).cumsum(0) - 1
        batch = ForwardBatch(
            input_ids=torch.tensor([t for x in ids for t in x], dtype=torch.int64, device=dev),
            positions=torch.tensor([p for s, n in zip(starts, lens) for p in range(s, s + n)], dtype=torch.int64,
                                   device=dev),
            query_lens=lens, context_lens=list(starts),
            slots=torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=dev), block_tables=tables,
            logits_indices=ends)
        return self.model.forward(batch).logits

    def _corrupt(self, request_id: str, position: int, token: int) -> int:
        """Deterministically replace a share `error_rate` of the drafts by another token."""
        h = zlib.crc32(f"{request_id}:{position}".encode())
        if (h % 10_000) / 10_000 >= self.error_rate:
            return token
        return (token + 1 + (h >> 14) % (self.vocab_size - 1)) % self.vocab_size

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest], features: torch.Tensor | None) -> list[Drafts | None]:
        result: list[Drafts | None] = [None] * len(requests)
        drafting = [i for i, r in enumerate(requests) if r.num_drafts > 0]
        if not drafting:
            return result
        group = [requests[i] for i in drafting]
        seqs = [self._sequence(r.request_id, r.num_tokens + r.num_drafts - 1) for r in group]
        # catch-up: every committed token not yet run through the twin; its last row drafts token 1
        starts = [min(s.num_computed, r.num_tokens - 1) for s, r in zip(seqs, group)]
        ids = [r.tokens(a, r.num_tokens) for a, r in zip(starts, group)]
        logits = self._forward(seqs, ids, starts)
        for s, r in zip(seqs, group):
            s.num_computed = r.num_tokens
        picked: list[Drafts] = [Drafts([], [], None) for _ in group]
        dists: list[list[torch.Tensor]] = [[] for _ in group]
        members = list(range(len(group)))
        for position in range(max(r.num_drafts for r in group)):
            sub = [group[b] for b in members]
            tokens, conf, q = choose_drafts(logits, sub, position, self.accelerator, self.generator)
            for row, b in enumerate(members):
                r = group[b]
                token = tokens[row]
                if r.greedy and self.error_rate > 0:  # a sampled draft must stay a draw from q
                    token = self._corrupt(r.request_id, r.num_tokens + position, token)
                picked[b].token_ids.append(token)
                picked[b].confidence.append(conf[row])
                if q[row] is not None:
                    dists[b].append(q[row])
            members = [b for b in members if group[b].num_drafts > position + 1]
            if not members:
                break
            logits = self._forward([seqs[b] for b in members], [[picked[b].token_ids[-1]] for b in members],
                                   [group[b].num_tokens + position for b in members])
        for b, i in enumerate(drafting):
            if dists[b]:
                picked[b].probs = torch.stack(dists[b])
            result[i] = picked[b]
        return result
