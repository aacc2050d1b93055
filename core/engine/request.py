"""One request's life in the engine: its tokens, progress, cache resources and finish state.

Who writes what: the `Scheduler` is the only writer of a request's state once it exists (queue
status, `num_computed_tokens`, pending and output tokens, drafts, finish state, final text); the
`CacheManager` it calls writes `slot` and `block_ids`. Admission only builds a request; the runner,
the drafter and the output processor only read it (the runner through its `ScheduledRequest`).
"""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, best_samples
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.engine.speculative import Drafts


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and waiting to recompute)
    RUNNING = "running"  # holds a slot and cache blocks
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int  # FCFS order; lower = older
    #: logits processors (by index in the engine's list) that track this request (set at admission)
    processors: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    #: tokens whose model state is written, or will be written by a step already handed to the
    #: runner (counted when scheduled, as in vLLM v1).
    num_computed_tokens: int = 0
    #: tokens sampled by steps still in flight (async pipeline), not yet in `output_token_ids`.
    num_pending_tokens: int = 0
    slot: int | None = None
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    #: speculative decoding: the drafts for the tokens after the last one (verified with it in the
    #: next step), with the drafter's confidences and draft distributions
    drafts: Drafts | None = None
    #: drafts the verification policy let this request verify when it last planned (None: never)
    num_drafts_planned: int | None = None
    num_drafts_verified: int = 0
    num_drafts_accepted: int = 0

    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    sum_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    scheduled_time: float | None = None  # when it first got a slot (its queue time ends)
    finished_time: float | None = None
    text: str = ""  # final text, set when the request finishes
    #: per prompt token, its log-probability entry (None for the first token), when asked
    #: (`SamplingParams.prompt_logprobs`); complete once it holds num_prompt_tokens entries
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    #: several samples of one prompt (`SamplingParams.n` / `best_of`): every member holds the same
    #: list, the first member first; None for a request of one sample
    group: list[Request] | None = None
    sample_index: int = 0
    num_returned: int = 1  # on the first member: the samples `to_output` returns (n; the rest is best_of's)
    #: on the first member: the others, until they are forked from its state (the scheduler copies
    #: its prompt state into them when it samples its first token); then empty
    fork_pending: list[Request] = field(default_factory=list)
    #: on a member waiting to be forked: the first member (it is then in no queue)
    fork_source: Request | None = None

    # -- token counts -----------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens that are known (appended)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return self.num_tokens + self.num_pending_tokens

    @property
    def num_outputs_with_pending(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def draft_token_ids(self) -> list[int]:
        return [] if self.drafts is None else self.drafts.token_ids

    def token_at(self, index: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < p else self.output_token_ids[index - p]

    def tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def members(self) -> list[Request]:
        """Every sample of the request (itself alone without `n` / `best_of`)."""
        return self.group if self.group is not None else [self]

    @property
    def all_finished(self) -> bool:
        return all(m.is_finished for m in self.members)

    @property
    def prompt_scored(self) -> bool:
        """Every prompt log-probability asked for is known (True when none was asked)."""
        return self.prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens

    # -- finishing --------------------------------------------------------------------------------

    def finish(self, reason: str, stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.finished_time = time.monotonic()

    def completion(self) -> CompletionOutput:
        """This sample's output."""
        return CompletionOutput(
            index=self.sample_index, text=self.text, token_ids=list(self.output_token_ids),
            cumulative_logprob=self.sum_logprob if self.output_token_ids else None,
            logprobs=self.logprobs, finish_reason=self.finish_reason, stop_reason=self.stop_reason)

    def to_output(self) -> RequestOutput:
        """The request's output: with several samples (asked of the first member), the `n` best of
        them (`best_samples`), and metrics over all of them."""
        members = self.members
        n_out = sum(len(m.output_token_ids) for m in members)
        sum_logprob = sum(m.sum_logprob for m in members)
        ppl = math.exp(-sum_logprob / n_out) if n_out else None
        verified, accepted = (sum(m.num_drafts_verified for m in members),
                              sum(m.num_drafts_accepted for m in members))
        firsts = [m.first_token_time for m in members if m.first_token_time is not None]
        ends = [m.finished_time for m in members if m.finished_time is not None]
        metrics = RequestMetrics(
            num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=n_out, decode_ppl=ppl,
            accept_rate=accepted / verified if verified else None,
            num_draft_tokens=verified, num_accepted_tokens=accepted,
            num_preemptions=sum(m.num_preemptions for m in members), arrival_time=self.arrival_time,
            first_token_time=min(firsts) if firsts else None,
            finished_time=max(ends) if len(ends) == len(members) else None)
        outputs = best_samples([m.completion() for m in members], self.num_returned)
        error = next((m.error for m in members if m.error is not None), None)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=list(self.prompt_token_ids), outputs=outputs,
                             finished=self.all_finished, metrics=metrics, error=error,
                             prompt_logprobs=self.prompt_logprobs)
