"""The contract between the engine (runner, cache manager) and a model implementation.

A model declares its per-sequence state as a `CacheLayout`; the cache manager preallocates it once
from the memory budget and binds the tensors to the model. Every step the runner hands the model
a ragged `ForwardBatch` (many sequences, different lengths, no padding) and gets logits back.
What the engine calls on a model is the `Model` protocol (`protocol.py`); which model class a
checkpoint needs comes from the registry (`registry.py`, keyed by config.json's `model_type`).

State comes in two kinds (docs/model.md, "Cache layout: owners and readers"):
- *slot state*: a constant size per sequence (window rings, compressor raw-row rings), one slot
  per running sequence;
- *block groups*: what grows with the context (compressed entries, indexer keys), paged in
  fixed-size blocks of entries; a group with `tokens_per_entry = m` holds floor(T / m) entries.
Each state tensor has owner layers (one copy each) and reader layers (a view of an owner's copy,
no memory of their own); see `cache_layout.py`.

Rings are indexed by absolute position modulo their size, and their size covers the attention
window plus `max_rollback` positions, so dropping the last k <= max_rollback tokens (speculative
decoding) is exact: the engine just sets the sequence length back.

This module gathers the contract's types in one import path (the definitions live in
`cache_layout.py`, `batch.py` and `protocol.py`).
"""
from __future__ import annotations

from deepinfer.models.batch import ForwardBatch, ForwardOutput
from deepinfer.models.cache_layout import BlockGroup, CacheLayout, CacheTensors, StateTensor, allocate_cache_tensors
from deepinfer.models.protocol import Model, ModelConfig, drafter_heads

__all__ = ["BlockGroup", "CacheLayout", "CacheTensors", "ForwardBatch", "ForwardOutput", "Model", "ModelConfig",
           "StateTensor", "allocate_cache_tensors", "drafter_heads"]
