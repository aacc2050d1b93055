"""DeepSeek-V4 causal LM on ragged batches with engine-managed state (docs/model.md, "DeepSeek-V4").

    model = DeepseekV4ForCausalLM(config, accelerator, dtype=torch.float32, device="cpu")
    model.load_weights(canonicalize(state_dict))
    layout = model.cache_layout(max_rollback=4)
    model.bind_cache(allocate_cache_tensors(layout, num_slots, num_blocks, block_size, device))
    out = model.forward(batch)          # ForwardOutput(logits [L, V] fp32, streams)
    draft = model.mtp_forward(streams, next_token_ids, mtp_batch)

Implements the engine's `Model` protocol (`deepinfer.models.protocol`); its registry entry is
`family.py`. Hardware-agnostic: only torch and the accelerator object it is given.
"""
from __future__ import annotations

import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.models.deepseek_v4.attention import AttentionState
from deepinfer.models.common.weights import WeightUses, ensure_row_groups, fuse_experts, fuse_rows, strip_prefix
from deepinfer.models.deepseek_v4.block import (DecoderBlock, StepInputs, build_decoder_block, lower_blocks,
                                                 run_blocks)
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer.models.deepseek_v4.ops import resolve_ops
from deepinfer.models.deepseek_v4.rope import RotaryTables
from deepinfer.models.deepseek_v4.state import (
    COMPRESSED_KV, CSA_ROWS, HCA_ROWS, INDEXER_KEYS, INDEXER_ROWS, WINDOW_KV, RingSizes, StepPlan,
    build_cache_layout, group_name, ring_sizes,
)
from deepinfer.models.deepseek_v4.weights import FUSED_PROJECTIONS, check_weights, weight_kind
from deepinfer.models.interface import CacheLayout, CacheTensors, ForwardBatch, ForwardOutput
from deepinfer.program import Builder, Program, Programs
from deepinfer.parallel.context_parallel import RowSplit, current_context_parallel


#: steps of up to this many decode tokens run as their program (one per token count)
DECODE_PROGRAM_MAX_TOKENS = 64


