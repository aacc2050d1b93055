"""Engram: hashed n-gram memory added to the residual streams before some layers' attention.

Hashing (`EngramHasher`, once per step for every Engram layer). Each token id maps to a
compressed id (the tokenizer-derived map, `engram_vocab.py`; loaded as `engram.token_map`). For
the token at position t, look back k = 0..N-1 (N = `engram_max_ngram_size`); a slot before the
sequence start is the compressed id of `engram_pad_token_id`. Per Engram layer, N odd int64
multipliers `2u + 1` (u from numpy's PCG64 `default_rng(10007 * layer_id)`, below
`(int64_max // compressed_vocab) // 2`; exact int64, never through a double) build a rolling hash
`h = c_t * m_0`, then `h ^= c_{t-k} * m_k` for k = 1..N-1; after step k it hashes the (k+1)-gram,
and each of that order's `engram_n_heads` heads takes `h mod p` for its own prime p. The primes are
the next unused primes above `engram_vocab_size - 1`, drawn per layer (in config order), per order,
per head, each order restarting its search at `engram_vocab_size - 1` (used primes are skipped
across layers); a head's rows start after the preceding heads' primes within the layer.

Image span positions are dead (`hash(..., dead)`): their compressed id is `DEAD` (-1), also in the
history, and a look-back stops at the first dead or pre-start slot: it and every older slot take
the pad id, so no n-gram crosses an image. `Engram` adds nothing at a span position (its gate is 0).

The n-gram history is per sequence state (`state.ENGRAM_HISTORY`: the compressed ids of the last
N-1 + max_rollback positions, a ring by position), so it survives chunked prefill, preemption
(recomputed with the prompt) and rollback, and nothing of it lives on the model.

Lookup and mixing (`Engram`, a block sub-module before attention): gather the N-1 x heads rows of
the FP8 table (e4m3 `[rows, hd]` + one ue8m0 scale per 32 channels, memory-mapped, dequantised per
row), project with `wkv` to one key per stream and one shared value, and add a gated value to each
stream: `d_k = sum(h_k * (q_weight * k_weight)_k * key_k) * rsqrt(mean(h_k^2) + eps)
* rsqrt(mean(key_k^2) + eps) / sqrt(D)`, `h_k += sigmoid(sign(d_k) * sqrt(max(|d_k|, 1e-6))) * value`.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.models.common.ragged import take_rows
from deepinfer.models.common.weights import WeightUses
from deepinfer.models.deepseek_v41.config import DeepseekV41Config

ENGRAM = "engram"
SCALE_BLOCK = 32  # channels per ue8m0 scale of an Engram table row
_SEED_STRIDE = 10007
DEAD = -1  # the compressed id of an image span position


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % f for f in range(3, math.isqrt(n) + 1, 2))


def engram_primes(config: DeepseekV41Config) -> list[list[int]]:
    """Per Engram layer, its (N-1) x heads primes in head order (orders 2..N, heads 1..n)."""
    used: set[int] = set()
    out = []
    for _ in config.engram_layer_ids:
        layer = []
        for _ in range(config.engram_max_ngram_size - 1):
            p = config.engram_vocab_size - 1
            for _ in range(config.engram_n_heads):
                p += 1
                while not _is_prime(p) or p in used:
                    p += 1
                used.add(p)
                layer.append(p)
        out.append(layer)
    return out


def engram_multipliers(config: DeepseekV41Config) -> list[list[int]]:
    """Per Engram layer, N odd int64 multipliers (exact Python ints)."""
    bound = max(1, (np.iinfo(np.int64).max // config.engram_compressed_vocab_size) // 2)
    out = []
    for layer in config.engram_layer_ids:
        u = np.random.default_rng(_SEED_STRIDE * layer).integers(0, bound, size=(config.engram_max_ngram_size,),
                                                                  dtype=np.int64)
        out.append([int(v) * 2 + 1 for v in u])
    return out


class EngramHasher:
    """Row ids `[T, engram layers, hash heads]` of a step's tokens, from the step's ids and the
    sequences' compressed-id history."""

    def __init__(self, config: DeepseekV41Config, token_map: torch.Tensor, device: torch.device):
        if token_map.dim() != 1 or token_map.numel() != config.vocab_size:
            raise ValueError(f"engram.token_map must be [vocab_size={config.vocab_size}] compressed ids; got shape "
                             f"{tuple(token_map.shape)}")
        self.c = config
        self.token_map = token_map.to(device=device, dtype=torch.long)
        self.pad_id = int(self.token_map[config.engram_pad_token_id])
        primes = engram_primes(config)
        for layer, ps, rows in zip(config.engram_layer_ids, primes, config.engram_num_embeddings):
            if sum(ps) > rows:
                raise ValueError(f"Engram layer {layer} hashes into {sum(ps)} rows but engram_num_embeddings gives "
                                 f"{rows}; the table is too small for the configured primes")
        self.primes = torch.tensor(primes, dtype=torch.long, device=device)  # [Le, heads]
        self.offsets = torch.tensor([[0, *np.cumsum(ps[:-1]).tolist()] for ps in primes], dtype=torch.long,
                                    device=device)
        self.multipliers = torch.tensor(engram_multipliers(config), dtype=torch.long, device=device)  # [Le, N]
        self.look_back = torch.arange(config.engram_max_ngram_size, device=device)  # k = 0..N-1

    def hash(self, input_ids: torch.Tensor, plan, history: torch.Tensor, dead: torch.Tensor | None = None
             ) -> torch.Tensor:
        """input_ids `[T]`; `plan` the step's RaggedPlan; history `[num_slots, Re]` int64 (this
        step's compressed ids are written into it after the look-ups); dead `[T]` bool: the image
        span positions, or None."""
        N, heads = self.c.engram_max_ngram_size, self.c.engram_n_heads
        ids = self.token_map[input_ids]  # [T]
        if dead is not None:
            ids = ids.masked_fill(dead, DEAD)
        ring = history.shape[1]
        flat_history = history.view(-1)
        # every look-back k = 0..N-1 at once: [T, N] positions, their ids from this step or the history
        back = self.look_back
        p = plan.positions.unsqueeze(1) - back
        in_step = back <= plan.query_offsets.unsqueeze(1)
        from_step = ids[(plan.row_ids.unsqueeze(1) - back).clamp(min=0)]
        from_history = flat_history[plan.row_slot.unsqueeze(1) * ring + p.clamp(min=0) % ring]
        c = torch.where(in_step, from_step, from_history)
        blocked = ((p < 0) | (c == DEAD)).cumsum(dim=1) > 0  # the look-back passed the start or an image
        products = c.masked_fill(blocked, self.pad_id).unsqueeze(1) * self.multipliers  # [T, Le, N] (wraps)
        h = products[..., 0]
        grams = []  # the rolling hash of each order 2..N
        for k in range(1, N):
            h = torch.bitwise_xor(h, products[..., k])
            grams.append(h)
        plan.ring_write(ring).store(flat_history, ids)
        return torch.stack(grams, dim=-1).repeat_interleave(heads, dim=-1) % self.primes + self.offsets


