"""The deepseek-recipe adapter: Chat Completions requests in, prompt token ids and sampling settings
out; generated token ids in, Chat Completions chunks (text, reasoning, parsed tool calls) out.

Everything about DeepSeek's chat format comes from two libraries and nothing is written here by
hand: deepseek-recipe renders the request into the V4 or V4.1 prompt (`DeepseekV4Encoding` /
`DeepseekV41Encoding`), resolves the sampling values, and parses the output stream; xgrammar's
built-in DeepSeek structural tags (`deepseek_v4`, `deepseek_v4_1`) turn the output constraint the
recipe reports (JSON schema, regex, tool calls) into a grammar, handed to the structured-output
feature as EBNF (`so_args`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from deepinfer.json_schema_support import unsupported_keyword
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.protocol import STRUCTURED_OUTPUTS_FIELD, ChatFields, SamplingFields, validation_message

# config.json model_type -> (recipe ModelVersion, recipe encoding class, xgrammar structural-tag key)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "deepseek_v4": ("DeepseekV4Pro", "DeepseekV4Encoding", "deepseek_v4"),
    "deepseek_v41": ("DeepseekV41Flash", "DeepseekV41Encoding", "deepseek_v4_1"),
}

#: the longest run of whitespace a tool-call grammar allows between its markers
MAX_WHITESPACE = 2


class RequestError(Exception):
    """A request the server refuses: HTTP `status` and the message for the client."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def import_recipe():
    """deepseek_recipe, or a start-up error that says how to install it."""
    try:
        import deepseek_recipe
    except ImportError as e:
        raise RuntimeError(
            "deepinfer serve renders and parses DeepSeek chat messages with the package 'deepseek-recipe', "
            f"which cannot be imported ({e}); install it with `pip install 'deepinfer[serve]'` "
            "(or `pip install deepseek-recipe`)") from None
    return deepseek_recipe


#: the protocols the recipe converts: name -> (its request class, its response class)
PROTOCOLS = {"chat": ("ChatCompletionRequest", "ChatCompletionResponse"),
             "responses": ("ResponsesRequest", "ResponsesResponse"),
             "messages": ("MessagesRequest", "MessagesResponse")}


def tokenizer_file(tokenizer: Any) -> str | None:
    """The tokenizer.json behind an engine's tokenizer, None when the engine has no text tokenizer."""
    return getattr(tokenizer, "source", None) if getattr(tokenizer, "has_text", False) else None


