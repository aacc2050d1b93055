"""A test-only second model family, `model_type: toy_dense`: what adding a family takes.

A family is this folder plus one registry entry (`family.py`: the config parser, the checkpoint
loader, the model class and its op defaults; optionally its random checkpoints for `deepinfer
make-model --family toy`). Everything else -- engine, scheduler, cache manager, sampler, back end --
is shared with DeepSeek-V4 unchanged.

The model is a small dense transformer (RMSNorm, RoPE multi-head attention, SwiGLU MLP) whose
layers are full attention (a per-token KV cache paged in a block group), sliding-window attention
(a KV ring in the sequence's slot), or full attention that reads an earlier layer's KV cache
instead of keeping its own (a reader in the cache layout: no memory of its own).
`reference.py` is an independent plain-torch full-sequence forward of the same weights.
"""
from toy_family.family import MODEL_TYPE, TOY_FAMILY, registered

__all__ = ["MODEL_TYPE", "TOY_FAMILY", "registered"]
