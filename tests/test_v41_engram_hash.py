"""EngramHasher against the definition written out token by token (engram.py's module doc): a ragged
step of chunked prefills and decode tokens over the history ring, with image positions (dead) in it."""
from __future__ import annotations

import torch

from deepinfer.models.batch import ForwardBatch
from deepinfer.models.common.ragged import RaggedPlan
from deepinfer.models.deepseek_v41.engram import DEAD, EngramHasher, engram_multipliers, engram_primes
from deepinfer.models.deepseek_v41.make_model import model_config

INT64 = 1 << 64


def _wrap(v: int) -> int:
    """Python int -> its int64 value (two's complement wrap-around, as torch's products)."""
    v %= INT64
    return v - INT64 if v >= 1 << 63 else v


def _reference_rows(config, compressed: list[int], pad: int) -> list[list[list[int]]]:
    """Per position of one sequence's compressed ids (DEAD at image positions): rows [layers][heads]."""
    N, heads = config.engram_max_ngram_size, config.engram_n_heads
    primes, mults = engram_primes(config), engram_multipliers(config)
    out = []
    for t in range(len(compressed)):
        grams, blocked = [], False
        for k in range(N):
            c = compressed[t - k] if t - k >= 0 else DEAD
            blocked = blocked or t - k < 0 or c == DEAD
            grams.append(pad if blocked else c)
        layers = []
        for ps, ms in zip(primes, mults):
            h, rows = _wrap(grams[0] * ms[0]), []
            for k in range(1, N):
                h = _wrap(h ^ _wrap(grams[k] * ms[k]))
                rows += [h % p + sum(ps[:(k - 1) * heads + j]) for j, p in enumerate(ps[(k - 1) * heads:k * heads])]
            layers.append(rows)
        out.append(layers)
    return out


def test_hash_matches_the_definition_over_chunks_decode_and_images():
    config, _ = model_config("tiny")
    torch.manual_seed(0)
    token_map = torch.randint(0, config.engram_compressed_vocab_size, (config.vocab_size,))
    hasher = EngramHasher(config, token_map, torch.device("cpu"))
    ring = config.engram_max_ngram_size - 1 + 4
    history = torch.zeros((3, ring), dtype=torch.long)
    lengths = (11, 7, 9)
    tokens = [torch.randint(0, config.vocab_size, (n,)) for n in lengths]
    dead = [torch.zeros(n, dtype=torch.bool) for n in lengths]
    dead[1][2:4] = True  # an image span inside sequence 1
    got = [[] for _ in lengths]
    done = [0, 0, 0]
    for chunk in ((5, 3, 1), (1, 4, 6), (1, 0, 1), (4, 0, 1)):  # prefill chunks, decode tokens, ragged
        seqs = [i for i, n in enumerate(chunk) if n]
        ids = torch.cat([tokens[i][done[i]:done[i] + chunk[i]] for i in seqs])
        positions = torch.cat([torch.arange(done[i], done[i] + chunk[i]) for i in seqs])
        batch = ForwardBatch(input_ids=ids, positions=positions, query_lens=[chunk[i] for i in seqs],
                             context_lens=[done[i] for i in seqs], slots=torch.tensor(seqs), block_tables={},
                             logits_indices=torch.zeros(0, dtype=torch.long))
        rows = hasher.hash(ids, RaggedPlan(batch, 3, 16), history,
                           torch.cat([dead[i][done[i]:done[i] + chunk[i]] for i in seqs]))
        start = 0
        for i in seqs:
            got[i] += rows[start:start + chunk[i]].tolist()
            start, done[i] = start + chunk[i], done[i] + chunk[i]
    pad = int(token_map[config.engram_pad_token_id])
    for i in range(3):
        compressed = [DEAD if d else int(token_map[t]) for t, d in zip(tokens[i], dead[i])]
        assert got[i] == _reference_rows(config, compressed, pad), f"sequence {i}"
