"""Weight-name canonicalisation helpers and load-time weight transforms, for any model family.

A family loads tensors under one canonical naming. Checkpoints in the wild spell the same tensor
several ways (a `model.` prefix, transformers' module paths, `weight_scale_inv` for a scale); a
family's `canonicalize` is built from these pieces:

- `drop_prefix(name, "model.")`, `rename_prefix(name, table)` (first matching prefix of a table of
  (stored, canonical) prefixes), `hf_scale_to_official` (`<w>.weight_scale_inv` -> `<w>.scale`);
- `CanonicalNames`: the output mapping, refusing two stored tensors that land on one name;
- `canonicalize_blocks`: the loop over stored names (prefix, top-level renames, per-block handler);
- `strip_prefix(weights, prefix)`: a sub-module's tensors, named relative to it;
- `fuse_rows` / `fused_parts` / `split_fused`: matrices that read the same input concatenated into
  one at load time (one GEMM instead of several), and the output split back by name;
- `fuse_experts`: the routed experts stacked into `w13 [E, 2I, D]` and `w2 [E, D, I]`;
- `group_rows` / `ensure_row_groups`: a `[G * R, in]` weight seen as `[G, R, in]` (grouped_linear).

Any of these weights may be a `QuantizedWeight` (kept quantised for a back end that declares its
format). Quantised parts are concatenated / stacked quantised when they can be: the same format and
input size, and, for FP8, every part but the last a whole number of scale blocks (so that the scale
rows concatenate too). Otherwise the quantised parts are dequantised (to the dtype they stand for)
and fused as plain tensors: keeping them apart would cost a GEMM per part on every step. In
DeepSeek-V4's and V4.1's released checkpoints this happens only for the attention input projection
`fused_x`, whose FP8 parts (`wq_a`, `wkv`) sit beside BF16 ones (compressor, `indexer.weights_proj`):
about 1.5k x hidden FP8 values per layer, a fraction of a percent of the model.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from deepinfer.accelerator.quantized_weight import QuantizedWeight, can_cat_rows, cat_rows, stack

Weight = torch.Tensor | QuantizedWeight
#: a module's weights, each with the op that reads it (what `SmallOps.prepare_weights` is given)
WeightUses = Iterator[tuple[str, Weight]]

def module_weight_uses(module: object) -> WeightUses:
    """`module.weight_uses()`; nothing for a module without it (one of a plugin's, which then runs on the
    plain weights wherever a back end would read a copy of its own)."""
    uses = getattr(module, "weight_uses", None)
    return uses() if callable(uses) else iter(())


def drop_prefix(name: str, prefix: str = "model.") -> str:
    return name[len(prefix):] if name.startswith(prefix) else name


def rename_prefix(name: str, table: tuple[tuple[str, str], ...]) -> str:
    """`name` with the first matching `old` prefix of `table` ((old, new) pairs) replaced by `new`."""
    for old, new in table:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def hf_scale_to_official(name: str) -> str:
    """transformers' scale spelling `<w>.weight_scale_inv` -> the official `<w>.scale`."""
    if name.endswith(".weight_scale_inv"):
        return name[: -len(".weight_scale_inv")] + ".scale"
    return name


class CanonicalNames(dict):
    """{canonical name: tensor} that refuses a second tensor under a name already taken."""

    def put(self, name: str, tensor: torch.Tensor) -> None:
        if name in self:
            raise ValueError(f"two checkpoint tensors map to the same canonical name {name!r}; the checkpoint "
                             f"mixes naming forms for one tensor")
        self[name] = tensor


def canonicalize_blocks(state: dict[str, torch.Tensor], top_renames: dict[str, str], block_re: re.Pattern[str],
                        put_block: Callable[[CanonicalNames, str, str, torch.Tensor], None]) -> dict[str, torch.Tensor]:
    """The loop of a family's `canonicalize`: each stored name without its `model.` prefix is renamed
    by `top_renames`, else, when `block_re` matches it as (block, rest) (e.g. `layers.3`,
    `attn.wq_a.weight`), handed to `put_block(out, block, rest, tensor)`, else kept with
    transformers' scale spelling made official."""
    out = CanonicalNames()
    for key, tensor in state.items():
        name = drop_prefix(key, "model.")
        if name in top_renames:
            out.put(top_renames[name], tensor)
            continue
        m = block_re.match(name)
        if m is None:
            out.put(hf_scale_to_official(name), tensor)
            continue
        put_block(out, m[1], m[2], tensor)
    return dict(out)


