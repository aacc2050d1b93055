"""Plain-PyTorch reference implementation of the generic accelerator ops, and collectives over
torch.distributed.

`TorchKernels` implements every kernel of `SmallOps`, `AttentionOps`, `MoEOps` and `SamplingOps`
with ordinary torch calls, reductions and softmaxes in fp32. It is device-agnostic: every tensor it
creates follows its inputs' device, nothing goes through NumPy, the MoE dispatch counts rows without
a host synchronisation, and sampling draws with each row's own generator. A back end subclasses it
and overrides the kernels it has faster versions of. `TorchCollectives` is the `Collectives`
sub-interface over torch.distributed (the default process group and its sub-groups); a back end sets
`collective_backend` ("gloo", "nccl", "hccl").

Quantised weights (`QuantizedWeight`, in the formats a back end declares in
`Capabilities.weight_formats`) are computed on by dequantising tile by tile: `quantized_linear` takes
row tiles of at most `QUANT_TILE_ELEMENTS` elements (so the transient memory is bounded, never the
whole matrix), `moe_experts` dequantises only the experts that have rows, one at a time. Each tile
goes through the kernel object's own plain-weight `linear`, so a back end's fast path (and its
batch-invariant mode) applies to the dequantised tiles too.

Model-specific fused ops (DeepSeek-V4's mHC, compressor pooling, indexer) are not here: they live in
the model's op table (`deepinfer.models.deepseek_v4.ops`)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from collections.abc import Callable

from deepinfer.accelerator.interface import AttentionOps, Collectives, MoEDispatch, MoEOps, SamplingOps, SmallOps
from deepinfer.accelerator.quantized_weight import QuantizedWeight

# Upper bound on elements of one attention score block, ~256 MB of fp32.
_MAX_SCORE_ELEMENTS = 1 << 26
# Upper bound on logical elements of one dequantised weight tile (8 MiB of bf16).
QUANT_TILE_ELEMENTS = 1 << 22

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def row_chunks(rows: int, per_row: int) -> int:
    """How many rows of `per_row` elements fit one score block."""
    return max(1, min(rows, _MAX_SCORE_ELEMENTS // max(per_row, 1)))


def check_generators(generators: list[torch.Generator | None], device: torch.device, kernel: str) -> None:
    """Per-row generators must live on the device they draw for (torch.Generator(device=...))."""
    for row, g in enumerate(generators):
        if g is not None and g.device.type != device.type:
            raise ValueError(f"{kernel}: the generator of row {row} is on {g.device} but the probabilities are on "
                             f"{device}; create it with torch.Generator(device='{device.type}')")


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, linear: Linear,
                     max_elements: int = QUANT_TILE_ELEMENTS) -> torch.Tensor:
    """`x @ weight.T` for a quantised `weight` `[out, in]`: each row tile dequantised to x's dtype
    (exactly the values a dequantise-at-load weight holds) and multiplied with `linear(x, tile)`."""
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    for start, stop in weight.row_tiles(max_elements):
        out[..., start:stop] = linear(x, weight.rows(start, stop).dequantize(x.dtype))
    return out


def expert_weight(w: torch.Tensor | QuantizedWeight, e: int, dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
    """Expert `e` of a stacked expert weight for `linear`: still quantised if it is (the back end's
    `linear` computes on it: tile by tile here, on the codes where a back end can), else as `dtype`."""
    return w[e] if isinstance(w, QuantizedWeight) else w[e].to(dtype)


class TorchKernels(SmallOps, AttentionOps, MoEOps, SamplingOps):
    """The generic kernels in plain torch (see the module docstring)."""

    # ----- small ops -----
    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return quantized_linear(x, weight, self.linear)
        return F.linear(x, weight.to(x.dtype))

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):  # one group at a time, each tiled
            return torch.stack([self.linear(x[:, g], weight[g]) for g in range(weight.shape[0])], dim=1)
        return torch.bmm(x.transpose(0, 1), weight.to(x.dtype).transpose(1, 2)).transpose(0, 1)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        return (y if weight is None else y * weight.float()).to(x.dtype)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        half = cos.shape[-1]
        r = 2 * half
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
        c, s = cos.float().reshape(shape), sin.float().reshape(shape)
        if inverse:
            s = -s
        rot = x[..., -r:].float().unflatten(-1, (half, 2))
        even, odd = rot[..., 0], rot[..., 1]
        out = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
        return torch.cat((x[..., :-r], out.to(x.dtype)), dim=-1)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        if limit > 0:
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
        return F.silu(gate) * up

    # ----- attention -----
    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                       sinks: torch.Tensor, scale: float) -> torch.Tensor:
        # fp32 logits with the per-head sink as one extra column of the softmax, dropped afterwards
        B, S, H, d = q.shape
        L = kv.shape[1]
        kv_f = kv.float()
        out = torch.empty_like(q)
        step = row_chunks(S, B * H * (L + 1))
        for s0 in range(0, S, step):
            qs = q[:, s0:s0 + step]
            rows = qs.shape[1]
            logits = torch.bmm(qs.reshape(B, rows * H, d).float(), kv_f.transpose(1, 2)).mul_(scale)
            logits = logits.view(B, rows, H, L).masked_fill_(~mask[:, s0:s0 + step].unsqueeze(2), float("-inf"))
            sink = sinks.float().view(1, 1, H, 1).expand(B, rows, H, 1)
            probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :L]
            out[:, s0:s0 + step] = torch.bmm(probs.reshape(B, rows * H, L), kv_f).view(B, rows, H, d).to(q.dtype)
        return out

    # ----- MoE -----
    def moe_route(self, scores: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                  routed_scaling_factor: float, hash_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = scores.float()
        if hash_ids is not None:
            ids = hash_ids.long()
        else:
            biased = scores + bias.float() if bias is not None else scores
            ids = biased.topk(top_k, dim=-1).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * routed_scaling_factor, ids

    def moe_dispatch(self, x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, MoEDispatch]:
        # counted with scatter_add, not bincount (which reads its input's maximum on the host)
        T, k = ids.shape
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        plan = MoEDispatch(tokens_per_expert=counts, source_token=order // k, source_slot=order % k, num_tokens=T)
        return x.index_select(0, plan.source_token), plan

    def moe_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor | QuantizedWeight,
                    w2: torch.Tensor | QuantizedWeight, swiglu_limit: float) -> torch.Tensor:
        if isinstance(w13, QuantizedWeight) or isinstance(w2, QuantizedWeight):
            return self.quantized_experts(rows, plan, w13, w2, swiglu_limit)
        # one GEMM pair per expert over its grouped rows
        out = torch.empty((rows.shape[0], w2.shape[1]), dtype=rows.dtype, device=rows.device)
        inter = w2.shape[2]
        start = 0
        for e, count in enumerate(plan.tokens_per_expert.tolist()):
            if count:
                gate_up = F.linear(rows[start:start + count], w13[e].to(rows.dtype))
                h = self.swiglu(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
                out[start:start + count] = F.linear(h, w2[e].to(rows.dtype))
            start += count
        return out

    def quantized_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor | QuantizedWeight,
                          w2: torch.Tensor | QuantizedWeight, swiglu_limit: float) -> torch.Tensor:
        """`moe_experts` with quantised expert weights: only the experts that have rows, one at a
        time, each through this object's own `linear` on its stored weights (which dequantises a
        tile at a time, or computes on the codes) and `swiglu`."""
        out = torch.empty((rows.shape[0], w2.shape[1]), dtype=rows.dtype, device=rows.device)
        inter = w2.shape[2]
        start = 0
        for e, count in enumerate(plan.tokens_per_expert.tolist()):
            if count:
                gate_up = self.linear(rows[start:start + count], expert_weight(w13, e, rows.dtype))
                h = self.swiglu(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
                out[start:start + count] = self.linear(h, expert_weight(w2, e, rows.dtype))
            start += count
        return out

    def moe_combine(self, out_rows: torch.Tensor, plan: MoEDispatch, weights: torch.Tensor) -> torch.Tensor:
        w = weights.float()[plan.source_token, plan.source_slot].unsqueeze(-1)
        y = torch.zeros((plan.num_tokens, out_rows.shape[-1]), dtype=torch.float32, device=out_rows.device)
        return y.index_add_(0, plan.source_token, out_rows.float() * w)

    # ----- sampling -----
    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        V = logits.shape[-1]
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[..., :V].to(logits.device)
        logits.masked_fill_(~allowed, float("-inf"))

    def sample(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        check_generators(generators, probs.device, "sample")
        if len(generators) != probs.shape[0]:
            raise ValueError(f"sample got {probs.shape[0]} rows but {len(generators)} generators; give one per row "
                             f"(None for rows without a seed)")
        out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        free = [i for i, g in enumerate(generators) if g is None]
        if free:
            out[free] = torch.multinomial(probs[free].float(), 1).squeeze(-1)
        for i, g in enumerate(generators):
            if g is not None:
                out[i] = torch.multinomial(probs[i].float(), 1, generator=g).squeeze(-1)
        return out

    def rejection_sample(self, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                         draft_token_ids: torch.Tensor, num_drafts: list[int],
                         generators: list[torch.Generator | None]) -> torch.Tensor:
        check_generators(generators, target_probs.device, "rejection_sample")
        B = len(num_drafts)
        if len(generators) != B:
            raise ValueError(f"rejection_sample got {B} requests but {len(generators)} generators; give one per "
                             f"request (None for requests without a seed)")
        total = sum(num_drafts)
        if target_probs.shape[0] != total + B or draft_token_ids.shape[0] != total or (
                draft_probs is not None and draft_probs.shape[0] != total):
            raise ValueError(f"rejection_sample: {B} requests with {total} drafts need {total + B} target rows, "
                             f"{total} draft ids and {total} draft rows; got {target_probs.shape[0]}, "
                             f"{draft_token_ids.shape[0]} and "
                             f"{'none' if draft_probs is None else draft_probs.shape[0]}")
        device = target_probs.device
        out = torch.full((B, 1 + max(num_drafts, default=0)), -1, dtype=torch.long, device=device)
        t0 = d0 = 0
        for b, m in enumerate(num_drafts):
            g = generators[b]
            p = target_probs[t0:t0 + m + 1].float()
            drafts = draft_token_ids[d0:d0 + m]
            j = m  # index of the position that draws a token (first rejection, or the bonus)
            if m:
                u = torch.rand(m, generator=g, device=device)
                rows = torch.arange(m, device=device)
                p_d = p[rows, drafts]
                q_d = draft_probs[d0:d0 + m].float()[rows, drafts] if draft_probs is not None else torch.ones_like(p_d)
                passed = (u * q_d < p_d).tolist()  # u < p/q without dividing by q
                j = passed.index(False) if False in passed else m
                out[b, :j] = drafts[:j]
            dist_j = p[j]
            if j < m:  # the residual max(p - q, 0) of the rejected position
                q = draft_probs[d0 + j].float() if draft_probs is not None else \
                    F.one_hot(drafts[j], p.shape[1]).to(p.dtype)
                residual = (dist_j - q).clamp(min=0.0)
                if float(residual.sum()) > 0.0:  # zero only through rounding when p == q
                    dist_j = residual
            if float(dist_j.sum()) > 0.0:
                out[b, j] = torch.multinomial(dist_j / dist_j.sum(), 1, generator=g).squeeze(0)
            t0 += m + 1
            d0 += m
        return out


class TorchCollectives(Collectives):
    """Collectives over torch.distributed (gloo, nccl or hccl): the default process group, or a
    sub-group made by `new_group`."""

    collective_backend = "gloo"

    def init_process_group(self, rank: int, world_size: int, init_method: str) -> None:
        if not dist.is_initialized():
            dist.init_process_group(self.collective_backend, rank=rank, world_size=world_size, init_method=init_method)

    def new_group(self, ranks: list[int]) -> object:
        # the world's backend; torch requires every rank of the world to make this call in the same order
        return dist.new_group(ranks=sorted(ranks))

    def all_reduce(self, tensor: torch.Tensor, group: object | None = None) -> torch.Tensor:
        dist.all_reduce(tensor, group=group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: object | None = None) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    def all_to_all(self, tensor: torch.Tensor, input_splits: list[int], output_splits: list[int],
                   group: object | None = None) -> torch.Tensor:
        out = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=group)
        return out
