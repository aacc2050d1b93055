"""DeepSeek-V4.1's single-pass mHC sites and how a chain of them runs.

A `Site` wraps one sub-layer (attention or MoE): it computes its own (pre, post, comb) from the
streams arriving at it, but its sub-layer reads those streams collapsed with the PREVIOUS site's
`pre` (carried on the step, `step.pre`; one-hot on stream 0 before the first site), then expands
with its own post and comb (`hc_post`).

`run_modules` runs the modules of one or more blocks in order, as `m.forward` one after another
would, except that a site's `hc_post` waits for the next module: the next site takes it in its own
entry op (`hc_post_mix_collapse_norm`, one op between two sub-layers), any other module (Engram)
gets the streams after it. `run_blocks` does this over whole blocks, so the last site of a block
and the first of the next meet in one op too.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.models.deepseek_v4.block import ATTN, DecoderBlock
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.ops import DeepseekV41Ops


class Site:
    """One sub-layer inside single-pass mHC (reads `hc_{name}_*` and `{name}_norm.weight`)."""

    def __init__(self, name: str, layer, weights: dict[str, torch.Tensor], config: DeepseekV41Config,
                 accel: Accelerator, ops: DeepseekV41Ops):
        self.name, self.layer, self.c, self.accel, self.ops = name, layer, config, accel, ops
        self.fn, self.base, self.scale = weights[f"hc_{name}_fn"], weights[f"hc_{name}_base"], weights[f"hc_{name}_scale"]
        self.norm = weights[f"{name}_norm.weight"]

    def forward(self, streams: torch.Tensor, step: Any) -> torch.Tensor:
        """streams `[T, n, D]` -> `[T, n, D]`: this site alone (its `hc_post` applied)."""
        return finish(*run_modules((self,), streams, None, step))

    def enter(self, streams: torch.Tensor, waiting: tuple | None, step: Any
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The streams arriving here (the `waiting` site's hc_post applied), this sub-layer's normalised
        input and this site's post and comb; `step.pre` becomes this site's pre."""
        c, ops = self.c, self.ops
        mix = (self.fn, self.base, self.scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, self.norm,
               c.rms_norm_eps)
        if waiting is None:
            x, pre, post, comb = ops.hc_mix_collapse_norm(streams, step.pre, *mix)
        else:
            _, y, post_in, comb_in = waiting
            streams, x, pre, post, comb = ops.hc_post_mix_collapse_norm(y, streams, post_in, comb_in, step.pre, *mix)
        step.pre = pre
        return streams, x, post, comb


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
