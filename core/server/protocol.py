"""Pydantic models of what crosses the server's boundary: its settings, the `/v1/completions`
request and response, the Chat Completions fields, the tokenizer routes, and the OpenAI-style error
body.

Request models are strict: a JSON value of the wrong type is refused, never converted (`true` is
not the token id 1, `"yes"` is not `stream: true`), and so is a field the server does not know
(`extra="forbid"`): every field is honoured or refused with a 400 naming it. The sampling fields
both routes take (OpenAI's and vLLM's: penalties, `logit_bias`, `top_k`, `min_p`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `n`, `seed`) are `SamplingFields`. A Chat Completions body is
checked against `ChatFields` (every accepted field listed), then deepseek-recipe validates and
renders the conversation (`chat_format.py`).
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: The request-body extension that asks for a regex or EBNF constraint (vLLM's spelling):
#: `{"structured_outputs": {"regex": "..."}}` or `{"structured_outputs": {"grammar": "..."}}`.
STRUCTURED_OUTPUTS_FIELD = "structured_outputs"


class ServerSettings(BaseModel):
    """`deepinfer serve` settings (each is a command-line flag; see docs/server.md)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    #: when set, every route but /health needs `Authorization: Bearer <api_key>`
    api_key: str | None = None
    served_model_name: str | None = None  # None: the checkpoint folder's name
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_prompt_tokens: int | None = Field(None, ge=1)  # None: the engine's max_model_len
    #: requests accepted and not finished (waiting + running); more get HTTP 429
    max_pending: int = Field(256, ge=1)
    request_timeout_s: float = Field(600.0, gt=0)
    #: a request body must arrive within this many seconds (a slow or short body gets 408)
    body_timeout_s: float = Field(30.0, gt=0)
    #: on shutdown (SIGTERM, Ctrl-C) requests still running get this many seconds before they are aborted
    shutdown_timeout_s: float = Field(5.0, ge=0)
    #: whether a chat request that does not say (`"thinking": {...}`) runs in thinking mode
    default_thinking: bool = True

    @model_validator(mode="after")
    def _key_not_blank(self) -> ServerSettings:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; give a non-empty key or leave it unset")
        return self


#: the seeds both routes accept (deepseek-recipe's chat range; 64-bit signed, non-negative)
SEED_LIMIT = 2**63


class StructuredOutputs(BaseModel):
    """The `structured_outputs` extension: exactly one of `regex` and `grammar` (EBNF)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    regex: str | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if (self.regex is None) == (self.grammar is None):
            raise ValueError("structured_outputs takes exactly one of 'regex' and 'grammar' (EBNF)")
        return self

    def so_args(self) -> dict[str, str]:
        if self.regex is not None:
            return {"schema_type": "regex", "schema": self.regex}
        return {"schema_type": "ebnf", "schema": self.grammar}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


#: the most samples (`n`, `best_of`) and alternatives per position (`logprobs`) a request may ask for
MAX_SAMPLES = 64
MAX_LOGPROBS = 20


class SamplingFields(BaseModel):
    """The sampling fields both generation routes take (OpenAI's, and vLLM's extensions), with
    OpenAI's and vLLM's ranges; `sampling_kwargs` maps them onto `SamplingParams`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are: a string) -> [-100, 100]
    # vLLM's extensions
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids (non-negative integers as strings); got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"values must be in [-100, 100]; got {value:g} for token {key}")
        return bias

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and any(t < 0 for t in ids):
            raise ValueError("token ids are non-negative integers")
        return ids

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams keywords of these fields (temperature, top_p, stop and n are the
        route's: chat resolves them with the recipe)."""
        return dict(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, top_k=self.top_k, min_p=self.min_p,
                    min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                    logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                    seq_seed=self.seed)


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: raw prompts (text, tokenised with BOS, or token ids; one or a batch),
    no chat format."""

    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("give a prompt: a string, a list of token ids, or a non-empty batch of either")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("a suffix (fill in the middle) is not supported by this model's completions; "
                             "leave it unset")
        return suffix

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed (the best samples are known only at the end); "
                             "set stream to false")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing; set echo (with logprobs, to score the prompt) or "
                             "max_tokens >= 1")
        if self.max_tokens == 0 and (self.n > 1 or (self.best_of or 1) > 1):
            raise ValueError("max_tokens 0 (score the prompt) takes one sample; leave n and best_of at 1")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt, or each of the list."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class ChatTemplateKwargs(BaseModel):
    """vLLM's `chat_template_kwargs`: DeepSeek's template reads `thinking` only."""

    model_config = ConfigDict(extra="forbid", strict=True)

    thinking: bool | None = None


class ChatFields(SamplingFields):
    """Every field a Chat Completions body may hold. The server reads the sampling fields, `n`,
    `max_completion_tokens`, `chat_template_kwargs`, `logprobs` and `structured_outputs` itself;
    deepseek-recipe validates the rest (`Any` here) and renders the conversation."""

    model: Any = None
    messages: Any = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    thinking: Any = None  # DeepSeek's {"type": "enabled" | "disabled"}
    reasoning_effort: Any = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatFields:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                             f"({self.max_completion_tokens}) differ; send one of them")
        return self


class TokenizeRequest(BaseModel):
    """`POST /tokenize` (vLLM's): a text prompt, or chat messages rendered as chat completions would."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy Completions `logprobs` object: per token its text, log-probability (None for the
    first prompt token) and top alternatives, and where its text starts."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """A response, or one streamed chunk (a final usage chunk has no choices)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deepinfer"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object; clients (the `openai` package) read `error.message`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code or kind}}


def validation_message(e: ValidationError, what: str = "invalid request") -> str:
    """pydantic's errors as one line: `what: field: problem; ...`."""
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return f"{what}: " + "; ".join(parts)
