"""The toy model as a plain-torch full-sequence forward (no cache, no engine): the test oracle.

Written from the math in `model.py`'s docstring, sharing no code with it: every layer over the
whole sequence at once with a causal (full) or banded (sliding) mask; a layer with a `kv_source`
attends with its own queries over the keys and values that layer `kv_source` computed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from toy_family.config import SLIDING, ToyConfig


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x `[T, H, d]`: pairs (j, j + d/2) rotated by position * theta^(-2j/d)."""
    T, _, d = x.shape
    angle = torch.arange(T, dtype=torch.float64).unsqueeze(1) / theta ** (torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    c, s = angle.cos().float().unsqueeze(1), angle.sin().float().unsqueeze(1)
    first, second = x[..., :d // 2], x[..., d // 2:]
    return torch.cat((first * c - second * s, first * s + second * c), dim=-1)


@torch.no_grad()
def reference_logits(config: ToyConfig, weights: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """fp32 logits `[len(tokens), vocab]` at every position."""
    c, w = config, {k: v.float() for k, v in weights.items()}
    T, H, d, eps = len(tokens), c.num_heads, c.head_dim, c.rms_norm_eps
    i, j = torch.arange(T).unsqueeze(1), torch.arange(T).unsqueeze(0)
    causal = j <= i
    banded = causal & (j > i - c.sliding_window)
    x = w["embed.weight"][torch.tensor(tokens)]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(c.num_layers):
        p = f"layers.{layer}."
        h = _rms(x, w[p + "attn_norm.weight"], eps)
        q = _rotate(F.linear(h, w[p + "attn.wq.weight"]).view(T, H, d), c.rope_theta)
        if c.kv_source[layer] is None:
            kv[layer] = (_rotate(F.linear(h, w[p + "attn.wk.weight"]).view(T, H, d), c.rope_theta),
                         F.linear(h, w[p + "attn.wv.weight"]).view(T, H, d))
        k, v = kv[layer if c.kv_source[layer] is None else c.kv_source[layer]]
        mask = banded if c.layer_types[layer] == SLIDING else causal
        scores = (q.transpose(0, 1) @ k.transpose(0, 1).transpose(1, 2)) / d ** 0.5  # [H, T, T]
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.transpose(0, 1)  # [H, T, d]
        x = x + F.linear(attn.transpose(0, 1).reshape(T, H * d), w[p + "attn.wo.weight"])
        h = _rms(x, w[p + "mlp_norm.weight"], eps)
        x = x + F.linear(F.silu(F.linear(h, w[p + "mlp.w_gate.weight"])) * F.linear(h, w[p + "mlp.w_up.weight"]),
                         w[p + "mlp.w_down.weight"])
    return F.linear(_rms(x, w["norm.weight"], eps), w["head.weight"])


def reference_greedy(config: ToyConfig, weights: dict[str, torch.Tensor], prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt`, each from an uncached forward over the whole sequence."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(reference_logits(config, weights, tokens)[-1].argmax()))
    return tokens[len(prompt):]
