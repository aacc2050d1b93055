"""DeepSeek-V4.1 causal LM on ragged batches with engine-managed state.

    model = DeepseekV41ForCausalLM(config, accelerator, dtype=torch.float32, device="cpu")
    model.load_weights(weights)        # checkpoint.load_checkpoint's tensors (+ engram.token_map)
    model.bind_cache(allocate_cache_tensors(model.cache_layout(max_rollback=0), ...))
    out = model.forward(batch)         # ForwardOutput(logits [L, V] fp32)

Forward: Engram row ids for every Engram layer (from the step's ids and each sequence's n-gram
history), the embedding copied into `hc_mult` streams, the layers, then the streams collapsed with
the last FFN site's `pre`, `norm` and `head`.

A layer is a `DecoderBlock` (V4's ordered list of sub-modules): `[Engram (some layers),
Site(attention), Site(MoE)]`. `Site` (sites.py) is single-pass mHC: it computes its own (pre, post,
comb) from the streams it receives, but its sub-layer reads the streams collapsed with the PREVIOUS
site's `pre` (carried on the step; one-hot on stream 0 before the first site), then expands with its
own post and comb; the blocks run through `sites.run_blocks` (one op between two sites). The MoE is
V4's without hash routing (every layer scored with `gate.bias`).

With the vision tower's weights loaded (`vision_config` with layers), `self.images` runs it: a
batch's `images` (the spans overlapping its chunks) replace those rows' token embeddings before the
streams expand, and the step's span rows route with `gate.bias_vl` and are dead to Engram
(multimodal.py, docs/vision.md).

With the DSpark drafter's weights (`mtp.*`) loaded, `self.dspark` is its `DSparkHead`
(dspark_head.py) and a batch with `return_streams` gets the DSpark target features of the asked
rows in `ForwardOutput.streams` (the stream means entering the attention of each
`dspark_target_layer_ids` layer, captured by `Site`). `twin()` gives a second model over the same
weights for the self-drafting test mode.

With `set_bounded_replay(k)` (the swa_replay feature) prefill runs the decoder layers only on the
last k prompt rows of each sequence (SWA bounded replay, approximate; replay.py); exact by default.

Under context parallelism (`--cp`), a step with a chunk of at least `cp_min_tokens` new tokens is
split zig-zag over the CP group: each rank runs its own rows, attention gathers the window keys and
compressor inputs of the others, and the final streams are gathered (context_parallel.py; under
bounded replay the decoder's kept rows are split anew, replay.py).

Implements the engine's `Model` protocol; its registry entry is `family.py`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.models.common.weights import WeightUses, ensure_row_groups, fuse_experts, fuse_rows, strip_prefix
from deepinfer.models.deepseek_v4.block import ATTN, FFN, DecoderBlock
from deepinfer.models.deepseek_v4.model import DECODE_PROGRAM_MAX_TOKENS
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.models.deepseek_v4.rope import RotaryTables
from deepinfer.models.deepseek_v4.state import StepPlan
from deepinfer.models.deepseek_v41.attention import QR_PARTS, X_PARTS, Attention, CacheViews
from deepinfer.models.deepseek_v41.config import FULL, DeepseekV41Config
from deepinfer.models.deepseek_v41.context_parallel import gather_outputs, step_split
from deepinfer.models.deepseek_v41.engram import Engram, EngramHasher
from deepinfer.models.deepseek_v41.image_processing import ProcessedImage, preprocess_image
from deepinfer.models.deepseek_v41.multimodal import ImageEmbedder, VisionRoutedMoE
from deepinfer.models.deepseek_v41.ops import DeepseekV41Ops, resolve_ops
from deepinfer.models.deepseek_v41.replay import decoder_rows, decoder_start, minimum_keep_tokens
from deepinfer.models.deepseek_v41.sites import Site, lower_blocks, run_blocks
from deepinfer.models.deepseek_v41.state import (
    COMPRESSED_KV, ENGRAM_HISTORY, INDEX_KEYS, WINDOW_KV, build_cache_layout, group_name, ring_sizes, rows_names,
)
from deepinfer.models.deepseek_v41.vision import VisionTower, is_vision_weight
from deepinfer.models.interface import CacheLayout, CacheTensors, ForwardBatch, ForwardOutput
from deepinfer.parallel.context_parallel import RowSplit, current_context_parallel
from deepinfer.program import Builder, Program, Programs

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v41.dspark_head import DSparkHead

FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "attn.fused_x.weight": X_PARTS,
    "attn.fused_qr.weight": QR_PARTS,
    "ffn.fused_shared.weight": ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"),
}
TOKEN_MAP = "engram.token_map"
# kept in fp32 whatever the model dtype: mHC parameters, sinks, router, the ratio>1 compressor
_FP32_SUFFIXES = ("attn_sink", "gate.weight", "gate.bias", "gate.bias_vl", "compressor.wkv.weight",
                  "compressor.wgate.weight", "confidence_head.proj.weight")


@dataclass
class StepInputs:
    """What a block's sub-modules read and carry in one step (one object for every block)."""

    input_ids: torch.Tensor  # [T]
    plan: StepPlan
    rope: RotaryTables
    cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]]
    pre: torch.Tensor  # [T, n] fp32: the previous mHC site's pre (single-pass mHC)
    engram_rows: torch.Tensor | None = None  # [T, engram layers, hash heads]
    selection: dict = field(default_factory=dict)  # attention group -> (index-source layer, picks)
    candidates: dict = field(default_factory=dict)  # attention group -> candidate pool [B, S, E]
    picked: dict = field(default_factory=dict)  # decode: (top-k owner, rate) -> (entry rows, mask) (attention.py)
    kv_published: bool = False  # bounded replay: the decoder KV source already ran its compressor (replay.py)
    capture: dict[int, torch.Tensor | None] | None = None  # DSpark target layer -> its attention input's stream mean
    span_rows: torch.Tensor | None = None  # [T] bool: image span positions (multimodal.py); None: no image

    @property
    def cp_split(self) -> RowSplit | None:
        """The context-parallel split whose rows of this rank the step runs, or None: the whole step."""
        return self.plan.split


