"""Model runner: SchedulerOutput -> ragged ForwardBatch (host side) -> forward + sampling -> ModelRunnerOutput.

The runner reads only the scheduler output (`ScheduledRequest`: tokens, positions, cache slot and
block ids, sampling parameters, drafts) and writes no request. `prepare` runs on the engine thread;
`execute` may run on the async pipeline's worker thread. An input token sampled by the step still
in flight is a placeholder row, filled in `execute` from that step's sampled tokens (which exist by
then, since steps execute in order).

Logits rows: one per sampled request (plus one per draft), a forked sample sharing its source's
last row, then the rows of positions whose prompt log-probabilities are asked for; the sampler
sees only the first kind. Penalties and logit bias count the tokens before each row's position;
an input the step in flight samples is known only in `execute`, so their token lists are completed
there (`_AdjustmentSource`).

Speculative decoding (`speculator`, a core `SpeculativeDecoder`): a decode carries its drafts as
extra input rows and gets a logits row per input row; `execute` verifies the drafts instead of
plain sampling, then lets the drafter propose the next ones from the target's final residual
streams of the rows it needs (`DraftRows`).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from deepinfer.engine.cache_manager import CacheManager
from deepinfer.engine.request import Request
from deepinfer.engine.sampler import (LogitAdjustment, Sampler, SamplerOutput, SamplingMetadata, nonfinite_problem,
                                      position_seed)
from deepinfer.engine.scheduler import (ModelRunnerOutput, PromptScores, SampledTokens, ScheduledRequest,
                                        SchedulerOutput)
from deepinfer.engine.speculative import DraftRows, SpeculativeDecoder
from deepinfer.models.batch import long_tensor
from deepinfer.models.interface import ForwardBatch
from deepinfer.sampling_params import SamplingParams


#: the bitmask of every step without logits processors: resolved once, shared (a Future each step
#: costs a lock and a condition variable)
_NO_BITMASK: Future = Future()
_NO_BITMASK.set_result(None)


@dataclass
class _AdjustmentSource:
    """Where one logits row's penalty history comes from: the request's known tokens from position
    `first` up to its chunk, then the chunk's input rows `chunk` of the batch (filled in execute)."""

    adjustment: LogitAdjustment
    known: list[int]
    first: int  # position of known[0]
    num_prompt_tokens: int
    chunk: slice

    def resolve(self, input_ids: torch.Tensor) -> LogitAdjustment:
        history = torch.cat([torch.tensor(self.known, dtype=torch.int64), input_ids[self.chunk].cpu()])
        split = max(self.num_prompt_tokens - self.first, 0)
        self.adjustment.output_ids = history[split:]
        if self.adjustment.repetition != 1.0:
            self.adjustment.prompt_ids = history[:split]
        return self.adjustment


@dataclass
class _PromptRows:
    """Logits rows that score prompt tokens: `count` rows from `first_row`, scoring `token_ids`
    (the prompt tokens at positions `first_position`, ...)."""

    request_id: str
    first_row: int
    first_position: int
    token_ids: list[int]
    top: int  # alternatives asked for


@dataclass(eq=False)
class PreparedStep:
    sched: SchedulerOutput
    batch: ForwardBatch
    sampling: SamplingMetadata
    sample_rows: list[ScheduledRequest]  # one per sampled request, in order
    logits_starts: list[int] = field(default_factory=list)  # first logits row of each (1 + drafts rows)
    draft_rows: list[DraftRows] = field(default_factory=list)  # speculative decoding only
    prev: PreparedStep | None = None  # the step whose sampled tokens fill the placeholders
    placeholder_rows: list[int] = field(default_factory=list)  # rows of input_ids to fill
    placeholder_src: list[int] = field(default_factory=list)  # logits rows of `prev` that fill them
    needs_bitmask: bool = False
    bitmask: Future = field(default_factory=Future)  # resolved by the engine thread (or None)
    sampled: SamplerOutput | None = None  # set by execute
    adjustment_sources: list[_AdjustmentSource] = field(default_factory=list)
    prompt_rows: list[_PromptRows] = field(default_factory=list)

    @property
    def num_sample_rows(self) -> int:
        return self.sampling.num_rows


