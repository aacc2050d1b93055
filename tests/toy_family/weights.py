"""The toy family's tensor names: canonical = short names; checkpoints use Llama-style HF names.

Canonical: `embed.weight`, `norm.weight`, `head.weight`, `layers.{i}.attn_norm.weight`,
`layers.{i}.attn.{wq,wk,wv,wo}.weight` (no wk/wv for a layer that reads another's KV),
`layers.{i}.mlp_norm.weight`, `layers.{i}.mlp.{w_gate,w_up,w_down}.weight`.
"""
from __future__ import annotations

import torch

from deepinfer.models.common.weights import CanonicalNames, drop_prefix, hf_scale_to_official, rename_prefix
from toy_family.config import ToyConfig

_TOP = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight"}
_LAYER = (
    ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "mlp_norm."),
    ("self_attn.q_proj.", "attn.wq."), ("self_attn.k_proj.", "attn.wk."), ("self_attn.v_proj.", "attn.wv."),
    ("self_attn.o_proj.", "attn.wo."), ("mlp.gate_proj.", "mlp.w_gate."), ("mlp.up_proj.", "mlp.w_up."),
    ("mlp.down_proj.", "mlp.w_down."),
)


def canonicalize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = CanonicalNames()
    for key, tensor in state.items():
        name = drop_prefix(key, "model.")
        if name in _TOP:
            out.put(_TOP[name], tensor)
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            out.put(hf_scale_to_official(f"layers.{i}.{rename_prefix(rest, _LAYER)}"), tensor)
        else:
            out.put(hf_scale_to_official(name), tensor)
    return dict(out)


def to_hf_names(canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    top = {v: k for k, v in _TOP.items()}
    layer = tuple((b, a) for a, b in _LAYER)
    out = {}
    for name, tensor in canonical.items():
        if name in top:
            out[top[name] if name == "head.weight" else f"model.{top[name]}"] = tensor
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            out[f"model.layers.{i}.{rename_prefix(rest, layer)}"] = tensor
        else:
            out[f"model.{name}"] = tensor
    return out


def expected_shapes(c: ToyConfig) -> dict[str, tuple[int, ...]]:
    D, HD, I = c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size
    shapes = {"embed.weight": (c.vocab_size, D), "norm.weight": (D,), "head.weight": (c.vocab_size, D)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm.weight": (D,), p + "attn.wq.weight": (HD, D), p + "attn.wo.weight": (D, HD),
                       p + "mlp_norm.weight": (D,), p + "mlp.w_gate.weight": (I, D), p + "mlp.w_up.weight": (I, D),
                       p + "mlp.w_down.weight": (D, I)})
        if c.owns_kv(i):
            shapes.update({p + "attn.wk.weight": (HD, D), p + "attn.wv.weight": (HD, D)})
    return shapes


def target_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """Norm weights stay fp32; everything else in the load dtype."""
    return torch.float32 if name.endswith("norm.weight") else dtype


def random_weights(c: ToyConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical fp32 tensors; norm weights around 1, matrices scaled by 1/sqrt(fan-in)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(c).items():
        t = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.2 * t
        elif name != "embed.weight":
            t = t / shape[-1] ** 0.5
        out[name] = t
    return out
