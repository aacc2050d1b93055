"""Output processing: stop conditions, detokenisation and logprob entries of generated tokens.

The scheduler asks after appending each token whether the request stops (`check_stop`), builds
logprob entries with `logprob_entry`, and sets the final text with `final_text` when a request
finishes. The incremental detokeniser of a request with stop strings is kept here (created with
its first token, released when it finishes); nothing here writes a request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.engine.request import Request
from deepinfer.outputs import Logprob


@dataclass
class _StopText:
    decoder: Any  # the tokenizer's incremental decoder
    text: str = ""  # decoded so far


class OutputProcessor:
    def __init__(self, tokenizer: Any = None, eos_token_ids: set[int] | frozenset[int] = frozenset(), *,
                 max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._stop_text: dict[str, _StopText] = {}  # by request id, for requests with stop strings

    def check_stop(self, req: Request) -> tuple[str | None, int | str | None]:
        """(finish reason, stop reason) after the request's last appended token, or (None, None).

        Stop conditions (EOS unless ignore_eos, stop tokens, stop strings) apply only once
        `min_tokens` tokens exist; `length` once `max_tokens` tokens exist or the sequence reached
        `max_model_len`."""
        p = req.params
        token = req.output_token_ids[-1]
        n_out = len(req.output_token_ids)
        stop_text = self._push_text(req, token)
        if n_out >= p.min_tokens:  # before min_tokens, stop conditions do not apply
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if p.stop_token_ids and token in p.stop_token_ids:
                return "stop", token
            if stop_text is not None:
                text, before = stop_text
                window = text[max(before - max(len(s) for s in p.stop_strings) + 1, 0):]
                for stop in p.stop_strings:
                    if stop in window:
                        return "stop", stop
        if n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _push_text(self, req: Request, token: int) -> tuple[str, int] | None:
        """Detokenise one more token of a request with stop strings: (its text so far, the length
        before this token); None when the request has no stop strings (or the tokenizer no stream
        decoder)."""
        if not req.params.stop_strings or not hasattr(self.tokenizer, "stream_decoder"):
            return None
        state = self._stop_text.get(req.request_id)
        if state is None:
            decoder = self.tokenizer.stream_decoder(skip_special_tokens=req.params.skip_special_tokens)
            state = self._stop_text[req.request_id] = _StopText(decoder)
        before = len(state.text)
        state.text += state.decoder.push(token)
        return state.text, before

    def release(self, request_id: str) -> None:
        """The request finished: drop its detokeniser."""
        self._stop_text.pop(request_id, None)

    def logprob_entry(self, token: int, logprob: float, rank: int, top: list[tuple[int, float]] | tuple = ()
                      ) -> dict[int, Logprob]:
        """The sampled token's entry, then the top-k tokens (rank 1 = most likely)."""
        entry = {token: Logprob(logprob, rank, self._decode_one(token))}
        for r, (tid, lp) in enumerate(top):
            entry.setdefault(tid, Logprob(lp, r + 1, self._decode_one(tid)))
        return entry

    def _decode_one(self, token: int) -> str | None:
        try:
            return self.tokenizer.decode([token])
        except Exception:
            return None

    def final_text(self, req: Request) -> str:
        """The request's text: EOS / the stop token is kept in token_ids but not in the text, and a
        stop string is cut from it."""
        ids = req.output_token_ids
        if req.finish_reason == "stop" and ids and (isinstance(req.stop_reason, int) or req.stop_reason is None) \
                and (ids[-1] in self.eos_token_ids or ids[-1] == req.stop_reason):
            ids = ids[:-1]
        try:
            text = self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens) if ids else ""
        except Exception:
            text = ""
        if isinstance(req.stop_reason, str) and req.stop_reason in text:
            text = text[:text.index(req.stop_reason)]
        return text
