"""The figures `benchmark.py` prints, computed from raw counts and times.

Definitions (the seeds' "Benchmark your node"):

- prefill throughput (tokens/s/device) = prefilled tokens / prefill seconds / devices;
- decode avg_SPS (steps/s) = decode steps / decode seconds, a step advancing a sequence once (by
  1 + its accepted drafts); measured as the steps one sequence takes part in (see workloads.py);
- decode throughput, full-acceptance accounting (tokens/s/device)
      = avg_SPS x decode_num_requests x (1 + nextn) / cp.
  It counts 1 + nextn tokens per request per step whatever the drafts' true acceptance, so it
  overstates output speed whenever drafts are rejected. `decode_num_requests` is per
  data-parallel group: with dp = devices / cp groups the run decodes requests x dp sequences and
  the per-device figure divides by dp x cp, which leaves the `/ cp` above;
- decode throughput, accepted tokens (tokens/s/device) = tokens actually emitted during the decode
  phase / decode seconds / devices. Without speculation (nextn = 0) it equals the full-acceptance
  figure whenever every sequence decodes in every step;
- decode throughput at an assumed acceptance (`--accept_rate A`, tokens/s/device)
      = avg_SPS x decode_num_requests x (1 + A x verified drafts per step) / cp,
  and the per-user speed avg_SPS x (1 + A x verified drafts per step): what the measured step rate
  gives when a share A of the verified drafts is accepted (A = 1 with every draft verified is the
  full-acceptance figure). A step verifies its drafts whatever their fate, so its time does not
  depend on A; random-weight drafters accept almost nothing, which makes the measured accepted
  figure meaningless for a real checkpoint's drafter. "verified drafts per step" is measured (nextn
  with fixed-length verification, fewer with confidence-scheduled verification).
"""
from __future__ import annotations

import math


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def prefill_throughput(tokens: int, seconds: float, devices: int) -> float:
    """Prefilled tokens per second per device."""
    _positive("prefill seconds", seconds)
    _positive("devices", devices)
    return tokens / seconds / devices


def decode_avg_sps(steps: int, seconds: float) -> float:
    """Decode steps per second."""
    _positive("decode seconds", seconds)
    return steps / seconds


def full_acceptance_throughput(avg_sps: float, decode_num_requests: int, nextn: int, cp: int) -> float:
    """avg_SPS x decode_num_requests x (1 + nextn) / cp, tokens/s/device (the seeds' third number)."""
    if nextn < 0:
        raise ValueError(f"nextn must be >= 0, got {nextn}")
    _positive("cp", cp)
    return avg_sps * decode_num_requests * (1 + nextn) / cp


def accepted_throughput(accepted_tokens: int, seconds: float, devices: int) -> float:
    """Tokens actually emitted per second per device during the decode phase."""
    _positive("decode seconds", seconds)
    _positive("devices", devices)
    return accepted_tokens / seconds / devices


def per_user_speed(accepted_tokens: int, seconds: float, num_sequences: int) -> float:
    """Tokens per second seen by one sequence (the x axis of the decode Pareto plot)."""
    _positive("decode seconds", seconds)
    _positive("num_sequences", num_sequences)
    return accepted_tokens / seconds / num_sequences


def acceptance_length(accepted_tokens: int, sequence_steps: int) -> float:
    """Mean tokens a sequence emits per decode step it takes part in (1.0 without speculation;
    at most 1 + nextn)."""
    _positive("sequence_steps", sequence_steps)
    return accepted_tokens / sequence_steps


def tokens_per_step(verified_drafts_per_step: float, accept_rate: float) -> float:
    """Tokens one sequence emits per decode step when a share `accept_rate` of its verified drafts is
    accepted: 1 + accept_rate x verified drafts (the 1: the target's own token)."""
    if not 0.0 <= accept_rate <= 1.0:
        raise ValueError(f"accept_rate must be between 0 and 1, got {accept_rate}")
    if verified_drafts_per_step < 0:
        raise ValueError(f"verified drafts per step must be >= 0, got {verified_drafts_per_step}")
    return 1.0 + accept_rate * verified_drafts_per_step


def assumed_acceptance_throughput(avg_sps: float, decode_num_requests: int, verified_drafts_per_step: float,
                                  accept_rate: float, cp: int) -> float:
    """avg_SPS x decode_num_requests x (1 + accept_rate x verified drafts per step) / cp, tokens/s/device."""
    _positive("cp", cp)
    return avg_sps * decode_num_requests * tokens_per_step(verified_drafts_per_step, accept_rate) / cp
