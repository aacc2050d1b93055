"""What `LLM.generate` returns: one `RequestOutput` per prompt (vLLM-compatible field names)."""
from __future__ import annotations

from dataclasses import dataclass, field

#: finish_reason values:
#:   "stop"   - EOS, a stop token, a stop string, or a logits processor completed its constraint;
#:   "length" - max_tokens or max_model_len was reached;
#:   "error"  - the request was refused at admission (see `RequestOutput.error`); others still ran;
#:   "grammar_dead_end" - the logits processors masked every token of the vocabulary, so nothing
#:              could be sampled; the tokens up to that point are returned, `error` says why;
#:   "abort"  - `LLM.abort` / `LLM.abort_all` (or an interrupt) stopped it; the tokens generated
#:              before are returned.
FINISH_REASONS = ("stop", "length", "error", "grammar_dead_end", "abort")


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token of the model's (raw) distribution
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per generated token, when requested
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


def mean_logprob(output: CompletionOutput) -> float:
    """The mean log-probability per generated token (-inf for an empty output): how best_of ranks."""
    if not output.token_ids or output.cumulative_logprob is None:
        return float("-inf")
    return output.cumulative_logprob / len(output.token_ids)


def best_samples(outputs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The `n` samples with the highest mean log-probability per token (OpenAI's `best_of`), best
    first, renumbered 0..n-1; every sample, in order, when n covers them all."""
    if n >= len(outputs):
        return outputs
    chosen = sorted(outputs, key=mean_logprob, reverse=True)[:n]
    for i, out in enumerate(chosen):
        out.index = i
    return chosen


@dataclass
class RequestMetrics:
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    #: exp(-mean log p(token)) over the generated tokens, under the model's raw distribution
    #: (before temperature, top-k/p and masks). None when nothing was generated.
    decode_ppl: float | None = None
    #: accepted / verified speculative draft tokens (drafts the target checked); None without
    #: speculative decoding or when no draft was verified.
    accept_rate: float | None = None
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None  # set when finish_reason is "error", "grammar_dead_end" or "abort"
    #: per prompt token, its log-probability and the top alternatives (None for the first token),
    #: when `SamplingParams.prompt_logprobs` asked for them
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __repr__(self) -> str:
        out = self.outputs[0] if self.outputs else None
        text = out.text if out else ""
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"text={text!r}, finish_reason={out.finish_reason if out else None!r}"
                + (f", error={self.error!r}" if self.error else "") + ")")
