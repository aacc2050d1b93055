"""One step's input and output between the runner and a model: a ragged batch of sequences.

Sequence i owns rows `cu[i]:cu[i+1]` of the flat token tensors (no padding); `context_lens[i]`
tokens of it are already in the state, `query_lens[i]` new ones run this step at absolute
positions `context_len + 0..query_len-1`.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def long_tensor(values: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """A 1-D int64 tensor of Python ints on `device`, through an `array` buffer: ~3x faster than
    `torch.tensor(values)` for the short lists a step turns into tensors (a dozen per forward)."""
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    t = torch.frombuffer(array("q", values), dtype=torch.long)  # keeps the array alive
    return t if device is None else t.to(device)


def bool_tensor(values: Sequence[bool], device: torch.device | str | None = None) -> torch.Tensor:
    """A 1-D bool tensor of Python bools on `device`, through a byte buffer (`long_tensor`'s counterpart)."""
    if not values:
        return torch.empty(0, dtype=torch.bool, device=device)
    t = torch.frombuffer(bytearray(values), dtype=torch.bool)  # keeps the buffer alive
    return t if device is None else t.to(device)


@dataclass(frozen=True)
class ImageSpan:
    """One image of a sequence's prompt: its span starts at absolute position `start` and takes
    `image.num_tokens` positions; `image` is the model's preprocessed image (for DeepSeek-V4.1 an
    `image_processing.ProcessedImage`), whose `digest` keys the model's encoder cache."""

    seq: int  # the sequence's index in the batch
    start: int
    image: object


@dataclass
class ForwardBatch:
    """One step's input, flattened over sequences (sequence i owns rows cu[i]:cu[i+1])."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions
    query_lens: list[int]  # new tokens per sequence this step
    context_lens: list[int]  # tokens already in the state before this step, per sequence
    slots: torch.Tensor  # [B] int64, slot index of each sequence
    block_tables: dict[str, torch.Tensor]  # group name -> [B, max_blocks] int64, -1 = unused
    logits_indices: torch.Tensor  # [L] int64 rows of T whose logits are returned
    return_streams: bool = False  # also return the final residual streams (for MTP drafting)
    stream_indices: torch.Tensor | None = None  # [S] int64 rows whose streams are returned; None: logits_indices
    #: prompt tokens of each sequence's request (a model's prefill plan may depend on it: V4.1's
    #: bounded replay keeps the last rows of the prompt); None where the caller does not know them
    prompt_lens: list[int] | None = None
    #: the image spans that overlap this step's rows (a span may be split over chunks); None: no image
    images: list[ImageSpan] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [L, V] fp32
    streams: torch.Tensor | None = None  # [S, n, D] final residual streams at stream_indices (or logits_indices)