@dataclass
class PreparedChat:
    """One chat request (Chat Completions, Responses or Messages) made ready for the engine."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    conversation_request: Any  # the recipe's ConversationRequest (parsing options, chunk generator)
    protocol: str = "chat"
    #: Responses: the settings its responses report, and its namespace tools (read before conversion)
    responses_echo: Any = None
    namespace_tools: dict[str, tuple[str, str]] | None = None


class ChatFormat:
    """Chat rendering and parsing for one served model.

    `unavailable` is None when chat works, else the reason (the model family has no DeepSeek
    encoding, the engine has no tokenizer file, or the tokenizer lacks a special token the encoding
    needs); `/v1/chat/completions` then answers 503 with it while `/v1/completions` keeps working.
    """

    def __init__(self, *, model_type: str, tokenizer_file: str | None, served_model_name: str,
                 max_model_len: int, default_thinking: bool = True):
        self.dr = import_recipe()
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.unavailable: str | None = None
        if model_type not in FAMILIES:
            self.unavailable = (f"chat needs a DeepSeek-V4 or V4.1 checkpoint; this one is {model_type!r} "
                                f"(use /v1/completions)")
            return
        version, encoding, self.tag_key = FAMILIES[model_type]
        self.version = getattr(self.dr.ModelVersion, version)
        # only the served name is accepted, so a request cannot pick the other family's encoding
        self.options = self.dr.ConversionOptions(default_thinking_mode=default_thinking) \
            .with_model_versions_by_name({served_model_name: self.version})
        if not tokenizer_file:
            self.unavailable = "chat needs the model's tokenizer.json, and this engine runs without a tokenizer"
            return
        self.tokenizer = self.dr.Tokenizer.from_file(str(tokenizer_file))
        self.encoding = getattr(self.dr, encoding)().with_tokenizer(self.tokenizer)
        try:  # a V4.1 encoding over a V4 tokenizer fails here (no <｜System｜> token), not per request
            self.encoding.encode(self.dr.Conversation([self.dr.UserMessage("hello")]))
        except RuntimeError as e:
            self.unavailable = (f"the tokenizer {tokenizer_file} cannot encode the {model_type} chat format ({e}); "
                                f"serve the checkpoint with the tokenizer of its release")

    # -- requests ---------------------------------------------------------------------------------

    def prepare(self, body: dict[str, Any]) -> PreparedChat:
        """Render, encode and map one request body; RequestError (4xx) for a bad request."""
        if self.unavailable is not None:
            raise RequestError(503, self.unavailable, "unavailable")
        try:
            fields = ChatFields.model_validate(body)
        except ValidationError as e:
            raise RequestError(400, validation_message(e)) from None
        extension = fields.structured_outputs
        if extension is not None and (body.get("response_format") or body.get("tools")):
            raise RequestError(400, f"give {STRUCTURED_OUTPUTS_FIELD} or response_format / tools, not both")
        include_usage = fields.stream_options is not None and fields.stream_options.include_usage
        req = self._convert(self.dr.ChatCompletionRequest(self._recipe_body(body, fields)))
        return self._for_engine(req, body, fields, include_usage)

    def prepare_protocol(self, protocol: str, body: dict[str, Any]) -> PreparedChat:
        """A Responses (`protocol` "responses") or Anthropic Messages ("messages") request body,
        converted by the recipe; RequestError (4xx) for a bad request."""
        if self.unavailable is not None:
            raise RequestError(503, self.unavailable, "unavailable")
        request = getattr(self.dr, PROTOCOLS[protocol][0])(body)
        echo = namespace = None
        if protocol == "responses":
            try:
                echo, namespace = request.echo(), request.namespace_tool_map(self.options)
            except self.dr.ConversionError as e:
                raise RequestError(400, _recipe_message(e)) from None
        req = self._convert(request)
        top_k = body.get("top_k") if protocol == "messages" else None  # Anthropic's; the recipe leaves it
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0):
            raise RequestError(400, f"top_k: must be a non-negative integer; got {top_k!r}")
        fields = SamplingFields(top_k=top_k or 0)
        prepared = self._for_engine(req, {}, fields, include_usage=True)
        prepared.protocol, prepared.responses_echo, prepared.namespace_tools = protocol, echo, namespace
        return prepared

    def _convert(self, request: Any) -> Any:
        try:
            return request.convert(self.options)
        except self.dr.ConversionError as e:
            raise RequestError(e.status_code if 400 <= e.status_code < 500 else 400, _recipe_message(e)) from None
        except ValueError as e:  # malformed body
            raise RequestError(400, str(e)) from None

    def _for_engine(self, req: Any, body: dict[str, Any], fields: SamplingFields, include_usage: bool
                    ) -> PreparedChat:
        """The engine's prompt and SamplingParams of a converted request (`fields`: the sampling
        fields the server reads itself; `body`: the request, for its schemas)."""
        extension = getattr(fields, STRUCTURED_OUTPUTS_FIELD, None)
        try:
            ids = self.encoding.encode(req.conversation)
            max_tokens = req.resolve_max_tokens(len(ids), self.max_model_len)
        except self.dr.ConversionError as e:
            raise RequestError(400, _recipe_message(e)) from None
        except RuntimeError as e:
            raise RequestError(400, f"the conversation cannot be encoded: {e}") from None
        opts = req.inference_options
        thinking = req.parsing_options.thinking_initial_stage is not None
        so_args = extension.so_args() if extension is not None else None
        if thinking and so_args is not None:  # the constraint applies after the reasoning
            so_args = self._answer_after_reasoning(so_args)
        if opts.output_constraint is not None:
            so_args = self._so_args(opts.output_constraint, thinking, req.conversation,
                                    parallel=getattr(fields, "parallel_tool_calls", None) is not False, body=body)
        stop = list(req.parsing_options.stop_sequences) or None
        # the request's own values; unset, the recipe's (DeepSeek's defaults for the model and mode)
        temperature = fields.temperature if fields.temperature is not None else opts.temperature
        top_p = fields.top_p if fields.top_p is not None else opts.top_p
        try:
            params = SamplingParams(temperature=temperature if temperature is not None else 1.0,
                                    top_p=top_p if top_p is not None else 1.0, max_tokens=max_tokens, stop=stop,
                                    so_args=so_args, n=fields.n,
                                    logprobs=(opts.top_logprobs or 0) if opts.logprobs else None,
                                    **{**fields.sampling_kwargs(), "seq_seed": opts.seed})
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        return PreparedChat(ids, params, bool(req.stream), include_usage, req)

    @staticmethod
    def _recipe_body(body: dict[str, Any], fields: ChatFields) -> dict[str, Any]:
        """The body deepseek-recipe converts: without the fields the server handles itself, with
        `max_completion_tokens` as `max_tokens` and vLLM's `chat_template_kwargs.thinking` as
        DeepSeek's `thinking`."""
        own = set(SamplingFields.model_fields) - {"temperature", "top_p", "stop", "seed"}
        out = {k: v for k, v in body.items()
               if k not in own | {STRUCTURED_OUTPUTS_FIELD, "max_completion_tokens", "chat_template_kwargs"}}
        if fields.max_completion_tokens is not None:
            out["max_tokens"] = fields.max_completion_tokens
        wanted = fields.chat_template_kwargs.thinking if fields.chat_template_kwargs is not None else None
        if wanted is not None:
            kind = "enabled" if wanted else "disabled"
            given = body.get("thinking")
            if given is not None and (not isinstance(given, dict) or given.get("type") != kind):
                raise RequestError(400, f"chat_template_kwargs.thinking={str(wanted).lower()} contradicts "
                                        f"thinking={json.dumps(given)}; send one of them")
            out["thinking"] = {"type": kind}
        return out

    def _so_args(self, constraint: Any, thinking: bool, conversation: Any, parallel: bool = True,
                 body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The grammar of the recipe's output constraint. The recipe renders the prompt from a
        normalised schema (a strict one loses `maxLength`, `minItems`, `const`, ...); the grammar is
        compiled from the request's own schemas, whole, and a keyword it cannot enforce is a 400."""
        body = body or {}
        kind, schema = constraint.kind, constraint.schema
        if kind == "json" and schema:
            schema = _request_schema(body) or schema
            _check_schema(json.loads(schema), "response_format.json_schema.schema")
        if kind in ("json", "regex"):
            so = {"schema_type": kind, "schema": schema or json.dumps({"type": "object"})}
            return self._answer_after_reasoning(so) if thinking else so
        if kind not in ("tool_call", "tool_call_required"):
            raise RequestError(400, f"output constraint {kind!r} is not supported")
        from xgrammar.builtin_structural_tag import get_model_structural_tag
        from xgrammar.structural_tag import ConstStringFormat, SequenceFormat

        tools = _with_request_parameters(json.loads(schema), body.get("tools"))
        choice = "auto" if kind == "tool_call" else "required"
        # whitespace runs are bounded, as the structured-output feature bounds them in JSON: a
        # model must not be able to loop on blanks between the tool-call markers
        tag = get_model_structural_tag(self.tag_key, tools=tools, tool_choice=choice,
                                       reasoning="enabled" if thinking else "disabled",
                                       max_whitespace_cnt=MAX_WHITESPACE, parallel_tool_calls=parallel)
        if kind == "tool_call_required":
            # the recipe's prompt already opened the tool-call block (its parser starts inside it):
            # the grammar's leading literal, which writes that opening, must not be generated again
            fmt = tag.format
            opening = fmt.elements[0] if isinstance(fmt, SequenceFormat) and fmt.elements else None
            prompt_text = self.encoding.render_conversation(conversation).prompt
            if not isinstance(opening, ConstStringFormat) or not prompt_text.endswith(opening.value):
                raise RuntimeError("the recipe's required-tool prompt does not end with the tool-call opening "
                                   "xgrammar's DeepSeek tag writes; the two libraries disagree")
            tag = tag.model_copy(update={"format": SequenceFormat(elements=fmt.elements[1:])})
        return _ebnf(tag)

    def _answer_after_reasoning(self, so_args: dict[str, Any]) -> dict[str, Any]:
        """In thinking mode the output is reasoning, `</think>`, then the answer: the constraint
        goes after xgrammar's DeepSeek reasoning block."""
        from xgrammar.builtin_structural_tag import get_model_structural_tag
        from xgrammar.structural_tag import GrammarFormat, JSONSchemaFormat, RegexFormat, SequenceFormat

        kind, schema = so_args["schema_type"], so_args["schema"]
        answer = (JSONSchemaFormat(json_schema=json.loads(schema) if isinstance(schema, str) else schema)
                  if kind == "json" else RegexFormat(pattern=schema) if kind == "regex"
                  else GrammarFormat(grammar=schema))
        tag = get_model_structural_tag(self.tag_key, tools=[], reasoning="enabled")
        reasoning = tag.format.elements[0]
        return _ebnf(tag.model_copy(update={"format": SequenceFormat(elements=[reasoning, answer])}))

    # -- output -----------------------------------------------------------------------------------

    def output(self, prepared: PreparedChat, request_id: str, tokenizer: Any, index: int = 0) -> ChatOutput:
        """The output parser of one sample (`index`) of a request; `tokenizer` is the engine's
        (text for the parser). With logprobs the parser is fed token ids and their log-probabilities
        and decodes them with the recipe's tokenizer."""
        request_cls = getattr(self.dr, PROTOCOLS[prepared.protocol][0])
        gen = request_cls.chunk_generator(prepared.conversation_request, request_id, self.served_model_name)
        if prepared.responses_echo is not None:
            gen = gen.with_echo(prepared.responses_echo)
        if prepared.namespace_tools:
            gen = gen.with_namespace_tool_map(prepared.namespace_tools)
        with_logprobs = prepared.params.logprobs is not None
        processor = self.dr.StreamProcessor(gen, prepared.conversation_request.parsing_options,
                                            self.tokenizer if with_logprobs else None)
        cls = ChatOutput if prepared.protocol == "chat" else EventOutput
        return cls(self.dr, processor, request_id, self.served_model_name, prepared, tokenizer, index)


class ChatOutput:
    """One sample's output parser: token ids in, Chat Completions chunks out (as JSON text when
    streaming; accumulated into one response otherwise).

    Without logprobs the parser is fed text with its token count, not token ids: given ids, the
    recipe counts `completion_tokens` per decoded piece, so ids that end inside a UTF-8 character
    are not counted. Text is decoded incrementally (held back inside a character); at the end the
    rest of the full decode is sent, so the parser sees exactly `decode(all ids)` (special tokens
    such as EOS left out; DeepSeek's chat and tool markers are not special and stay in). With
    logprobs it is fed the ids with their log-probabilities. Either way the usage reported is the
    engine's count of generated tokens.

    Streaming, usage is never inside a content chunk: with `stream_options.include_usage` it comes
    in a last chunk with no choices (`usage_chunk`), as OpenAI sends it. Sample `index` is the
    choice index of every chunk (several samples: `n`)."""

    def __init__(self, dr: Any, processor: Any, request_id: str, model: str, prepared: PreparedChat,
                 tokenizer: Any, index: int = 0):
        self.dr = dr
        self.processor = processor
        self.prepared = prepared
        self.tokenizer = tokenizer
        self.index = index
        self.top_logprobs = prepared.params.logprobs
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=True)
        self.token_ids: list[int] = []
        self.sent_text = ""
        self.uncounted = 0  # tokens whose text the parser has not been given yet
        self.closed = False
        self.usage: dict[str, Any] | None = None  # the recipe's, from the last chunk that carried it
        self.model, self.request_id, self.created = model, request_id, int(time.time())
        n = len(prepared.prompt_token_ids)
        self.response_cls = getattr(dr, PROTOCOLS[prepared.protocol][1])
        self.response = None if prepared.stream else self.response_cls(request_id, model, self.created, n, 0)
        # the role chunk, sent with the first tokens
        self._first = self._emit(processor.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=n))))

    def _emit(self, chunks: list[Any]) -> list[str]:
        if self.response is not None:
            for c in chunks:
                self.response.accumulate(c)
            return []
        out = []
        for c in chunks:
            data = json.loads(c.to_json())
            if data.get("usage") is not None:
                self.usage = data["usage"]
            data["usage"] = None
            for choice in data.get("choices", []):
                choice["index"] = self.index
            if data.get("choices"):
                out.append(_dumps(data))
        return out

    def _with_first(self, chunks: list[str]) -> list[str]:
        first, self._first = self._first, []
        return first + chunks

    def _text(self, text: str) -> list[Any]:
        if self.processor.finished:  # it saw a stop sequence: the rest of the output is dropped
            return []
        n, self.uncounted = self.uncounted, 0
        self.sent_text += text
        return self.processor.push(self.dr.InferenceChunk.text(text, n))

    def push(self, token_ids: list[int], logprobs: list[dict[int, Any]] | None = None) -> list[str]:
        self.token_ids += token_ids
        if self.top_logprobs is not None:
            if not token_ids or self.processor.finished:
                return self._with_first([])
            entries = [(entry[t].logprob, _top(entry, self.top_logprobs)) for t, entry in zip(token_ids, logprobs)]
            return self._with_first(self._emit(self.processor.push(self.dr.InferenceChunk.tokens(token_ids, entries))))
        self.uncounted += len(token_ids)
        text = self.decoder.push(token_ids) if token_ids else ""
        return self._with_first(self._emit(self._text(text) if text else []))

    def finish(self, reason: str) -> list[str]:
        chunks = []
        if self.top_logprobs is None:
            full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            # the incremental text is a prefix of the full decode, bar bytes it held back that
            # decode to replacement characters; send whatever the parser has not seen
            rest = full[len(self.sent_text):] if full.startswith(self.sent_text) else ""
            chunks = self._text(rest) if rest or self.uncounted else []
        fr = self.dr.InferenceFinishReason.Length if reason == "length" else self.dr.InferenceFinishReason.Stop
        if not self.processor.finished:
            chunks += self.processor.push(self.dr.InferenceChunk.finish(fr)) + self.processor.finish()
        return self._with_first(self._emit(chunks))

    def push_delta(self, delta: Any) -> list[str]:
        return self.push(delta.token_ids, delta.logprobs)

    def close(self) -> None:
        """Release the parser (idempotent; nothing to do once it finished)."""
        if not self.processor.finished and not self.closed:
            self.processor.close()
        self.closed = True

    def choice(self) -> dict[str, Any]:
        """The accumulated choice (not streaming), with this sample's index."""
        data = json.loads(self.response.to_json())
        choice = data["choices"][0]
        choice["index"] = self.index
        return choice

    def response_dict(self) -> dict[str, Any]:
        """The accumulated response (not streaming), usage counted by the engine."""
        data = json.loads(self.response.to_json())
        data["usage"] = _usage(data.get("usage"), len(self.prepared.prompt_token_ids), len(self.token_ids))
        return data

    def usage_chunk(self, completion_tokens: int, reasoning_tokens: int | None = None) -> str:
        """OpenAI's last streamed chunk: no choices, the request's usage."""
        usage = _usage(self.usage, len(self.prepared.prompt_token_ids), completion_tokens)
        if reasoning_tokens is not None and "completion_tokens_details" in usage:
            usage["completion_tokens_details"]["reasoning_tokens"] = reasoning_tokens
        return _dumps({"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                       "model": self.model, "system_fingerprint": None, "choices": [], "usage": usage})

    @property
    def reasoning_tokens(self) -> int:
        details = (self.usage or {}).get("completion_tokens_details") or {}
        return details.get("reasoning_tokens") or 0


class EventOutput(ChatOutput):
    """A Responses or Messages request's output: the recipe's events as named SSE events
    (`(event name, JSON)` pairs) when streaming, the accumulated response otherwise. Their usage is
    the recipe's (it counts the tokens it was told of)."""

    def _emit(self, chunks: list[Any]) -> list[Any]:
        if self.response is not None:
            for c in chunks:
                self.response.accumulate(c)
            return []
        return [(self.response_cls.sse_event_name(c), c.to_json()) for c in chunks]

    def response_dict(self) -> dict[str, Any]:
        return json.loads(self.response.to_json())


def _top(entry: dict[int, Any], k: int) -> list[tuple[int, float]]:
    """The top-k alternatives of a logprob entry (rank order)."""
    ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k))
    return [(t, lp) for _, t, lp in ranked[:k]]


