"""DeepSeek-V4.1's DSpark drafter (`mtp.0..S-1`): one parallel pass drafts a block of
`dspark_block_size` tokens, a Markov head chains them, a confidence head scores each.

Target features: for every committed row t, the mean over the `hc_mult` streams of the streams
entering the attention site of each layer in `dspark_target_layer_ids` (after that layer's Engram),
concatenated (`model.forward` returns them as `ForwardOutput.streams` when the DSpark head is
loaded). `main_x = main_norm(main_proj(features))` (stage 0's weights); every stage projects it
through its own `wkv` / `kv_norm` / main RoPE / FP8 into its own context ring, one entry per
position (`seed_context`). An entry depends only on that row's features, so entries of committed
rows are exact, and nothing else is ever written: rejected drafts leave no state to undo.

Drafting (`draft_block`): the anchor (the last emitted token, not yet run through the target) and
`block_size - 1` noise tokens (`dspark_noise_token_id`) at the anchor's position and the ones after
it are embedded (the target's embedding), copied to the streams and run through the stages in one
pass: each is a V4.1 block (single-pass mHC, the pre of the previous site carried across stages)
with sliding-only attention whose keys are the `sliding_window` context entries before the anchor
plus the whole block, bidirectionally (an attention sink as everywhere in V4.1), and a
`dspark_n_routed_experts` top-`dspark_num_experts_per_tok` MoE with a shared expert. Collapse, the
last stage's `norm` and the target's head give the base logits U_k of row k (predicting the token
at anchor + k + 1). The Markov head then runs sequentially (`markov`): draft k+1 is chosen from
`U_k + W2 W1[x_k]` with x_0 the anchor; the confidence head (`confidence`) gives the logit of its
conditional acceptance from `[h_k ; W1[x_k]]`, where h_k is the final norm's output (how NVIDIA
NeMo AutoModel trains and runs the head) or, with `confidence_input="residual"`, the collapsed
residual before it (what DeepSeek's released reference reads).

The context rings (`[S, slots, sliding_window, FP8 window key bytes]` uint8) belong to the head,
indexed by the engine's cache slot; `bind` allocates them for the model's slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.models.common.weights import WeightUses, fuse_experts, fuse_rows, group_rows, strip_prefix
from deepinfer.models.deepseek_v4.block import ATTN, FFN, DecoderBlock
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.models.deepseek_v4.rope import RotaryTables
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.kv_quant import FP8_WINDOW, decode, encode
from deepinfer.models.deepseek_v41.ops import DeepseekV41Ops
from deepinfer.models.deepseek_v41.sites import Site, run_blocks

ConfidenceInput = Literal["normed", "residual"]


@dataclass
class _BlockStep:
    """What the stages' sub-modules read in one drafting pass (B blocks of S rows, T = B * S)."""

    input_ids: torch.Tensor  # [T] (the MoE's routing reads the step's ids)
    pre: torch.Tensor  # [T, n] fp32: the previous mHC site's pre (single-pass mHC)
    cos_sin: tuple[torch.Tensor, torch.Tensor]  # main RoPE at the block rows' positions
    slots: torch.Tensor  # [B] cache slot of each block's request
    ctx_rows: torch.Tensor  # [B, W] ring rows of the W positions before each anchor
    ctx_valid: torch.Tensor  # [B, W] bool: the position exists (>= 0)
    num_blocks: int
    block_size: int
    capture: None = None  # the target model's feature capture; never on a drafting pass
    cp_split: None = None  # a drafting pass runs whole, on every rank of a context-parallel group


