"""Block keys of a token sequence: one SHA-256 chain, so a block's key names the whole prefix up to it.

Shared by the prefix cache feature (its store is keyed by these) and the data-parallel router of
`deepinfer serve` (which remembers the keys it sent to each rank, so a prompt that repeats a
prefix goes where that prefix's state is cached).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_keys(token_ids: Sequence[int], num_blocks: int, block_tokens: int, seed: bytes = b"") -> list[bytes]:
    """Keys of the first `num_blocks` blocks of `token_ids`: key_k = H(key_{k-1} || block k)."""
    keys, prev = [], seed
    for k in range(num_blocks):
        block = token_ids[k * block_tokens:(k + 1) * block_tokens]
        prev = hashlib.sha256(prev + array("q", block).tobytes()).digest()
        keys.append(prev)
    return keys
