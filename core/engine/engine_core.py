"""The engine loop: step = schedule -> execute -> update.

Synchronous mode runs the three phases in order on the calling thread. Async mode (default) keeps
one step in flight on the worker thread (`async_pipeline.StepWorker`); each `step()` then

1. schedules and prepares step N+1 (a token sampled by step N is a placeholder input),
2. queues it behind step N on the worker,
3. waits for step N and applies its results (new tokens, stop checks, logits-processor `accept`),
4. fills step N+1's logits-processor bitmasks: they depend on the token step N sampled, so they
   are computed only now, while step N+1's forward runs, and the worker waits for them before
   sampling.

A request that finishes in step N may already be scheduled in step N+1; what that step computes
for it is discarded. Its cache is freed at once: a freed slot or block can only be handed out by
a later schedule, whose step runs after step N+1 (the worker is serial), so no live state is
overwritten. Both modes produce identical tokens.
"""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from typing import Any

import torch

from deepinfer.engine.async_pipeline import StepWorker
from deepinfer.engine.cache_manager import CacheManager, CacheStats
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.runner import ModelRunner, PreparedStep
from deepinfer.engine.sampler import Sampler, SamplerOutput
from deepinfer.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer.logits_processor import LogitsProcessor, RequestRejected
from deepinfer.outputs import Logprob
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer")

DEAD_END = "grammar_dead_end"