def strip_prefix(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix`, named relative to it."""
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def _plain(t: Weight) -> torch.Tensor:
    return t.dequantize() if isinstance(t, QuantizedWeight) else t


def concat_rows(parts: list[Weight]) -> Weight:
    """The parts' rows concatenated: quantised when `can_cat_rows`, else as plain tensors (quantised
    parts dequantised to the dtype they stand for)."""
    if any(isinstance(p, QuantizedWeight) for p in parts) and can_cat_rows(parts):
        return cat_rows(parts)
    return torch.cat([_plain(p) for p in parts])


def _row_view(fused: Weight, start: int, stop: int) -> Weight:
    return fused.rows(start, stop) if isinstance(fused, QuantizedWeight) else fused[start:stop]


def fuse_rows(w: dict[str, Weight], key: str, names: tuple[str, ...]) -> None:
    """Concatenate the present `names` (matrices with the same input) into `w[key]`, in place; each
    part is then a row view of the fused weight, so no memory is added (`concat_rows` for quantised
    parts). Idempotent."""
    present = [n for n in names if n in w]
    if key in w or not present:
        return
    if len({(w[n].dtype, tuple(w[n].shape[1:])) for n in present}) != 1:
        raise ValueError(f"cannot fuse {present}: their dtypes or input sizes differ")
    fused = concat_rows([w[n] for n in present])
    start = 0
    for n in present:
        rows = w[n].shape[0]
        w[n] = _row_view(fused, start, start + rows)
        start += rows
    w[key] = fused


def stack_weights(parts: list[Weight]) -> Weight:
    """Equal-shaped weights stacked along a new leading dim: quantised when all are, of one format."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        try:
            return stack(parts)
        except ValueError:
            pass  # formats differ between experts: dequantised below
    return torch.stack([_plain(p) for p in parts])


def fuse_experts(w: dict[str, Weight], num_experts: int, prefix: str = "ffn.experts.") -> None:
    """Pop the routed experts `{prefix}{e}.w1/w2/w3.weight` and store them stacked, in place:
    `{prefix}w13` `[E, 2I, D]` (each expert's w1 rows then its w3 rows) and `{prefix}w2` `[E, D, I]`."""
    pop = [{k: w.pop(f"{prefix}{e}.{k}.weight") for k in ("w1", "w3", "w2")} for e in range(num_experts)]
    w[f"{prefix}w13"] = stack_weights([concat_rows([p["w1"], p["w3"]]) for p in pop])
    w[f"{prefix}w2"] = stack_weights([p["w2"] for p in pop])


def group_rows(weight: Weight, groups: int) -> Weight:
    """A `[groups * R, in]` weight as `[groups, R, in]` (a view; see `ensure_row_groups`)."""
    if isinstance(weight, QuantizedWeight):
        return weight.unflatten_rows(groups)
    return weight.view(groups, -1, weight.shape[-1])


def ensure_row_groups(w: dict[str, Weight], name: str, groups: int) -> None:
    """In place: dequantise `w[name]` when it is quantised but cannot be split into `groups` row
    groups of whole scale blocks (FP8 groups of rows off a block boundary), so that `group_rows`
    holds for it."""
    t = w.get(name)
    if isinstance(t, QuantizedWeight) and not t.can_unflatten_rows(groups):
        w[name] = t.dequantize()


def fused_parts(w: dict[str, torch.Tensor], names: tuple[str, ...], prefix: str) -> tuple[list[str], list[int]]:
    """The parts of a fused projection that `w` has (names relative to `prefix`) and their output
    widths, in row order: what `split_fused` needs, computed once at load."""
    present = [n[len(prefix):] for n in names if n[len(prefix):] in w]
    return present, [w[n].shape[0] for n in present]


def fused_part(out: torch.Tensor, parts: tuple[list[str], list[int]], name: str) -> torch.Tensor:
    """One part of a fused projection's output, by name: a view of its columns (see `fused_parts`)."""
    names, widths = parts
    i = names.index(name)
    start = sum(widths[:i])
    return out.narrow(-1, start, widths[i])


def split_fused(out: torch.Tensor, parts: tuple[list[str], list[int]]) -> dict[str, torch.Tensor]:
    """Split the output of a fused projection back into its parts, by name (see `fused_parts`)."""
    names, widths = parts
    return dict(zip(names, out.split_with_sizes(widths, dim=-1)))  # Tensor.split's Python wrapper: ~2 us more
