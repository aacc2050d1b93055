"""Batch-level logits processors contributed by features (structured outputs, ...).

The engine owns one instance per feature. Per step, for the rows of the batch that belong to
requests the processor tracks, the engine calls `fill_bitmask` (CPU work, which the async pipeline
overlaps with the model's forward), applies the mask through the back end's
`apply_token_bitmask` kernel, samples, and reports the accepted tokens with `accept`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class RequestRejected(ValueError):
    """A request's constraint is invalid: that request fails alone, with this message."""


class LogitsProcessor(ABC):
    @abstractmethod
    def add_request(self, request_id: str, sampling_params) -> bool:
        """Start tracking a request. Returns False when the request carries nothing for this
        processor. Raises `RequestRejected` (naming the problem and fix) for a bad constraint."""

    @abstractmethod
    def remove_request(self, request_id: str) -> None:
        """Forget a finished or aborted request."""

    @abstractmethod
    def fill_bitmask(self, request_ids: list[str], bitmask: torch.Tensor, draft_tokens: list[list[int]] | None = None) -> None:
        """Write the allowed-token bitmask of each tracked request into `bitmask` rows.

        `bitmask` is int32 `[R, ceil(V/32)]`, one row per request in `request_ids` (or, with
        `draft_tokens`, `1 + len(drafts)` consecutive rows per request: the mask after the
        accepted prefix and after each draft token). Rows of untracked requests are left as they
        are (all ones)."""

    @abstractmethod
    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the request's state by `token_ids`. Returns True when the constraint is
        complete and the request must finish (EOS was accepted or the grammar terminated)."""

    def pop_failures(self) -> dict[str, tuple[str, str]]:
        """Requests this processor cannot continue, found since the last call: request id ->
        (finish_reason, message). "grammar_dead_end": the constraint admits no token (its bitmask
        row was left all zeros); "error": e.g. its grammar failed to compile after admission (its
        row was left untouched). The engine calls this after `fill_bitmask` and `accept`, finishes
        each request with that reason and message, and discards any token sampled for it in that step.
        Default: none."""
        return {}
