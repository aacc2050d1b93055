"""Confidence-scheduled, variable-length verification (DEEPINFER_ENABLE_MTP_VARLEN=1).

Each step, every decoding request arrives with up to k drafts and a confidence per draft (the
drafter's estimate that the draft is accepted given the ones before it). Verifying the first m
drafts of a request is expected to emit `1 + sum_{i<=m} prod_{l<=i} c_l` tokens (the product is
the chance that the whole prefix survives; the 1 is the token drawn at the first rejection or the
bonus token). Verification costs time as a function of the batch: `cost(B, T)`, the seconds of a
target forward of B sequences with T query tokens in all.

The scheduler chooses the drafts to verify across the whole batch to maximise expected emitted
tokens per second of step time (DSpark's prefix scheduler): candidates are ranked by cumulative
confidence, which keeps every request's choice a prefix of its drafts, and the best number of
candidates is read off the profiled cost curve. When drafts are cheap to verify (a
memory-bound accelerator at small batch) it verifies all of them; when verification costs about
as much per token as decoding (a CPU) or confidence is low, it verifies few or none.

`VerifyCostModel` holds the table, profiled at engine start on the selected back end by timing the
real target forward on synthetic batches (`profile_verify_cost`); nothing in it is specific to
one kind of hardware. `VariableLengthPolicy` is what the core calls (its `VerifyPolicy` protocol):
`plan` before each schedule, `observe` after each verification.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class VerifyCostModel:
    """Seconds of one target forward: `table[B]` lists (total query tokens, seconds) for B sequences."""

    table: dict[int, list[tuple[int, float]]]

    def __post_init__(self) -> None:
        if not self.table or any(not points for points in self.table.values()):
            raise ValueError("a verify-cost table needs at least one (tokens, seconds) point per batch size")
        self.table = {b: sorted(points) for b, points in sorted(self.table.items())}

    @staticmethod
    def _along_tokens(points: list[tuple[int, float]], tokens: float) -> float:
        """Piecewise linear in tokens, extrapolated with the last slope (or proportionally)."""
        if len(points) == 1:
            t0, s0 = points[0]
            return s0 * max(tokens, 1) / max(t0, 1)
        for (t0, s0), (t1, s1) in zip(points, points[1:]):
            if tokens <= t1 or (t1, s1) == points[-1]:
                return max(s0 + (s1 - s0) * (tokens - t0) / max(t1 - t0, 1), 0.0)
        raise AssertionError("unreachable")

    def cost(self, batch_size: int, tokens: int) -> float:
        """Seconds for `batch_size` sequences with `tokens` query tokens, interpolated in log2(B)."""
        sizes = list(self.table)
        if batch_size <= sizes[0] or len(sizes) == 1:
            return self._along_tokens(self.table[sizes[0] if batch_size <= sizes[0] else sizes[-1]], tokens)
        if batch_size >= sizes[-1]:
            return self._along_tokens(self.table[sizes[-1]], tokens)
        upper = next(i for i, b in enumerate(sizes) if b >= batch_size)
        b0, b1 = sizes[upper - 1], sizes[upper]
        w = (math.log2(batch_size) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
        return (1 - w) * self._along_tokens(self.table[b0], tokens) + w * self._along_tokens(self.table[b1], tokens)


class ConfidenceCalibrator:
    """Turns a drafter's raw confidence into the acceptance rate observed for its drafts.

    A draft probability is not an acceptance probability: a random-weight MTP block is confident
    and always wrong, a model drafting for itself has flat distributions and is always right. The
    calibrator counts, per draft position and per confidence bin (log-spaced), how often a draft
    that was reached (every draft before it accepted) was accepted, and returns
    `(accepted + w * raw) / (reached + w)`: the raw value until evidence accumulates. The DSpark
    head's confidence is trained to be calibrated; this keeps the schedule honest for any drafter.
    """

    def __init__(self, num_positions: int, bins_per_decade: int = 2, floor: float = 1e-4, prior_weight: float = 8.0,
                 min_observations: int = 16):
        self.bins_per_decade, self.floor, self.prior_weight = bins_per_decade, floor, prior_weight
        self.min_observations = min_observations
        num_bins = int(math.ceil(-math.log10(floor) * bins_per_decade)) + 1
        self.reached = [[0] * num_bins for _ in range(num_positions)]
        self.accepted = [[0] * num_bins for _ in range(num_positions)]

    def _bin(self, confidence: float) -> int:
        c = min(max(confidence, self.floor), 1.0)
        return min(int(-math.log10(c) * self.bins_per_decade), len(self.reached[0]) - 1)

    def calibrate(self, position: int, confidence: float) -> float:
        b = self._bin(confidence)
        w = self.prior_weight
        return (self.accepted[position][b] + w * confidence) / (self.reached[position][b] + w)

    def needs_evidence(self, position: int, confidence: float) -> bool:
        """Too few drafts like this one were ever verified to trust the estimate: the schedule
        verifies one such draft anyway (exploration), or a pessimistic start would never change."""
        return self.reached[position][self._bin(confidence)] < self.min_observations

    def observe(self, confidences: list[float], num_verified: int, num_accepted: int) -> None:
        """One verification: drafts 0..num_accepted-1 passed, draft num_accepted (if verified) failed."""
        for i in range(min(num_accepted + 1, num_verified)):
            b = self._bin(confidences[i])
            self.reached[i][b] += 1
            self.accepted[i][b] += i < num_accepted


class VariableLengthPolicy:
    """The core's `VerifyPolicy` for confidence-scheduled verification: calibrated confidences,
    the expected-gain-per-second schedule over the profiled cost table, and one exploratory draft
    where the calibration has too little evidence."""

    def __init__(self, cost_model: VerifyCostModel, num_draft_tokens: int):
        self.cost_model = cost_model
        self.calibrator = ConfidenceCalibrator(num_draft_tokens)

    def plan(self, confidences: list[list[float]], draft_seconds: float) -> list[int]:
        calibrated = [[self.calibrator.calibrate(i, c) for i, c in enumerate(conf)] for conf in confidences]
        chosen = plan_verification(calibrated, self.cost_model, draft_seconds)
        for r, (conf, m) in enumerate(zip(confidences, chosen)):
            if m < len(conf) and self.calibrator.needs_evidence(m, conf[m]):
                chosen[r] = m + 1  # explore: one more draft whose acceptance has hardly been measured
        return chosen

    def observe(self, confidences: list[float], num_verified: int, num_accepted: int) -> None:
        self.calibrator.observe(confidences, num_verified, num_accepted)


def plan_verification(confidences: list[list[float]], cost: VerifyCostModel, overhead_seconds: float = 0.0,
                      extra_tokens: int = 0) -> list[int]:
    """How many leading drafts of each request to verify this step.

    `confidences[r]`: per-draft acceptance estimates of request r (conditional on the previous
    drafts); `overhead_seconds`: step time that does not depend on the choice (drafting, sampling);
    `extra_tokens`: other query tokens in the step (prefill chunks). Maximises
    (B + sum of chosen prefix-survival probabilities) / (cost(B, B + extra + chosen) + overhead).
    """
    batch = len(confidences)
    if batch == 0:
        return []
    candidates = []  # (prefix survival, request, index)
    for r, conf in enumerate(confidences):
        survive = 1.0
        for i, c in enumerate(conf):
            survive *= min(max(float(c), 0.0), 1.0)
            candidates.append((survive, r, i))
    # survival never grows along a request, so taking a prefix of this order keeps prefixes
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    base = batch + extra_tokens
    best_n, best_rate, gain = 0, -1.0, float(batch)
    for n in range(len(candidates) + 1):
        if n:
            gain += candidates[n - 1][0]
        rate = gain / max(cost.cost(batch, base + n) + overhead_seconds, 1e-12)
        if rate > best_rate * (1 + 1e-9):
            best_n, best_rate = n, rate
    chosen = [0] * batch
    for _, r, _ in candidates[:best_n]:
        chosen[r] += 1
    return chosen


def profile_verify_cost(run: Callable[[int, int], None], max_batch: int, max_query: int, max_tokens: int,
                        repeats: int = 2) -> VerifyCostModel:
    """Time `run(batch_size, query_len)` (one target forward of `batch_size` sequences with
    `query_len` new tokens each) for batch sizes 1, 4, 16, ... and max_batch, at query lengths 1
    and max_query (cost is close to linear in between), within `max_tokens` tokens per step.
    One warm-up run of the largest batch comes first (first-touch allocation, kernel selection);
    each point is then the fastest of `repeats` runs (the one least disturbed by other work on the
    machine), and a cost never decreases with more tokens."""
    sizes = sorted({min(4 ** i, max_batch) for i in range(max(max_batch, 1).bit_length())} | {max_batch})
    points = [(b, q) for b in sizes for q in sorted({1, max_query}) if b * q <= max_tokens or q == 1]
    run(*max(points, key=lambda p: p[0] * p[1]))
    table: dict[int, list[tuple[int, float]]] = {}
    for b, q in points:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(b, q)
            times.append(time.perf_counter() - t0)
        slowest = table[b][-1][1] if b in table else 0.0
        table.setdefault(b, []).append((b * q, max(slowest, min(times))))
    return VerifyCostModel(table)


def format_cost_table(cost: VerifyCostModel) -> str:
    return "; ".join(f"B={b}: " + ", ".join(f"{t} tok {s * 1e3:.2f} ms" for t, s in points)
                     for b, points in cost.table.items())


__all__ = ["ConfidenceCalibrator", "VariableLengthPolicy", "VerifyCostModel", "format_cost_table", "plan_verification",
           "profile_verify_cost"]
