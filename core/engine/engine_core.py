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

Speculative decoding (a draft proposer from the `draft_proposer` slot, `self.speculator`): before
scheduling, the speculator may trim each decode's drafts (variable-length verification); a decode
verifies its drafts in the step's one forward; `_update` applies the emitted tokens (accepted
drafts plus one), sets the sequence length back over the rejected drafts and stores the next
drafts, cut to the prefix the request's grammar allows. With the async pipeline, a request with a
step in flight waits for it (its next input depends on the acceptance), so the pipeline overlaps
different requests' steps instead.
"""
from __future__ import annotations

import itertools
import logging
import operator
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
        self.worker: StepWorker | None = None
        self._in_flight: tuple[PreparedStep, Future] | None = None
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._requests: dict[str, Request] = {}
        self._failures: dict[str, tuple[str, str]] = {}
        self.num_steps = 0
        # Engine-thread time: in step() in all, and blocked on the forward + sampling (running it in
        # sync mode, waiting for the worker in async mode). The difference is host work.
        self.step_seconds = 0.0
        self.wait_seconds = 0.0
        self._closed = False
        self.speculator: Any = None  # speculative decoding (the draft_proposer slot), see _update
        if features is not None:
            features.start(self)
            self.processors = list(features.processors)
            self.speculator = features.draft_proposer
            self.runner.speculator = self.speculator
            self.scheduler.speculative = self.speculator is not None
        if async_pipeline:  # last: nothing above can leave a thread behind when it fails
            self.worker = StepWorker(self.runner)

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
                ids, problem = as_token_ids(prompt["prompt_token_ids"], "prompt_token_ids")
                return prompt.get("prompt"), ids, problem
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                return None, None, 'a prompt dict needs the key "prompt_token_ids" (or "prompt")'
        if isinstance(prompt, str):
            if not prompt:
                return prompt, [], "the prompt is empty; give at least one token"
            problem = _unicode_problem(prompt)
            if problem is not None:
                return prompt, None, problem
            try:
                add_bos = getattr(self.tokenizer, "bos_token_id", None) is not None
                return prompt, self.tokenizer.encode(prompt, add_bos=add_bos), None
            except (ValueError, TypeError) as e:
                return prompt, None, str(e)
        if isinstance(prompt, (list, tuple)) or _is_array(prompt):
            ids, problem = as_token_ids(prompt, "the prompt")
            return None, ids, problem
        return None, None, (f"a prompt must be a string, a list of token ids or a dict with "
                            f'"prompt_token_ids"; got {type(prompt).__name__}')

    def _check(self, req: Request) -> str | None:
        ids = req.prompt_token_ids
        if not ids:
            return "the prompt is empty; give at least one token"
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
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
        return self._check_against_vocabulary(req.params)

    def _check_against_vocabulary(self, p: SamplingParams) -> str | None:
        """Values that SamplingParams cannot check alone: they depend on the model's vocabulary."""
        bad = [t for t in p.stop_token_ids or () if t >= self.vocab_size]
        if bad:
            return (f"SamplingParams.stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}); "
                    f"give ids of this model's tokens")
        if p.logprobs is not None and p.logprobs > self.vocab_size:
            return (f"SamplingParams.logprobs={p.logprobs} asks for more tokens than the vocabulary has "
                    f"({self.vocab_size}); give at most {self.vocab_size}")
        return None

    def _attach_processors(self, req: Request) -> str | None:
        for index, processor in enumerate(self.processors):
            try:
                if processor.add_request(req.request_id, req.params):
                    req.processors.append(index)
            except Exception as e:  # a request the feature cannot take fails alone
                for i in req.processors:
                    self.processors[i].remove_request(req.request_id)
                req.processors.clear()
                if isinstance(e, RequestRejected):
                    return str(e)
                logger.debug("logits processor %s failed to admit request %s", type(processor).__name__,
                             req.request_id, exc_info=True)
                return f"the {type(processor).__name__} could not take this request: {type(e).__name__}: {e}"
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
        step_start = time.perf_counter()
        finished: list[Request] = []
        if self.speculator is not None:  # how many drafts each decode verifies this step
            self.speculator.plan([r for r in self.scheduler.running if r.draft_token_ids and not r.num_pending_tokens])
        sched = self.scheduler.schedule()
        prev = self._in_flight
        current: PreparedStep | None = None
        if not sched.is_empty:
            current = self.runner.prepare(sched, prev[0] if prev else None)
            self.num_steps += 1
        if self.worker is not None:
            self._in_flight = (current, self.worker.submit(current)) if current is not None else None
            if prev is not None:
                waited = time.perf_counter()
                out = prev[1].result()
                self.wait_seconds += time.perf_counter() - waited
                finished += self._update(prev[0], out)
            if current is not None:
                self._fill_bitmask(current, finished)
        elif current is not None:
            self._fill_bitmask(current, finished)
            waited = time.perf_counter()
            out = self.runner.execute(current)
            self.wait_seconds += time.perf_counter() - waited
            finished += self._update(current, out)
        if current is None and prev is None and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not schedule any request although some are unfinished; "
                               "this is a bug (cache pool smaller than one request?)")
        if self.features is not None:
            self.features.hook.deepinfer_step_end(scheduler_output=sched,
                                                  finished_request_ids=[r.request_id for r in finished])
        self.step_seconds += time.perf_counter() - step_start
        return finished

    def _fill_bitmask(self, step: PreparedStep, finished: list[Request]) -> None:
        if not step.needs_bitmask:
            return
        try:
            words = -(-self.vocab_size // 32)
            rows = step.sampling.num_rows  # one per sampled request, plus one per draft
            combined = torch.full((rows, words), -1, dtype=torch.int32)
            for index, processor in enumerate(self.processors):
                mine = [(i, s) for i, s in enumerate(step.sample_rows)
                        if index in s.request.processors and not s.request.is_finished]
                if not mine:
                    continue
                drafts = [s.draft_token_ids for _, s in mine]
                part = torch.full((sum(1 + len(d) for d in drafts), words), -1, dtype=torch.int32)
                if any(drafts):  # a row after each draft too: the mask if the drafts before it pass
                    processor.fill_bitmask([s.request_id for _, s in mine], part, drafts)
                else:
                    processor.fill_bitmask([s.request_id for _, s in mine], part)
                combined[[step.logits_starts[i] + k for i, s in mine for k in range(1 + len(s.draft_token_ids))]] &= part
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
        outcomes: list[tuple[int, int]] = []  # (drafts verified, drafts accepted) per verification
        for index, s in enumerate(step.sample_rows):
            req = s.request
            req.num_pending_tokens -= 1
            if req.is_finished:
                continue  # finished by an earlier step; its tokens are discarded
            start = step.logits_starts[index]
            num_drafts = len(s.draft_token_ids)
            # a verification emits the accepted drafts and one more token; its later rows are -1
            for row in range(start, start + num_drafts + 1):
                if tokens[row] < 0 and not dead[row]:
                    break
                if self._apply_token(req, row, tokens, logprobs, dead, out, ranks, finished):
                    break  # the request finished; the rest is discarded
            if self.speculator is not None:
                emitted = sum(1 for t in tokens[start:start + num_drafts + 1] if t >= 0)
                self._after_verification(step, s, max(emitted - 1, 0), outcomes)
        if outcomes:
            self.speculator.stats.record_step(outcomes)
        return finished

    def _apply_token(self, req: Request, row: int, tokens: list[int], logprobs: list[float], dead: list[bool],
                     out: SamplerOutput, ranks: list[int] | None, finished: list[Request]) -> bool:
        """Apply one sampled (or accepted draft) token; True when the request finished."""
        if dead[row]:
            self._finish(req, DEAD_END, error="every token of the vocabulary was masked by the logits "
                                              "processors, so no token could be sampled")
            finished.append(req)
            return True
        token = tokens[row]
        stop_by_processor = False
        for index in req.processors:
            stop_by_processor |= self.processors[index].accept(req.request_id, [token])
        if req.processors:
            finished += self._apply_processor_failures()
            if req.is_finished:
                return True  # its token is discarded
        self._append(req, token, logprobs[row], out, row, ranks)
        reason = "stop" if stop_by_processor else None
        stop_reason = None
        if reason is None:
            reason, stop_reason = self._check_stop(req, token)
        if reason is not None:
            self._finish(req, reason, stop_reason=stop_reason)
            finished.append(req)
            return True
        return False

    def _after_verification(self, step: PreparedStep, s, accepted: int, outcomes: list[tuple[int, int]]) -> None:
        """Speculative decoding: statistics, rollback of the rejected drafts' positions, next drafts.

        The model's state of a rejected draft's position needs no undo: the sequence length is set
        back and the next step overwrites it (the cache rings hold `max_rollback` extra positions).
        Logits processors never saw the rejected drafts (they accept emitted tokens only), and the
        draft proposer restarts from the committed length at every step."""
        req = s.request
        num_drafts = len(s.draft_token_ids)
        if s.is_decode:
            outcomes.append((num_drafts, accepted))
            req.num_drafts_verified += num_drafts
            req.num_drafts_accepted += accepted
        req.draft_token_ids, req.draft_state = [], None
        if req.is_finished or req.status is not RequestStatus.RUNNING:
            return  # finished, or preempted while this step ran (its state is recomputed)
        req.num_computed_tokens = s.context_len + s.query_len - num_drafts + accepted
        drafts = step.drafts.get(req.request_id)
        if drafts is not None and drafts.token_ids:
            req.draft_token_ids = drafts.token_ids[:self._valid_draft_prefix(req, drafts.token_ids)]
            req.draft_state = drafts

    def _valid_draft_prefix(self, req: Request, drafts: list[int]) -> int:
        """Leading drafts every logits processor of the request allows: a draft its grammar rejects
        can never be accepted, so it is not worth verifying."""
        n = len(drafts)
        for index in req.processors:
            check = getattr(self.processors[index], "count_valid_draft", None)
            if check is not None and n:
                n = min(n, check(req.request_id, drafts[:n]))
        return n

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
        """Drop every unfinished request (after an interrupt): frees their cache and processor state.

        Does not wait for a step still running on the worker: its results are dropped, and any later
        step runs after it (the worker is serial), so reusing the freed cache is safe."""
        if self._in_flight is not None:
            step, _ = self._in_flight
            self._in_flight = None
            if not step.bitmask.done():
                step.bitmask.set_result(None)  # let it finish without a mask; nobody reads its tokens
        for req in list(self._requests.values()):
            if not req.is_finished:
                self._finish(req, "abort", error="aborted")

    # -- lifecycle --------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        return self.cache.stats()

    @property
    def spec_stats(self) -> Any:
        """Speculative-decoding totals (accepted length, verified drafts per step, acceptance by
        position), or None without speculative decoding."""
        return None if self.speculator is None else self.speculator.stats

    def shutdown(self, wait: bool = True) -> None:
        """Stop the worker thread (joined unless wait=False) and announce shutdown to the features.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.worker is not None:
            self.worker.shutdown(wait=wait)
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


def _is_array(value: Any) -> bool:
    """A numpy array or a torch tensor (numpy is not imported for the check)."""
    return isinstance(value, torch.Tensor) or type(value).__module__ == "numpy"


def as_token_ids(value: Any, what: str) -> tuple[list[int] | None, str | None]:
    """`value` as a list of Python ints: a list/tuple of ints (numpy integer scalars included) or a
    1-D integer numpy array / torch tensor; else (None, the problem)."""
    if _is_array(value):
        kind = str(value.dtype)
        if getattr(value, "ndim", None) != 1:
            return None, f"{what} must be one-dimensional; got an array of shape {tuple(value.shape)}"
        if "int" not in kind:
            return None, f"{what} must hold integer token ids; got an array of dtype {kind}"
        return [int(t) for t in value.tolist()], None
    if not isinstance(value, (list, tuple)):
        return None, f"{what} must be a list of integer token ids; got {type(value).__name__}"
    ids = []
    for position, token in enumerate(value):
        if isinstance(token, bool):
            index = None
        else:
            try:
                index = operator.index(token)
            except TypeError:
                index = None
        if index is None:
            return None, (f"{what} must hold integer token ids; the one at position {position} is "
                          f"{token!r} ({type(token).__name__})")
        ids.append(index)
    return ids, None


def _unicode_problem(text: str) -> str | None:
    """A string the tokenizer cannot take: one with lone surrogates (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"the prompt is not valid Unicode text: it contains a lone surrogate ({text[e.start]!r}) at "
                f"character {e.start}; decode the input with errors='replace', or pass token ids")
    return None


__all__ = ["EngineCore", "RequestStatus", "SchedulerOutput", "DEAD_END"]
