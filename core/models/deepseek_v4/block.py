"""A decoder block as an ordered list of sub-modules over the residual streams (docs/model.md,
"Block composition").

Every sub-module maps the streams `[T, n, D]` to new streams through `forward(streams, step)`,
where `step` (`StepInputs`) carries what any of them may read in this step (token ids, the step
plan, RoPE tables). The block runs them in order; nothing in `DecoderBlock` knows what they are.

DeepSeek-V4 builds `[mHC(attention), mHC(MoE)]` (`build_decoder_block`): `HyperConnected` wraps one
sub-layer in manifold-constrained hyper-connections (collapse the streams with `hc_pre`, RMS-norm,
run the sub-layer, expand back with `hc_post`). A module that acts on the streams directly (e.g.
V4.1's Engram memory, which precedes attention in two layers) is inserted with
`block.insert_before("attn", module)` or `build_decoder_block(..., pre_modules=[module])`.

Blocks run through `run_modules`: between two mHC sites in a row (the attention and MoE of a block,
the MoE of one block and the attention of the next) it makes one op call, the first site's `hc_post`
with the second's `hc_pre_norm` (`hc_post_pre_norm`), instead of the two. `lower_blocks` describes the
same chain of calls as a step program (`deepinfer.program`), for the steps whose sub-layers can lower
themselves (decode steps): the model runs that program, which a back end may prepare once and replay.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.models.common.weights import WeightUses, module_weight_uses, strip_prefix
from deepinfer.models.deepseek_v4.attention import Attention
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops, resolve_ops
from deepinfer.models.deepseek_v4.rope import RotaryTables
from deepinfer.models.deepseek_v4.state import StepPlan
from deepinfer.program import Builder, Ref
from deepinfer.parallel.context_parallel import RowSplit

ATTN, FFN = "attn", "ffn"


@dataclass
class StepInputs:
    """What a block's sub-modules may read in one step (the same object for every block)."""

    input_ids: torch.Tensor  # [T]
    plan: StepPlan
    rope: RotaryTables
    cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]]  # frequency set -> cos, sin `[T, r/2]`

    @property
    def cp_split(self) -> RowSplit | None:
        """The context-parallel split whose rows of this rank the step runs, or None: the whole step."""
        return self.plan.split


