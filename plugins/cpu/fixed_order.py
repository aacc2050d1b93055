"""Element-wise and summing helpers whose every element's bits are independent of the tensor's size and
of the other rows: the composed ops of the cpu back end's batch-invariant mode (docs/batch_invariance.md)."""
from __future__ import annotations

import torch


def lanewise(op, x: torch.Tensor) -> torch.Tensor:
    """`op` (an element-wise torch function) of `x` with every element on torch's vector path. torch
    computes the last `numel % 16` elements of a tensor (and of each thread's share) with the scalar
    libm function, which may differ from the vector one in the last bit; zero padding to a multiple
    of 64 elements per thread keeps an element's bits independent of the tensor's size."""
    flat = x.reshape(-1)
    pad = -flat.numel() % (64 * torch.get_num_threads())
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return op(flat)[:x.numel()].view(x.shape)


def row_strided(y: torch.Tensor) -> torch.Tensor:
    """`y` (values unchanged) as a view whose rows are a multiple of 16 elements apart when its last
    dimension is not. torch runs an element-wise op over a contiguous tensor as one flat loop whose
    last `numel % 16` elements take the scalar libm path; over rows that cannot be merged it loops
    row by row, so every row takes the same path whatever the row count. The model's own element-wise
    math on narrow products (e.g. the router's softplus over 8 experts) then stays batch-invariant."""
    width = y.shape[-1]
    if width % 16 == 0 or y.dim() < 2:
        return y
    padded = y.new_empty((*y.shape[:-1], width + (-width % 16)))
    padded[..., :width] = y
    return padded[..., :width]


def sum_fixed(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over a short `dim` as one add after another, in index order (keepdim)."""
    total = x.narrow(dim, 0, 1).clone()
    for i in range(1, x.shape[dim]):
        total += x.narrow(dim, i, 1)
    return total
