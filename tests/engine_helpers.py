"""A toy model and tokenizer that exercise the engine's cache contract without a real model.

`ToyModel` keeps real per-sequence state in the engine's pool: a rolling hash in its slot, a ring
of the last 4 tokens in its slot, and one compressed entry (the sum of 4 tokens) per 4 tokens in a
block group. Its next-token distribution depends on all of it, so a wrong slot, a wrong block
table, or state that does not carry across chunks changes the tokens.
"""
from __future__ import annotations

import torch

from deepinfer.engine.cache_manager import CacheManager
from deepinfer.engine.engine_core import EngineCore
from deepinfer.models.interface import (BlockGroup, CacheLayout, CacheTensors, ForwardBatch, ForwardOutput,
                                        StateTensor, allocate_cache_tensors)

TOY_VOCAB = 64
TOY_EOS = 1
MOD = 1_000_003


class ToyModel:
    def __init__(self, vocab_size: int = TOY_VOCAB, sharpness: float = 3.0):
        self.vocab_size = vocab_size
        self.sharpness = sharpness
        self.cache: CacheTensors | None = None
        self.forward_calls = 0

    def cache_layout(self, max_rollback: int = 0) -> CacheLayout:
        slot = (StateTensor("hash", (1,), torch.int64, (0,)), StateTensor("ring", (4,), torch.int64, (0,)))
        group = BlockGroup("c4", 4, (StateTensor("entry", (1,), torch.int64, (0,)),))
        return CacheLayout(slot_tensors=slot, block_groups=(group,), max_rollback=max_rollback)

    def bind_cache(self, tensors: CacheTensors) -> None:
        self.cache = tensors

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        self.forward_calls += 1
        c = self.cache
        hash_, ring = c.slot["hash"][0], c.slot["ring"][0]
        entries = c.blocks["c4"]["entry"][0]
        bs = c.block_size
        ids = batch.input_ids.tolist()
        rows = []
        start = 0
        for i, (q, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
            slot = int(batch.slots[i])
            table = batch.block_tables["c4"][i].tolist()
            h = 0 if ctx == 0 else int(hash_[slot, 0])
            for j in range(q):
                pos = ctx + j
                tok = ids[start + j]
                assert int(batch.positions[start + j]) == pos
                h = (h * 31 + tok + 1) % MOD
                ring[slot, pos % 4] = tok
                if (pos + 1) % 4 == 0:
                    e = (pos + 1) // 4 - 1
                    assert table[e // bs] >= 0, "entry written outside the allocated blocks"
                    entries[table[e // bs] * bs + e % bs, 0] = int(ring[slot].sum())
                rows.append((h, pos + 1, table))
            hash_[slot, 0] = h
            start += q
        logits = []
        for r in batch.logits_indices.tolist():
            h, n, table = rows[r]
            total = sum(int(entries[table[e // bs] * bs + e % bs, 0]) for e in range(n // 4))
            center = (h + 7 * total) % self.vocab_size
            v = torch.arange(self.vocab_size, dtype=torch.float32)
            row = torch.cos((v - center) * 0.37) * self.sharpness + (v == center) * 1.5
            row[:2] = -10.0  # BOS and EOS stay unlikely: tests pick their own stop tokens
            logits.append(row)
        out = torch.stack(logits) if logits else torch.zeros(0, self.vocab_size)
        return ForwardOutput(logits=out)


class FaultyToyModel(ToyModel):
    """A ToyModel whose logits break for sequences that start with token `trigger`, at every position
    from `after` tokens on: one NaN (`fault="nan"`), one +inf ("inf") or every logit -inf ("-inf").
    The other sequences get exactly the ToyModel's logits."""

    def __init__(self, fault: str, trigger: int = 63, after: int = 0, **kw):
        super().__init__(**kw)
        self.fault, self.trigger, self.after = fault, trigger, after
        self.first_token: dict[int, int] = {}  # slot -> the first token of its sequence

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        out = super().forward(batch)
        ids, positions = batch.input_ids.tolist(), batch.positions.tolist()
        slot_of_row, start = [], 0
        for i, (q, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
            slot = int(batch.slots[i])
            if ctx == 0:
                self.first_token[slot] = ids[start]
            slot_of_row += [slot] * q
            start += q
        for k, r in enumerate(batch.logits_indices.tolist()):
            if self.first_token.get(slot_of_row[r]) == self.trigger and positions[r] + 1 >= self.after:
                if self.fault == "-inf":
                    out.logits[k] = float("-inf")
                else:
                    out.logits[k, 7] = float(self.fault)
        return out


class ToyTokenizer:
    """Token v <-> one character; id 0 is BOS, 1 is EOS (decoded as nothing)."""

    bos_token_id = 0
    eos_token_id = TOY_EOS
    ALPHABET = "..abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?"

    def __init__(self, vocab_size: int = TOY_VOCAB):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [self.ALPHABET.index(ch, 2) if ch in self.ALPHABET[2:] else 30 for ch in text]
        return ([0] if add_bos else []) + ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.ALPHABET[i] for i in ids if i >= 2 and i < len(self.ALPHABET))

    def stream_decoder(self, skip_special_tokens: bool = False):
        tok = self

        class _Stream:
            def push(self, ids):
                ids = [ids] if isinstance(ids, int) else ids
                return tok.decode(ids)
        return _Stream()


def toy_engine(*, num_slots: int = 4, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 4,
               max_num_batched_tokens: int = 32, max_model_len: int = 256, async_pipeline: bool = False,
               features=None, processors=None, sampler_force_topk=None, model: ToyModel | None = None,
               seed: int = 0, eos_token_ids: set[int] = frozenset({TOY_EOS})) -> EngineCore:
    from deepinfer_plugins.cpu import CpuAccelerator

    model = model or ToyModel()
    layout = model.cache_layout(0)
    tensors = allocate_cache_tensors(layout, num_slots, {"c4": num_blocks}, block_size, "cpu")
    model.bind_cache(tensors)
    cache = CacheManager(layout, num_slots, {"c4": num_blocks}, block_size, tensors=tensors)
    return EngineCore(model=model, accelerator=CpuAccelerator(), tokenizer=ToyTokenizer(model.vocab_size),
                      cache=cache, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, vocab_size=model.vocab_size,
                      eos_token_ids=set(eos_token_ids), device=torch.device("cpu"), async_pipeline=async_pipeline,
                      sampler_force_topk=sampler_force_topk, seed=seed, features=features, processors=processors)


def run_all(engine: EngineCore, prompts, params):
    """Add every prompt, step until done; RequestOutputs in order."""
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    guard = 0
    while engine.has_unfinished():
        engine.step()
        guard += 1
        assert guard < 100_000, "engine did not finish"
    return [r.to_output() for r in reqs]