class DraftAttention:
    """A DSpark stage's sliding-only attention: queries of the block rows over the stage's context
    ring (the positions before the anchor) and the whole block."""

    def __init__(self, config: DeepseekV41Config, stage: int, weights: dict[str, torch.Tensor], accel: Accelerator):
        """`weights`: the stage's tensors relative to `attn.`."""
        self.c, self.layer, self.a, self.w = config, config.num_hidden_layers + stage, accel, weights
        self.wo_a = group_rows(weights["wo_a.weight"], config.o_groups)  # [G, R, in] for grouped_linear
        self.ring: torch.Tensor | None = None  # [slots, W, bytes] uint8 FP8 window keys

    def weight_uses(self) -> WeightUses:
        for name in ("wkv.weight", "wq_a.weight", "wq_b.weight", "wo_b.weight"):
            yield "linear", self.w[name]
        yield "grouped_linear", self.wo_a

    def key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """FP8 codes of the keys of rows `x` `[T, D]` at their positions' RoPE."""
        a, w = self.a, self.w
        kv = a.rotary(a.rms_norm(a.linear(x, w["wkv.weight"]), w["kv_norm.weight"], self.c.rms_norm_eps), cos, sin,
                      False)
        return encode(kv, FP8_WINDOW)

    def run(self, x: torch.Tensor, step: _BlockStep) -> torch.Tensor:
        a, c, w = self.a, self.c, self.w
        T, H, d, B, S = x.shape[0], c.num_attention_heads, c.head_dim, step.num_blocks, step.block_size
        cos, sin = step.cos_sin
        q = a.linear(a.rms_norm(a.linear(x, w["wq_a.weight"]), w["q_norm.weight"], c.rms_norm_eps), w["wq_b.weight"])
        q = a.rotary(q.reshape(T, H, d), cos, sin, False)
        own = decode(self.key(x, cos, sin), FP8_WINDOW, d, x.dtype).view(B, S, d)
        context = decode(self.ring[step.slots.unsqueeze(1), step.ctx_rows], FP8_WINDOW, d, x.dtype)  # [B, W, d]
        keys = torch.cat((context, own), dim=1)
        mask = torch.cat((step.ctx_valid.unsqueeze(1).expand(B, S, -1),
                          torch.ones((B, S, S), dtype=torch.bool, device=x.device)), dim=2)
        out = a.sink_attention(q.view(B, S, H, d), keys, mask, w["attn_sink"], d ** -0.5).reshape(T, H, d)
        o = a.rotary(out, cos, sin, True).view(T, c.o_groups, -1)
        return a.linear(a.grouped_linear(o, self.wo_a).reshape(T, -1), w["wo_b.weight"])


@dataclass
class DraftBlock:
    """One drafting pass: per block, the rows' final hidden states and base logits."""

    hidden: torch.Tensor  # [B, S, D] the last stage's norm output
    residual: torch.Tensor  # [B, S, D] the collapsed residual before that norm
    base_logits: torch.Tensor  # [B, S, V] fp32: head(hidden), before the Markov bias