def _usage(recipe: dict[str, Any] | None, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The recipe's usage object with the engine's token counts."""
    usage = dict(recipe or {})
    usage.update(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
    return usage


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _request_schema(body: dict[str, Any]) -> str | None:
    """The JSON schema of the request's `response_format`, as sent."""
    fmt = body.get("response_format")
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    return json.dumps(schema) if isinstance(schema, dict) else None


def _with_request_parameters(tools: list[dict[str, Any]], sent: Any) -> list[dict[str, Any]]:
    """The recipe's tool list with each function's `parameters` as the request sent them; a
    keyword the grammar cannot enforce is a 400."""
    by_name = {}
    for i, tool in enumerate(sent if isinstance(sent, list) else []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("parameters"), dict):
            by_name[function.get("name")] = (i, function["parameters"])
    for tool in tools:
        function = tool.get("function", {})
        if function.get("name") in by_name:
            i, parameters = by_name[function["name"]]
            _check_schema(parameters, f"tools.{i}.function.parameters")
            function["parameters"] = parameters
    return tools


def _check_schema(schema: Any, where: str) -> None:
    problem = unsupported_keyword(schema, where)
    if problem is not None:
        raise RequestError(400, problem)


def _ebnf(tag: Any) -> dict[str, str]:
    import xgrammar as xgr

    return {"schema_type": "ebnf", "schema": str(xgr.Grammar.from_structural_tag(tag))}


def _recipe_message(e: Exception) -> str:
    """The message inside the recipe's OpenAI-style error body (else the exception's text)."""
    try:
        return json.loads(e.body)["error"]["message"]
    except Exception:
        return str(e)