class ModelRunner:
    def __init__(self, model, sampler: Sampler, device: torch.device, block_group_names: list[str],
                 eos_token_ids: set[int]):
        self.model = model
        self.sampler = sampler
        self.device = device
        self.group_names = block_group_names
        self.eos_token_ids = eos_token_ids
        self.speculator: SpeculativeDecoder | None = None  # set by the engine when speculative decoding is on

    # -- host side --------------------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput, prev: PreparedStep | None) -> PreparedStep:
        input_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[ScheduledRequest] = []
        logits_starts: list[int] = []
        placeholder_rows: list[int] = []
        placeholder_src: list[int] = []
        prev_rows = {s.request_id: prev.logits_starts[i] for i, s in enumerate(prev.sample_rows)} \
            if prev is not None else {}
        spec = self.speculator
        window = spec.stream_window if spec is not None else 0
        stream_indices: list[int] = []
        draft_rows: list[DraftRows] = []
        last_rows: dict[str, int] = {}  # request id -> its last known input row (forks sample from it)
        chunk_starts: dict[str, int] = {}  # request id -> its first input row
        for s in sched.scheduled:
            start = len(input_ids)
            input_ids += s.token_ids
            for _ in range(s.num_placeholders):
                if s.request_id not in prev_rows:
                    raise RuntimeError(f"request {s.request_id} has an input token from a step that is not in flight")
                placeholder_rows.append(len(input_ids))
                placeholder_src.append(prev_rows[s.request_id])
                input_ids.append(0)
            input_ids += s.draft_token_ids
            positions += range(s.context_len, s.context_len + s.query_len)
            m = len(s.draft_token_ids)
            chunk_starts[s.request_id] = start
            last_rows[s.request_id] = start + s.query_len - 1 - m
            if s.sample:
                logits_starts.append(len(logits_indices))
                logits_indices += range(start + s.query_len - 1 - m, start + s.query_len)
                sample_rows.append(s)
            if spec is not None:
                end = s.context_len + s.query_len
                first = max(s.context_len, s.num_known_tokens - window) if window else end
                rows = range(start + first - s.context_len, start + s.query_len)
                if s.sample or rows:
                    known_last = start + s.query_len - 1 - m  # last row with a known input token
                    draft_rows.append(DraftRows(
                        scheduled=s, logits_start=logits_starts[-1] if s.sample else None,
                        stream_start=len(stream_indices), first_position=first, num_stream_rows=len(rows),
                        following_ids=input_ids[rows.start + 1:known_last + 1] if rows else [],
                        next_known=None if s.sample else s.tokens(end, end + 1)[0]))
                    stream_indices += rows

        for f in sched.forked:  # a fork samples from its source's last row: no input rows of its own
            logits_starts.append(len(logits_indices))
            logits_indices.append(last_rows[f.fork_of])
            sample_rows.append(f)
        prompt_rows = []
        for s in sched.scheduled:
            if s.prompt_positions:
                first = s.prompt_positions.start
                rows = [chunk_starts[s.request_id] + p - s.context_len for p in s.prompt_positions]
                prompt_rows.append(_PromptRows(s.request_id, len(logits_indices), first + 1,
                                               s.tokens(first + 1, s.prompt_positions.stop + 1),
                                               s.params.prompt_logprobs))
                logits_indices += rows

        block_tables = {}
        for name in self.group_names:
            # padded with -1 on the host, then one tensor (three ops per sequence when filled row by row)
            ids = [s.block_ids.get(name, ()) for s in sched.scheduled]
            width = max([len(b) for b in ids] + [1])
            flat = [i for b in ids for i in (*b, *[-1] * (width - len(b)))]
            block_tables[name] = long_tensor(flat, self.device).view(len(ids), width)

        batch = ForwardBatch(
            input_ids=long_tensor(input_ids, self.device),
            positions=long_tensor(positions, self.device),
            query_lens=[s.query_len for s in sched.scheduled],
            context_lens=[s.context_len for s in sched.scheduled],
            slots=long_tensor([s.slot for s in sched.scheduled], self.device),
            block_tables=block_tables,
            logits_indices=long_tensor(logits_indices, self.device),
            return_streams=bool(stream_indices),
            stream_indices=long_tensor(stream_indices, self.device) if stream_indices else None,
            prompt_lens=[s.request.num_prompt_tokens for s in sched.scheduled],
        )
        needs_bitmask = any(s.constrained for s in sample_rows)
        rows = [(s, i) for s in sample_rows for i in range(1 + len(s.draft_token_ids))]
        sources = [self._adjustment_source(row, s, offset, chunk_starts.get(s.fork_of or s.request_id, 0))
                   for row, (s, offset) in enumerate(rows) if s.params.adjusts_logits]
        return PreparedStep(sched=sched, batch=batch, sampling=self._sampling_metadata(rows),
                            sample_rows=sample_rows, logits_starts=logits_starts, draft_rows=draft_rows,
                            prev=prev if placeholder_rows else None,
                            placeholder_rows=placeholder_rows, placeholder_src=placeholder_src,
                            needs_bitmask=needs_bitmask, bitmask=Future() if needs_bitmask else _NO_BITMASK,
                            adjustment_sources=sources, prompt_rows=prompt_rows)

    @staticmethod
    def _adjustment_source(row: int, s: ScheduledRequest, offset: int, chunk_start: int) -> _AdjustmentSource:
        """The tokens before logits row `row` (request `s`, draft offset `offset`): the known ones
        before the chunk, then the chunk's inputs up to the row (a fork: none, its source's prompt
        is all known)."""
        p = s.params
        first = 0 if p.repetition_penalty != 1.0 else min(s.request.num_prompt_tokens, s.context_len)
        inputs = 0 if s.fork_of else s.query_len - len(s.draft_token_ids) + offset
        adjustment = LogitAdjustment(row=row, output_ids=torch.zeros(0, dtype=torch.int64),
                                     presence=float(p.presence_penalty), frequency=float(p.frequency_penalty),
                                     repetition=float(p.repetition_penalty), bias=p.logit_bias or None)
        known = s.request.tokens(first, s.context_len) if s.context_len > first else []
        return _AdjustmentSource(adjustment, known, first, s.request.num_prompt_tokens,
                                 slice(chunk_start, chunk_start + inputs))

    def _sampling_metadata(self, rows: list[tuple[ScheduledRequest, int]]) -> SamplingMetadata:
        """One entry per logits row: (request, offset of the row among its 1 + drafts rows)."""
        meta = SamplingMetadata(temperature=[], top_k=[], top_p=[], min_p=[], seeds=[], num_logprobs=[])
        for i, (s, offset) in enumerate(rows):
            p = s.params
            output_index = s.output_index + offset
            meta.temperature.append(0.0 if p.greedy else float(p.temperature))
            meta.top_k.append(p.effective_top_k)
            meta.top_p.append(float(p.top_p))
            meta.min_p.append(float(p.min_p))
            meta.seeds.append(None if p.seq_seed is None else position_seed(p.seq_seed, output_index))
            meta.num_logprobs.append(p.logprobs)
            if output_index < p.min_tokens:
                banned = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    banned |= self.eos_token_ids
                if banned:
                    meta.banned.append((i, sorted(banned)))
        return meta

    def dummy_run(self, cache: CacheManager, num_seqs: int, query_len: int, context_len: int, token: int = 0) -> None:
        """One target forward of `num_seqs` synthetic sequences, each with `query_len` new tokens (a
        decode verifying query_len - 1 drafts) after `context_len` tokens, then a device sync: for
        start-up profiling (speculative decoding times its verify cost with it). The cache it needs
        is held for the call only; the state it writes is overwritten by later steps."""
        requests = [Request(request_id=f"dummy-{i}", prompt=None, prompt_token_ids=[token] * (context_len + 1),
                            params=SamplingParams(max_tokens=1), arrival_index=-1) for i in range(num_seqs)]
        try:
            for r in requests:
                if not cache.allocate(r, context_len + query_len):
                    raise RuntimeError(f"the cache pool is too small for {num_seqs} sequences of "
                                       f"{context_len + query_len} tokens")
            scheduled = [ScheduledRequest(request=r, context_len=context_len, token_ids=[token], num_placeholders=0,
                                          sample=True, output_index=0, draft_token_ids=[token] * (query_len - 1))
                         for r in requests]
            self.model.forward(self.prepare(SchedulerOutput(step_id=0, scheduled=scheduled), None).batch)
            self.sampler.accelerator.synchronize()
        finally:
            for r in requests:
                cache.free(r)

    # -- device side ------------------------------------------------------------------------------

    def execute(self, step: PreparedStep) -> ModelRunnerOutput:
        batch = step.batch
        if step.placeholder_rows:
            prev_tokens = step.prev.sampled.token_ids.to(self.device)
            src = torch.tensor(step.placeholder_src, dtype=torch.int64, device=self.device)
            rows = torch.tensor(step.placeholder_rows, dtype=torch.int64, device=self.device)
            # A row that sampled nothing (dead end, -1) belongs to a finished request: feed token 0.
            batch.input_ids[rows] = prev_tokens[src].clamp(min=0)
            step.prev = None  # do not keep a chain of finished steps alive
        step.sched.restore_prefixes()  # prefix-cache hits: their cached state, before the forward
        forward = self.model.forward(batch)
        logits = forward.logits[:step.num_sample_rows]
        prompt_scores = self._score_prompts(step, forward.logits)
        step.sampling.adjustments = [a.resolve(batch.input_ids) for a in step.adjustment_sources]
        bitmask = step.bitmask.result()  # the engine thread fills it while the forward runs
        if bitmask is not None:
            bitmask = bitmask.to(logits.device)
        drafts = {}
        if self.speculator is None:
            out = self.sampler(logits, step.sampling, bitmask)
        else:
            out = self.speculator.verify(logits, step, bitmask)
            drafts = self.speculator.propose(step, forward.streams, out)
        step.sched.capture_prefixes()  # snapshots at block boundaries, after every model call of the step
        step.sched.copy_forks()
        step.sampled = out
        return ModelRunnerOutput(sampled=self._per_request(step, out, logits), drafts=drafts,
                                 prompt_scores=prompt_scores)

    def _score_prompts(self, step: PreparedStep, logits: torch.Tensor) -> dict[str, PromptScores]:
        """The prompt log-probabilities of the step's prompt rows (raw distribution), by request."""
        scores = {}
        for pr in step.prompt_rows:
            rows = logits[pr.first_row:pr.first_row + len(pr.token_ids)].float()
            tokens = torch.tensor(pr.token_ids, dtype=torch.int64, device=rows.device)
            logprobs, ranks, top_ids, top_logprobs, log_norm = self.sampler.score_tokens(rows, tokens, pr.top)
            broken = (~torch.isfinite(log_norm)).nonzero()
            if broken.numel():
                i = int(broken[0])
                scores[pr.request_id] = PromptScores(pr.first_position, [], [], error=nonfinite_problem(
                    rows[i], 0, at=f"prompt position {pr.first_position + i - 1}"))
                continue
            top = None
            if top_ids is not None:
                top = [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_logprobs.tolist())]
            scores[pr.request_id] = PromptScores(pr.first_position, logprobs.tolist(), ranks.tolist(), top)
        return scores

    @staticmethod
    def _per_request(step: PreparedStep, out: SamplerOutput, logits: torch.Tensor) -> dict[str, SampledTokens]:
        """The sampler's rows as each request's emitted tokens (rows after them carry -1), and why
        the position after them could not be sampled, if it could not (`logits`: to say what was
        wrong with a non-finite row)."""
        tokens = out.token_ids.tolist()
        logprobs = out.logprobs.tolist()
        dead = out.dead.tolist()
        nonfinite = out.nonfinite.tolist()
        ranks = out.ranks.tolist() if out.ranks is not None else None
        result = {}
        for start, s in zip(step.logits_starts, step.sample_rows):
            end = start + len(s.draft_token_ids) + 1
            n = next((i for i in range(start, end) if tokens[i] < 0), end) - start
            stop = start + n  # the row no token came from, if any
            k = s.params.logprobs
            top = None
            if k and out.top_ids is not None:
                top = [list(zip(out.top_ids[row, :k].tolist(), out.top_logprobs[row, :k].tolist()))
                       for row in range(start, start + n)]
            broken = stop < end and nonfinite[stop]
            result[s.request_id] = SampledTokens(
                token_ids=tokens[start:start + n], logprobs=logprobs[start:start + n],
                ranks=ranks[start:start + n] if ranks is not None and k is not None else None, top=top,
                dead=stop < end and dead[stop] and not broken,
                error=nonfinite_problem(logits[stop], s.output_index + n) if broken else None)
        return result