class BlockModule(Protocol):
    name: str

    def forward(self, streams: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """streams `[T, n, D]` -> `[T, n, D]`."""


class SubLayer(Protocol):
    def run(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """x `[T, D]` (normalised) -> `[T, D]`."""


class HyperConnected:
    """One sub-layer inside mHC: `hc_pre` -> RMS-norm -> sub-layer -> `hc_post`.

    `weights` are the block's tensors; this module reads `hc_{name}_fn/_base/_scale` and
    `{name}_norm.weight`."""

    def __init__(self, name: str, layer: SubLayer, weights: dict[str, torch.Tensor], config: DeepseekV4Config,
                 accel: Accelerator, ops: DeepseekV4Ops | None = None):
        self.name, self.layer, self.c, self.accel = name, layer, config, accel
        self.ops = resolve_ops(accel) if ops is None else ops  # V4's own ops (mHC)
        self.fn, self.base, self.scale = weights[f"hc_{name}_fn"], weights[f"hc_{name}_base"], weights[f"hc_{name}_scale"]
        self.norm = weights[f"{name}_norm.weight"]

    def weight_uses(self) -> WeightUses:
        """This site's mix weights (V4's mHC ops read them) and its sub-layer's weights, by op."""
        yield "hc_pre", self.fn
        yield from module_weight_uses(self.layer)

    def forward(self, streams: torch.Tensor, step: StepInputs) -> torch.Tensor:
        x, post, comb = self.pre(streams)
        return self.ops.hc_post(self.layer.run(x, step), streams, post, comb)

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the sub-layer's normalised input, post, comb) of the streams."""
        c = self.c
        return self.ops.hc_pre_norm(streams, self.fn, self.base, self.scale, c.hc_sinkhorn_iters, c.hc_eps,
                                    c.rms_norm_eps, self.norm, c.rms_norm_eps)

    def post_pre(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The previous site's `hc_post` (its output y, post and comb) then this site's `pre`, in one op:
        (streams, this sub-layer's input, post, comb)."""
        c = self.c
        return self.ops.hc_post_pre_norm(y, streams, post, comb, self.fn, self.base, self.scale, c.hc_sinkhorn_iters,
                                         c.hc_eps, c.rms_norm_eps, self.norm, c.rms_norm_eps)

    def lower(self, b: Builder, streams: Ref, waiting: tuple | None, step: Ref) -> tuple[Ref, tuple]:
        """This site as program calls (`_run_waiting`'s for it): `pre` or, with a site still `waiting`,
        `post_pre`, then the sub-layer (`lower_decode` when it has one, else its `run` as one call);
        returns the streams and this site, waiting."""
        c = self.c
        site = dict(fn=self.fn, base=self.base, scale=self.scale, sinkhorn_iters=c.hc_sinkhorn_iters, eps=c.hc_eps,
                    norm_eps=c.rms_norm_eps, norm_weight=self.norm, rms_eps=c.rms_norm_eps)
        if waiting is None:
            x, post, comb = b.call("ops.hc_pre_norm", 3, streams=streams, **site)
        else:
            _, y, post_in, comb_in = waiting
            streams, x, post, comb = b.call("ops.hc_post_pre_norm", 4, y=y, streams=streams, post=post_in,
                                            comb=comb_in, **site)
        lower = getattr(self.layer, "lower_decode", None)
        y = lower(b, x, step) if lower is not None else b.call(self.layer.run, x=x, step=step)
        return streams, (self, y, post, comb)


def run_modules(modules: Iterable[BlockModule], streams: torch.Tensor, step: StepInputs) -> torch.Tensor:
    """streams `[T, n, D]` -> `[T, n, D]`: every module in order, as `m.forward` one after another would,
    except that an mHC site's `hc_post` waits for the next module: an mHC site takes it in its own first
    op (`HyperConnected.post_pre`), any other module gets the streams after it."""
    return _finish(*_run_waiting(modules, streams, None, step))


def _run_waiting(modules: Iterable[BlockModule], streams: torch.Tensor, waiting: tuple | None, step: StepInputs
                 ) -> tuple[torch.Tensor, tuple | None]:
    """`run_modules` from a site still `waiting` = (site, y, post, comb) (an mHC site whose output is not in the
    streams yet, or None), up to the streams and the last site still waiting."""
    for m in modules:
        if not isinstance(m, HyperConnected):
            if waiting is not None:
                site, y, post, comb = waiting
                streams, waiting = site.ops.hc_post(y, streams, post, comb), None
            streams = m.forward(streams, step)
            continue
        if waiting is None:
            x, post, comb = m.pre(streams)
        else:
            streams, x, post, comb = m.post_pre(waiting[1], streams, waiting[2], waiting[3])
        waiting = (m, m.layer.run(x, step), post, comb)
    return streams, waiting


def _finish(streams: torch.Tensor, waiting: tuple | None) -> torch.Tensor:
    if waiting is not None:
        site, y, post, comb = waiting
        streams = site.ops.hc_post(y, streams, post, comb)
    return streams


def run_blocks(blocks: Iterable[DecoderBlock], streams: torch.Tensor, step: StepInputs) -> torch.Tensor:
    """Every block in order (`run_modules` over all their modules: one op between two blocks too)."""
    waiting = None
    for blk in blocks:
        streams, waiting = _run_waiting(blk.modules, streams, waiting, step)
    return _finish(streams, waiting)


def lower_blocks(blocks: Iterable[DecoderBlock], b: Builder, streams: Ref, step: Ref) -> Ref:
    """`run_blocks` as program calls: the same ops on the same values in the same order (mHC sites by
    `HyperConnected.lower`, any other module's `forward` as one call). `step` is the step's
    `StepInputs`, for the calls that read it whole."""
    waiting = None
    for blk in blocks:
        for m in blk.modules:
            if isinstance(m, HyperConnected):
                streams, waiting = m.lower(b, streams, waiting, step)
                continue
            if waiting is not None:
                streams, waiting = lower_post(b, waiting, streams), None
            streams = b.call(m.forward, streams=streams, step=step)
    return streams if waiting is None else lower_post(b, waiting, streams)


def lower_post(b: Builder, waiting: tuple, streams: Ref) -> Ref:
    """The waiting site's `hc_post` as a program call."""
    _, y, post, comb = waiting
    return b.call("ops.hc_post", y=y, streams=streams, post=post, comb=comb)


class DecoderBlock:
    """An ordered list of sub-modules over the residual streams."""

    def __init__(self, modules: list[BlockModule], weights: dict[str, torch.Tensor]):
        """`weights`: the block's tensors under official names relative to `layers.{i}.`/`mtp.{j}.`."""
        self.modules: list[BlockModule] = list(modules)
        self.w = weights
        self._check_names()

    def _check_names(self) -> None:
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"sub-module names of a block must be unique; got {names}")

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.modules]

    def module(self, name: str) -> BlockModule:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"block has no sub-module {name!r}; it has {self.names}")

    def insert_before(self, name: str, module: BlockModule) -> None:
        """Run `module` right before the sub-module called `name`."""
        index = self.names.index(self.module(name).name)
        self.modules.insert(index, module)
        self._check_names()

    @property
    def attn(self) -> Attention:
        return self.module(ATTN).layer

    @property
    def ffn(self) -> MoE:
        return self.module(FFN).layer

    def weight_uses(self) -> WeightUses:
        """Every sub-module's weights, by the op that reads them (`SmallOps.prepare_weights`)."""
        for m in self.modules:
            yield from module_weight_uses(m)

    def run(self, streams: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """streams `[T, n, D]` -> `[T, n, D]`: every sub-module in order (`run_modules`)."""
        return run_modules(self.modules, streams, step)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, plan: StepPlan, rope: RotaryTables,
                cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return self.run(streams, StepInputs(input_ids, plan, rope, cos_sin))


def build_decoder_block(config: DeepseekV4Config, layer_type: str, mlp_type: str, weights: dict[str, torch.Tensor],
                        accel: Accelerator, pre_modules: tuple[BlockModule, ...] | list[BlockModule] = (),
                        ops: DeepseekV4Ops | None = None) -> DecoderBlock:
    """V4's block: `[*pre_modules, mHC(attention of layer_type), mHC(MoE, hash-routed for "hash_moe")]`.

    `ops`: the model's V4 op table (resolved once by the model); None resolves it from `accel`."""
    ops = resolve_ops(accel) if ops is None else ops
    attn = HyperConnected(ATTN, Attention(config, layer_type, strip_prefix(weights, "attn."), accel, ops), weights,
                          config, accel, ops)
    ffn = HyperConnected(FFN, MoE(config, mlp_type == "hash_moe", strip_prefix(weights, "ffn."), accel), weights,
                         config, accel, ops)
    return DecoderBlock([*pre_modules, attn, ffn], weights)

