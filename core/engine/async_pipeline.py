"""The async batch pipeline's worker: one daemon thread that executes prepared steps in order.

While the worker runs step N (forward, then sampling), the engine thread schedules and prepares
step N+1, applies step N-1's results and fills step N's logits-processor bitmasks
(`executor.AsyncExecutor` drives it). On the CPU back end the forward is torch kernels, which
release the GIL, so the two threads overlap.

The thread is a daemon (it can never keep the interpreter alive) and `shutdown` joins it: it
fails every queued step and unblocks a step waiting for its bitmask, so Ctrl-C or an engine error
never leaves the worker stuck. At interpreter exit an `atexit` hook lets a forward that is still
running finish and joins the thread: a daemon thread killed inside a torch kernel aborts the
process ("terminate called without an active exception").
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref
from concurrent.futures import Future

from deepinfer.engine.runner import ModelRunner, PreparedStep
from deepinfer.engine.scheduler import ModelRunnerOutput

_STOP = object()


class EngineShutdown(RuntimeError):
    """The engine shut down before this step ran."""


class StepWorker:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._queue: queue.Queue = queue.Queue()
        self._pending: set[PreparedStep] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="deepinfer-step-worker", daemon=True)
        self._thread.start()
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    def submit(self, step: PreparedStep) -> Future:
        """Queue `step`; the future resolves to its ModelRunnerOutput (or the error it raised)."""
        result: Future = Future()
        with self._lock:
            if self._closed:
                raise EngineShutdown("the engine was shut down")
            self._pending.add(step)
        self._queue.put((step, result))
        return result

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            step, result = item
            try:
                if not result.set_running_or_notify_cancel():
                    continue
                out: ModelRunnerOutput = self.runner.execute(step)
                result.set_result(out)
            except BaseException as exc:  # handed to the engine thread, which re-raises it
                if not result.done():
                    result.set_exception(exc)
            finally:
                with self._lock:
                    self._pending.discard(step)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, wait: bool = True, timeout: float | None = 60.0) -> None:
        """Fail what is queued, release a step waiting for its bitmask, and join the thread (a
        forward already running cannot be interrupted: with wait=False the daemon thread finishes
        it and exits on its own)."""
        with self._lock:
            self._closed = True
            pending = list(self._pending)
        for step in pending:
            if not step.bitmask.done():
                step.bitmask.set_exception(EngineShutdown("the engine was shut down"))
        while True:  # drop queued steps that have not started
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[1].cancel()
        self._queue.put(_STOP)
        if wait:
            self._thread.join(timeout)


def _shutdown_at_exit(ref: weakref.ref) -> None:
    worker = ref()
    if worker is not None and worker.alive:
        worker.shutdown(wait=True, timeout=None)
