"""The drafter interface: what a speculative-decoding draft model gets after each step and returns.

It fits the V4 MTP block (`mtp_drafter.py`: one sliding-window block fed with the trunk's final
residual streams, drafting one token per pass), the V4.1 DSpark head (deepseek-v41.md §6: three
blocks fed with features of target layers 37-39, drafting a whole block per pass plus a Markov
head and a confidence head) and the test-mode self drafter (`self_drafter.py`: the target model
drafting for itself, fed with tokens only).

After every target step the engine hands the drafter, per request, its *committed rows*: the
positions whose target features are final (the prompt chunk, or the anchor and the accepted
drafts of a verification), each with the token that follows it, plus the target features of those
rows (`features`). The drafter brings its own cache up to date with them and proposes up to
`num_drafts` tokens, each with a confidence.

Rollback of the drafter's cache: a drafter keeps exact state only for committed positions; what it
writes while drafting lies beyond them and is overwritten by the next `propose`, which always
starts at the first position not yet committed. Rejected drafts therefore need no undo call, and
the cache must only hold `max_rollback` positions beyond the committed ones (the model's rings do).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

#: Mixed into a request's seq_seed for its draft draws, so they are independent of its target draws.
DRAFT_SEED_SALT = 0x5DEECE66D


@dataclass
class DraftRequest:
    """One request of a finished step, as the drafter sees it."""

    request: Any  # the engine's Request (read only): request_id, params, tokens()
    slot: int  # the request's cache slot in the step (drafters that keep state in the engine cache)
    num_known_tokens: int  # tokens the request had before this step's emitted tokens
    emitted: list[int]  # tokens this step emitted (accepted drafts, then the sampled one); [] for a chunk
    first_position: int  # position of the first committed row below
    next_token_ids: list[int]  # the token after each committed row (len = number of committed rows)
    feature_rows: torch.Tensor | None  # rows of `features` holding the committed rows' target features
    num_drafts: int  # drafts wanted (0: only bring the cache up to date)
    greedy: bool  # the request samples greedily: draft greedily, confidence = draft probability
    temperature: float
    draft_seeds: list[int | None]  # seed of each draft position's draw (None: the shared generator)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence after this step (known plus emitted)."""
        return self.num_known_tokens + len(self.emitted)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the sequence after this step."""
        known = self.request.tokens(start, min(end, self.num_known_tokens)) if start < self.num_known_tokens else []
        n = self.num_known_tokens
        return known + self.emitted[max(start - n, 0):max(end - n, 0)]


@dataclass
class Drafts:
    """A request's proposal for the next step."""

    token_ids: list[int]
    #: per draft, the drafter's estimate that it is accepted given that the drafts before it were
    #: (MTP: the draft probability of the proposed token; DSpark: the confidence head's sigmoid)
    confidence: list[float]
    #: `[len(token_ids), V]` fp32, the distribution each draft was drawn from, for rejection
    #: sampling; None when the drafts were chosen greedily (a one-hot distribution)
    probs: torch.Tensor | None = None

    def truncate(self, n: int) -> Drafts:
        return Drafts(self.token_ids[:n], self.confidence[:n], None if self.probs is None else self.probs[:n])


class DraftProposer(ABC):
    """A draft model. `propose` runs on the engine's worker thread, one call per step."""

    #: which target features the drafter reads: "final_streams" (the trunk's final residual streams
    #: `[n, D]` per row, before hc_head: V4 MTP) or None (tokens only)
    features: str | None = None
    #: how many trailing committed positions of a sequence the drafter needs features for (the
    #: window of its own attention); earlier positions are never handed to it
    context_window: int = 0

    @abstractmethod
    def propose(self, requests: list[DraftRequest], features: torch.Tensor | None) -> list[Drafts | None]:
        """Bring the cache up to date with each request's committed rows, then draft. Returns one
        entry per request: None for a request that asked for no drafts."""

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: drop what the drafter keeps for it."""


def choose_drafts(logits: torch.Tensor, requests: list[DraftRequest], position: int, accelerator: Any,
                  shared_generator: torch.Generator | None) -> tuple[list[int], list[float], list[torch.Tensor | None]]:
    """Pick draft `position` of each request from the drafter's logits `[B, V]`: the argmax for
    greedy requests, else a draw from softmax(logits / temperature) with the request's seed.
    Returns (tokens, confidences, the distribution drawn from or None for greedy rows)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    base = torch.softmax(logits, dim=-1)
    confidence = base.gather(1, tokens.unsqueeze(1)).squeeze(1)
    dists: list[torch.Tensor | None] = [None] * len(requests)
    sampled = [i for i, r in enumerate(requests) if not r.greedy]
    if sampled:
        temps = torch.tensor([requests[i].temperature for i in sampled], device=logits.device).unsqueeze(1)
        q = torch.softmax(logits[sampled] / temps, dim=-1)
        gens = []
        for i in sampled:
            seed = requests[i].draft_seeds[position]
            if seed is None:
                gens.append(shared_generator)
            else:
                g = torch.Generator(device=logits.device)
                g.manual_seed(seed)
                gens.append(g)
        picked = accelerator.sample(q, gens)
        tokens[sampled] = picked
        confidence[sampled] = q.gather(1, picked.unsqueeze(1)).squeeze(1)
        for row, i in enumerate(sampled):
            dists[i] = q[row]
    return tokens.tolist(), confidence.tolist(), dists

