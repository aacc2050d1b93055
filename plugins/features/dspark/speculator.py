"""The object the engine drives each step (contributed through `deepinfer_draft_proposer`).

Per step, with the engine's calls in order:

1. `plan(requests)` (engine thread, before scheduling): with variable-length verification, trims
   each decoding request's drafts to the number worth verifying (`verify_scheduler.py`); the
   request then drafts at most one more than that for the following step.
2. The scheduler gives each decode 1 + m query tokens (its last token and m drafts); the runner
   asks the target for logits at all of them, and for the final residual streams of the rows the
   drafter needs.
3. `verify(logits, step, bitmask, sampler)` (worker thread): accepts drafts (`acceptance.py`);
   one forward verified every draft of every request (ragged).
4. `propose(step, streams, sampled)` (worker thread): hands the drafter each request's committed
   rows and gets the next drafts (`proposer.py`).
5. The engine applies the emitted tokens, rolls the sequence length back over the rejected drafts,
   keeps the drafts the grammar allows, and records statistics in `stats`.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from deepinfer.engine.sampler import SamplerOutput, position_seed

from .acceptance import VERIFY_SEED_SALT, VerifyGroup, verify
from .config import DSparkConfig
from .proposer import DRAFT_SEED_SALT, DraftProposer, DraftRequest, Drafts
from .stats import SpecDecodeStats
from .verify_scheduler import ConfidenceCalibrator, VerifyCostModel, plan_verification


class Speculator:
    def __init__(self, drafter: DraftProposer, config: DSparkConfig, accelerator: Any, max_model_len: int,
                 cost_model: VerifyCostModel | None = None):
        if config.variable_length and cost_model is None:
            raise ValueError("variable-length verification needs a verify-cost table")
        self.drafter = drafter
        self.config = config
        self.accelerator = accelerator
        self.num_draft_tokens = config.num_draft_tokens
        self.max_model_len = max_model_len
        self.cost_model = cost_model
        self.stats = SpecDecodeStats(num_draft_tokens=config.num_draft_tokens)
        self.draft_seconds = 0.0  # moving average of propose() time: step time no plan changes
        self.calibrator = ConfidenceCalibrator(config.num_draft_tokens)
        #: variable length: drafts each request last had verified; it next drafts one more than that
        #: at most (drafting what will not be verified is wasted, and costs most on small models)
        self._planned: dict[str, int] = {}

    # what the runner reads
    @property
    def features(self) -> str | None:
        return self.drafter.features

    @property
    def context_window(self) -> int:
        return self.drafter.context_window

    # -- 1. planning (engine thread) ---------------------------------------------------------------

    def plan(self, requests: list[Any]) -> None:
        """Variable length: keep, per request, only the drafts worth verifying this step."""
        if not self.config.variable_length or not requests:
            return
        raw = [r.draft_state.confidence[:len(r.draft_token_ids)] if r.draft_state is not None else
               [0.0] * len(r.draft_token_ids) for r in requests]
        calibrated = [[self.calibrator.calibrate(i, c) for i, c in enumerate(conf)] for conf in raw]
        for r, conf, m in zip(requests, raw, plan_verification(calibrated, self.cost_model, self.draft_seconds)):
            if m < len(conf) and self.calibrator.needs_evidence(m, conf[m]):
                m += 1  # explore: one more draft whose acceptance has hardly been measured
            r.draft_token_ids = r.draft_token_ids[:m]
            self._planned[r.request_id] = m

    # -- 3. verification (worker thread) -----------------------------------------------------------

    def verify(self, logits: torch.Tensor, step: Any, bitmask: torch.Tensor | None, sampler: Any) -> SamplerOutput:
        groups = []
        for start, s in zip(step.logits_starts, step.sample_rows):
            params = s.request.params
            state: Drafts | None = s.request.draft_state
            m = len(s.draft_token_ids)
            probs = None if state is None or state.probs is None else state.probs[:m]
            seed = None if params.seq_seed is None else position_seed(params.seq_seed ^ VERIFY_SEED_SALT, s.output_index)
            groups.append(VerifyGroup(start, list(s.draft_token_ids), probs, params.greedy, seed))
        out = verify(logits, step.sampling, bitmask, groups, sampler, self.accelerator)
        tokens = out.token_ids.tolist()
        for g, s in zip(groups, step.sample_rows):
            state = s.request.draft_state
            if g.num_drafts and state is not None:
                emitted = sum(1 for t in tokens[g.logits_start:g.logits_start + g.num_drafts + 1] if t >= 0)
                self.calibrator.observe(state.confidence, g.num_drafts, max(emitted - 1, 0))
        return out

    # -- 4. drafting (worker thread) ---------------------------------------------------------------

    def propose(self, step: Any, streams: torch.Tensor | None, sampled: SamplerOutput) -> dict[str, Drafts]:
        t0 = time.perf_counter()
        tokens = sampled.token_ids.tolist()
        requests = []
        for rows in step.draft_rows:
            s = rows.scheduled
            req = s.request
            m = len(s.draft_token_ids)
            if rows.logits_start is None:  # a prompt chunk that samples nothing: catch up only
                emitted, following = [], rows.following_ids + [rows.next_known]
            else:
                emitted = []
                for t in tokens[rows.logits_start:rows.logits_start + m + 1]:
                    if t < 0:
                        break
                    emitted.append(t)
                if not emitted:
                    continue  # a dead end: the request ends
                following = rows.following_ids + emitted
            committed = min(len(following), rows.num_stream_rows)
            p = req.params
            num_outputs = len(req.output_token_ids) + len(emitted)
            wanted = 0
            if emitted:  # drafts worth making: one token of the next step always comes from the target
                room = min(p.max_tokens - num_outputs, self.max_model_len - (rows.num_known_tokens + len(emitted)))
                wanted = max(0, min(self.num_draft_tokens, room - 1, self._planned.get(req.request_id, room) + 1))
            requests.append(DraftRequest(
                request=req, slot=rows.slot, num_known_tokens=rows.num_known_tokens, emitted=emitted,
                first_position=rows.first_position, next_token_ids=following[:committed],
                feature_rows=torch.arange(rows.stream_start, rows.stream_start + committed),
                num_drafts=wanted, greedy=p.greedy, temperature=float(p.temperature),
                draft_seeds=[None if p.seq_seed is None else
                             position_seed(p.seq_seed ^ DRAFT_SEED_SALT, num_outputs + i) for i in range(wanted)]))
        if not requests:
            return {}
        drafts = self.drafter.propose(requests, streams)
        out = {r.request_id: d for r, d in zip(requests, drafts) if d is not None}
        self.draft_seconds = 0.8 * self.draft_seconds + 0.2 * (time.perf_counter() - t0)
        return out

    def forget(self, request_id: str) -> None:
        self._planned.pop(request_id, None)
        self.drafter.forget(request_id)
