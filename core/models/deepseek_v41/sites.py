"""DeepSeek-V4.1's single-pass mHC sites and how a chain of them runs.

A `Site` wraps one sub-layer (attention or MoE): it computes its own (pre, post, comb) from the
streams arriving at it, but its sub-layer reads those streams collapsed with the PREVIOUS site's
`pre` (carried on the step, `step.pre`; one-hot on stream 0 before the first site), then expands
with its own post and comb (`hc_post`).

`run_modules` runs the modules of one or more blocks in order, as `m.forward` one after another
would, except that a site's `hc_post` waits for the next module: the next site takes it in its own
entry op (`hc_post_mix_collapse_norm`, one op between two sub-layers), any other module (Engram)
gets the streams after it. `run_blocks` does this over whole blocks, so the last site of a block
and the first of the next meet in one op too. `lower_blocks` describes the same calls as a step
program (`deepinfer.program`), which a back end may prepare once and replay.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.models.common.weights import WeightUses, module_weight_uses
from deepinfer.models.deepseek_v4.block import ATTN, DecoderBlock
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.ops import DeepseekV41Ops
from deepinfer.program import Builder, Ref


class Site:
    """One sub-layer inside single-pass mHC (reads `hc_{name}_*` and `{name}_norm.weight`)."""

    def __init__(self, name: str, layer, weights: dict[str, torch.Tensor], config: DeepseekV41Config,
                 accel: Accelerator, ops: DeepseekV41Ops):
        self.name, self.layer, self.c, self.accel, self.ops = name, layer, config, accel, ops
        self.fn, self.base, self.scale = weights[f"hc_{name}_fn"], weights[f"hc_{name}_base"], weights[f"hc_{name}_scale"]
        self.norm = weights[f"{name}_norm.weight"]

    def weight_uses(self) -> WeightUses:
        """This site's mix weights (V4.1's mHC ops read them) and its sub-layer's weights, by op."""
        yield "hc_mix", self.fn
        yield from module_weight_uses(self.layer)

    def forward(self, streams: torch.Tensor, step: Any) -> torch.Tensor:
        """streams `[T, n, D]` -> `[T, n, D]`: this site alone (its `hc_post` applied)."""
        return finish(*run_modules((self,), streams, None, step))

    def enter(self, streams: torch.Tensor, waiting: tuple | None, step: Any
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The streams arriving here (the `waiting` site's hc_post applied), this sub-layer's normalised
        input and this site's post and comb; `step.pre` becomes this site's pre."""
        mix = self._mix()
        if waiting is None:
            x, pre, post, comb = self.ops.hc_mix_collapse_norm(streams, step.pre, **mix)
        else:
            _, y, post_in, comb_in = waiting
            streams, x, pre, post, comb = self.ops.hc_post_mix_collapse_norm(y, streams, post_in, comb_in, step.pre,
                                                                             **mix)
        step.pre = pre
        return streams, x, post, comb

    def lower(self, b: Builder, streams: Ref, waiting: tuple | None, pre_in: Ref) -> tuple[Ref, Ref, Ref, Ref, Ref]:
        """`enter` as a program call, the previous site's pre flowing as a value: (streams, the sub-layer's
        input, this site's pre, post, comb)."""
        if waiting is None:
            x, pre, post, comb = b.call("ops.hc_mix_collapse_norm", 4, streams=streams, pre_in=pre_in, **self._mix())
            return streams, x, pre, post, comb
        _, y, post_in, comb_in = waiting
        return b.call("ops.hc_post_mix_collapse_norm", 5, y=y, streams=streams, post=post_in, comb=comb_in,
                      pre_in=pre_in, **self._mix())

    def _mix(self) -> dict[str, Any]:
        """This site's coefficient and norm arguments of the entry ops."""
        c = self.c
        return dict(fn=self.fn, base=self.base, scale=self.scale, sinkhorn_iters=c.hc_sinkhorn_iters, eps=c.hc_eps,
                    norm_eps=c.rms_norm_eps, norm_weight=self.norm, rms_eps=c.rms_norm_eps)


def run_modules(modules: Iterable, streams: torch.Tensor, waiting: tuple | None, step: Any
                ) -> tuple[torch.Tensor, tuple | None]:
    """`modules` in order from the streams and a site still `waiting` = (site, y, post, comb) (its hc_post
    not yet applied, or None), up to the streams and the last site still waiting."""
    for m in modules:
        if not isinstance(m, Site):
            streams = m.forward(finish(streams, waiting), step)
            waiting = None
            continue
        streams, x, post, comb = m.enter(streams, waiting, step)
        if step.capture is not None and m.name == ATTN and m.layer.layer in step.capture:
            # DSpark's target feature: the streams entering this attention (after Engram), averaged
            step.capture[m.layer.layer] = streams.float().mean(dim=1)
        waiting = (m, m.layer.run(x, step), post, comb)
    return streams, waiting


def finish(streams: torch.Tensor, waiting: tuple | None) -> torch.Tensor:
    """The streams with the waiting site's hc_post applied (if any)."""
    if waiting is None:
        return streams
    site, y, post, comb = waiting
    return site.ops.hc_post(y, streams, post, comb)


def run_blocks(blocks: Iterable[DecoderBlock], streams: torch.Tensor, step: Any, waiting: tuple | None = None
               ) -> torch.Tensor:
    """Every block's modules in order from a site still `waiting` (`run_modules`, one op between two
    blocks' sites too) -> the streams after them."""
    for blk in blocks:
        streams, waiting = run_modules(blk.modules, streams, waiting, step)
    return finish(streams, waiting)


def lower_blocks(blocks: Iterable[DecoderBlock], b: Builder, streams: Ref, pre: Ref, step: Ref) -> tuple[Ref, Ref]:
    """`run_blocks` of a decode step (no DSpark capture, no image rows) as program calls: the same ops on the
    same values in the same order (sites by `Site.lower`, a sub-layer by its `lower_decode` where it has one,
    else its `run`; any other module's `forward` as one call). `pre`: the first site's pre_in; returns the
    streams after the blocks and the last site's pre (what the output collapses with)."""
    waiting = None
    for blk in blocks:
        for m in blk.modules:
            if not isinstance(m, Site):
                streams, waiting = b.call(m.forward, streams=_lower_finish(b, streams, waiting), step=step), None
                continue
            streams, x, pre, post, comb = m.lower(b, streams, waiting, pre)
            lower = getattr(m.layer, "lower_decode", None)
            waiting = (m, lower(b, x, step) if lower is not None else b.call(m.layer.run, x=x, step=step), post, comb)
    return _lower_finish(b, streams, waiting), pre


def _lower_finish(b: Builder, streams: Ref, waiting: tuple | None) -> Ref:
    """`finish` as a program call."""
    if waiting is None:
        return streams
    _, y, post, comb = waiting
    return b.call("ops.hc_post", y=y, streams=streams, post=post, comb=comb)