class DSparkHead:
    """The drafter's weights and context rings; `DSparkDrafter` (the dspark feature) drives it."""

    def __init__(self, config: DeepseekV41Config, weights: dict[str, torch.Tensor], top: dict[str, torch.Tensor],
                 rope: RotaryTables, accel: Accelerator, ops: DeepseekV41Ops,
                 confidence_input: ConfidenceInput = "normed"):
        """`weights`: the `mtp.*` tensors under official names, converted to the model's dtypes;
        `top`: the target's `embed.weight` and `head.weight` (shared)."""
        c = config
        if c.num_nextn_predict_layers < 1:
            raise ValueError("the config has no DSpark stages (num_nextn_predict_layers = 0)")
        self.c, self.a, self.ops, self.rope, self.top = c, accel, ops, rope, top
        self.confidence_input = confidence_input
        self.num_stages, self.block_size = c.num_nextn_predict_layers, c.dspark_block_size
        self.window = c.sliding_window
        # the draft MoE: its own expert count and top-k, everything else as the backbone's (the
        # router weight is used as stored: NeMo's draft gate has no gate_temp)
        moe_config = c.model_copy(update={"n_routed_experts": c.dspark_n_routed_experts,
                                          "num_experts_per_tok": c.dspark_num_experts_per_tok})
        self.blocks: list[DecoderBlock] = []
        self.attn: list[DraftAttention] = []
        for j in range(self.num_stages):
            w = strip_prefix(weights, f"mtp.{j}.")
            fuse_rows(w, "ffn.fused_shared.weight", ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"))
            fuse_experts(w, c.dspark_n_routed_experts)
            attn = DraftAttention(c, j, strip_prefix(w, "attn."), accel)
            self.attn.append(attn)
            self.blocks.append(DecoderBlock([Site(ATTN, attn, w, c, accel, ops),
                                             Site(FFN, MoE(moe_config, False, strip_prefix(w, "ffn."), accel), w, c,
                                                  accel, ops)], w))
            if j == 0:
                self.main_proj, self.main_norm = w["main_proj.weight"], w["main_norm.weight"]
            if j == self.num_stages - 1:
                self.norm = w["norm.weight"]
                self.markov_embed, self.markov_out = w["markov_head.embed.weight"], w["markov_head.head.weight"]
                self.confidence_proj = w["confidence_head.proj.weight"].float()
        self.device = self.main_proj.device
        self.num_slots = 0

    def weight_uses(self) -> WeightUses:
        """The stages' weights by the op that reads them (the shared LM head is the target's)."""
        yield "linear", self.main_proj
        yield "linear", self.markov_out
        for block in self.blocks:
            yield from block.weight_uses()

    def bind(self, num_slots: int) -> None:
        """Allocate the stages' context rings for `num_slots` engine cache slots (zeroed)."""
        width = FP8_WINDOW.bytes_per_vector(self.c.head_dim)
        rings = torch.zeros((self.num_stages, num_slots, self.window, width), dtype=torch.uint8, device=self.device)
        for j, attn in enumerate(self.attn):
            attn.ring = rings[j]
        self.num_slots = num_slots

    def seed_context(self, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> None:
        """Write every stage's context entry of committed rows: `slots`, `positions` `[N]`,
        `features` `[N, len(dspark_target_layer_ids) * D]` (the target's, see the module doc)."""
        if self.num_slots == 0:
            raise RuntimeError("the DSpark head has no context rings: call bind() (the model does in bind_cache)")
        a, eps = self.a, self.c.rms_norm_eps
        main_x = a.rms_norm(a.linear(features.to(self.main_proj.dtype), self.main_proj), self.main_norm, eps)
        cos, sin = self.rope.cos_sin(positions, "main")
        rows = positions % self.window
        for attn in self.attn:
            attn.ring[slots, rows] = attn.key(main_x, cos, sin)

    @torch.no_grad()
    def draft_block(self, slots: torch.Tensor, anchor_positions: torch.Tensor, anchor_ids: torch.Tensor) -> DraftBlock:
        """One parallel pass for B blocks (`[B]` each): base logits of every block row."""
        c, a, dev = self.c, self.a, self.device
        B, S, W, n = anchor_ids.shape[0], self.block_size, self.window, c.hc_mult
        offsets = torch.arange(S, device=dev)
        positions = (anchor_positions.to(dev).unsqueeze(1) + offsets).reshape(-1)
        ids = torch.full((B, S), c.dspark_noise_token_id, dtype=torch.int64, device=dev)
        ids[:, 0] = anchor_ids.to(dev)
        ids = ids.reshape(-1)
        streams = self.top["embed.weight"][ids].unsqueeze(1).expand(-1, n, -1).contiguous()
        pre = torch.zeros((B * S, n), dtype=torch.float32, device=dev)
        pre[:, 0] = 1.0  # the first site reads stream 0
        context = anchor_positions.to(dev).unsqueeze(1) - W + torch.arange(W, device=dev)
        step = _BlockStep(ids, pre, self.rope.cos_sin(positions, "main"), slots.to(dev), context % W, context >= 0,
                          B, S)
        streams = run_blocks(self.blocks, streams, step)
        residual = self.ops.hc_collapse(streams, step.pre)
        hidden = a.rms_norm(residual, self.norm, c.rms_norm_eps)
        logits = a.linear(hidden, self.top["head.weight"]).float()
        return DraftBlock(hidden.view(B, S, -1), residual.view(B, S, -1), logits.view(B, S, -1))

    def markov(self, previous_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The transition bias `[B, V]` fp32 after tokens `[B]`, and their Markov embeddings `[B, r]`."""
        embedding = self.markov_embed[previous_ids.to(self.device)]
        return self.a.linear(embedding, self.markov_out).float(), embedding

    def confidence(self, block: DraftBlock, row: int, rows: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """Confidence logits `[len(rows)]` (fp32) of the drafts chosen from block row `row` of the
        blocks `rows`, given the Markov embeddings of the tokens before them."""
        states = block.hidden if self.confidence_input == "normed" else block.residual
        x = torch.cat((states[rows, row].float(), embedding.float()), dim=-1)
        return (x @ self.confidence_proj.T).squeeze(-1)


__all__ = ["ConfidenceInput", "DSparkHead", "DraftAttention", "DraftBlock"]
