"""The structured-output logits processor: one xgrammar `GrammarMatcher` per constrained request.

Per step the engine calls `fill_bitmask` for the batch rows, applies the mask with the back end's
`apply_token_bitmask`, samples, and reports the sampled tokens to `accept`. Tokens are admitted only
when the grammar allows them; added tokens other than EOS are always masked (`Vocabulary`), and EOS
is allowed exactly when the grammar may end. `accept` returns True once EOS was accepted: the
engine finishes the request with finish_reason "stop".

A row whose constraint admits no token at all is a *dead end*: its row is left all zeros and the
request is reported by `pop_failures` (as is a grammar whose compilation failed after admission),
so the engine can finish it with a clear reason instead of sampling from an all -inf row.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.logits_processor import LogitsProcessor, RequestRejected

from .config import StructuredOutputConfig
from .grammar import Constraint, GrammarCompiler, xgrammar_message
from .vocabulary import Vocabulary

logger = logging.getLogger("deepinfer.structured_output")

#: finish_reason of a request whose constraint admits no token (deepinfer.outputs.FINISH_REASONS).
DEAD_END = "grammar_dead_end"


@dataclass
class _Tracked:
    constraint: Constraint
    compiled: Future  # of an xgrammar CompiledGrammar
    matcher: Any = None  # xgrammar GrammarMatcher, created at the first fill
    num_accepted: int = 0  # tokens accepted so far (bounds rollback)
    failure: str | None = None  # set once the request cannot continue


class StructuredOutputProcessor(LogitsProcessor):
    """Grammar bitmasks for requests whose `SamplingParams.so_args` is set."""

    def __init__(self, vocabulary: Vocabulary | Callable[[], Vocabulary],
                 config: StructuredOutputConfig | None = None) -> None:
        # The vocabulary may be given lazily: building it costs ~0.2 s on the 129k-token tokenizer,
        # which an engine that never sees a constrained request should not pay.
        self._vocabulary_source = vocabulary
        self.config = config or StructuredOutputConfig()
        self._compiler: GrammarCompiler | None = None
        self._blocked_columns: np.ndarray | None = None  # bitmask words that hold blocked ids
        self._keep_words: np.ndarray | None = None  # ANDed into those words
        self._requests: dict[str, _Tracked] = {}
        self._failures: dict[str, tuple[str, str]] = {}

    # -- setup ------------------------------------------------------------------------------------

    @property
    def vocabulary(self) -> Vocabulary:
        return self._grammars().vocabulary

    def _grammars(self) -> GrammarCompiler:
        if self._compiler is None:
            source = self._vocabulary_source
            vocabulary = source if isinstance(source, Vocabulary) else source()
            self._compiler = GrammarCompiler(vocabulary, self.config)
            blocked = vocabulary.blocked_token_ids if self.config.block_control_tokens else ()
            self._blocked_columns, self._keep_words = _keep_words(blocked)
        return self._compiler

    # -- LogitsProcessor --------------------------------------------------------------------------

    def add_request(self, request_id: str, sampling_params) -> bool:
        so_args = getattr(sampling_params, "so_args", None)
        if not so_args:
            return False
        constraint = Constraint.from_so_args(so_args)
        try:
            compiler = self._grammars()
        except ValueError as e:  # e.g. the engine runs without a tokenizer
            raise RequestRejected(f"structured outputs are unavailable: {e}") from None
        self._requests[request_id] = _Tracked(constraint, compiler.submit(constraint))
        return True

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._failures.pop(request_id, None)

    def fill_bitmask(self, request_ids: list[str], bitmask: torch.Tensor,
                     draft_tokens: list[list[int]] | None = None) -> None:
        if self._compiler is None:  # no constrained request was ever added
            return
        width = self._compiler.vocabulary.bitmask_width
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] != width:
            raise ValueError(f"bitmask must be int32 [rows, {width}] for a {self._compiler.vocabulary.vocab_size}-token "
                             f"vocabulary; got {bitmask.dtype} {list(bitmask.shape)}")
        drafts_of = draft_tokens if draft_tokens is not None else [[] for _ in request_ids]
        needed = len(request_ids) + sum(len(d) for d in drafts_of)
        if len(drafts_of) != len(request_ids) or bitmask.shape[0] != needed:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows but {len(request_ids)} requests with "
                             f"{len(drafts_of)} draft lists need {needed}")
        target = bitmask if bitmask.device.type == "cpu" and bitmask.is_contiguous() else None
        if target is None:  # xgrammar writes into host memory only
            target = bitmask.to("cpu").contiguous()
        filled: list[int] = []
        row = 0
        for request_id, drafts in zip(request_ids, drafts_of):
            state = self._requests.get(request_id)
            matcher = self._matcher(request_id, state) if state is not None else None
            if matcher is not None:
                filled += self._fill_rows(matcher, target, row, drafts)
            row += 1 + len(drafts)
        if filled:
            self._block_and_check(target, filled, request_ids, draft_tokens)
        if target is not bitmask:
            bitmask.copy_(target)

    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        state = self._requests.get(request_id)
        if state is None:
            return False
        matcher = self._matcher(request_id, state)
        if matcher is None:  # failed (compile error or dead end): end it
            return True
        for token in token_ids:
            if not matcher.accept_token(int(token)):
                self._fail(request_id, f"token {token} does not continue the {state.constraint.schema_type} constraint "
                                       f"(was the bitmask applied before sampling?)")
                return True
            state.num_accepted += 1
            if matcher.is_terminated():  # EOS accepted
                return True
        return False

    # -- extras for speculative decoding and the engine -------------------------------------------

    def count_valid_draft(self, request_id: str, draft_tokens: list[int]) -> int:
        """How many leading `draft_tokens` the grammar accepts (the state is left unchanged)."""
        state = self._requests.get(request_id)
        if state is None:
            return len(draft_tokens)
        matcher = self._matcher(request_id, state)
        if matcher is None:
            return 0
        valid = 0
        for token in draft_tokens:
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                break
            valid += 1
        if valid:
            matcher.rollback(valid)
        return valid

    def pop_failures(self) -> dict[str, tuple[str, str]]:
        failures, self._failures = self._failures, {}
        return failures

    def is_tracking(self, request_id: str) -> bool:
        return request_id in self._requests

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()

    # -- internals --------------------------------------------------------------------------------

    def _matcher(self, request_id: str, state: _Tracked):
        if state.failure is not None:
            return None
        if state.matcher is None:
            import xgrammar as xgr

            try:
                compiled = state.compiled.result()  # usually done: compiled while the prompt ran
            except Exception as e:
                self._fail(request_id, f"the {state.constraint.schema_type} constraint failed to compile: "
                                       f"{xgrammar_message(e)}")
                return None
            state.matcher = xgr.GrammarMatcher(compiled)
        return state.matcher

    def _fill_rows(self, matcher, bitmask: torch.Tensor, row: int, drafts: list[int]) -> list[int]:
        """Fill the row after the accepted prefix and, for drafts, one row after each draft token
        the grammar accepts; rows after a rejected draft token or a draft EOS stay as they are
        (the verifier never uses them: the rejected token is masked in its own row)."""
        if matcher.is_terminated():  # EOS already accepted: nothing left to constrain
            return []
        matcher.fill_next_token_bitmask(bitmask, row)
        rows = [row]
        accepted = 0
        for token in drafts:
            if not matcher.accept_token(int(token)):
                break
            accepted += 1
            if matcher.is_terminated():  # a draft EOS: the positions after it are never used
                break
            matcher.fill_next_token_bitmask(bitmask, row + accepted)
            rows.append(row + accepted)
        if accepted:
            matcher.rollback(accepted)
        return rows

    def _block_and_check(self, bitmask: torch.Tensor, rows: list[int], request_ids: list[str],
                         draft_tokens: list[list[int]] | None) -> None:
        # numpy on purpose: it runs single-threaded, while torch would start OpenMP work that
        # competes with the forward pass running on the worker thread (async pipeline).
        words = bitmask.numpy()
        index = np.asarray(rows)
        if self._blocked_columns.size:
            cell = np.ix_(index, self._blocked_columns)
            words[cell] &= self._keep_words
        dead = ~words[index].any(axis=1)
        if not dead.any():
            return
        owner: list[str] = []  # request id of every row
        for i, request_id in enumerate(request_ids):
            owner += [request_id] * (1 + (len(draft_tokens[i]) if draft_tokens is not None else 0))
        for r in index[dead].tolist():
            state = self._requests[owner[r]]
            if state.failure is None:
                self._fail(owner[r], f"the {state.constraint.schema_type} constraint admits no token after "
                                     f"{state.num_accepted} generated tokens (every token of the vocabulary is "
                                     f"masked); the constraint cannot be completed with this tokenizer",
                           reason=DEAD_END)

    def _fail(self, request_id: str, message: str, reason: str = "error") -> None:
        state = self._requests[request_id]
        state.failure = message
        self._failures[request_id] = (reason, message)
        logger.info("structured output: request %s stopped (%s): %s", request_id, reason, message)


def _keep_words(blocked_ids) -> tuple[np.ndarray, np.ndarray]:
    """The bitmask columns holding blocked ids, and the int32 words to AND into them."""
    words: dict[int, int] = {}
    for t in blocked_ids:
        words[t // 32] = words.get(t // 32, 0xFFFFFFFF) & ~(1 << (t % 32))
    columns = sorted(words)
    return np.asarray(columns, dtype=np.int64), np.asarray([words[c] for c in columns], dtype=np.uint32).view(np.int32)
