"""Decoder-side SWA bounded replay of DeepSeek-V4.1 prefill (docs/swa_replay.md).

V4.1's layers split into an encoder (every layer before the last KV source) and a decoder (the
last KV source, layer 20 of the release, and every layer after it). The decoder's only global KV
is that source's per-token compressed KV and index keys; everything else a decoder layer keeps is
its own sliding-window ring, and decode reads only the last `sliding_window` entries of it. So a
prefill can run, per sequence with prompt length P and kept length K:

- the encoder over every row (its rings and compressed caches are exact);
- the *prepass* over every row: the first decoder layer's compressor and index-key projection,
  which publish the complete decoder global KV (exact);
- the rest of the decoder (attention and MoE of the decoder layers) only over the rows at
  positions >= floor = max(0, P - K), with their window reads floored at `floor` (a kept row sees
  no decoder window entry below it: those rows were never computed).

Decode steps after prefill read window positions >= P - sliding_window + 1 > floor (K >= window),
so they are unchanged and run the exact path. The result is approximate by design: the decoder
states of the kept rows no longer see the dropped rows through the stacked windows.

The floor is per sequence and comes from the step (`ForwardBatch.prompt_lens`), never from the
model object, so any prefill chunking and preemption-recompute give the same kept rows: a chunk
wholly below the floor runs the encoder and the prepass only; a chunk reaching it runs the decoder
on its rows at or after the floor.

Under context parallelism the encoder and the prepass run on this rank's rows of the step (their
attention and compressor inputs gathered as usual); then the step's per-row state is gathered
(`_whole_step`) and the kept rows are split anew over the group for the decoder.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.models.batch import ForwardBatch
from deepinfer.models.deepseek_v4.block import ATTN
from deepinfer.models.deepseek_v4.state import AttnGroup, StepPlan
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.context_parallel import gather_outputs, gather_parts, step_split
from deepinfer.models.deepseek_v41.sites import run_blocks, run_modules
from deepinfer.models.deepseek_v41.state import RingSizes
from deepinfer.parallel.context_parallel import RowSplit

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM, StepInputs


def decoder_start(config: DeepseekV41Config) -> int:
    """The first decoder layer: the last KV source (every later layer reads only its global KV)."""
    if not config.kv_source_layer_ids:
        raise ValueError("this DeepSeek-V4.1 configuration has no KV source layer, so it has no encoder/decoder "
                         "split for bounded replay")
    return max(config.kv_source_layer_ids)


def minimum_keep_tokens(config: DeepseekV41Config, max_rollback: int) -> int:
    """The smallest kept suffix: one full window plus the maximum speculative backtrack, 2 x the
    verify width (`max_rollback` = 1 + drafts when speculative decoding is on, else 0)."""
    return config.sliding_window + 2 * max_rollback


class FlooredStepPlan(StepPlan):
    """A step plan whose window keys below a per-sequence position floor are masked out."""

    def __init__(self, batch: ForwardBatch, config: DeepseekV41Config, rings: RingSizes, block_size: int,
                 num_slots: int, query_block: int, floors: list[int], split: RowSplit | None = None):
        super().__init__(batch, config, rings, block_size, num_slots, query_block, split)
        self.floors = torch.tensor(floors, dtype=torch.long, device=self.device)

    def _group(self, items: list[tuple[int, int, int]], decode: bool = False,
               local_row: int | None = None) -> AttnGroup:
        g = super()._group(items, decode, local_row)
        # StepPlan._group's window keys are [max(0, first query - W + 1), end): rebuild their positions
        key_start = (g.q_pos[:, 0] - (self.config.sliding_window - 1)).clamp(min=0)
        key_pos = key_start.unsqueeze(1) + torch.arange(g.window_mask.shape[2], device=self.device)
        g.window_mask = g.window_mask & (key_pos >= self.floors[g.seq].unsqueeze(1)).unsqueeze(1)
        return g


@dataclass
class DecoderRows:
    """The rows of one step that the decoder runs under bounded replay."""

    layer: int  # first decoder layer
    rows: torch.Tensor  # [T'] step rows the decoder runs (positions >= the sequence's floor)
    row_of: torch.Tensor  # [T] index of each step row among `rows`, -1 where dropped
    batch: ForwardBatch | None  # `rows` as a ragged batch (sequences without kept rows left out); None: no row
    floors: list[int]  # per sequence of `batch`

    def kept(self, step_rows: torch.Tensor, what: str) -> torch.Tensor:
        """`step_rows` (rows of the step) as rows of the decoder's output; an error for a dropped row."""
        out = self.row_of[step_rows.to(self.row_of.device)]
        if bool((out < 0).any()):
            raise ValueError(f"{what} were requested at prompt rows that SWA bounded replay does not run through the "
                             f"decoder (rows below max(0, prompt_len - keep_tokens)); only rows in the kept suffix "
                             f"have them: request them there, or turn bounded replay off "
                             f"(DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=off)")
        return out

    def run_decoder(self, model: DeepseekV41ForCausalLM, streams: torch.Tensor, step: StepInputs
                    ) -> tuple[torch.Tensor, StepInputs | None]:
        """Prepass over every row, then the decoder over the kept rows: (kept streams, their step)."""
        c, blk = model.config, model.blocks[self.layer]
        site = blk.names.index(ATTN)
        for m in blk.modules[:site]:  # modules before the first decoder attention (Engram): every row
            streams = m.forward(streams, step)
        attn_site = blk.modules[site]
        x = model.accel.rms_norm(model.ops.hc_collapse(streams, step.pre), attn_site.norm, c.rms_norm_eps)
        blk.attn.publish_kv(x, step)  # the prepass: complete decoder global KV for every row
        if step.plan.split is not None:  # context parallelism: the decoder runs other rows, split anew
            streams, step = _whole_step(step.plan.split, streams, step)
        if self.batch is None:
            return streams[:0], None
        split = step_split(model.context_parallel, self.batch, model.cp_min_tokens, model.device)
        rows = self.rows if split is None else self.rows[split.local_rows]
        plan = FlooredStepPlan(self.batch, c, model._rings, model._cache.block_size, model._num_slots,
                               model.query_block, self.floors, split)
        kept = dataclasses.replace(
            step, input_ids=step.input_ids[rows], plan=plan,
            cos_sin={k: (cos[rows], sin[rows]) for k, (cos, sin) in step.cos_sin.items()}, pre=step.pre[rows],
            engram_rows=None if step.engram_rows is None else step.engram_rows[rows], selection={}, candidates={},
            picked={}, kv_published=True, span_rows=None if step.span_rows is None else step.span_rows[rows])
        h, waiting = run_modules(blk.modules[site:], streams[rows], None, kept)
        h = run_blocks(model.blocks[self.layer + 1:], h, kept, waiting)
        if split is not None:  # every rank's kept rows (the decoder layers' captures are kept rows too)
            h, kept.pre, kept.capture = gather_outputs(split, h, kept.pre, kept.capture,
                                                       range(self.layer, len(model.blocks)))
        return h, kept