class Engram:
    """The memory sub-module of one layer (runs on the streams before attention)."""

    name = ENGRAM

    def __init__(self, config: DeepseekV41Config, index: int, weights: dict[str, torch.Tensor], accel: Accelerator):
        """`index`: this layer's position in `engram_layer_ids`; `weights` relative to `engram.`:
        `embed.weight` (float8_e4m3fn, kept as stored), `embed.scale` (float8_e8m0fnu), `wkv.weight`,
        `q_weight`, `k_weight`."""
        self.c, self.index, self.accel = config, index, accel
        self.table = weights["embed.weight"].view(torch.uint8)
        self.scale = weights["embed.scale"].view(torch.uint8)
        self.wkv = weights["wkv.weight"]
        self.qk = (weights["q_weight"].float() * weights["k_weight"].float())  # [n, D]

    def weight_uses(self) -> WeightUses:
        yield "linear", self.wkv

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantised table rows `[*ids.shape, hd]` on `ids`' device (only the gathered rows are read).

        The table stays where the loader mapped it (host memory, also under an accelerator): the
        rows are gathered there and only their FP8 bytes travel to the compute device."""
        table_ids = ids.to(self.table.device)
        codes = take_rows(self.table, table_ids).to(ids.device).view(torch.float8_e4m3fn).float()
        scales = take_rows(self.scale, table_ids).to(ids.device).view(torch.float8_e8m0fnu).float()
        return (codes * scales.repeat_interleave(SCALE_BLOCK, dim=-1)).to(dtype)

    def forward(self, streams: torch.Tensor, step) -> torch.Tensor:
        T, n, D = streams.shape
        emb = self.rows(step.engram_rows[:, self.index], streams.dtype).reshape(T, -1)
        key, value = self.accel.linear(emb, self.wkv).split((n * D, D), dim=-1)
        key = key.float().view(T, n, D)
        h = streams.float()
        eps = self.c.rms_norm_eps
        rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
        dot = (h * self.qk * key).sum(-1) * rstd * D ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if getattr(step, "span_rows", None) is not None:  # no Engram contribution at image positions
            gate = gate.masked_fill(step.span_rows.unsqueeze(-1), 0.0)
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(1)).to(streams.dtype)
