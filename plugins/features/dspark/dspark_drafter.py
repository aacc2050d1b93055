"""The DeepSeek-V4.1 DSpark drafter: the checkpoint's `mtp.0..2` stages draft a whole block per step.

The model (`deepinfer.models.deepseek_v41.dspark_head.DSparkHead`) holds the stages and their
context rings; this drafter drives it through the core's `Drafter` protocol. After every step:

1. every committed row the step hands over (the last `sliding_window` rows of a prompt chunk, the
   anchor and accepted drafts of a verification) seeds the context rings from its target features
   (the stream means entering the `dspark_target_layer_ids` attentions);
2. every request that wants drafts gets one parallel pass over its block: the anchor (the token
   just emitted, at the first position the target has not run) and noise tokens;
3. the Markov head chains the drafts sequentially: draft k+1 is chosen (greedy, or drawn at the
   request's temperature for rejection sampling) from `U_k + B(x_k)`, and its confidence is the
   sigmoid of the confidence head, the conditional acceptance estimate the variable-length
   scheduler (`verify_scheduler`) ranks by.

Rollback: a ring entry is only ever written for a committed row and depends on that row alone, so
rejected drafts leave nothing to undo (the rows of a later step overwrite the same ring slots with
the same positions' values). The rings are indexed by the engine cache slot; a preempted request
is recomputed from its prompt, which re-seeds them.
"""
from __future__ import annotations

from typing import Any

import torch

from deepinfer.engine.speculative import DraftRequest, Drafts

from .proposer import choose_drafts


class DSparkDrafter:
    """A core `Drafter` reading the DSpark target features of the trunk."""

    features = "dspark_target"

    def __init__(self, model: Any, accelerator: Any, num_draft_tokens: int, confidence_input: str = "normed",
                 shared_generator: torch.Generator | None = None):
        head = getattr(model, "dspark", None)
        if head is None:
            raise ValueError("the dspark feature on DeepSeek-V4.1 needs the checkpoint's DSpark drafter (mtp.0-2 "
                             "weights, text_config.num_nextn_predict_layers > 0), which this model does not have; "
                             "use a checkpoint with it (`deepinfer make-model --family v41 --dspark`) or disable "
                             "speculation (DEEPINFER_USE_NEXTN_DECODE=0)")
        if num_draft_tokens > head.block_size:
            raise ValueError(f"the DSpark drafter drafts at most dspark_block_size = {head.block_size} tokens per step, "
                             f"but num_draft_tokens (DEEPINFER_USE_NEXTN_DECODE) is {num_draft_tokens}; set it to "
                             f"{head.block_size} or less")
        head.confidence_input = confidence_input
        self.head = head
        self.accelerator = accelerator
        self.generator = shared_generator
        self.device = head.device
        self.context_window = model.config.sliding_window

    def forget(self, request_id: str) -> None:
        """Nothing to drop: the context rings are indexed by cache slot and position."""

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest], features: torch.Tensor | None) -> list[Drafts | None]:
        result: list[Drafts | None] = [None] * len(requests)
        active = [r for r in requests if r.next_token_ids]
        if not active:
            return result
        if features is None:
            raise RuntimeError("the DSpark drafter needs the trunk's target features; the step did not return them")
        dev = self.device
        slots = torch.tensor([r.slot for r in active for _ in r.next_token_ids], dtype=torch.int64, device=dev)
        positions = torch.tensor([p for r in active for p in range(r.first_position,
                                                                     r.first_position + len(r.next_token_ids))],
                                 dtype=torch.int64, device=dev)
        rows = torch.cat([r.feature_rows for r in active]).to(features.device)
        self.head.seed_context(slots, positions, features[rows].to(dev))

        drafting = [i for i, r in enumerate(requests) if r.next_token_ids and r.num_drafts > 0]
        if not drafting:
            return result
        group = [requests[i] for i in drafting]
        block = self.head.draft_block(
            torch.tensor([r.slot for r in group], dtype=torch.int64, device=dev),
            torch.tensor([r.first_position + len(r.next_token_ids) for r in group], dtype=torch.int64, device=dev),
            torch.tensor([r.next_token_ids[-1] for r in group], dtype=torch.int64, device=dev))
        previous = torch.tensor([r.next_token_ids[-1] for r in group], dtype=torch.int64, device=dev)
        picked = [Drafts([], [], None) for _ in group]
        dists: list[list[torch.Tensor]] = [[] for _ in group]
        members = list(range(len(group)))
        for k in range(max(r.num_drafts for r in group)):
            index = torch.tensor(members, dtype=torch.int64, device=dev)
            bias, embedding = self.head.markov(previous[index])
            logits = block.base_logits[index, k] + bias
            tokens, _, q = choose_drafts(logits, [group[b] for b in members], k, self.accelerator, self.generator)
            confidence = torch.sigmoid(self.head.confidence(block, k, index, embedding)).tolist()
            for row, b in enumerate(members):
                picked[b].token_ids.append(tokens[row])
                picked[b].confidence.append(confidence[row])
                if q[row] is not None:
                    dists[b].append(q[row])
            previous[index] = torch.tensor(tokens, dtype=torch.int64, device=dev)
            members = [b for b in members if group[b].num_drafts > k + 1]
            if not members:
                break
        for b, i in enumerate(drafting):
            if dists[b]:
                picked[b].probs = torch.stack(dists[b])
            result[i] = picked[b]
        return result
