"""Model runner: SchedulerOutput -> ragged ForwardBatch (host side) -> forward + sampling (device side).

`prepare` runs on the engine thread and only reads the scheduler output; `execute` may run on the
async pipeline's worker thread. An input token sampled by the step still in flight is a
placeholder row, filled in `execute` from that step's sampled tokens (which exist by then, since
steps execute in order).

Speculative decoding (a `speculator` from the draft_proposer slot): a decode carries its drafts as
extra input rows and gets a logits row per input row; `execute` lets the speculator accept or
reject the drafts (`verify`) and then draft for the next step (`propose`) from the target's final
residual streams of the rows it needs (`DraftRows`).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from deepinfer.engine.sampler import Sampler, SamplerOutput, SamplingMetadata, position_seed
from deepinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from deepinfer.models.interface import ForwardBatch


@dataclass
class DraftRows:
    """One scheduled request's rows as the draft proposer needs them (speculative decoding)."""

    scheduled: ScheduledRequest
    slot: int  # its cache slot in this step (the request may be preempted while the step runs)
    logits_start: int | None  # its first logits row; None for a chunk that samples nothing
    stream_start: int  # its first row of ForwardOutput.streams
    first_position: int  # position of that row
    num_stream_rows: int  # rows with streams: the last `context_window` positions of the chunk
    following_ids: list[int]  # the known input token after each stream row, up to the last known row
    next_known: int | None  # the token after the chunk, for a chunk that samples nothing
    num_known_tokens: int  # request.num_tokens when scheduled


@dataclass(eq=False)
class PreparedStep:
    sched: SchedulerOutput
    batch: ForwardBatch
    sampling: SamplingMetadata
    sample_rows: list[ScheduledRequest]  # one per sampled request, in order
    logits_starts: list[int] = field(default_factory=list)  # first logits row of each (1 + drafts rows)
    draft_rows: list[DraftRows] = field(default_factory=list)  # speculative decoding only
    drafts: dict = field(default_factory=dict)  # request id -> the speculator's next drafts (set by execute)
    prev: PreparedStep | None = None  # the step whose sampled tokens fill the placeholders
    placeholder_rows: list[int] = field(default_factory=list)  # rows of input_ids to fill
    placeholder_src: list[int] = field(default_factory=list)  # logits rows of `prev` that fill them
    needs_bitmask: bool = False
    bitmask: Future = field(default_factory=Future)  # resolved by the engine thread (or None)
    sampled: SamplerOutput | None = None  # set by execute


class ModelRunner:
    def __init__(self, model, sampler: Sampler, device: torch.device, block_group_names: list[str],
                 eos_token_ids: set[int]):
        self.model = model
        self.sampler = sampler
        self.device = device
        self.group_names = block_group_names
        self.eos_token_ids = eos_token_ids
        self.speculator = None  # set by the engine when a draft proposer is enabled

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
        window = spec.context_window if spec is not None and spec.features else 0
        stream_indices: list[int] = []
        draft_rows: list[DraftRows] = []
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
            if s.sample:
                logits_starts.append(len(logits_indices))
                logits_indices += range(start + s.query_len - 1 - m, start + s.query_len)
                sample_rows.append(s)
            if spec is not None:
                end = s.context_len + s.query_len
                first = max(s.context_len, s.request.num_tokens - window) if window else end
                rows = range(start + first - s.context_len, start + s.query_len)
                if s.sample or rows:
                    known_last = start + s.query_len - 1 - m  # last row with a known input token
                    draft_rows.append(DraftRows(
                        scheduled=s, slot=s.request.slot, logits_start=logits_starts[-1] if s.sample else None,
                        stream_start=len(stream_indices), first_position=first, num_stream_rows=len(rows),
                        following_ids=input_ids[rows.start + 1:known_last + 1] if rows else [],
                        next_known=None if s.sample else s.request.token_at(end),
                        num_known_tokens=s.request.num_tokens))
                    stream_indices += rows

        reqs = [s.request for s in sched.scheduled]
        block_tables = {}
        for name in self.group_names:
            width = max([len(r.block_ids.get(name, ())) for r in reqs] + [1])
            table = torch.full((len(reqs), width), -1, dtype=torch.int64)
            for i, r in enumerate(reqs):
                ids = r.block_ids.get(name, [])
                if ids:
                    table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
            block_tables[name] = table.to(self.device)

        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            query_lens=[s.query_len for s in sched.scheduled],
            context_lens=[s.context_len for s in sched.scheduled],
            slots=torch.tensor([r.slot for r in reqs], dtype=torch.int64, device=self.device),
            block_tables=block_tables,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            return_streams=bool(stream_indices),
            stream_indices=torch.tensor(stream_indices, dtype=torch.int64, device=self.device) if stream_indices else None,
        )
        step = PreparedStep(sched=sched, batch=batch,
                            sampling=self._sampling_metadata([(s, i) for s in sample_rows
                                                              for i in range(1 + len(s.draft_token_ids))]),
                            sample_rows=sample_rows, logits_starts=logits_starts, draft_rows=draft_rows,
                            prev=prev if placeholder_rows else None,
                            placeholder_rows=placeholder_rows, placeholder_src=placeholder_src,
                            needs_bitmask=any(s.request.processors for s in sample_rows))
        if not step.needs_bitmask:
            step.bitmask.set_result(None)
        return step

    def _sampling_metadata(self, rows: list[tuple[ScheduledRequest, int]]) -> SamplingMetadata:
        """One entry per logits row: (request, offset of the row among its 1 + drafts rows)."""
        meta = SamplingMetadata(temperature=[], top_k=[], top_p=[], min_p=[], seeds=[], num_logprobs=[])
        for i, (s, offset) in enumerate(rows):
            p = s.request.params
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

    # -- device side ------------------------------------------------------------------------------

    def execute(self, step: PreparedStep) -> SamplerOutput:
        batch = step.batch
        if step.placeholder_rows:
            prev_tokens = step.prev.sampled.token_ids.to(self.device)
            src = torch.tensor(step.placeholder_src, dtype=torch.int64, device=self.device)
            rows = torch.tensor(step.placeholder_rows, dtype=torch.int64, device=self.device)
            # A row that sampled nothing (dead end, -1) belongs to a finished request: feed token 0.
            batch.input_ids[rows] = prev_tokens[src].clamp(min=0)
            step.prev = None  # do not keep a chain of finished steps alive
        forward = self.model.forward(batch)
        logits = forward.logits
        bitmask = step.bitmask.result()  # the engine thread fills it while the forward runs
        if bitmask is not None:
            bitmask = bitmask.to(logits.device)
        if self.speculator is None:
            out = self.sampler(logits, step.sampling, bitmask)
        else:
            out = self.speculator.verify(logits, step, bitmask, self.sampler)
            step.drafts = self.speculator.propose(step, forward.streams, out)
        step.sampled = out
        return out
