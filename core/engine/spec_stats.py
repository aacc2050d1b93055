"""Speculative-decoding totals of one engine (`EngineCore.spec_stats`, `LLM.stats()["spec_decode"]`)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counts since the engine started. A *verification* is one decoding request in one step: it
    verified `m` drafts (0 <= m <= num_draft_tokens; fewer when variable-length verification, the
    grammar or max_tokens trimmed them) and emitted the accepted ones plus one token from the target."""

    num_draft_tokens: int  # configured maximum drafts per request per step ("nextn")
    num_steps: int = 0  # engine steps with at least one verification
    num_verifications: int = 0
    num_drafts_verified: int = 0
    num_drafts_accepted: int = 0
    num_tokens_emitted: int = 0  # by verifications: accepted drafts + one target token each
    verified_at: list[int] = field(default_factory=list)  # per draft position (0-based): times verified
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted

    def __post_init__(self) -> None:
        self.verified_at = self.verified_at or [0] * self.num_draft_tokens
        self.accepted_at = self.accepted_at or [0] * self.num_draft_tokens

    def record_step(self, outcomes: list[tuple[int, int]]) -> None:
        """One engine step: (drafts verified, drafts accepted) per verifying request."""
        if not outcomes:
            return
        self.num_steps += 1
        for verified, accepted in outcomes:
            self.num_verifications += 1
            self.num_drafts_verified += verified
            self.num_drafts_accepted += accepted
            self.num_tokens_emitted += accepted + 1
            for i in range(verified):
                self.verified_at[i] += 1
            for i in range(accepted):
                self.accepted_at[i] += 1

    @property
    def accept_rate(self) -> float | None:
        """Accepted / verified drafts."""
        return self.num_drafts_accepted / self.num_drafts_verified if self.num_drafts_verified else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification, the bonus or corrected token included ("accepted length", AL)."""
        return self.num_tokens_emitted / self.num_verifications if self.num_verifications else None

    @property
    def mean_verified_drafts(self) -> float | None:
        """Drafts verified per request per step (5.00 for fixed k = 5; less with variable length)."""
        return self.num_drafts_verified / self.num_verifications if self.num_verifications else None

    @property
    def verified_drafts_per_step(self) -> float | None:
        """Drafts verified per engine step, all requests together."""
        return self.num_drafts_verified / self.num_steps if self.num_steps else None

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """Per draft position: accepted / verified (conditional on reaching it)."""
        return [a / v if v else None for a, v in zip(self.accepted_at, self.verified_at)]

    def as_dict(self) -> dict:
        return dict(num_draft_tokens=self.num_draft_tokens, num_steps=self.num_steps,
                    num_verifications=self.num_verifications, num_drafts_verified=self.num_drafts_verified,
                    num_drafts_accepted=self.num_drafts_accepted, num_tokens_emitted=self.num_tokens_emitted,
                    accept_rate=self.accept_rate, mean_accepted_length=self.mean_accepted_length,
                    mean_verified_drafts=self.mean_verified_drafts,
                    verified_drafts_per_step=self.verified_drafts_per_step,
                    acceptance_by_position=self.acceptance_by_position)