def _twin_module(m):
    """A block sub-module for a twin model: attention sites get their own attention object (it
    holds the cache views), the rest is shared."""
    if isinstance(m, Site) and isinstance(m.layer, Attention):
        m = copy.copy(m)
        m.layer = copy.copy(m.layer)
        m.layer.state = None
    return m


class DeepseekV41ForCausalLM:
    #: context parallelism (`--cp`) splits this model's long prefills (context_parallel.py)
    supports_context_parallel = True

    #: why speculative decoding is refused on this model (read by the speculative-decoding feature);
    #: None on an instance whose checkpoint brought the DSpark drafter (`load_weights`)
    drafter_unsupported: str | None = (
        "speculative decoding on DeepSeek-V4.1 needs its own DSpark draft head (mtp.0-2 weights with "
        "text_config.num_nextn_predict_layers > 0, which `deepinfer make-model --family v41 --dspark` writes), and "
        "this checkpoint has none")

    @classmethod
    def drafter_unsupported_for(cls, checkpoint: str | Path) -> str | None:
        """`drafter_unsupported` of the model `checkpoint` would load, from its config and tensor
        names alone (what the examples ask before they apply the seeds' speculation default)."""
        from deepinfer.models.deepseek_v41.checkpoint import has_dspark_drafter

        return None if has_dspark_drafter(checkpoint) else cls.drafter_unsupported

    def __init__(self, config: DeepseekV41Config, accelerator: Accelerator, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", query_block: int = 256, cp_min_tokens: int = 16):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported; choose torch.float32, torch.bfloat16 or torch.float16")
        if cp_min_tokens < 1:
            raise ValueError(f"cp_min_tokens must be >= 1, got {cp_min_tokens}")
        self.config, self.accel, self.dtype = config, accelerator, dtype
        self.ops = resolve_ops(accelerator)
        self.device = torch.device(device)
        self.query_block = query_block
        self.cp_min_tokens = cp_min_tokens  # a step with a chunk this long is split over the CP group
        self.context_parallel = current_context_parallel()  # the launch's CP group, or None
        self.rope = RotaryTables(config, self.device)
        self.blocks: list[DecoderBlock] = []
        self.top: dict[str, torch.Tensor] = {}
        self.hasher: EngramHasher | None = None
        self._cache: CacheTensors | None = None
        self._layout: CacheLayout | None = None
        self._num_slots = 0
        self.replay_keep_tokens: int | None = None  # SWA bounded replay (replay.py); None: exact prefill
        self.dspark: DSparkHead | None = None  # the DSpark drafter, when the checkpoint has it
        self.images: ImageEmbedder | None = None  # the image tower, when the checkpoint has it (multimodal.py)
        self.programs = Programs(accelerator)  # decode-step programs by token count (`decode_program`)

    def set_bounded_replay(self, keep_tokens: int | None) -> None:
        """Run prefill with decoder-side SWA bounded replay keeping the last `keep_tokens` prompt
        rows per sequence (replay.py), or exactly (None, the default). Call after bind_cache."""
        if keep_tokens is not None:
            decoder_start(self.config)  # refuses a schedule without an encoder/decoder split
            rollback = self._rings.window - self.config.sliding_window if self._cache is not None else 0
            minimum = minimum_keep_tokens(self.config, rollback)
            if keep_tokens < minimum:
                raise ValueError(f"bounded replay keeps {keep_tokens} prompt rows, fewer than the minimum {minimum} "
                                 f"(sliding_window {self.config.sliding_window} + 2 x max_rollback {rollback}); "
                                 f"keep at least {minimum}")
        self.replay_keep_tokens = keep_tokens

    def drafter_heads(self) -> tuple[DSparkHead] | None:
        """The DSpark drafter (`mtp.*`, run by the dspark feature) when its weights are loaded, else None."""
        return None if self.dspark is None else (self.dspark,)

    def twin(self) -> DeepseekV41ForCausalLM:
        """A second model over the same weight tensors with no cache bound (the dspark feature's
        self-drafting test mode binds a cache of its own to it); it has no drafter."""
        other = copy.copy(self)
        other.blocks = [DecoderBlock([_twin_module(m) for m in blk.modules], blk.w) for blk in self.blocks]
        other._cache, other._layout, other._num_slots, other.dspark = None, None, 0, None
        other.programs = Programs(self.accel)  # its programs hold its own cache
        return other

    # ----- weights -----
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Tensors under official names (checkpoint.load_checkpoint): dequantised, except the
        Engram tables (FP8 + row scales, kept as stored) and the linear weights the loader kept
        quantised (`QuantizedWeight`, in formats the back end declares), plus the derived
        `engram.token_map`."""
        c = self.config
        quantised = [k for k in weights if k.endswith(".scale") and ".engram.embed." not in k]
        if quantised:
            raise ValueError(f"{len(quantised)} quantisation scales found (e.g. {quantised[0]!r}); dequantise the "
                             f"checkpoint with the checkpoint loader before load_weights")
        if c.engram_layer_ids and TOKEN_MAP not in weights:
            raise ValueError(f"{TOKEN_MAP!r} is missing: the Engram layers need the tokenizer-derived compressed-id "
                             f"map (load the checkpoint with deepinfer.models.deepseek_v41.checkpoint)")
        state = {k: self._convert(k, v) for k, v in weights.items() if k.startswith(("layers.", "embed.", "norm.",
                                                                                     "head.", "mtp."))}
        self.top = {k: state[k] for k in ("embed.weight", "norm.weight", "head.weight")}
        self.hasher = EngramHasher(c, weights[TOKEN_MAP], self.device) if c.engram_layer_ids else None
        self.blocks = [self._build_block(i, strip_prefix(state, f"layers.{i}.")) for i in range(c.num_hidden_layers)]
        self.dspark = None
        self.programs.clear()
        self.__dict__.pop("drafter_unsupported", None)
        self.images = None
        if c.vision is not None and "vision.norm.weight" in weights:
            tower = VisionTower(c.vision, {k: v for k, v in weights.items() if is_vision_weight(k)}, self.accel,
                                self.dtype, self.device)
            self.images = ImageEmbedder(tower)
        if c.num_nextn_predict_layers and any(k.startswith("mtp.") for k in state):
            from deepinfer.models.deepseek_v41.dspark_head import DSparkHead

            self.dspark = DSparkHead(c, {k: v for k, v in state.items() if k.startswith("mtp.")}, self.top,
                                     self.rope, self.accel, self.ops)
            self.drafter_unsupported = None
        self.accel.prepare_weights(self.weight_uses())
        if self._cache is not None:
            self.bind_cache(self._cache)

    def weight_uses(self) -> WeightUses:
        """Every weight the forward (and the drafter, the vision tower) passes to an op, by that op
        (`SmallOps.prepare_weights`)."""
        yield "linear", self.top["head.weight"]
        for block in self.blocks:
            yield from block.weight_uses()
        if self.dspark is not None:
            yield from self.dspark.weight_uses()
        if self.images is not None:
            yield from self.images.tower.weight_uses()

    def _convert(self, name: str, t: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        if isinstance(t, QuantizedWeight):  # a linear weight kept quantised: own memory on the device
            return t.copy_to(self.device, self.dtype)
        if ".engram.embed." in name:
            return t  # the FP8 table stays as stored (memory-mapped); rows are dequantised per look-up
        fp32 = name.endswith(_FP32_SUFFIXES) or ".hc_" in name
        out = t.to(device=self.device, dtype=torch.float32 if fp32 else self.dtype)
        return out.clone() if out.data_ptr() == t.data_ptr() else out.contiguous()

    def _build_block(self, i: int, w: dict[str, torch.Tensor]) -> DecoderBlock:
        c, a, ops = self.config, self.accel, self.ops
        for key, names in FUSED_PROJECTIONS.items():
            fuse_rows(w, key, names)
        ensure_row_groups(w, "attn.wo_a.weight", c.o_groups)  # read as [G, R, in]
        fuse_experts(w, c.n_routed_experts)
        if c.gate_temp != 1.0:  # router logits x W^T / gate_temp
            w["ffn.gate.weight"] = w["ffn.gate.weight"] / c.gate_temp
        modules = []
        if i in c.engram_layer_ids:
            modules.append(Engram(c, c.engram_layer_ids.index(i), strip_prefix(w, "engram."), a))
        modules.append(Site(ATTN, Attention(c, i, strip_prefix(w, "attn."), a, ops), w, c, a, ops))
        ffn = strip_prefix(w, "ffn.")
        moe = VisionRoutedMoE(c, ffn, a) if "gate.bias_vl" in ffn else MoE(c, False, ffn, a)
        modules.append(Site(FFN, moe, w, c, a, ops))
        return DecoderBlock(modules, w)

    # ----- state -----
    def cache_layout(self, max_rollback: int) -> CacheLayout:
        return build_cache_layout(self.config, max_rollback)

    def bind_cache(self, cache: CacheTensors) -> None:
        """Bind preallocated state (allocate_cache_tensors of cache_layout); checked against it."""
        c = self.config
        if WINDOW_KV not in cache.slot:
            raise ValueError(f"cache has no {WINDOW_KV!r} tensor; allocate it from model.cache_layout()")
        max_rollback = cache.slot[WINDOW_KV].shape[2] - c.sliding_window
        layout = self.cache_layout(max_rollback)
        layout.check(cache, f"model.cache_layout({max_rollback})")
        self._cache, self._layout = cache, layout
        self.programs.clear()  # their calls hold the old cache's tensors
        self._num_slots = cache.slot[WINDOW_KV].shape[1]
        self._rings = ring_sizes(c, max_rollback)
        if self.dspark is not None:
            self.dspark.bind(self._num_slots)

        def slot(name: str, layer: int) -> torch.Tensor:
            return layout.slot_tensor(name).view(cache.slot[name], layer)

        def block(name: str, layer: int) -> torch.Tensor:
            group = group_name(c.compress_ratio(layer))
            return layout.group(group).tensor(name).view(cache.blocks[group][name], layer)

        for i, blk in enumerate(self.blocks):
            views = CacheViews(window=slot(WINDOW_KV, i))
            if c.compress_ratio(i):
                views.entries = block(COMPRESSED_KV, i)
                if blk.attn.indexes:
                    views.index_keys = block(INDEX_KEYS, i)
                if c.layer_roles[i] == FULL and c.compress_ratio(i) > 1:
                    views.rows = tuple(slot(n, i) for n in rows_names(c.compress_ratio(i)))
            blk.attn.state = views

    # ----- forward -----
    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if not self.blocks:
            raise RuntimeError("no weights loaded: call load_weights() first")
        if self._cache is None:
            raise RuntimeError("no cache bound: call bind_cache(allocate_cache_tensors(model.cache_layout(...), ...))")
        c = self.config
        split = decoder_rows(batch, c, self.replay_keep_tokens)
        # context parallelism: this rank runs its own rows (cp_split); attention gathers what it reads
        cp_split = step_split(self.context_parallel, batch, self.cp_min_tokens, self.device)
        plan = StepPlan(batch, c, self._rings, self._cache.block_size, self._num_slots, self.query_block, cp_split)
        all_ids = ids = batch.input_ids.to(self.device)
        positions = plan.positions
        if cp_split is not None:
            ids, positions = ids[cp_split.local_rows], positions[cp_split.local_rows]
        cos_sin = self.rope.cos_sin_all(positions)
        span_rows = dead = None  # image span positions: this rank's rows, the whole step's (Engram hashing)
        if batch.images:  # image span rows replace the token embeddings before the streams expand
            embedded, dead = self._embed_with_images(batch, all_ids)
            span_rows = dead
            if cp_split is not None:
                embedded, span_rows = embedded[cp_split.local_rows], dead[cp_split.local_rows]
        else:
            embedded = self.top["embed.weight"][ids]
        streams = embedded.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        pre = torch.zeros((ids.shape[0], c.hc_mult), dtype=torch.float32, device=self.device)
        pre[:, 0] = 1.0  # the first site reads stream 0
        step = StepInputs(ids, plan, self.rope, cos_sin, pre, span_rows=span_rows)
        if self.hasher is not None:  # hashed over the whole step (n-grams reach back; the history ring)
            history = self._layout.slot_tensor(ENGRAM_HISTORY).view(self._cache.slot[ENGRAM_HISTORY],
                                                                    c.engram_layer_ids[0])
            step.engram_rows = self.hasher.hash(all_ids, plan, history, dead)
            if cp_split is not None:
                step.engram_rows = step.engram_rows[cp_split.local_rows]
        features = batch.return_streams and self.dspark is not None
        if features:
            step.capture = dict.fromkeys(c.dspark_target_layer_ids)
        if (plan.decode_step and plan.T <= DECODE_PROGRAM_MAX_TOKENS and split is None and not batch.images
                and not features):  # the same calls, prepared by the back end
            program = self.programs.get(("decode", plan.T), lambda: self.decode_program(plan.T))
            streams, step.pre = program.run(step, streams=streams, pre=pre)
        else:
            streams = run_blocks(self.blocks if split is None else self.blocks[:split.layer], streams, step)
        if cp_split is not None and split is None:  # every rank samples (and drafts) from the whole step's rows
            streams, step.pre, step.capture = gather_outputs(cp_split, streams, step.pre, step.capture)
        rows = logits_rows = batch.logits_indices.to(self.device)
        capture = step.capture
        if split is not None:  # bounded replay: the decoder runs only the kept rows
            rows = split.kept(rows, "logits")
            streams, kept_step = split.run_decoder(self, streams, step)
            if kept_step is None:
                return ForwardOutput(logits=torch.zeros((0, c.vocab_size), dtype=torch.float32, device=self.device),
                                     streams=self._target_features(capture, batch, logits_rows, split)
                                     if features else None)
            step = kept_step
        h = self.ops.hc_collapse(streams[rows], step.pre[rows])
        h = self.accel.rms_norm(h, self.top["norm.weight"], c.rms_norm_eps)
        logits = self.accel.linear(h, self.top["head.weight"]).float()
        out = streams[rows] if batch.return_streams else None
        if features:
            out = self._target_features(capture, batch, logits_rows, split)
        return ForwardOutput(logits=logits, streams=out)

    def decode_program(self, tokens: int) -> Program:
        """The layers of a step of `tokens` decode tokens (one per sequence, in row order, not split; no image
        rows, no DSpark capture) as a program (`deepinfer.program`): inputs the embedded streams, the first
        site's `pre` and the step's `StepInputs`; outputs the final streams and the last site's pre; the
        calls `run_blocks` makes on such a step."""
        if self._cache is None:
            raise RuntimeError("no cache bound: call bind_cache() before building a decode program")
        b = Builder({"ops": self.ops, "kernels": self.accel})
        streams, pre = lower_blocks(self.blocks, b, b.input("streams"), b.input("pre"), b.input("step", lambda s: s))
        return b.build((streams, pre), key=("decode", tokens))

    def _embed_with_images(self, batch: ForwardBatch, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's embeddings `[T, D]` with its image span rows from the tower, and the span mask `[T]`."""
        if self.images is None:
            raise ValueError(self.image_input_unsupported or "this model has no vision tower")
        rows, values = self.images.step_rows(batch, self.device)
        embedded = self.top["embed.weight"][ids]
        mask = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)
        if rows.numel():
            embedded = embedded.index_copy(0, rows, values.to(embedded.dtype))
            mask[rows] = True
        return embedded, mask

    @property
    def image_token_id(self) -> int | None:
        """The image placeholder's token id (every position of an image span carries it)."""
        return self.config.image_token_id

    def preprocess_image(self, image) -> ProcessedImage:
        """One PIL image planned, fitted and cut into patches for the tower (image_processing.py);
        its `num_tokens` is the span's length. ValueError for an image the budget cannot hold."""
        if self.config.vision is None:
            raise ValueError(self.image_input_unsupported)
        return preprocess_image(image, self.config.vision)

    @property
    def image_input_unsupported(self) -> str | None:
        """Why this model refuses image input, or None when it takes images."""
        if self.images is not None:
            return None
        if self.config.vision is None:
            return ("this DeepSeek-V4.1 checkpoint is text-only (its config.json has no vision_config with layers); "
                    "send text only, or load a checkpoint with the vision tower")
        return ("this DeepSeek-V4.1 checkpoint's config.json has a vision_config but its weights have no vision "
                "tower (vision.*, aligner.*, image_* tensors); load the full checkpoint to send images")

    def _target_features(self, capture: dict[int, torch.Tensor | None], batch: ForwardBatch, logits_rows: torch.Tensor,
                         split) -> torch.Tensor:
        """The DSpark target features `[S, len(ids) * D]` of the asked rows (stream_indices, else the
        logits rows). Under bounded replay a decoder layer ran only the kept rows; a dropped row's
        feature is 0. The drafter never reads it: it attends to the `sliding_window` positions
        before its anchor, which lie in the kept suffix (keep_tokens >= sliding_window) and are
        seeded after the dropped rows of the same ring slots."""
        picked = logits_rows if batch.stream_indices is None else batch.stream_indices.to(self.device)
        parts = []
        for layer in self.config.dspark_target_layer_ids:
            f = capture[layer]
            if split is None or layer < split.layer:
                parts.append(f[picked])
                continue
            where = split.row_of[picked]
            part = torch.zeros((picked.numel(), self.config.hidden_size), dtype=torch.float32, device=self.device)
            if f is not None and f.shape[0]:
                part = torch.where((where >= 0).unsqueeze(-1), f[where.clamp(min=0)], part)
            parts.append(part)
        return torch.cat(parts, dim=-1)
