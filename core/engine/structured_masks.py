"""The engine's logits processors at run time: each step's token bitmask, and the per-token checks.

`fill(scheduler_output)` builds the step's bitmask on the engine thread: an all-ones int32
`[rows, ceil(V/32)]` (one row per sampled request, plus one per draft: the mask if the drafts
before it pass) ANDed over every processor that tracks a request of the step. The runner applies it
before sampling. The async pipeline fills step N+1's mask after step N's tokens were accepted, while
step N+1's forward runs (a grammar's next mask depends on the token just accepted).

The scheduler calls the rest while it applies a step: `accept` (True: a processor completed the
request's constraint), `pop_failures` (requests a processor cannot continue, found by `fill` or
`accept`), `valid_draft_prefix` (drafts the grammar allows), and `remove` when a request finishes.
Processor state changes here; request state does not (the scheduler finishes failed requests).
"""
from __future__ import annotations

import torch

from deepinfer.engine.request import Request
from deepinfer.logits_processor import LogitsProcessor


class StructuredMasks:
    def __init__(self, processors: list[LogitsProcessor], vocab_size: int):
        self.processors = processors  # the engine's list; a request's `processors` index into it
        self.vocab_size = vocab_size

    @staticmethod
    def needed(scheduler_output) -> bool:
        """Some sampled request of the step is tracked by a logits processor."""
        return any(s.constrained for s in scheduler_output.sampled)

    def fill(self, scheduler_output) -> torch.Tensor | None:
        """The step's combined bitmask (None when no sampled request is tracked)."""
        rows = scheduler_output.sampled
        if not any(s.constrained for s in rows):
            return None
        starts, total = [], 0
        for s in rows:
            starts.append(total)
            total += 1 + len(s.draft_token_ids)
        words = -(-self.vocab_size // 32)
        combined = torch.full((total, words), -1, dtype=torch.int32)
        for index, processor in enumerate(self.processors):
            mine = [(start, s) for start, s in zip(starts, rows)
                    if index in s.request.processors and not s.request.is_finished]
            if not mine:
                continue
            drafts = [s.draft_token_ids for _, s in mine]
            part = torch.full((sum(1 + len(d) for d in drafts), words), -1, dtype=torch.int32)
            if any(drafts):  # a row after each draft too: the mask if the drafts before it pass
                processor.fill_bitmask([s.request_id for _, s in mine], part, drafts)
            else:
                processor.fill_bitmask([s.request_id for _, s in mine], part)
            combined[[start + k for start, s in mine for k in range(1 + len(s.draft_token_ids))]] &= part
        return combined

    def pop_failures(self) -> dict[str, tuple[str, str]]:
        """Requests the processors cannot continue: request id -> (finish reason, message)."""
        failures: dict[str, tuple[str, str]] = {}
        for processor in self.processors:
            failures.update(processor.pop_failures())
        return failures

    def accept(self, req: Request, token: int) -> bool:
        """Advance every processor of the request by `token`; True when one completed its constraint."""
        stop = False
        for index in req.processors:
            stop |= self.processors[index].accept(req.request_id, [token])
        return stop

    def valid_draft_prefix(self, req: Request, drafts: list[int]) -> int:
        """Leading drafts every processor of the request allows (the processors' state is unchanged)."""
        n = len(drafts)
        for index in req.processors:
            check = getattr(self.processors[index], "count_valid_draft", None)
            if check is not None and n:
                n = min(n, check(req.request_id, drafts[:n]))
        return n

    def remove(self, req: Request) -> None:
        for index in req.processors:
            self.processors[index].remove_request(req.request_id)
