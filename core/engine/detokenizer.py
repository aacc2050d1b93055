"""Incremental detokenization, so stop strings are found as tokens arrive at O(1) cost per token."""
from __future__ import annotations

from typing import Callable

_INCOMPLETE = "\ufffd"  # what a decoder yields for a partial UTF-8 sequence


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a short window `ids[prefix:]` each time and emits what it adds beyond
    `ids[prefix:read]`, so multi-token characters (partial UTF-8) are held back until complete.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: list[str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""
        self._stops = stop_strings
        self._tail = max((len(s) for s in stop_strings), default=1) - 1

    def append(self, token_id: int) -> str | None:
        """Add one token; returns the stop string that now appears in the text, else None."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return None
        start = max(len(self.text) - self._tail, 0)
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        for stop in self._stops:
            if stop in self.text[start:]:
                return stop
        return None
