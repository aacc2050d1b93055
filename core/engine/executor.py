"""Executing scheduled steps: on the engine thread, or one step ahead on a worker thread.

The engine picks one executor at start-up, and the step function that goes with it
(engine_core.py):

- `SyncExecutor.execute(scheduler_output, bitmask)`: prepares the step, runs the forward and
  sampling, returns the step's `ModelRunnerOutput`.
- `AsyncExecutor` (the async batch pipeline): `submit(scheduler_output)` prepares the step and
  queues it on the worker thread behind the step in flight, then waits for that one and returns it
  with its output; `fill_bitmask` computes the queued step's logits-processor bitmask on the engine
  thread while its forward runs (the worker waits for it before sampling).

`wait_seconds` counts the engine thread's time blocked on the forward and sampling.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from deepinfer.engine.async_pipeline import StepWorker
from deepinfer.engine.request import Request
from deepinfer.engine.runner import ModelRunner, PreparedStep
from deepinfer.engine.scheduler import ModelRunnerOutput, SchedulerOutput

#: the engine's bitmask filler: (bitmask or None, requests the logits processors failed while filling it)
BitmaskFiller = Callable[[SchedulerOutput], tuple[torch.Tensor | None, list[Request]]]


class SyncExecutor:
    worker = None

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.wait_seconds = 0.0

    @property
    def has_in_flight(self) -> bool:
        return False

    def execute(self, scheduler_output: SchedulerOutput, bitmask: torch.Tensor | None) -> ModelRunnerOutput:
        step = self.runner.prepare(scheduler_output, None)
        if not step.bitmask.done():
            step.bitmask.set_result(bitmask)
        waited = time.perf_counter()
        out = self.runner.execute(step)
        self.wait_seconds += time.perf_counter() - waited
        return out

    def drop_in_flight(self) -> None:
        """Nothing runs between two calls."""

    def shutdown(self, wait: bool = True) -> None:
        """No thread to stop."""


class AsyncExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.worker = StepWorker(runner)
        self.in_flight: tuple[PreparedStep, Future] | None = None
        self.wait_seconds = 0.0

    @property
    def has_in_flight(self) -> bool:
        return self.in_flight is not None

    def submit(self, scheduler_output: SchedulerOutput) -> tuple[SchedulerOutput, ModelRunnerOutput] | None:
        """Queue `scheduler_output` (unless empty) behind the step in flight, then wait for that step;
        returns it with its output (None when none was in flight)."""
        prev = self.in_flight
        self.in_flight = None
        if not scheduler_output.is_empty:
            step = self.runner.prepare(scheduler_output, prev[0] if prev is not None else None)
            self.in_flight = (step, self.worker.submit(step))
        if prev is None:
            return None
        waited = time.perf_counter()
        out = prev[1].result()
        self.wait_seconds += time.perf_counter() - waited
        return prev[0].sched, out

    def fill_bitmask(self, fill: BitmaskFiller) -> list[Request]:
        """Fill the queued step's bitmask with `fill` (if it needs one); returns the requests `fill` failed."""
        if self.in_flight is None or self.in_flight[0].bitmask.done():
            return []
        step = self.in_flight[0]
        try:
            bitmask, failed = fill(step.sched)
        except BaseException as exc:
            step.bitmask.set_exception(exc)  # the worker must not wait forever
            raise
        step.bitmask.set_result(bitmask)
        return failed

    def drop_in_flight(self) -> None:
        """Forget the step in flight (after an abort): it finishes without a mask and nobody reads
        its tokens. Later steps run after it (the worker is serial), so reusing freed cache is safe."""
        if self.in_flight is not None:
            step, _ = self.in_flight
            self.in_flight = None
            if not step.bitmask.done():
                step.bitmask.set_result(None)

    def shutdown(self, wait: bool = True) -> None:
        self.worker.shutdown(wait=wait)
