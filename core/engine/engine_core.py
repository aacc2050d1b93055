"""The engine loop: step = schedule -> execute -> update.

    scheduler_output = scheduler.schedule()                    # what runs (the only input of the runner)
    runner_output = executor.execute(scheduler_output, ...)   # forward, sampling / draft verification
    finished = scheduler.update_from_output(scheduler_output, runner_output)

The engine picks its step function once, at start-up:

- synchronous (`_step_sync`): the three phases in order on the calling thread, the step's
  logits-processor bitmask filled just before it executes;
- async pipeline (`_step_async`): one step stays in flight on the worker thread. Each call
  schedules and queues step N+1 (a token step N is still sampling is a placeholder input), waits
  for step N and applies it, then fills step N+1's bitmasks, which depend on the tokens step N
  sampled, while step N+1's forward runs; the worker waits for them before sampling.

Aborts (`abort`, `abort_all`) may come from any thread: they are posted to a mailbox and applied
between steps, under the lock that every change of request state takes (a step, an admission, the
mailbox drain), so the scheduler stays the only writer and never changes state under a running
step.

A request that finishes in step N may already be scheduled in step N+1; what that step computes for
it is discarded. Its cache is freed at once: a freed slot or block can only be handed out by a later
schedule, whose step runs after step N+1 (the worker is serial), so no live state is overwritten.
Both modes produce identical tokens.

Who does what: `Admission` builds requests (tokenising, checks, logits processors); the `Scheduler`
is the only writer of request state (`schedule`, `update_from_output`, finishing); the
`ModelRunner` reads only the scheduler output; `OutputProcessor` checks stop conditions and
detokenises; `StructuredMasks` fills the logits processors' bitmasks; `SpeculativeDecoder`
verifies drafts and drives the drafter a feature contributed (speculative.py).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from deepinfer.engine.admission import Admission, _is_array, as_token_ids  # noqa: F401  (_is_array: core/llm.py)
from deepinfer.engine.cache_manager import CacheManager, CacheStats
from deepinfer.engine.executor import AsyncExecutor, SyncExecutor
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.scheduler import DEAD_END, Scheduler, SchedulerOutput
from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.engine.speculative import SpeculativeDecoder
from deepinfer.engine.structured_masks import StructuredMasks
from deepinfer.logits_processor import LogitsProcessor
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer")


class EngineCore:
    def __init__(self, *, model: Any, accelerator: Any, tokenizer: Any, cache: CacheManager,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, vocab_size: int,
                 eos_token_ids: set[int], device: torch.device, async_pipeline: bool = True,
                 sampler_force_topk: int | None = None, seed: int = 0, features: Any = None,
                 config: Any = None, processors: list[LogitsProcessor] | None = None):
        self.model = model
        self.accelerator = accelerator
        self.tokenizer = tokenizer
        self.cache = cache
        self.config = config
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = device
        self.features = features
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.sampler = Sampler(accelerator, force_topk=sampler_force_topk, generator=generator)
        self._processors: list[LogitsProcessor] = list(processors or ())  # shared by admission and masks
        self.admission = Admission(tokenizer, vocab_size=vocab_size, max_model_len=max_model_len,
                                   processors=self._processors)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, max_model_len=max_model_len)
        self.masks = StructuredMasks(self._processors, vocab_size)
        self.scheduler = Scheduler(cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len, outputs=self.outputs, masks=self.masks)
        self.runner = ModelRunner(model, self.sampler, device, [g.name for g in cache.layout.block_groups],
                                  self.eos_token_ids)
        #: speculative decoding (a feature's `draft_proposer` contribution), None when off
        self.speculator: SpeculativeDecoder | None = None
        self._ids = itertools.count()
        self._num_arrivals = 0  # requests admitted so far; the next one's arrival_index
        # Held while request state changes (a step, an admission, applying aborts): aborts posted from
        # other threads wait in `_aborts` until no step runs. Each is (number of arrivals when posted,
        # the ids to abort, or None for all): an abort never touches a request admitted after it.
        self._state_lock = threading.Lock()
        self._aborts: list[tuple[int, frozenset[str] | None]] = []
        self._aborts_lock = threading.Lock()
        self.num_steps = 0
        # Engine-thread time in step() in all; executor.wait_seconds is the part blocked on the
        # forward + sampling (running it in sync mode, waiting for the worker in async mode).
        self.step_seconds = 0.0
        self._closed = False
        if features is not None:
            features.start(self)
            self._processors[:0] = features.processors
            if features.draft_proposer is not None:
                self.speculator = SpeculativeDecoder(features.draft_proposer, self.sampler, accelerator,
                                                     max_model_len)
                self.runner.speculator = self.scheduler.speculator = self.speculator
        # last: nothing above can leave a thread behind when it fails
        self.executor = AsyncExecutor(self.runner) if async_pipeline else SyncExecutor(self.runner)
        self._step_fn = self._step_async if async_pipeline else self._step_sync

    @property
    def processors(self) -> list[LogitsProcessor]:
        """The logits processors (features' first); a request's `processors` index into this list."""
        return self._processors

    @property
    def async_pipeline(self) -> bool:
        return isinstance(self.executor, AsyncExecutor)

    @property
    def worker(self):
        """The async pipeline's worker thread (`StepWorker`), None in synchronous mode."""
        return self.executor.worker

    @property
    def wait_seconds(self) -> float:
        return self.executor.wait_seconds

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None) -> Request:
        """Admit one request. Problems with this request alone (empty or too long prompt, token ids
        outside the vocabulary, invalid sampling values, a rejected constraint) return it already
        finished with finish_reason "error" and a message; the engine carries on. A request of
        several samples (`n`, `best_of`) returns its first member; the others are in its `group`
        (`all_finished`, `to_output` cover them all)."""
        request_id = str(next(self._ids)) if request_id is None else request_id
        with self._state_lock:
            if request_id in self.scheduler.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            samples = params.num_samples if isinstance(params, SamplingParams) else 1
            if samples > 1 and self.speculator is None:
                req, problem = self.admission.admit_samples(prompt, params, request_id, self._num_arrivals)
            else:
                req, problem = self.admission.admit(prompt, params, request_id, self._num_arrivals)
                if problem is None and samples > 1:
                    self.masks.remove(req)
                    problem = (f"SamplingParams n={params.n} / best_of={params.best_of} needs the samples' prompt "
                               f"state forked, which speculative decoding cannot do (the drafter's per-request "
                               f"context is not in the cache); send one request per sample")
            self._num_arrivals += 1
            if problem is not None:
                self.scheduler.reject(req, problem)
                return req
            for member in req.members:
                self.scheduler.add_request(member)
            return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.executor.has_in_flight

    # -- the step loop ----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it, the ones aborted since the last
        step included (unless an `abort` call applied them itself)."""
        if self._closed:
            raise RuntimeError("the engine was shut down")
        with self._state_lock:
            step_start = time.perf_counter()
            aborted = self._apply_aborts()
            _, finished = self._step_fn()
            self._announce_finished(finished)
            self.step_seconds += time.perf_counter() - step_start
            return aborted + finished

    def _step_sync(self) -> tuple[SchedulerOutput, list[Request]]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._check_progress()
            return sched, []
        self.num_steps += 1
        bitmask, finished = self._bitmask(sched)
        output = self.executor.execute(sched, bitmask)
        return sched, finished + self.scheduler.update_from_output(sched, output)

    def _step_async(self) -> tuple[SchedulerOutput, list[Request]]:
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            self.num_steps += 1
        done = self.executor.submit(sched)  # queued behind the step in flight, which comes back
        if done is None and sched.is_empty:
            self._check_progress()
        finished = [] if done is None else self.scheduler.update_from_output(*done)
        return sched, finished + self.executor.fill_bitmask(self._bitmask)

    def _bitmask(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list[Request]]:
        """The step's logits-processor bitmask, and the requests the processors failed while filling it."""
        if not self.masks.needed(sched):
            return None, []
        bitmask = self.masks.fill(sched)
        return bitmask, self.scheduler.apply_failures(self.masks.pop_failures())

    def _check_progress(self) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not schedule any request although some are unfinished; "
                               "this is a bug (cache pool smaller than one request?)")

    def _announce_finished(self, finished: list[Request]) -> None:
        for req in finished:
            if self.speculator is not None:
                self.speculator.forget(req.request_id)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish these requests with finish_reason "abort", freeing their cache and processor state;
        ids that are unknown, finished, or admitted after this call are ignored. Safe from any thread:
        applied at once when no step or admission is running (returns the requests it finished),
        otherwise before the next step (returns []; that step returns them among its finished
        requests). A step in flight for them is discarded when it comes back."""
        return self._post_abort(frozenset(request_ids))

    def abort_all(self) -> list[Request]:
        """`abort` every request admitted before this call (an interrupt, a shutdown)."""
        return self._post_abort(None)

    def _post_abort(self, request_ids: frozenset[str] | None) -> list[Request]:
        with self._aborts_lock:
            self._aborts.append((self._num_arrivals, request_ids))
        if not self._state_lock.acquire(blocking=False):
            return []  # a step or an admission runs (on another thread, or this one below us)
        try:
            return self._apply_aborts()
        finally:
            self._state_lock.release()

    def _apply_aborts(self) -> list[Request]:
        """Apply the posted aborts (with `_state_lock` held)."""
        with self._aborts_lock:
            posted, self._aborts = self._aborts, []
        if not posted:
            return []
        requests = self.scheduler.requests
        targets: dict[str, tuple[str, str]] = {}
        for arrivals, ids in posted:
            candidates = requests.values() if ids is None else (m for i in ids if i in requests
                                                                for m in requests[i].members)
            targets.update({r.request_id: ("abort", "aborted") for r in candidates if r.arrival_index < arrivals})
        done = self.scheduler.apply_failures(targets)
        if not self.scheduler.has_unfinished():
            # nobody reads the step in flight; release it if it still waits for its bitmask (an
            # interrupt inside step() can leave it so)
            self.executor.drop_in_flight()
        self._announce_finished(done)
        return done

    # -- lifecycle --------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        return self.cache.stats()

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        """Speculative-decoding totals (accepted length, verified drafts per step, acceptance by
        position), or None without speculative decoding."""
        return None if self.speculator is None else self.speculator.stats

    def shutdown(self, wait: bool = True) -> None:
        """Stop the worker thread (joined unless wait=False) and announce shutdown to the features.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        executor = getattr(self, "executor", None)  # absent when __init__ failed before creating it
        if executor is not None:
            executor.shutdown(wait=wait)
        if self.features is not None:
            try:
                self.features.shutdown(self)
            except Exception:  # shutdown must not mask the error that caused it
                logger.exception("a feature failed during engine shutdown")

    def __del__(self):
        try:
            self.shutdown(wait=False)
        except Exception:
            pass


__all__ = ["EngineCore", "RequestStatus", "SchedulerOutput", "DEAD_END", "as_token_ids"]
