"""Load-time check that a checkpoint's tensors hold finite numbers.

A NaN or an infinity in a norm weight, an FP8 scale or an embedding row loads without complaint
and then turns every logit into NaN (greedy decoding emitted token 0 forever). `first_nonfinite`
looks for one at a bounded cost: tensors of up to `WHOLE_LIMIT` values (norms, biases, scales, the
mHC and router parameters) are read whole, larger ones at `SAMPLED_ROWS` rows spread over their
first dimension (reading every large weight would add a pass over the whole checkpoint to the
load), and the loader names the tensors to read whole whatever their size (the embedding, and the
scales of quantised weights, which are small next to their weights). Values are converted to fp32
a chunk at a time, so the check needs little memory; FP8 codes and ue8m0 scales are checked too
(their NaN encodings), packed FP4 has none.
"""
from __future__ import annotations

import torch

WHOLE_LIMIT = 1 << 22  # values: a tensor this small is checked whole
SAMPLED_ROWS = 64  # rows checked of a larger tensor
_CHUNK = 1 << 22  # values converted to fp32 at a time
_CHECKED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                   torch.float8_e5m2, torch.float8_e8m0fnu)


def first_nonfinite(tensor: torch.Tensor, whole: bool = False) -> tuple[int, ...] | None:
    """The index of a NaN or infinite value of `tensor` (the first one found), or None. Checked whole
    when `whole` or small, else at `SAMPLED_ROWS` rows; integer and packed FP4 tensors have none."""
    if tensor.dtype not in _CHECKED_DTYPES or tensor.numel() == 0:
        return None
    rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(1, -1)
    n, width = rows.shape
    if whole or tensor.numel() <= WHOLE_LIMIT:
        picked = None
    else:  # evenly spread, first and last row included
        picked = torch.linspace(0, n - 1, min(SAMPLED_ROWS, n)).round().long().unique()
    step = max(1, _CHUNK // width)
    count = n if picked is None else len(picked)
    for start in range(0, count, step):
        index = torch.arange(start, min(start + step, count)) if picked is None else picked[start:start + step]
        bad = ~torch.isfinite(rows[index].float())
        if bool(bad.any()):
            r, c = (int(i) for i in bad.nonzero()[0])
            return _unravel(int(index[r]) * width + c, tuple(tensor.shape))
    return None


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def nonfinite_message(name: str, file: object, index: tuple[int, ...], tensor: torch.Tensor) -> str:
    """The load error for a non-finite value of stored tensor `name` at `index`."""
    value = float(tensor[index].float()) if index else float(tensor.float())
    return (f"checkpoint file {file}: tensor {name} ({str(tensor.dtype).removeprefix('torch.')} "
            f"{list(tensor.shape)}) holds a non-finite value ({value}) at index {list(index)}; the model would "
            f"compute NaN logits with it. The file is corrupt or was saved from a diverged model: download or "
            f"write it again")