def _whole_step(split: RowSplit, streams: torch.Tensor, step: StepInputs) -> tuple[torch.Tensor, StepInputs]:
    """A context-parallel step's per-row state (streams, ids, RoPE, mHC pre, Engram rows, DSpark
    captures so far) on every row of the step, from this rank's rows (one all-gather)."""
    parts = {"streams": streams, "input_ids": step.input_ids, "pre": step.pre}
    parts.update({f"cos.{k}": cos for k, (cos, _) in step.cos_sin.items()})
    parts.update({f"sin.{k}": sin for k, (_, sin) in step.cos_sin.items()})
    if step.engram_rows is not None:
        parts["engram_rows"] = step.engram_rows
    if step.span_rows is not None:  # image span positions (bool: gathered as bytes)
        parts["span_rows"] = step.span_rows.to(torch.uint8)
    captured = [] if step.capture is None else [layer for layer, f in step.capture.items() if f is not None]
    parts.update({f"capture.{layer}": step.capture[layer] for layer in captured})
    full = gather_parts(split, parts)
    for layer in captured:  # in the step's own dict, which the model reads afterwards
        step.capture[layer] = full[f"capture.{layer}"]
    whole = dataclasses.replace(step, input_ids=full["input_ids"], pre=full["pre"],
                                cos_sin={k: (full[f"cos.{k}"], full[f"sin.{k}"]) for k in step.cos_sin},
                                engram_rows=full.get("engram_rows"),
                                span_rows=None if step.span_rows is None else full["span_rows"].bool())
    return full["streams"], whole


def decoder_rows(batch: ForwardBatch, config: DeepseekV41Config, keep_tokens: int | None) -> DecoderRows | None:
    """The kept rows of this step, or None when bounded replay changes nothing in it (off, or no
    sequence has a decoder row or window key below its floor: decode steps, K >= prompt length)."""
    if keep_tokens is None:
        return None
    if batch.prompt_lens is None or len(batch.prompt_lens) != batch.num_seqs:
        raise ValueError("SWA bounded replay needs ForwardBatch.prompt_lens (the prompt length of every sequence, "
                         "which fixes its kept suffix); the engine's runner fills it, a hand-built batch must too")
    W = config.sliding_window
    floors = [max(0, int(p) - keep_tokens) for p in batch.prompt_lens]
    if all(f == 0 or c - (W - 1) >= f for f, c in zip(floors, batch.context_lens)):
        return None
    dev = batch.input_ids.device
    T = int(batch.input_ids.numel())
    seqs, ctx, qlens, rows, start = [], [], [], [], 0
    for i, (c, n, f) in enumerate(zip(batch.context_lens, batch.query_lens, floors)):
        first = max(c, f)
        if first < c + n:
            seqs.append(i)
            ctx.append(first)
            qlens.append(c + n - first)
            rows.append(torch.arange(start + first - c, start + n, device=dev))
        start += n
    kept_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=dev)
    row_of = torch.full((T,), -1, dtype=torch.long, device=dev)
    row_of[kept_rows] = torch.arange(kept_rows.numel(), device=dev)
    sub = None
    if seqs:
        index = torch.tensor(seqs, dtype=torch.long, device=dev)
        sub = ForwardBatch(
            input_ids=batch.input_ids[kept_rows], positions=batch.positions.to(dev)[kept_rows], query_lens=qlens,
            context_lens=ctx, slots=batch.slots[index.to(batch.slots.device)],
            block_tables={k: t[index.to(t.device)] for k, t in batch.block_tables.items()},
            logits_indices=torch.zeros(0, dtype=torch.long, device=dev),
            prompt_lens=[batch.prompt_lens[i] for i in seqs])
    return DecoderRows(decoder_start(config), kept_rows, row_of, sub, [floors[i] for i in seqs])
