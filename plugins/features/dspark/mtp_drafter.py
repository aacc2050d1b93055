"""The V4 MTP drafter: the checkpoint's multi-token-prediction block `mtp.0` drafts autoregressively.

Token alignment: the MTP row at position t reads the trunk's final residual streams at t (before
hc_head) and the embedding of the token at t+1, and predicts the token at t+2. After a step that
committed positions up to p (the next token x_{p+1} is known: sampled or accepted), one catch-up
pass over the committed rows fills the MTP's own sliding-window ring and its last row predicts
draft 1 = x_{p+2}. Draft i+1 comes from one more single-row pass at position p+i that reads the MTP
block's own output streams of the previous pass (no trunk streams exist for draft positions) and
the embedding of draft i.

State: the MTP ring is a window ring in the request's slot of the engine cache (layer index
num_hidden_layers), addressed by absolute position. Its entry at t depends only on that row's
inputs, so it is exact for every committed row the drafter was handed; the engine hands it the
last `sliding_window` committed positions of every chunk and every committed verification row,
which is all the MTP attention ever reads. The drafter therefore keeps no per-request state:
positions written while drafting lie past the committed ones and are overwritten by the next
catch-up (rollback by construction).
"""
from __future__ import annotations

from typing import Any

import torch

from deepinfer.engine.speculative import DraftRequest, Drafts
from deepinfer.models.interface import ForwardBatch

from .proposer import choose_drafts


class MtpDrafter:
    """A core `Drafter`: reads the trunk's final residual streams of the last `sliding_window`
    committed positions of each sequence."""

    features = "final_streams"

    def __init__(self, model: Any, accelerator: Any, shared_generator: torch.Generator | None = None):
        unsupported = getattr(model, "drafter_unsupported", None)
        if unsupported:
            raise ValueError(f"{unsupported}; disable speculation for this model (DEEPINFER_USE_NEXTN_DECODE=0)")
        if not getattr(model, "has_mtp", False):
            raise ValueError("the dspark feature with drafter='mtp' needs the checkpoint's MTP block (mtp.0.* weights, "
                             "config num_nextn_predict_layers >= 1), which this model does not have. Use a checkpoint "
                             "with MTP weights (`deepinfer make-model` writes them unless --no-mtp), or disable "
                             "speculation (DEEPINFER_USE_NEXTN_DECODE=0)")
        self.model = model
        self.accelerator = accelerator
        self.generator = shared_generator
        self.device = model.device
        self.context_window = model.config.sliding_window

    def _batch(self, ids: list[int], positions: list[list[int]], slots: list[int], logits_rows: list[int]) -> ForwardBatch:
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor([p for ps in positions for p in ps], dtype=torch.int64, device=dev),
            query_lens=[len(ps) for ps in positions], context_lens=[ps[0] for ps in positions],
            slots=torch.tensor(slots, dtype=torch.int64, device=dev), block_tables={},
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev), return_streams=True)

    def forget(self, request_id: str) -> None:
        """Nothing to drop: the drafter's only state is the MTP ring in the request's engine slot."""

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest], features: torch.Tensor | None) -> list[Drafts | None]:
        result: list[Drafts | None] = [None] * len(requests)
        active = [i for i, r in enumerate(requests) if r.next_token_ids]
        if not active:
            return result
        if features is None:
            raise RuntimeError("the MTP drafter needs the trunk's final streams; the step did not return them")
        # 1. catch-up over every committed row; draft 1 from the last row of each drafting request
        ids, positions, slots, logits_rows, drafting = [], [], [], [], []
        for i in active:
            r = requests[i]
            n = len(r.next_token_ids)
            ids += r.next_token_ids
            positions.append(list(range(r.first_position, r.first_position + n)))
            slots.append(r.slot)
            if r.num_drafts > 0:
                logits_rows.append(len(ids) - 1)
                drafting.append(i)
        streams = features[torch.cat([requests[i].feature_rows for i in active]).to(features.device)]
        out = self.model.mtp_forward(streams, torch.tensor(ids, dtype=torch.int64, device=self.device),
                                     self._batch(ids, positions, slots, logits_rows))
        if not drafting:
            return result
        group = [requests[i] for i in drafting]
        tokens: list[list[int]] = [[] for _ in group]
        confidence: list[list[float]] = [[] for _ in group]
        dists: list[list[torch.Tensor | None]] = [[] for _ in group]

        def take(members: list[int], logits: torch.Tensor, position: int) -> None:
            t, c, d = choose_drafts(logits, [group[b] for b in members], position, self.accelerator, self.generator)
            for row, b in enumerate(members):
                tokens[b].append(t[row])
                confidence[b].append(c[row])
                dists[b].append(d[row])

        members = list(range(len(group)))  # requests of `out`'s rows, in order
        take(members, out.logits, 0)
        last = [r.first_position + len(r.next_token_ids) - 1 for r in group]
        # 2. one single-row pass per further draft, fed with the MTP's own output streams
        for position in range(1, max(r.num_drafts for r in group)):
            keep = [row for row, b in enumerate(members) if group[b].num_drafts > position]
            members = [members[row] for row in keep]
            ids = [tokens[b][-1] for b in members]
            batch = self._batch(ids, [[last[b] + position] for b in members], [group[b].slot for b in members],
                                list(range(len(members))))
            out = self.model.mtp_forward(out.streams[keep], torch.tensor(ids, dtype=torch.int64, device=self.device),
                                         batch)
            take(members, out.logits, position)
        for b, i in enumerate(drafting):
            probs = None if dists[b][0] is None else torch.stack(dists[b])
            result[i] = Drafts(tokens[b], confidence[b], probs)
        return result
