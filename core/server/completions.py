"""`/v1/completions`: a request's prompts and fields as engine requests, and their deltas as
Completions choices (text, `echo`, the legacy `logprobs` object), streamed or whole.

A batch of prompts is one engine request per prompt; a prompt with `n` / `best_of` is one engine
request of several samples. Choice `i * n + j` is sample `j` of prompt `i` (OpenAI's order); with
`best_of` > n the `n` samples of a prompt with the highest mean log-probability are returned.
`echo` puts the prompt before the text, and with `logprobs` the prompt tokens' log-probabilities
before the generated ones (the first prompt token has none): what lm-evaluation-harness reads to
score a continuation, with `max_tokens` 1, or 0 to generate nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.outputs import CompletionOutput, Logprob, best_samples
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.engine_loop import Delta
from deepinfer.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest


def completion_params(req: CompletionRequest) -> SamplingParams:
    """The engine's SamplingParams of a request (ValueError names a bad value)."""
    scores_prompt = req.echo and req.logprobs is not None
    return SamplingParams(
        max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, stop=req.stop, n=req.n, best_of=req.best_of,
        logprobs=req.logprobs, prompt_logprobs=req.logprobs if scores_prompt else (0 if req.max_tokens == 0 else None),
        so_args=None if req.structured_outputs is None else req.structured_outputs.so_args(),
        **req.sampling_kwargs())


@dataclass
class Sample:
    """One choice being built: its tokens, their logprob entries, the text sent so far."""

    index: int  # the sample within its prompt
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    streamed: str = ""  # the text decoded so far (streaming)
    sent: int = 0  # characters of `streamed` sent
    final: Delta | None = None


class PromptChoices:
    """The choices of one prompt: `n` (of `best_of`) samples, with echo and logprobs as asked."""

    def __init__(self, req: CompletionRequest, params: SamplingParams, prompt_ids: list[int], prompt_text: str,
                 tokenizer: Any, first_choice: int):
        self.req, self.params, self.tokenizer = req, params, tokenizer
        self.prompt_ids, self.prompt_text = prompt_ids, prompt_text
        self.first_choice = first_choice
        self.samples = [Sample(j) for j in range(params.num_samples)]
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.decoders = [tokenizer.stream_decoder(skip_special_tokens=params.skip_special_tokens)
                         for _ in self.samples]
        # a stop string may be forming at the end of the text: held back until it cannot be
        self.holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        self.echo_sent: set[int] = set()

    # -- deltas in --------------------------------------------------------------------------------

    def add(self, delta: Delta) -> None:
        sample = self.samples[delta.index]
        sample.token_ids += delta.token_ids
        if delta.logprobs:
            sample.logprobs += delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            sample.final = delta

    # -- whole response ---------------------------------------------------------------------------

    def choices(self) -> list[CompletionChoice]:
        outputs = [CompletionOutput(index=s.index, text=s.final.text if s.final else "", token_ids=s.token_ids,
                                    cumulative_logprob=s.final.cumulative_logprob if s.final else None,
                                    logprobs=s.logprobs, finish_reason=s.final.finish_reason if s.final else None)
                   for s in self.samples]
        chosen = best_samples(outputs, self.params.n)
        return [CompletionChoice(index=self.first_choice + k, text=(self.prompt_text if self.req.echo else "") + o.text,
                                 finish_reason=o.finish_reason,
                                 logprobs=self._logprobs(o.token_ids, o.logprobs, echo=self.req.echo))
                for k, o in enumerate(chosen)]

    @property
    def num_generated(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    # -- streaming --------------------------------------------------------------------------------

    def stream_piece(self, delta: Delta) -> CompletionChoice | None:
        """The choice chunk for a delta of new tokens (None: nothing new to send yet)."""
        sample = self.samples[delta.index]
        sample.streamed += self.decoders[delta.index].push(delta.token_ids)
        safe = len(sample.streamed) - self.holdback
        echo = self._echo_once(delta.index)
        if safe <= sample.sent and not echo:
            return None
        piece, sample.sent = sample.streamed[sample.sent:max(safe, sample.sent)], max(safe, sample.sent)
        return CompletionChoice(index=self.first_choice + delta.index, text=self._echo_text(echo) + piece,
                                logprobs=self._logprobs(delta.token_ids, delta.logprobs or [], echo=echo))

    def stream_end(self, delta: Delta) -> CompletionChoice:
        """The last chunk of a sample: the rest of its final text (stop strings cut)."""
        sample = self.samples[delta.index]
        echo = self._echo_once(delta.index)
        return CompletionChoice(index=self.first_choice + delta.index,
                                text=self._echo_text(echo) + delta.text[sample.sent:],
                                finish_reason=delta.finish_reason,
                                logprobs=self._logprobs(delta.token_ids, delta.logprobs or [], echo=echo))

    def _echo_once(self, index: int) -> bool:
        """Whether this sample's next chunk is its first with echo (it carries the prompt)."""
        if not self.req.echo or index in self.echo_sent:
            return False
        self.echo_sent.add(index)
        return True

    def _echo_text(self, echo: bool) -> str:
        return self.prompt_text if echo else ""

    # -- logprobs ---------------------------------------------------------------------------------

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]], echo: bool
                  ) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        out = CompletionLogprobs()
        rows: list[tuple[int, dict[int, Logprob] | None]] = []
        if echo:
            prompt = self.prompt_logprobs or [None] * len(self.prompt_ids)
            rows += list(zip(self.prompt_ids, prompt))
        rows += list(zip(token_ids, entries))
        offset = 0
        for token, entry in rows:
            text = self._token_text(token, entry)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(entry[token].logprob)
            # the token and the `logprobs` most likely ones (vLLM's), most likely first
            ranked = sorted(entry.items(), key=lambda item: item[1].rank)
            out.top_logprobs.append({self._token_text(t, entry): lp.logprob for t, lp in ranked})
        return out

    def _token_text(self, token: int, entry: dict[int, Logprob] | None) -> str:
        known = entry.get(token).decoded_token if entry is not None and token in entry else None
        return known if known is not None else self.tokenizer.decode([token])
