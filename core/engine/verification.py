"""Verification of drafts after the target's forward: which drafts are accepted, and the token after them.

A request with m drafts has m + 1 logits rows: row i is the target's distribution for the token
after the anchor and the first i drafts. Its emitted tokens are, in order, the accepted drafts and
one token drawn at the first rejected position (or a bonus token after the last draft when every
draft passes), so a verification emits between 1 and m + 1 tokens.

- Greedy requests (temperature 0 or top_k 1): exact match. Every row is decoded exactly as
  without speculation (the engine's sampler, masks included); draft i is accepted while it equals
  row i's token. The emitted tokens are therefore the ones speculation-off decoding produces.
- Other requests: speculative rejection sampling (the back end's `rejection_sample` kernel) with
  p = the distribution the engine's sampler draws from (temperature, top-k/p, min-p, masks) and
  q = the distribution each draft was drawn from. Each emitted token is distributed exactly as
  p at its position, so sampling is unchanged in distribution. With a seq_seed, a request's draws
  use a generator seeded by (seq_seed, output index): the same request and drafts give the same
  tokens in any batch.

Rows after the emitted ones carry token -1; a row where every token was masked is `dead`. A row
whose raw logits are not finite (`Sampler`'s `nonfinite`) emits nothing, nor do the rows after it:
the request keeps the tokens of the rows before it and fails, as it would without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.engine.sampler import Sampler, SamplerOutput, SamplingMetadata

#: Mixed into a request's seq_seed for its acceptance draws.
VERIFY_SEED_SALT = 0x2545F4914F6CDD1D


@dataclass
class VerifyGroup:
    """One sampled request's rows in a step: logits rows [logits_start, logits_start + 1 + m)."""

    logits_start: int
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None  # [m, V], None: greedy drafts (one-hot)
    greedy: bool
    seed: int | None  # seed of the acceptance draws; None: the sampler's shared generator

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)


def greedy_accept_count(row_tokens: list[int], drafts: list[int]) -> int:
    """Leading drafts equal to the target's greedy tokens (row i decides draft i)."""
    n = 0
    while n < len(drafts) and row_tokens[n] == drafts[n]:
        n += 1
    return n


def verify(logits: torch.Tensor, meta: SamplingMetadata, bitmask: torch.Tensor | None, groups: list[VerifyGroup],
           sampler: Sampler, accelerator: Any) -> SamplerOutput:
    """Accept or reject the drafts of every group; one SamplerOutput row per logits row."""
    num_rows = logits.shape[0]
    device = logits.device
    tokens = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    dead = torch.zeros(num_rows, dtype=torch.bool, device=device)
    log_norm = torch.logsumexp(logits.float(), dim=-1)  # the logprobs' normaliser; not finite for a broken row
    nonfinite = ~torch.isfinite(log_norm)
    flagged = torch.zeros(num_rows, dtype=torch.bool, device=device)  # the broken row each request stopped at

    def sub(rows: list[int], source: torch.Tensor = logits):
        return source[rows], meta.subset(rows), None if bitmask is None else bitmask[rows]

    # greedy requests, and sampled requests without drafts: decoded row by row as without speculation
    plain_groups = [g for g in groups if g.greedy or g.num_drafts == 0]
    plain = [g.logits_start + i for g in plain_groups for i in range(g.num_drafts + 1)]
    if plain:
        out = sampler(*sub(plain))
        picked = torch.full_like(tokens, -1)
        picked[plain] = out.token_ids
        row_tokens = picked.tolist()
        dead[plain] = out.dead
        flagged[plain] = out.nonfinite
        for g in plain_groups:
            a = g.logits_start
            n = greedy_accept_count(row_tokens[a:a + g.num_drafts], g.draft_token_ids)
            tokens[a:a + n + 1] = picked[a:a + n + 1]
            dead[a + n + 1:a + g.num_drafts + 1] = False
            flagged[a + n + 1:a + g.num_drafts + 1] = False

    # sampled requests with drafts: rejection sampling
    sampled = [g for g in groups if not g.greedy and g.num_drafts > 0]
    if sampled:
        rows = [g.logits_start + i for g in sampled for i in range(g.num_drafts + 1)]
        broken = nonfinite.tolist()
        # a broken row draws from finite stand-in logits; what it emits is cut off below
        finite = logits.masked_fill(nonfinite.unsqueeze(1), 0.0) if any(broken[r] for r in rows) else logits
        target = sampler.probabilities(*sub(rows, finite))
        drafts = torch.tensor([t for g in sampled for t in g.draft_token_ids], dtype=torch.int64, device=device)
        if all(g.draft_probs is None for g in sampled):
            q = None
        else:
            vocab = logits.shape[1]
            q = torch.cat([(g.draft_probs if g.draft_probs is not None else
                            F.one_hot(torch.tensor(g.draft_token_ids), vocab).float()).to(device) for g in sampled])
        gens = [sampler.generator if g.seed is None else torch.Generator(device=device).manual_seed(g.seed)
                for g in sampled]
        emitted = accelerator.rejection_sample(target, q, drafts, [g.num_drafts for g in sampled], gens)
        mass = target.sum(dim=-1).tolist()
        offset = 0
        for b, g in enumerate(sampled):
            row = emitted[b, :g.num_drafts + 1]
            count = int((row >= 0).sum())
            a = g.logits_start
            # each emitted token came from its own row's distribution: stop at the first broken one
            first_broken = next((i for i in range(count) if broken[a + i]), None)
            if first_broken is not None:
                count = first_broken
                flagged[a + count] = True
            tokens[a:a + count] = row[:count]
            if first_broken is None and count <= g.num_drafts and mass[offset + count] <= 0.0:
                dead[a + count] = True
            offset += g.num_drafts + 1

    logprobs, ranks, top_ids, top_logprobs = sampler.score(logits, tokens, meta, log_norm)
    return SamplerOutput(token_ids=tokens, logprobs=logprobs.masked_fill(tokens < 0, 0.0), ranks=ranks, dead=dead,
                         nonfinite=flagged, top_ids=top_ids, top_logprobs=top_logprobs)