class EngineCore:
    def __init__(self, *, model: Any, accelerator: Any, tokenizer: Any, cache: CacheManager,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, vocab_size: int,
                 eos_token_ids: set[int], device: torch.device, async_pipeline: bool = True,
                 sampler_force_topk: int | None = None, seed: int = 0, features: Any = None,
                 config: Any = None):
        self.model = model
        self.accelerator = accelerator
        self.tokenizer = tokenizer
        self.cache = cache
        self.config = config
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.device = device
        self.scheduler = Scheduler(cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len)
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.sampler = Sampler(accelerator, force_topk=sampler_force_topk, generator=generator)
        self.runner = ModelRunner(model, self.sampler, device, [g.name for g in cache.layout.block_groups],
                                  self.eos_token_ids)
        self.features = features
        self.processors: list[LogitsProcessor] = []
        self.async_pipeline = async_pipeline
        self.worker = StepWorker(self.runner) if async_pipeline else None
        self._in_flight: tuple[PreparedStep, Future] | None = None
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._requests: dict[str, Request] = {}
        self._failures: dict[str, tuple[str, str]] = {}
        self.num_steps = 0
        self._closed = False
        if features is not None:
            features.start(self)
            self.processors = list(features.processors)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None) -> Request:
        """Admit one request. Problems with this request alone (empty or too long prompt, token ids
        outside the vocabulary, invalid sampling values, a rejected constraint) return it already
        finished with finish_reason "error" and a message; the engine carries on."""
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids, problem = self._tokenize(prompt)
        req = Request(request_id=request_id, prompt=text, prompt_token_ids=token_ids or [], params=params,
                      arrival_index=next(self._arrivals))
        if problem is None:
            problem = self._check(req)
        if problem is None:
            problem = self._attach_processors(req)
        if problem is not None:
            req.finish("error", error=problem)
            self._finish_text(req)
            return req
        if params.stop_strings and hasattr(self.tokenizer, "stream_decoder"):
            req.stop_decoder = self.tokenizer.stream_decoder(skip_special_tokens=params.skip_special_tokens)
        self._requests[request_id] = req
        self.scheduler.add_request(req)
        if self.features is not None:
            self.features.hook.deepinfer_request_added(request=req)
        return req

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int] | None, str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), prompt["prompt_token_ids"], None
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                return None, None, 'a prompt dict needs the key "prompt_token_ids" (or "prompt")'
        if isinstance(prompt, str):
            if not prompt:
                return prompt, [], "the prompt is empty; give at least one token"
            try:
                add_bos = getattr(self.tokenizer, "bos_token_id", None) is not None
                return prompt, self.tokenizer.encode(prompt, add_bos=add_bos), None
            except (ValueError, TypeError) as e:
                return prompt, None, str(e)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt), None
        return None, None, (f"a prompt must be a string, a list of token ids or a dict with "
                            f'"prompt_token_ids"; got {type(prompt).__name__}')

    def _check(self, req: Request) -> str | None:
        ids = req.prompt_token_ids
        if not ids:
            return "the prompt is empty; give at least one token"
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            return (f"prompt token ids {bad[:5]}{'...' if len(bad) > 5 else ''} are outside the vocabulary "
                    f"[0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            return (f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}; shorten "
                    f"it or raise max_model_len")
        try:
            req.params._validate()  # the object may have been changed after it was built
        except ValueError as e:
            return str(e)
        return None

    def _attach_processors(self, req: Request) -> str | None:
        for index, processor in enumerate(self.processors):
            try:
                if processor.add_request(req.request_id, req.params):
                    req.processors.append(index)
            except RequestRejected as e:
                for i in req.processors:
                    self.processors[i].remove_request(req.request_id)
                req.processors.clear()
                return str(e)
        if req.params.so_args and not req.processors:
            return ("so_args needs the structured_output feature, which is not enabled on this engine "
                    "(it needs a back end with token-bitmask support)")
        return None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- the step loop ----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it."""
        if self._closed:
            raise RuntimeError("the engine was shut down")
        finished: list[Request] = []
        sched = self.scheduler.schedule()
        prev = self._in_flight
        current: PreparedStep | None = None
        if not sched.is_empty:
            current = self.runner.prepare(sched, prev[0] if prev else None)
            self.num_steps += 1
        if self.worker is not None:
            future = self.worker.submit(current) if current is not None else None
            if prev is not None:
                finished += self._update(prev[0], prev[1].result())
            if current is not None:
                self._fill_bitmask(current, finished)
            self._in_flight = (current, future) if current is not None else None
        elif current is not None:
            self._fill_bitmask(current, finished)
            finished += self._update(current, self.runner.execute(current))
        if current is None and prev is None and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not schedule any request although some are unfinished; "
                               "this is a bug (cache pool smaller than one request?)")
        if self.features is not None:
            self.features.hook.deepinfer_step_end(scheduler_output=sched,
                                                  finished_request_ids=[r.request_id for r in finished])
        return finished

    def _fill_bitmask(self, step: PreparedStep, finished: list[Request]) -> None:
        if not step.needs_bitmask:
            return
        try:
            words = -(-self.vocab_size // 32)
            rows = len(step.sample_rows)
            combined = torch.full((rows, words), -1, dtype=torch.int32)
            for index, processor in enumerate(self.processors):
                mine = [(i, s.request_id) for i, s in enumerate(step.sample_rows)
                        if index in s.request.processors and not s.request.is_finished]
                if not mine:
                    continue
                part = torch.full((len(mine), words), -1, dtype=torch.int32)
                processor.fill_bitmask([rid for _, rid in mine], part)
                combined[[i for i, _ in mine]] &= part
            finished += self._apply_processor_failures()
        except BaseException as exc:
            step.bitmask.set_exception(exc)
            raise
        step.bitmask.set_result(combined)

    def _apply_processor_failures(self) -> list[Request]:
        for processor in self.processors:
            self._failures.update(processor.pop_failures())
        done = []
        for rid in list(self._failures):
            req = self._requests.get(rid)
            reason, message = self._failures.pop(rid)
            if req is not None and not req.is_finished:
                self._finish(req, reason, error=message)
                done.append(req)
        return done

    # -- applying a step's results ----------------------------------------------------------------

    def _update(self, step: PreparedStep, out: SamplerOutput) -> list[Request]:
        finished: list[Request] = []
        tokens = out.token_ids.tolist()
        logprobs = out.logprobs.tolist()
        dead = out.dead.tolist()
        ranks = out.ranks.tolist() if any(s.request.params.logprobs is not None for s in step.sample_rows) else None
        for row, s in enumerate(step.sample_rows):
            req = s.request
            req.num_pending_tokens -= 1
            if req.is_finished:
                continue  # finished by an earlier step; this token is discarded
            if dead[row]:
                self._finish(req, DEAD_END, error="every token of the vocabulary was masked by the logits "
                                                  "processors, so no token could be sampled")
                finished.append(req)
                continue
            token = tokens[row]
            stop_by_processor = False
            for index in req.processors:
                stop_by_processor |= self.processors[index].accept(req.request_id, [token])
            if req.processors:
                finished += self._apply_processor_failures()
                if req.is_finished:
                    continue  # its token is discarded
            self._append(req, token, logprobs[row], out, row, ranks)
            reason = "stop" if stop_by_processor else None
            stop_reason = None
            if reason is None:
                reason, stop_reason = self._check_stop(req, token)
            if reason is not None:
                self._finish(req, reason, stop_reason=stop_reason)
                finished.append(req)
        return finished

    def _append(self, req: Request, token: int, logprob: float, out: SamplerOutput, row: int,
                ranks: list[int] | None) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_token_ids.append(token)
        req.sum_logprob += logprob
        k = req.params.logprobs
        if k is not None:
            entry = {token: Logprob(logprob, ranks[row], self._decode_one(token))}
            if k and out.top_ids is not None:
                for rank, (tid, lp) in enumerate(zip(out.top_ids[row, :k].tolist(), out.top_logprobs[row, :k].tolist())):
                    entry.setdefault(tid, Logprob(lp, rank + 1, self._decode_one(tid)))
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.append(entry)

    def _decode_one(self, token: int) -> str | None:
        try:
            return self.tokenizer.decode([token])
        except Exception:
            return None

    def _check_stop(self, req: Request, token: int) -> tuple[str | None, int | str | None]:
        p = req.params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:  # before min_tokens, stop conditions do not apply
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if p.stop_token_ids and token in p.stop_token_ids:
                return "stop", token
            if req.stop_decoder is not None:
                tail_from = max(len(req.stop_text) - max(len(s) for s in p.stop_strings) + 1, 0)
                req.stop_text += req.stop_decoder.push(token)
                window = req.stop_text[tail_from:]
                for stop in p.stop_strings:
                    if stop in window:
                        return "stop", stop
        elif req.stop_decoder is not None:
            req.stop_text += req.stop_decoder.push(token)
        if n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None, error: str | None = None) -> None:
        req.finish(reason, stop_reason=stop_reason, error=error)
        self.scheduler.finish_request(req)
        for index in req.processors:
            self.processors[index].remove_request(req.request_id)
        self._requests.pop(req.request_id, None)
        self._finish_text(req)
        if self.features is not None:
            self.features.hook.deepinfer_request_finished(request=req)

    def _finish_text(self, req: Request) -> None:
        ids = req.output_token_ids
        if req.finish_reason == "stop" and ids and (isinstance(req.stop_reason, int) or req.stop_reason is None) \
                and (ids[-1] in self.eos_token_ids or ids[-1] == req.stop_reason):
            ids = ids[:-1]  # the EOS / stop token is kept in token_ids but not in the text
        try:
            text = self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens) if ids else ""
        except Exception:
            text = ""
        if isinstance(req.stop_reason, str) and req.stop_reason in text:
            text = text[:text.index(req.stop_reason)]
        req.text = text

    def abort_all(self) -> None:
        """Drop every unfinished request (after an interrupt): frees their cache and processor state."""
        if self._in_flight is not None:
            step, future = self._in_flight
            self._in_flight = None
            if not step.bitmask.done():
                step.bitmask.set_result(None)
            try:
                future.result()
            except Exception:
                pass
        for req in list(self._requests.values()):
            if not req.is_finished:
                self._finish(req, "abort", error="aborted")

    # -- lifecycle --------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        return self.cache.stats()

    def shutdown(self) -> None:
        """Stop the worker thread (joined) and announce shutdown to the features. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.worker is not None:
            self.worker.shutdown()
        if self.features is not None:
            try:
                self.features.shutdown(self)
            except Exception:  # shutdown must not mask the error that caused it
                logger.exception("a feature failed during engine shutdown")

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


__all__ = ["EngineCore", "RequestStatus", "SchedulerOutput", "DEAD_END"]
