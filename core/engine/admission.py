"""Admission: a prompt and its sampling parameters become a `Request`, or the reason they cannot.

`Admission.admit` tokenises the prompt, checks the request against the model (vocabulary,
`max_model_len`, which must hold the prompt plus one generated token, sampling values that depend
on the vocabulary) and attaches the logits processors that track it. A problem with this request
alone is returned as a message: the engine finishes the request with finish_reason "error" and
carries on (see "The contract" in docs/engine.md). Nothing is queued here.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch

from deepinfer.engine.request import Request
from deepinfer.logits_processor import LogitsProcessor, RequestRejected
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer")


class Admission:
    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int, processors: list[LogitsProcessor]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.processors = processors  # the engine's list (features add theirs once they start)

    def admit(self, prompt: Any, params: SamplingParams, request_id: str, arrival_index: int
              ) -> tuple[Request, str | None]:
        """The request, and the problem that makes it fail (None: it may be queued). When it may be
        queued, the processors that track it have taken it."""
        text, token_ids, problem = self._tokenize(prompt)
        if problem is None:
            problem = self._check(token_ids, params)
        processors: tuple[int, ...] = ()
        if problem is None:
            processors, problem = self._attach_processors(request_id, params)
        req = Request(request_id=request_id, prompt=text, prompt_token_ids=token_ids or [], params=params,
                      arrival_index=arrival_index, processors=processors,
                      prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        return req, problem

    def admit_samples(self, prompt: Any, params: SamplingParams, request_id: str, arrival_index: int
                      ) -> tuple[Request, str | None]:
        """`admit` for a request of several samples (`params.num_samples` > 1): the first member
        (returned) and the others in its `group`, each with the params of one sample (n=1, seed
        seq_seed + i), its own logits-processor state, and the others waiting to be forked from it."""
        members: list[Request] = []
        problem = None
        for i in range(params.num_samples):
            sample = params.clone(n=1, best_of=None, seq_seed=None if params.seq_seed is None else params.seq_seed + i,
                                  prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            first = members[0] if members else None
            source = prompt if first is None else {"prompt": first.prompt, "prompt_token_ids": first.prompt_token_ids}
            req, problem = self.admit(source, sample, request_id if i == 0 else f"{request_id}#{i}", arrival_index)
            req.sample_index = i
            members.append(req)
            if problem is not None:
                break
        if problem is not None:
            for m in members[:-1]:  # the ones processors took already forget it
                for index in m.processors:
                    self.processors[index].remove_request(m.request_id)
            members[0].params = params
            return members[0], problem
        for m in members:
            m.group = members
        members[0].num_returned = params.n
        members[0].fork_pending = members[1:]
        for m in members[1:]:
            m.fork_source = members[0]
        return members[0], None

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

    def _check(self, ids: list[int], params: SamplingParams) -> str | None:
        if not ids:
            return "the prompt is empty; give at least one token"
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            return (f"prompt token ids {bad[:5]}{'...' if len(bad) > 5 else ''} are outside the vocabulary "
                    f"[0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:  # as vLLM: the prompt and at least one generated token must fit
            return (f"the prompt has {len(ids)} tokens, but max_model_len={self.max_model_len} must hold the prompt "
                    f"and at least one generated token: give at most {self.max_model_len - 1} prompt tokens, or "
                    f"raise max_model_len")
        try:
            params._validate()  # the object may have been changed after it was built
        except ValueError as e:
            return str(e)
        return self._check_against_vocabulary(params)

    def _check_against_vocabulary(self, p: SamplingParams) -> str | None:
        """Values that SamplingParams cannot check alone: they depend on the model's vocabulary."""
        bad = [t for t in p.stop_token_ids or () if t >= self.vocab_size]
        if bad:
            return (f"SamplingParams.stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}); "
                    f"give ids of this model's tokens")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if k is not None and k > self.vocab_size:
                return (f"SamplingParams.{name}={k} asks for more tokens than the vocabulary has "
                        f"({self.vocab_size}); give at most {self.vocab_size}")
        bad = [t for t in p.logit_bias or () if t >= self.vocab_size]
        if bad:
            return (f"SamplingParams.logit_bias names token ids {sorted(bad)[:5]} outside the vocabulary "
                    f"[0, {self.vocab_size}); give ids of this model's tokens")
        return None

    def _attach_processors(self, request_id: str, params: SamplingParams) -> tuple[tuple[int, ...], str | None]:
        """(indices of the processors that track the request, problem). A processor that rejects
        the request, or raises while taking it, fails this request alone; the ones that took it
        before are told to forget it."""
        taken: list[int] = []
        for index, processor in enumerate(self.processors):
            try:
                if processor.add_request(request_id, params):
                    taken.append(index)
            except Exception as e:  # a request the feature cannot take fails alone
                for i in taken:
                    self.processors[i].remove_request(request_id)
                if isinstance(e, RequestRejected):
                    return (), str(e)
                logger.debug("logits processor %s failed to admit request %s", type(processor).__name__,
                             request_id, exc_info=True)
                return (), f"the {type(processor).__name__} could not take this request: {type(e).__name__}: {e}"
        if params.so_args and not taken:
            return (), ("so_args needs the structured_output feature, which is not enabled on this engine "
                        "(it needs a back end with token-bitmask support)")
        return tuple(taken), None


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
