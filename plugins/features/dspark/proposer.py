"""Choosing draft tokens from a drafter's logits, shared by the dspark drafters.

A drafter implements the core's `Drafter` protocol (`deepinfer.engine.speculative`): after every
target step it gets, per request, the committed rows (positions, the token after each, their
target features) and proposes up to `num_drafts` tokens with a confidence each. The drafters here:
the V4 MTP block (`mtp_drafter.py`: one sliding-window block fed with the trunk's final residual
streams, one token per pass), the V4.1 DSpark head (`dspark_drafter.py`: three stages fed with the
features of the target layers `dspark_target_layer_ids`, a whole block per pass, a Markov head and
a confidence head) and the self-drafting test mode (`self_drafter.py`: the target model drafting
for itself, fed with tokens only).
"""
from __future__ import annotations

from typing import Any

import torch

from deepinfer.engine.speculative import DraftRequest


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

