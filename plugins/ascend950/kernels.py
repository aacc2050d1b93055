"""Kernels of the Ascend back end: torch_npu fused ops where one matches the contract, else the
plain-torch reference kernels (`deepinfer.accelerator.reference.TorchKernels`, device-agnostic) on
NPU tensors. DeepSeek-V4's own ops come from `AscendDeepseekV4Ops` (declared through `model_ops`):
the fused mHC ops where they fit, else the model's plain-torch defaults.

Every fused op is called with the signature documented in torch_npu's `_op_plugin_docs.py`
(Ascend/op-plugin, codegen/templates/_op_plugin_docs.py) and, where a fused op's semantics or
dtypes do not cover an input, the reference kernel runs instead:

| kernel | fused op | falls back when |
|---|---|---|
| rms_norm | npu_rms_norm | x is 1-D |
| rotary | npu_rotary_mul (interleave, fp32) | never |
| swiglu | npu_clipped_swiglu (limit > 0) / npu_swiglu | inputs are 1-D |
| hc_pre | npu_mhc_pre + npu_mhc_sinkhorn | streams fp32, n not in {4, 6, 8}, iters not in 1..100 |
| hc_post | npu_mhc_post | streams fp32 |
| sink_attention | npu_fused_infer_attention_score_v2 + sink rescale | q fp32, d > 512, no keys |
| moe_dispatch | npu_moe_init_routing_v2 | no tokens, > 10240 experts |
| moe_experts | npu_grouped_matmul (+ clipped SwiGLU) | no rows, > 1024 experts |
| moe_combine | npu_moe_finalize_routing (fp32 rows) | rows != tokens * k |

Reference kernels only (no fused op fits): linear (a plain matmul), moe_route
(npu_moe_gating_top_k applies softmax/sigmoid itself; V4's scores arrive already
sqrt-softplus'ed), apply_token_bitmask, sample and rejection_sample (per-row torch generators on
the NPU). V4 defaults only: hc_head (npu_mhc_pre needs the (2+n)n mixing layout), compress_pool,
indexer_topk (npu_lightning_indexer masks by sequence lengths and a token-level causal rule, not
an arbitrary visibility mask).
"""
from __future__ import annotations

from typing import Any

import torch

from deepinfer.accelerator.interface import MoEDispatch
from deepinfer.accelerator.reference import TorchKernels
from deepinfer.models.deepseek_v4.ops import FAMILY as DEEPSEEK_V4, DeepseekV4Ops

#: every torch_npu op this module can call; the accelerator keeps those its torch_npu provides
FUSED_OPS = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_clipped_swiglu", "npu_mhc_pre",
             "npu_mhc_sinkhorn", "npu_mhc_post", "npu_fused_infer_attention_score_v2",
             "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing")
HALF = (torch.float16, torch.bfloat16)
MHC_STREAMS = (4, 6, 8)
FIA_MAX_HEAD_DIM = 512
FIA_MAX_GROUP = 64  # num_query_heads / num_key_value_heads may not exceed 64
GMM_MAX_GROUPS = 1024
INIT_ROUTING_MAX_EXPERTS = 10240


