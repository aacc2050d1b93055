"""Shared helpers for model tests: a tiny random transformers DeepseekV4ForCausalLM (the oracle,
its special parameters randomised: docs/model.md, "Verification"), our model built from its
weights, and a small engine stand-in that owns slots and blocks and runs sequences through
`forward` in ragged batches."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v4.weights import canonicalize
from deepinfer.models.batch import ImageSpan
from deepinfer.models.interface import ForwardBatch, allocate_cache_tensors

# the test model: every layer type, both MLP types, YaRN, 16 indexer heads (no top-k ties),
# index_topk 4 so that sparse selection is active from 16 tokens on.
TINY_HF = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, head_dim=32,
    partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    layer_types=[SLIDING, CSA, HCA, CSA, HCA, SLIDING], mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 4,
    sliding_window=8, compress_rates={CSA: 4, HCA: 16}, index_n_heads=16, index_head_dim=16, index_topk=4,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32,
                     "beta_fast": 32.0, "beta_slow": 1.0},
    max_position_embeddings=512, initializer_range=0.1,
)


def accelerator():
    try:
        from deepinfer_plugins.cpu import CpuAccelerator
        return CpuAccelerator()
    except ImportError:  # the CPU kernels alone are enough for the model
        from deepinfer_plugins.cpu.kernels import CpuKernels
        return CpuKernels()


def build_hf_model(seed: int = 0, **overrides):
    """A random fp32 HF model whose sinks, position biases, mHC parameters, router biases, hash
    tables and norm weights are randomised (the default init zeroes several of them)."""
    import transformers
    transformers.logging.set_verbosity_error()
    from transformers import DeepseekV4Config as HFConfig, DeepseekV4ForCausalLM as HFModel

    torch.manual_seed(seed)
    model = HFModel(HFConfig(**{**TINY_HF, **overrides})).eval()
    cfg = model.config
    gen = torch.Generator().manual_seed(seed + 1)

    def rnd(shape, std=1.0, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(rnd(p.shape, 1.0))
            elif name.endswith("position_bias"):
                p.copy_(rnd(p.shape, 0.5))
            elif name.endswith((".base", "hc_base")):
                p.copy_(rnd(p.shape, 0.5))
            elif name.endswith((".scale", "hc_scale")):
                p.copy_(rnd(p.shape, 0.3, 1.0))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(rnd(p.shape, 0.2, 1.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(rnd(b.shape, 0.1))
            elif name.endswith("tid2eid"):
                b.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen).argsort(-1)
                        [:, :cfg.num_experts_per_tok])
    return model


def our_config(hf_model) -> DeepseekV4Config:
    return DeepseekV4Config.from_dict(hf_model.config.to_dict())


def build_our_model(hf_model, dtype: torch.dtype = torch.float32, extra: dict | None = None,
                    query_block: int = 256) -> DeepseekV4ForCausalLM:
    cfg = our_config(hf_model)
    model = DeepseekV4ForCausalLM(cfg, accelerator(), dtype=dtype, device="cpu", query_block=query_block)
    state = canonicalize(hf_model.state_dict())
    state.update(extra or {})
    model.load_weights(state)
    return model


@torch.no_grad()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """Uncached full forward: logits `[len, V]` at every position."""
    return hf_model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()


@dataclass
class Seq:
    slot: int
    length: int = 0
    blocks: dict[str, list[int]] = field(default_factory=dict)


class Runner:
    """An engine stand-in: slots, a shuffled block pool per group, ragged batches."""

    def __init__(self, model: DeepseekV4ForCausalLM, max_rollback: int = 0, num_slots: int = 8,
                 num_blocks: int = 256, block_size: int = 4, seed: int = 0):
        self.model = model
        self.layout = model.cache_layout(max_rollback)
        groups = {g.name: num_blocks for g in self.layout.block_groups}
        self.cache = allocate_cache_tensors(self.layout, num_slots, groups, block_size, "cpu")  # what the model writes
        model.bind_cache(self.cache)
        self.block_size = block_size
        rng = random.Random(seed)
        self.free_blocks = {}
        for g in groups:
            pool = list(range(num_blocks))
            rng.shuffle(pool)  # non-contiguous block ids exercise the block-table indirection
            self.free_blocks[g] = pool
        self.free_slots = list(range(num_slots))[::-1]
        self.seqs: dict[object, Seq] = {}

    def add(self, key) -> None:
        self.seqs[key] = Seq(slot=self.free_slots.pop(), blocks={g.name: [] for g in self.layout.block_groups})

    def truncate(self, key, k: int) -> None:
        """Drop the last k tokens (rollback): only the length goes back."""
        self.seqs[key].length -= k

    def batch(self, chunks: dict[object, list[int]], return_streams: bool = False,
              images: dict[object, list[tuple[int, object]]] | None = None) -> ForwardBatch:
        """`images`: per key, the (span start position, preprocessed image) of its prompt's images."""
        ids, pos, q_lens, ctx, slots = [], [], [], [], []
        spans = [ImageSpan(i, start, image) for i, key in enumerate(chunks)
                 for start, image in (images or {}).get(key, ())]
        for key, toks in chunks.items():
            s = self.seqs[key]
            ids += toks
            pos += range(s.length, s.length + len(toks))
            q_lens.append(len(toks))
            ctx.append(s.length)
            slots.append(s.slot)
            for g in self.layout.block_groups:
                need = -(-g.entries_for(s.length + len(toks)) // self.block_size)
                while len(s.blocks[g.name]) < need:
                    s.blocks[g.name].append(self.free_blocks[g.name].pop())
        tables = {}
        for g in self.layout.block_groups:
            width = max([len(self.seqs[k].blocks[g.name]) for k in chunks] + [1])
            rows = [self.seqs[k].blocks[g.name] for k in chunks]
            tables[g.name] = torch.tensor([b + [-1] * (width - len(b)) for b in rows], dtype=torch.long)
        T = len(ids)
        return ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.long),
                            positions=torch.tensor(pos, dtype=torch.long),
                            query_lens=q_lens, context_lens=ctx, slots=torch.tensor(slots, dtype=torch.long),
                            block_tables=tables, logits_indices=torch.arange(T), return_streams=return_streams,
                            images=spans or None)

    def step(self, chunks: dict[object, list[int]], return_streams: bool = False,
             images: dict[object, list[tuple[int, object]]] | None = None):
        """Run one ragged step; returns {key: logits [len(chunk), V]} (and the streams when asked)."""
        out = self.model.forward(self.batch(chunks, return_streams, images))
        result, streams, row = {}, {}, 0
        for key, toks in chunks.items():
            result[key] = out.logits[row:row + len(toks)]
            if return_streams:
                streams[key] = out.streams[row:row + len(toks)]
            row += len(toks)
            self.seqs[key].length += len(toks)
        return (result, streams) if return_streams else result

    def generate(self, key, prompt: list[int], new_tokens: int, chunk_sizes: list[int] | None = None
                 ) -> tuple[list[int], torch.Tensor]:
        """Prefill (in the given chunk sizes) then greedy decode; returns (all tokens, logits at
        every position [len, V])."""
        self.add(key)
        logits, i = [], 0
        for n in chunk_sizes or [len(prompt)]:
            logits.append(self.step({key: prompt[i:i + n]})[key])
            i += n
        assert i == len(prompt)
        tokens = list(prompt)
        for _ in range(new_tokens):
            tokens.append(int(logits[-1][-1].argmax()))
            logits.append(self.step({key: tokens[-1:]})[key])
        return tokens, torch.cat(logits)


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute difference relative to the logit scale (max |b|, at least 1)."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1.0))
