"""Per-request sampling settings (vLLM-compatible names, plus DeepInfer's `seq_seed` and `so_args`).

Every value is checked when the object is built: a bad value raises `ValueError` naming the field,
the value and the valid range, before any request runs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

_SCHEMA_TYPES = ("regex", "json", "ebnf")
# Temperatures below this sample greedily: dividing fp32 logits by a smaller one overflows (1e-39
# is 0 in fp32) and would turn the row's probabilities into NaN.
GREEDY_TEMPERATURE = 1e-5
#: the range of presence and frequency penalties (OpenAI's and vLLM's) and of logit_bias values
PENALTY_RANGE = 2.0
LOGIT_BIAS_RANGE = 100.0


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature: 0 means greedy (argmax); > 0 scales the logits before sampling (below 1e-5 it
        is greedy too: such a division overflows).
    top_p: nucleus sampling, 0 < top_p <= 1 (1 = off).
    top_k: keep the k most likely tokens; 0 or -1 = off.
    min_p: drop tokens whose probability is below min_p × the top token's; 0 = off.
    max_tokens: most tokens to generate (finish_reason "length" when reached); 0 only with
        `prompt_logprobs` (score the prompt, generate nothing).
    min_tokens: EOS and stop tokens are suppressed until this many tokens were generated.
    stop: strings that end the output (the stop string itself is not included in `text`).
    stop_token_ids: token ids that end the output (the token is kept in `token_ids`).
    ignore_eos: keep generating after the EOS token (up to max_tokens).
    logprobs: also return the log-probabilities of this many most likely tokens per position
        (plus the sampled one); None = off, 0 = the sampled token only.
    prompt_logprobs: also return the log-probability of each prompt token after the tokens before
        it (the first has none), with this many most likely alternatives; None = off.
    presence_penalty: subtracted from the logit of every token generated so far, in [-2, 2].
    frequency_penalty: subtracted once per time a token was generated so far, in [-2, 2].
    repetition_penalty: the logit of a token in the prompt or generated so far is divided by it
        when positive, multiplied by it when negative; 1 = off, > 1 discourages repeats.
    logit_bias: {token id: value in [-100, 100]} added to those tokens' logits before sampling.
    n: completions returned for the prompt.
    best_of: completions generated (>= n; default n); the n with the highest mean log-probability
        per token are returned. The prompt is prefilled once and its state copied to each sample.
    seq_seed: seed of this request's sampling; the same seed gives the same tokens whatever the
        request is batched with. With several samples (n, best_of), sample i uses seq_seed + i.
    so_args: structured-output constraint `{"schema_type": "regex"|"json"|"ebnf", "schema": str}`
        (a JSON schema may also be a dict),
        interpreted by the structured-output feature.
    skip_special_tokens: leave special/control tokens out of `text`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    n: int = 1
    best_of: int | None = None
    seq_seed: int | None = None
    so_args: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {rule}")

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_num(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if not is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]; 1 disables nucleus sampling")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 1, or 0 / -1 to disable it")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]; 0 disables it")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be None or an integer >= 0 (number of top tokens per prompt position)")
        if not is_int(self.max_tokens) or self.max_tokens < 0:
            raise bad("max_tokens", "must be an integer >= 1")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise bad("max_tokens", "must be an integer >= 1; 0 (generate nothing) needs prompt_logprobs, "
                                    "to score the prompt")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be None or an integer >= 0 (number of top tokens to return)")
        if self.seq_seed is not None and not is_int(self.seq_seed):
            raise bad("seq_seed", "must be None or an integer")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise bad(name, f"must be a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]; 0 disables it")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a finite number > 0; 1 disables it")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_int(t) and t >= 0 and is_num(v) and -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE
                    for t, v in self.logit_bias.items()):
                raise bad("logit_bias", f"must map non-negative integer token ids to numbers in "
                                        f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            raise bad("best_of", f"must be None or an integer >= n={self.n}")
        if self.max_tokens == 0 and self.num_samples > 1:
            raise bad("max_tokens", "0 (score the prompt only) takes one sample; leave n and best_of at 1")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be True or False")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", "must be True or False")

        if self.stop is None:
            stops: list[str] = []
        elif isinstance(self.stop, str):
            stops = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            stops = list(self.stop)
        else:
            raise bad("stop", "must be a string, a list of strings, or None")
        if any(s == "" for s in stops):
            raise bad("stop", "stop strings must not be empty")
        self._stop_list = stops

        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
                raise bad("stop_token_ids", "must be a list of non-negative integer token ids, or None")
            self.stop_token_ids = list(ids)

        if self.so_args is not None:
            so = self.so_args
            if not isinstance(so, dict) or set(so) != {"schema_type", "schema"}:
                raise bad("so_args", 'must be a dict with exactly the keys "schema_type" and "schema"')
            if so["schema_type"] not in _SCHEMA_TYPES:
                raise bad("so_args", f'schema_type must be one of {", ".join(_SCHEMA_TYPES)}')
            json_dict = so["schema_type"] == "json" and isinstance(so["schema"], dict) and so["schema"]
            if not json_dict and (not isinstance(so["schema"], str) or not so["schema"]):
                raise bad("so_args", "schema must be a non-empty string (for json: json.dumps(schema), or a dict)")
            if json_dict:
                try:
                    json.dumps(so["schema"])
                except (TypeError, ValueError) as e:
                    raise bad("so_args", f"the JSON schema dict cannot be serialised to JSON ({e})") from None

    # -- derived values used by the engine ------------------------------------------------------

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def num_samples(self) -> int:
        """Completions generated: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def adjusts_logits(self) -> bool:
        """A penalty or a logit bias changes this request's logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def effective_top_k(self) -> int:
        """0 when top-k is off (the user may write -1 or 0)."""
        return max(self.top_k, 0)

    def clone(self, **changes: Any) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        values.update(changes)
        return SamplingParams(**values)