class AscendDeepseekV4Ops(DeepseekV4Ops):
    """DeepSeek-V4's op table on Ascend: torch_npu's fused mHC ops for bf16/fp16 streams, else the
    model's plain-torch defaults. Uses the kernels object's torch_npu module and op list."""

    def __init__(self, kernels: "AscendKernels"):
        self.kernels = kernels

    def hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               sinkhorn_iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if (not self.kernels._has("npu_mhc_pre", "npu_mhc_sinkhorn") or streams.dtype not in HALF
                or streams.shape[-2] not in MHC_STREAMS or not 1 <= sinkhorn_iters <= 100):
            return super().hc_pre(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps)
        npu = self.kernels.npu
        collapsed, post, res_logits = npu.npu_mhc_pre(streams, fn.float(), scale.float(), base.float(),
                                                       norm_eps=norm_eps, hc_eps=eps)[:3]
        comb = npu.npu_mhc_sinkhorn(res_logits, eps=eps, num_iters=sinkhorn_iters)[0]
        return collapsed, post, comb

    def hc_post(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        if not self.kernels._has("npu_mhc_post") or streams.dtype not in HALF:
            return super().hc_post(y, streams, post, comb)
        return self.kernels.npu.npu_mhc_post(streams, comb.float(), y.to(streams.dtype), post.float())


class AscendKernels(TorchKernels):
    """Set `self.npu` (the torch_npu module) and `self.fused` (available op names) before use."""

    npu: Any = None
    fused: frozenset[str] = frozenset()

    def model_ops(self, family: str) -> DeepseekV4Ops | None:
        """The V4 op table with the fused mHC ops; None (the defaults) for other families."""
        return AscendDeepseekV4Ops(self) if family == DEEPSEEK_V4 else None

    def _has(self, *ops: str) -> bool:
        return all(op in self.fused for op in ops)

    # ----- small ops -----
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        if not self._has("npu_rms_norm") or x.dim() < 2:
            return super().rms_norm(x, weight, eps)
        gamma = weight.to(x.dtype) if weight is not None else x.new_ones(x.shape[-1])
        return self.npu.npu_rms_norm(x, gamma, epsilon=eps)[0]

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        if not self._has("npu_rotary_mul"):
            return super().rotary(x, cos, sin, inverse)
        T, r = cos.shape[0], 2 * cos.shape[-1]
        # BSND with B = 1, S = tokens, N = everything between; r1/r2 are 1S1D (interleave mode)
        rope = x[..., -r:].float().reshape(1, T, -1, r)
        r1 = cos.float().repeat_interleave(2, dim=-1).view(1, T, 1, r)
        r2 = sin.float().repeat_interleave(2, dim=-1).view(1, T, 1, r)
        out = self.npu.npu_rotary_mul(rope, r1, -r2 if inverse else r2, rotary_mode="interleave")
        return torch.cat((x[..., :-r], out.reshape(x[..., -r:].shape).to(x.dtype)), dim=-1)

    def _glu(self, gate_up: torch.Tensor, limit: float) -> torch.Tensor:
        """SwiGLU on `[..., 2I]` (gate first): one fused op, no split."""
        if limit > 0:
            return self.npu.npu_clipped_swiglu(gate_up, dim=-1, alpha=1.0, limit=float(limit), bias=0.0,
                                               interleaved=False)
        return self.npu.npu_swiglu(gate_up, dim=-1)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        op = "npu_clipped_swiglu" if limit > 0 else "npu_swiglu"
        if not self._has(op) or gate.dim() < 2:
            return super().swiglu(gate, up, limit)
        return self._glu(torch.cat((gate, up), dim=-1), limit)

    # ----- attention -----
    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                       sinks: torch.Tensor, scale: float) -> torch.Tensor:
        B, S, H, d = q.shape
        if (not self._has("npu_fused_infer_attention_score_v2") or q.dtype not in HALF
                or d > FIA_MAX_HEAD_DIM or kv.shape[1] == 0):
            return super().sink_attention(q, kv, mask, sinks, scale)
        kv4 = kv.to(q.dtype).unsqueeze(2).contiguous()  # [B, L, 1, d]: MQA, K = V
        masked_out = (~mask).unsqueeze(1).contiguous()  # [B, 1, S, L], True = do not attend
        visible = mask.any(-1).view(B, S, 1, 1)
        parts = []
        for h0 in range(0, H, FIA_MAX_GROUP):
            qh = q[:, :, h0:h0 + FIA_MAX_GROUP].contiguous()
            heads = qh.shape[2]
            out, lse = self.npu.npu_fused_infer_attention_score_v2(
                qh, kv4, kv4, atten_mask=masked_out, num_query_heads=heads, num_key_value_heads=1,
                softmax_scale=float(scale), input_layout="BSND", sparse_mode=0,
                inner_precise=2 if S > 1 else 0, return_softmax_lse=True)
            # the sink joins the softmax denominator: out * exp(lse) / (exp(lse) + exp(sink))
            lse = lse.view(B, heads, S).transpose(1, 2).unsqueeze(-1)  # [B, S, heads, 1]
            keep = torch.sigmoid(lse - sinks[h0:h0 + heads].float().view(1, 1, heads, 1))
            parts.append(torch.where(visible, out.float() * keep, torch.zeros((), device=q.device)))
        return torch.cat(parts, dim=2).to(q.dtype)

    # ----- MoE -----
    def moe_dispatch(self, x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, MoEDispatch]:
        T, k = ids.shape
        if not self._has("npu_moe_init_routing_v2") or T == 0 or num_experts > INIT_ROUTING_MAX_EXPERTS:
            return super().moe_dispatch(x, ids, num_experts)
        # row_idx_type=1: expanded row p holds flat choice order[p] = token * k + slot (stable by expert)
        rows, order, counts, _ = self.npu.npu_moe_init_routing_v2(
            x, ids.to(torch.int32), active_num=T * k, expert_num=num_experts, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, num_experts], row_idx_type=1)
        order = order.long()
        return rows, MoEDispatch(tokens_per_expert=counts.long(), source_token=order // k, source_slot=order % k,
                                 num_tokens=T)

    def moe_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor, w2: torch.Tensor,
                    swiglu_limit: float) -> torch.Tensor:
        glu = "npu_clipped_swiglu" if swiglu_limit > 0 else "npu_swiglu"
        if not self._has("npu_grouped_matmul", glu) or rows.shape[0] == 0 or w13.shape[0] > GMM_MAX_GROUPS:
            return super().moe_experts(rows, plan, w13, w2, swiglu_limit)
        groups = plan.tokens_per_expert.to(torch.int64)

        def grouped(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            # single x / single 3-D weight [E, K, N] (a transposed view) / single y; group sizes as counts
            return self.npu.npu_grouped_matmul([a], [w.to(a.dtype).transpose(1, 2)], group_list=groups,
                                               group_type=0, split_item=3, group_list_type=1)[0]

        return grouped(self._glu(grouped(rows, w13), swiglu_limit), w2)

    def moe_combine(self, out_rows: torch.Tensor, plan: MoEDispatch, weights: torch.Tensor) -> torch.Tensor:
        T, k = weights.shape
        if not self._has("npu_moe_finalize_routing") or out_rows.shape[0] != T * k or T == 0:
            return super().moe_combine(out_rows, plan, weights)
        # row of choice (token i, slot j), laid out slot-major as the op indexes it: [i + j * T]
        row_of_choice = torch.empty(T * k, dtype=torch.int64, device=out_rows.device)
        row_of_choice[plan.source_token * k + plan.source_slot] = torch.arange(T * k, device=out_rows.device)
        src_to_dst = row_of_choice.view(T, k).t().reshape(-1).to(torch.int32)
        # fp32 rows and scales: the contract accumulates in fp32
        return self.npu.npu_moe_finalize_routing(out_rows.float(), None, None, None, weights.float(), src_to_dst,
                                                 None, drop_pad_mode=0)

    # ----- sampling -----

