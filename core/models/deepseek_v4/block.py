"""A decoder block: mHC-wrapped attention then mHC-wrapped MoE (deepseek-v4.md §4)."""
from __future__ import annotations

import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.models.deepseek_v4.attention import Attention
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.models.deepseek_v4.rope import RotaryTables
from deepinfer.models.deepseek_v4.state import StepPlan
from deepinfer.models.deepseek_v4.weights import strip_prefix


class DecoderBlock:
    def __init__(self, config: DeepseekV4Config, layer_type: str, mlp_type: str, weights: dict[str, torch.Tensor],
                 accel: Accelerator):
        """`weights`: the block's tensors under official names relative to `layers.{i}.`/`mtp.{j}.`."""
        self.c, self.accel, self.w = config, accel, weights
        self.attn = Attention(config, layer_type, strip_prefix(weights, "attn."), accel)
        self.ffn = MoE(config, mlp_type == "hash_moe", strip_prefix(weights, "ffn."), accel)

    def _hc(self, streams: torch.Tensor, unit: str):
        c, w = self.c, self.w
        return self.accel.hc_pre(streams, w[f"hc_{unit}_fn"], w[f"hc_{unit}_base"], w[f"hc_{unit}_scale"],
                                 c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, plan: StepPlan, rope: RotaryTables,
                cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """streams `[T, n, D]` -> `[T, n, D]`."""
        a, eps = self.accel, self.c.rms_norm_eps
        collapsed, post, comb = self._hc(streams, "attn")
        y = self.attn.forward(a.rms_norm(collapsed, self.w["attn_norm.weight"], eps), plan, rope, cos_sin)
        streams = a.hc_post(y, streams, post, comb)
        collapsed, post, comb = self._hc(streams, "ffn")
        y = self.ffn.forward(a.rms_norm(collapsed, self.w["ffn_norm.weight"], eps), input_ids)
        return a.hc_post(y, streams, post, comb)
