"""Speculative decoding in the core: what a drafter is, and everything around it.

A feature contributes a `Speculation` through the `draft_proposer` slot: a `Drafter` (proposes the
next tokens of each request from the rows the step committed), the most drafts per request per
step, and optionally a `VerifyPolicy` (how many of each request's drafts a step verifies). The core
owns the rest, in the usual three phases of a step:

- `Scheduler.schedule` asks the policy (`SpeculativeDecoder.plan`), trims the drafts, and schedules
  a decode with m drafts as 1 + m query tokens (its last token, the anchor, then the drafts);
- `ModelRunner.execute` (on the worker thread with the async pipeline) calls `verify`: greedy
  exact match or rejection sampling against the sampler's distribution (`verification.py`), then
  `propose`: hands the drafter each request's committed rows and gets the next drafts;
- `Scheduler.update_from_output` appends the emitted tokens, sets `num_computed_tokens` back over
  the rejected drafts (the model's rings hold `max_rollback` extra positions, so that is an exact
  rollback), stores the next drafts cut to the prefix the request's grammar allows, and calls
  `observe` / `stats`.

A drafter keeps exact state only for committed positions: what it writes while drafting lies past
them and is overwritten by the next `propose`, which starts at the first uncommitted position, so
rejected drafts need no undo.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from deepinfer.engine.sampler import Sampler, SamplerOutput, position_seed
from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.engine.verification import VERIFY_SEED_SALT, VerifyGroup, verify

if TYPE_CHECKING:
    from deepinfer.engine.runner import PreparedStep
    from deepinfer.engine.scheduler import ScheduledRequest

#: Mixed into a request's seq_seed for its draft draws, so they are independent of its target draws.
DRAFT_SEED_SALT = 0x5DEECE66D


# -- what a drafter gets and returns --------------------------------------------------------------


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


@dataclass
class DraftRequest:
    """One request of a finished step, as the drafter sees it: its *committed rows* (the prompt
    chunk, or the anchor and the accepted drafts of a verification), each with the token after it."""

    scheduled: ScheduledRequest  # the request's entry in the step's scheduler output (read only)
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
        return self.scheduled.request_id

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence after this step (known plus emitted)."""
        return self.num_known_tokens + len(self.emitted)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the sequence after this step."""
        n = self.num_known_tokens
        known = self.scheduled.tokens(start, min(end, n)) if start < n else []
        return known + self.emitted[max(start - n, 0):max(end - n, 0)]


@runtime_checkable
class Drafter(Protocol):
    """A draft model. `propose` runs where the step executes (the worker thread with the async
    pipeline), once per step; `forget` on the engine thread when a request finishes."""

    #: which target features the drafter reads: "final_streams" (the trunk's final residual streams
    #: `[n, D]` per row, before hc_head: V4 MTP), "dspark_target" (per row, the stream means entering
    #: the attention of each DSpark target layer, concatenated: V4.1 DSpark) or None (tokens only);
    #: the model returns them in `ForwardOutput.streams`
    features: str | None
    #: how many trailing committed positions of a sequence the drafter needs features for (the
    #: window of its own attention); earlier positions are never handed to it
    context_window: int

    def propose(self, requests: list[DraftRequest], features: torch.Tensor | None) -> list[Drafts | None]:
        """Bring the drafter's state up to date with each request's committed rows, then draft.
        Returns one entry per request: None for a request that asked for no drafts."""

    def forget(self, request_id: str) -> None:
        """The request finished: drop what the drafter keeps for it."""


@runtime_checkable
class VerifyPolicy(Protocol):
    """How many of each request's drafts a step verifies (e.g. a confidence-scheduled,
    variable-length schedule). Called on the engine thread only."""

    def plan(self, confidences: list[list[float]], draft_seconds: float) -> list[int]:
        """Per decoding request (its drafts' confidences), how many leading drafts to verify.
        `draft_seconds`: the average time the drafter takes per step."""

    def observe(self, confidences: list[float], num_verified: int, num_accepted: int) -> None:
        """One verification's outcome: drafts 0..num_accepted-1 passed, the next one (if verified) failed."""


@dataclass
class Speculation:
    """What a feature contributes to the `draft_proposer` slot."""

    drafter: Drafter
    num_draft_tokens: int  # the most drafts per request per step
    policy: VerifyPolicy | None = None  # None: verify every draft the token budget allows


@dataclass
class DraftRows:
    """One scheduled request's rows as the drafter needs them (built by `ModelRunner.prepare`)."""

    scheduled: ScheduledRequest
    logits_start: int | None  # its first logits row; None for a chunk that samples nothing
    stream_start: int  # its first row of ForwardOutput.streams
    first_position: int  # position of that row
    num_stream_rows: int  # rows with streams: the last `context_window` positions of the chunk
    following_ids: list[int]  # the known input token after each stream row, up to the last known row
    next_known: int | None  # the token after the chunk, for a chunk that samples nothing


# -- the core's side --------------------------------------------------------------------------------


class SpeculativeDecoder:
    """Verification, acceptance and draft bookkeeping around a contributed `Speculation`."""

    def __init__(self, speculation: Speculation, sampler: Sampler, accelerator: Any, max_model_len: int):
        k, policy = getattr(speculation, "num_draft_tokens", None), getattr(speculation, "policy", None)
        if not isinstance(getattr(speculation, "drafter", None), Drafter) or not isinstance(k, int) or \
                not (policy is None or isinstance(policy, VerifyPolicy)):
            raise TypeError(f"the draft_proposer slot holds a {type(speculation).__name__}; it must be a Speculation: "
                            f"a drafter (features, context_window, propose, forget), num_draft_tokens and an "
                            f"optional policy (plan, observe)")
        if k < 1:
            raise ValueError(f"speculative decoding needs num_draft_tokens >= 1; got {k}")
        self.speculation = speculation  # as contributed (e.g. the feature's own subclass, with its config)
        self.drafter = speculation.drafter
        self.policy = policy
        self.num_draft_tokens = k
        self.sampler = sampler
        self.accelerator = accelerator
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(num_draft_tokens=self.num_draft_tokens)
        self.draft_seconds = 0.0  # moving average of the drafter's time per step

    @property
    def stream_window(self) -> int:
        """Trailing positions of each chunk whose target features the drafter reads (0: none)."""
        return self.drafter.context_window if self.drafter.features else 0

    # -- engine thread ----------------------------------------------------------------------------

    def plan(self, confidences: list[list[float]]) -> list[int] | None:
        """Drafts to verify per request this step (the policy's choice), or None: all of them."""
        return None if self.policy is None else self.policy.plan(confidences, self.draft_seconds)

    def draft_limit(self, num_drafts_planned: int | None) -> int:
        """The most drafts a request proposes for its next step: one more than the policy last let it
        verify (drafting what will not be verified is wasted work)."""
        if num_drafts_planned is None:
            return self.num_draft_tokens
        return min(self.num_draft_tokens, num_drafts_planned + 1)

    def observe(self, confidences: list[float], num_verified: int, num_accepted: int) -> None:
        if self.policy is not None:
            self.policy.observe(confidences, num_verified, num_accepted)

    def forget(self, request_id: str) -> None:
        self.drafter.forget(request_id)

    # -- where the step executes ------------------------------------------------------------------

    def verify(self, logits: torch.Tensor, step: PreparedStep, bitmask: torch.Tensor | None) -> SamplerOutput:
        """Accept or reject every sampled request's drafts: one SamplerOutput row per logits row."""
        groups = []
        for start, s in zip(step.logits_starts, step.sample_rows):
            p = s.params
            seed = None if p.seq_seed is None else position_seed(p.seq_seed ^ VERIFY_SEED_SALT, s.output_index)
            groups.append(VerifyGroup(start, list(s.draft_token_ids), s.draft_probs, p.greedy, seed))
        return verify(logits, step.sampling, bitmask, groups, self.sampler, self.accelerator)

    def propose(self, step: PreparedStep, streams: torch.Tensor | None, sampled: SamplerOutput) -> dict[str, Drafts]:
        """Hand the drafter the rows this step committed; the next drafts by request id."""
        t0 = time.perf_counter()
        tokens = sampled.token_ids.tolist()
        requests = []
        for rows in step.draft_rows:
            s = rows.scheduled
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
            p = s.params
            num_outputs = s.output_index + len(emitted)
            wanted = 0
            if emitted:  # drafts worth making: one token of the next step always comes from the target
                room = min(p.max_tokens - num_outputs, self.max_model_len - (s.num_known_tokens + len(emitted)))
                wanted = max(0, min(s.draft_limit, room - 1))
            requests.append(DraftRequest(
                scheduled=s, slot=s.slot, num_known_tokens=s.num_known_tokens, emitted=emitted,
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
