"""What `benchmark.py` tells the user while it runs: the plan up front, an estimate of the timed
phases once the warm-up has measured this machine, and a progress bar per timed phase.

The seeds' defaults are sized for a node of SM100 GPUs (64 sequences at a 32,768-token context:
2.1 M prompt tokens to prefill before decoding starts); on a CPU they run for hours, and one engine
step of 32,768 prompt tokens alone can take minutes, so the plan names the flags that shrink the
run, a short calibration (one small prompt) gives a first estimate before the warm-up, and the
warm-up (timed step sizes) a second one. Everything goes to stderr: stdout keeps the figures.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import IO, Any

#: Flags that shrink a run, named in the plan when the back end is the CPU.
SHRINK_HINT = ("--preset cpu (about a minute on 2 cores with the `bench` model), or smaller --decode_num_requests, "
               "--context_length, --non_cached_tokens, --prefill_batch_size, --decode_tokens, or one phase "
               "(--phase prefill|decode)")


@dataclass(frozen=True)
class Work:
    """Tokens and steps one repeat of the timed phases runs (per data-parallel rank)."""

    prefill_prompts: int  # prefill phase: prompts of `prompt_len` fresh tokens
    prompt_len: int
    decode_sequences: int  # decode phase: sequences prefilled to `context_len`, then decoded
    context_len: int
    decode_steps: int

    @property
    def prefill_tokens(self) -> int:
        return self.prefill_prompts * self.prompt_len

    @property
    def decode_prompt_tokens(self) -> int:
        return self.decode_sequences * self.context_len


def plan_text(work: Work, phase: str, repeats: int, prefill_batch_size: int, preset: str, accelerator: str,
              devices: int, warmup: bool) -> str:
    """The run described before anything is built: the work of each phase and, on the CPU with the
    seeds' sizes, how to shrink it."""
    lines = [f"benchmark plan ({preset} sizes, {devices} device(s), {accelerator} back end), per repeat x {repeats}:"]
    if phase in ("both", "prefill"):
        lines.append(f"  prefill: {work.prefill_prompts} prompts x {work.prompt_len:,} tokens = "
                     f"{work.prefill_tokens:,} tokens, {prefill_batch_size:,} per step")
    if phase in ("both", "decode"):
        lines.append(f"  decode: {work.decode_sequences} sequences, first prefilled to {work.context_len:,} tokens each "
                     f"({work.decode_prompt_tokens:,} prompt tokens), then {work.decode_steps} steps each")
    if warmup:
        lines.append("  before them, an untimed warm-up of one prefill step (twice) and a short decode")
    if accelerator == "cpu" and preset == "seeds":
        lines.append(f"  these are the seeds' accelerator sizes: on a CPU this takes long (estimates follow); to "
                     f"shrink it use {SHRINK_HINT}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Speed:
    """This machine's speed as a short run measured it: prompt tokens/s and one decode step."""

    prefill_tokens_per_s: float
    decode_step_s: float | None
    measured_on: str  # what was timed, for the message


def estimate_seconds(work: Work, phase: str, repeats: int, speed: Speed, extra_prefill_tokens: int = 0,
                     extra_decode_steps: int = 0) -> float | None:
    """Seconds the timed phases (plus `extra_*` work, e.g. the warm-up still to come) take at `speed`;
    None when the decode phase runs and no decode step was measured."""
    prefill_tokens, decode_steps = 0, 0
    if phase in ("both", "prefill"):
        prefill_tokens += work.prefill_tokens * repeats
    if phase in ("both", "decode"):
        if speed.decode_step_s is None:
            return None
        prefill_tokens += work.decode_prompt_tokens * repeats
        decode_steps += work.decode_steps * repeats
    seconds = (prefill_tokens + extra_prefill_tokens) / speed.prefill_tokens_per_s
    return seconds + (decode_steps + extra_decode_steps) * (speed.decode_step_s or 0.0)


def estimate_text(seconds: float, speed: Speed, what: str) -> str:
    """One line: how long `what` takes at `speed`, a lower bound (attention over a long context costs
    more per token, and a large decode batch more per step, than a short measurement shows)."""
    step = f", one decode step {speed.decode_step_s * 1e3:,.0f} ms" if speed.decode_step_s is not None else ""
    return (f"estimate: {what} at least {_duration(seconds)} at the speed of {speed.measured_on} "
            f"(prefill {speed.prefill_tokens_per_s:,.0f} tokens/s{step}; longer contexts and larger batches are "
            f"slower)")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class PhaseProgress:
    """Progress bars of one timed phase, fed after every engine step (`update`): prompt tokens
    prefilled, then (decode phase, `decode_steps` set) the steps every sequence has taken since all
    were prefilled. Drawn only on a terminal unless `enabled` says otherwise."""

    def __init__(self, label: str, decode_steps: int | None = None, stream: IO[str] | None = None,
                 enabled: bool | None = None):
        self.label, self.decode_steps = label, decode_steps
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._prefill: Any = None
        self._decode: Any = None

    def _bar(self, total: int, desc: str, unit: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=f"{self.label}: {desc}", unit=unit, unit_scale=unit == "tok", file=self.stream,
                    leave=True, dynamic_ncols=True)

    def update(self, requests: list[Any], trace: Any) -> None:
        if not self.enabled or not requests:
            return
        if self._prefill is None:
            self._prefill = self._bar(sum(r.num_prompt_tokens for r in requests), "prefill", "tok")
        done = sum(min(r.num_computed_tokens, r.num_prompt_tokens) for r in requests)
        self._prefill.update(done - self._prefill.n)
        if self.decode_steps is None or not trace.all_started[-1]:
            return
        if self._decode is None:  # every prompt is prefilled: that bar is done, the decode bar starts
            self._prefill.update(self._prefill.total - self._prefill.n)
            self._prefill.close()
            self._decode = self._bar(self.decode_steps, "decode", "step")
        first = trace.all_started.index(True)
        steps = min((trace.advances[-1] - trace.advances[first]) // len(requests), self.decode_steps)
        self._decode.update(steps - self._decode.n)

    def close(self) -> None:
        for bar in (self._prefill, self._decode):
            if bar is not None:
                bar.close()
