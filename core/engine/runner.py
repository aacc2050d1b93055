"""Model runner: SchedulerOutput -> ragged ForwardBatch (host side) -> forward + sampling (device side).

`prepare` runs on the engine thread and only reads the scheduler output; `execute` may run on the
async pipeline's worker thread. An input token sampled by the step still in flight is a
placeholder row, filled in `execute` from that step's sampled tokens (which exist by then, since
steps execute in order).
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from deepinfer.engine.sampler import Sampler, SamplerOutput, SamplingMetadata, position_seed
from deepinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from deepinfer.models.interface import ForwardBatch


@dataclass(eq=False)
class PreparedStep:
    sched: SchedulerOutput
    batch: ForwardBatch
    sampling: SamplingMetadata
    sample_rows: list[ScheduledRequest]  # one per logits row, in order
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

    # -- host side --------------------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput, prev: PreparedStep | None) -> PreparedStep:
        input_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[ScheduledRequest] = []
        placeholder_rows: list[int] = []
        placeholder_src: list[int] = []
        prev_rows = {s.request_id: i for i, s in enumerate(prev.sample_rows)} if prev is not None else {}
        for s in sched.scheduled:
            start = len(input_ids)
            input_ids += s.token_ids
            for _ in range(s.num_placeholders):
                if s.request_id not in prev_rows:
                    raise RuntimeError(f"request {s.request_id} has an input token from a step that is not in flight")
                placeholder_rows.append(len(input_ids))
                placeholder_src.append(prev_rows[s.request_id])
                input_ids.append(0)
            positions += range(s.context_len, s.context_len + s.query_len)
            if s.sample:
                logits_indices.append(start + s.query_len - 1)
                sample_rows.append(s)

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
        )
        step = PreparedStep(sched=sched, batch=batch, sampling=self._sampling_metadata(sample_rows),
                            sample_rows=sample_rows, prev=prev if placeholder_rows else None,
                            placeholder_rows=placeholder_rows, placeholder_src=placeholder_src,
                            needs_bitmask=any(s.request.processors for s in sample_rows))
        if not step.needs_bitmask:
            step.bitmask.set_result(None)
        return step

    def _sampling_metadata(self, rows: list[ScheduledRequest]) -> SamplingMetadata:
        meta = SamplingMetadata(temperature=[], top_k=[], top_p=[], min_p=[], seeds=[], num_logprobs=[])
        for i, s in enumerate(rows):
            p = s.request.params
            meta.temperature.append(float(p.temperature))
            meta.top_k.append(p.effective_top_k)
            meta.top_p.append(float(p.top_p))
            meta.min_p.append(float(p.min_p))
            meta.seeds.append(None if p.seq_seed is None else position_seed(p.seq_seed, s.output_index))
            meta.num_logprobs.append(p.logprobs)
            if s.output_index < p.min_tokens:
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
        logits = self.model.forward(batch).logits
        bitmask = step.bitmask.result()  # the engine thread fills it while the forward runs
        if bitmask is not None:
            bitmask = bitmask.to(logits.device)
        out = self.sampler(logits, step.sampling, bitmask)
        step.sampled = out
        return out