class DeepseekV4ForCausalLM:
    #: context parallelism (`--cp`) splits this model's long prefills (see `forward`)
    supports_context_parallel = True

    def __init__(self, config: DeepseekV4Config, accelerator: Accelerator, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", query_block: int = 256, cp_min_tokens: int = 16):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported; choose torch.float32, torch.bfloat16 or torch.float16")
        self.config, self.accel, self.dtype = config, accelerator, dtype
        self.ops = resolve_ops(accelerator)  # V4's own ops: the back end's table if it declares one
        self.device = torch.device(device)
        self.query_block = query_block
        if cp_min_tokens < 1:
            raise ValueError(f"cp_min_tokens must be >= 1, got {cp_min_tokens}")
        self.cp_min_tokens = cp_min_tokens
        self.context_parallel = current_context_parallel()  # the launch's CP group, or None
        self.rope = RotaryTables(config, self.device)
        self.blocks: list[DecoderBlock] = []
        self.mtp_block: DecoderBlock | None = None
        self.top: dict[str, torch.Tensor] = {}
        self.mtp_top: dict[str, torch.Tensor] = {}
        self._cache: CacheTensors | None = None
        self._rings: RingSizes | None = None
        self._num_slots = 0
        self.programs = Programs(accelerator)  # decode-step programs by token count (`decode_program`)

    def drafter_heads(self) -> tuple[DecoderBlock, ...] | None:
        """The MTP block (`mtp.0`, run by `mtp_forward`) when its weights are loaded, else None."""
        return None if self.mtp_block is None else (self.mtp_block,)

    @property
    def has_mtp(self) -> bool:
        return self.drafter_heads() is not None

    # ----- weights -----
    def load_weights(self, canonical: dict[str, torch.Tensor]) -> None:
        """Load tensors under official names (see weights.canonicalize): dequantised, except the
        linear weights the loader kept quantised (`QuantizedWeight`, only in formats the back end
        declares). The MTP block (`mtp.0.*`) is loaded when present; it is optional."""
        quantised = [k for k in canonical if k.endswith(".scale")]
        if quantised:
            raise ValueError(f"{len(quantised)} quantisation scales found (e.g. {quantised[0]!r}); dequantise the "
                             f"checkpoint with the checkpoint loader before load_weights")
        c = self.config
        with_mtp = c.num_nextn_predict_layers > 0 and any(k.startswith("mtp.0.") for k in canonical)
        state = {k: v for k, v in canonical.items() if with_mtp or not k.startswith("mtp.")}
        check_weights(state, c, include_mtp=with_mtp)
        # V4 ships one MTP block; only mtp.0 is used
        state = {k: self._convert(k, v) for k, v in state.items() if not k.startswith("mtp.") or k.startswith("mtp.0.")}
        self.top = {k: state[k] for k in ("embed.weight", "norm.weight", "head.weight",
                                          "hc_head_fn", "hc_head_base", "hc_head_scale")}
        self.blocks = [build_decoder_block(c, c.layer_types[i], c.mlp_layer_types[i],
                                           self._fuse_block(strip_prefix(state, f"layers.{i}.")), self.accel,
                                           ops=self.ops)
                       for i in range(c.num_hidden_layers)]
        self.mtp_block, self.mtp_top = None, {}
        self.programs.clear()
        if with_mtp:
            mtp = strip_prefix(state, "mtp.0.")
            self.mtp_top = {k: mtp.pop(k) for k in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight",
                                                    "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")}
            self.mtp_block = build_decoder_block(c, SLIDING, "moe", self._fuse_block(mtp), self.accel, ops=self.ops)
        self.accel.prepare_weights(self.weight_uses())
        if self._cache is not None:
            self.bind_cache(self._cache)

    def weight_uses(self) -> WeightUses:
        """Every weight the forward passes to an op, by that op (`SmallOps.prepare_weights`)."""
        yield "linear", self.top["head.weight"]
        yield "hc_head", self.top["hc_head_fn"]
        for block in self.blocks:
            yield from block.weight_uses()
        if self.mtp_block is not None:
            for name in ("e_proj.weight", "h_proj.weight"):
                yield "linear", self.mtp_top[name]
            yield "hc_head", self.mtp_top["hc_head_fn"]
            yield from self.mtp_block.weight_uses()

    def twin(self) -> DeepseekV4ForCausalLM:
        """A second model over the same weight tensors (no copy) with no cache bound: bind a cache of
        its own to run it beside this one (the target drafting for itself in speculative-decoding
        tests)."""
        c = self.config
        other = DeepseekV4ForCausalLM(c, self.accel, self.dtype, self.device, self.query_block, self.cp_min_tokens)
        other.top, other.mtp_top = self.top, self.mtp_top
        other.blocks = [build_decoder_block(c, c.layer_types[i], c.mlp_layer_types[i], blk.w, self.accel, ops=self.ops)
                        for i, blk in enumerate(self.blocks)]
        if self.mtp_block is not None:
            other.mtp_block = build_decoder_block(c, SLIDING, "moe", self.mtp_block.w, self.accel, ops=self.ops)
        other.accel.prepare_weights(other.weight_uses())  # its own views of the shared tensors (wo_a's groups)
        return other

    def _convert(self, name: str, t: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        if isinstance(t, QuantizedWeight):  # own memory on the device, standing for the model dtype
            return t.copy_to(self.device, self.dtype)
        kind = weight_kind(name)
        dtype = torch.long if kind == "int" else torch.float32 if kind == "fp32" else self.dtype
        out = t.to(device=self.device, dtype=dtype)
        if out.data_ptr() == t.data_ptr():
            # still the checkpoint's memory map (file pages at an unaligned offset): an own, aligned
            # copy streams ~1.2x faster in the memory-bound decode GEMVs
            return out.clone(memory_format=torch.contiguous_format)
        return out.contiguous()

    def _fuse_block(self, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A block's tensors with the routed experts stacked and the projections that read the same
        input concatenated (see `fuse_rows`)."""
        for key, names in FUSED_PROJECTIONS.items():
            fuse_rows(w, key, names)
        ensure_row_groups(w, "attn.wo_a.weight", self.config.o_groups)  # read as [G, R, in]
        fuse_experts(w, self.config.n_routed_experts)
        return w

    # ----- state -----
    def cache_layout(self, max_rollback: int) -> CacheLayout:
        return build_cache_layout(self.config, self.dtype, max_rollback)

    def bind_cache(self, cache: CacheTensors) -> None:
        """Bind preallocated state (see interface.allocate_cache_tensors); checks every tensor
        against the layout implied by the config and the window ring size."""
        c = self.config
        if WINDOW_KV not in cache.slot:
            raise ValueError(f"cache has no {WINDOW_KV!r} tensor; allocate it from model.cache_layout()")
        window = cache.slot[WINDOW_KV]
        max_rollback = window.shape[2] - c.sliding_window
        layout = self.cache_layout(max_rollback)
        layout.check(cache, f"model.cache_layout({max_rollback})")
        self._cache = cache
        self.programs.clear()
        self._num_slots = window.shape[1]
        self._rings = ring_sizes(c, max_rollback)

        def slot(name: str, layer: int) -> torch.Tensor:
            return layout.slot_tensor(name).view(cache.slot[name], layer)

        def block(rate: int, name: str, layer: int) -> torch.Tensor:
            group = group_name(rate)
            return layout.group(group).tensor(name).view(cache.blocks[group][name], layer)

        for i, blk in enumerate(self.blocks):
            t = c.layer_types[i]
            st = AttentionState(window=slot(WINDOW_KV, i))
            if t == CSA:
                st.rows = (slot(CSA_ROWS[0], i), slot(CSA_ROWS[1], i))
                st.indexer_rows = (slot(INDEXER_ROWS[0], i), slot(INDEXER_ROWS[1], i))
                st.entries = block(c.csa_compress_rate, COMPRESSED_KV, i)
                st.indexer_keys = block(c.csa_compress_rate, INDEXER_KEYS, i)
            elif t == HCA:
                st.rows = (slot(HCA_ROWS[0], i), slot(HCA_ROWS[1], i))
                st.entries = block(c.hca_compress_rate, COMPRESSED_KV, i)
            blk.attn.state = st
        if self.mtp_block is not None:
            self.mtp_block.attn.state = AttentionState(window=slot(WINDOW_KV, c.num_hidden_layers))

    def _plan(self, batch: ForwardBatch, split: RowSplit | None = None) -> StepPlan:
        if self._cache is None:
            raise RuntimeError("no cache bound: call bind_cache(allocate_cache_tensors(model.cache_layout(...), ...))")
        return StepPlan(batch, self.config, self._rings, self._cache.block_size, self._num_slots, self.query_block,
                        split)

    def _split(self, batch: ForwardBatch) -> RowSplit | None:
        """Under context parallelism, a step with a chunk of at least `cp_min_tokens` new tokens is
        split zig-zag over the CP group (every rank sees the same batch, so all decide alike);
        other steps (decode, short chunks) run whole on every rank."""
        cp = self.context_parallel
        if cp is None or max((int(n) for n in batch.query_lens), default=0) < self.cp_min_tokens:
            return None
        return cp.split([int(n) for n in batch.query_lens], self.device)

    # ----- forward -----
    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if not self.blocks:
            raise RuntimeError("no weights loaded: call load_weights() first")
        c, a = self.config, self.accel
        split = self._split(batch)
        plan = self._plan(batch, split)
        ids, positions = batch.input_ids.to(self.device), plan.positions
        if split is not None:  # this rank's rows only; attention gathers what it needs of the others
            ids, positions = ids[split.local_rows], positions[split.local_rows]
        # a decode step's positions are its context lengths, on the host already
        cos_sin = self.rope.cos_sin_all(plan.ctx if plan.decode_only and split is None else positions)
        x = self.top["embed.weight"].index_select(0, ids)
        streams = x.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        step = StepInputs(ids, plan, self.rope, cos_sin)
        if plan.decode_step and plan.T <= DECODE_PROGRAM_MAX_TOKENS:  # the same calls, prepared by the back end
            streams, = self.programs.get(("decode", plan.T), lambda: self.decode_program(plan.T)).run(step,
                                                                                                    streams=streams)
        else:
            streams = run_blocks(self.blocks, streams, step)  # one mHC op between two sub-layers
        if split is not None:  # every rank samples (and drafts) from the whole step's final streams
            streams = split.gather(streams)
        picked = streams.index_select(0, batch.logits_indices.to(self.device))
        logits = self._logits(picked, self.top["hc_head_fn"], self.top["hc_head_base"], self.top["hc_head_scale"],
                              self.top["norm.weight"])
        return ForwardOutput(logits=logits, streams=self._streams_out(batch, streams, picked))

    def decode_program(self, tokens: int) -> Program:
        """The layers of a step of `tokens` decode tokens (one per sequence, in row order, not split) as a
        program (`deepinfer.program`): input the embedded streams and the step's `StepInputs`, output
        the final streams; the calls `run_blocks` makes on such a step."""
        if self._cache is None:
            raise RuntimeError("no cache bound: call bind_cache() before building a decode program")
        b = Builder({"ops": self.ops, "kernels": self.accel})
        streams = lower_blocks(self.blocks, b, b.input("streams"), b.input("step", lambda s: s))
        return b.build((streams,), key=("decode", tokens))

    @torch.no_grad()
    def mtp_forward(self, streams: torch.Tensor, next_token_ids: torch.Tensor, batch: ForwardBatch) -> ForwardOutput:
        """The MTP block (docs/model.md, "MTP"). streams `[T, n, D]`: the trunk's final residual streams at the
        rows of `batch` (positions t, before hc_head); next_token_ids `[T]`: the token at t+1.
        `batch` describes the MTP's own state: positions t, context_lens = positions already run
        through the MTP for each sequence (its window ring is separate from the trunk's).
        Returns logits for t+2 at `batch.logits_indices` (and the MTP output streams there when
        `batch.return_streams`, for chaining drafts)."""
        if self.mtp_block is None:
            raise RuntimeError("this checkpoint has no MTP weights (mtp.0.*) loaded")
        c, a, w = self.config, self.accel, self.mtp_top
        plan = self._plan(batch)
        ids = next_token_ids.to(self.device)
        eps = c.rms_norm_eps
        cos_sin = self.rope.cos_sin_all(plan.positions)
        e = a.linear(a.rms_norm(self.top["embed.weight"][ids], w["enorm.weight"], eps), w["e_proj.weight"])
        h = a.linear(a.rms_norm(streams.to(self.dtype), w["hnorm.weight"], eps), w["h_proj.weight"])
        x = self.mtp_block.run(e.unsqueeze(1) + h, StepInputs(ids, plan, self.rope, cos_sin))
        picked = x[batch.logits_indices.to(self.device)]
        logits = self._logits(picked, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"], w["norm.weight"])
        return ForwardOutput(logits=logits, streams=self._streams_out(batch, x, picked))

    def _streams_out(self, batch: ForwardBatch, streams: torch.Tensor, picked: torch.Tensor) -> torch.Tensor | None:
        if not batch.return_streams:
            return None
        return picked if batch.stream_indices is None else streams[batch.stream_indices.to(self.device)]

    def _logits(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                norm: torch.Tensor) -> torch.Tensor:
        a, c = self.accel, self.config
        h = self.ops.hc_head(streams, fn, base, scale, c.hc_eps, c.rms_norm_eps)
        h = a.rms_norm(h, norm, c.rms_norm_eps)
        return a.linear(h, self.top["head.weight"]).float()
