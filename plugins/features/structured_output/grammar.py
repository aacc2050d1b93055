"""Grammar compilation: `so_args` -> xgrammar `CompiledGrammar`, off the engine thread, cached.

At admission (`GrammarCompiler.submit`) the constraint is *parsed* synchronously (0.03-0.3 ms for
the seed schemas), so an invalid regex, schema or grammar fails that request right away with
xgrammar's message. The expensive part, computing the token-mask cache over the 129k vocabulary
(up to ~25 ms for a JSON schema with free strings), runs in a small thread pool; the processor
waits for that future only at the request's first bitmask fill.

xgrammar is imported on the first `submit`, never before: importing it costs ~0.5-1.3 s.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from deepinfer.json_schema_support import unsupported_keyword
from deepinfer.logits_processor import RequestRejected

from .config import StructuredOutputConfig
from .vocabulary import Vocabulary

logger = logging.getLogger("deepinfer.structured_output")

SCHEMA_TYPES = ("regex", "json", "ebnf")

# xgrammar <= 0.2.9 compiles a JSON-schema string with minLength/maxLength to this character class,
# which admits raw control characters (invalid JSON) and no escapes (mlc-ai/xgrammar#800).
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
# The JSON-correct replacement: any character but controls, quote and backslash, or one escape
# (an escape decodes to one character, so length bounds still count characters).
_JSON_STRING_CHAR = r'([^\0-\x1f\"\\] | "\\" [\"\\/bfnrt] | "\\u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9])'
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class Constraint:
    """A request's constraint, normalised: the schema is always text (a JSON dict is dumped)."""

    schema_type: str
    schema: str

    @classmethod
    def from_so_args(cls, so_args: Any) -> Constraint:
        if not isinstance(so_args, dict) or "schema_type" not in so_args or "schema" not in so_args:
            raise RequestRejected('so_args must be a dict {"schema_type": "regex"|"json"|"ebnf", "schema": ...}; '
                                  f"got {so_args!r}")
        schema_type, schema = so_args["schema_type"], so_args["schema"]
        if schema_type not in SCHEMA_TYPES:
            raise RequestRejected(f"so_args schema_type {schema_type!r} is not supported; use one of "
                                  f"{', '.join(SCHEMA_TYPES)}")
        if schema_type == "json" and isinstance(schema, dict):
            schema = json.dumps(schema)  # key order kept: it is the order properties are generated in
        if not isinstance(schema, str) or not schema.strip():
            hint = " (a JSON schema may be given as json.dumps(schema) or as a dict)" if schema_type == "json" else ""
            raise RequestRejected(f"so_args schema for schema_type {schema_type!r} must be a non-empty string"
                                  f"{hint}; got {type(schema).__name__} {schema!r:.80}")
        return cls(schema_type, schema)


def xgrammar_message(error: BaseException) -> str:
    """xgrammar's error text without its C++ log prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    text = str(error).strip()
    return _XGRAMMAR_LOG_PREFIX.sub("", text.splitlines()[0] if text else type(error).__name__)


def fix_bounded_json_strings(ebnf: str) -> str:
    """Make length-bounded JSON strings JSON-correct (see `_BOUNDED_STRING_CHAR`); a no-op on an
    xgrammar release that no longer produces the faulty class."""
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


_TOKENIZER_INFOS: dict[str, Any] = {}  # Vocabulary.fingerprint -> xgrammar.TokenizerInfo (shared per process)
_TOKENIZER_INFOS_LOCK = threading.Lock()


def tokenizer_info(vocabulary: Vocabulary):
    """The xgrammar `TokenizerInfo` of a vocabulary (built once per process: ~0.1 s for 129k tokens)."""
    import xgrammar as xgr

    with _TOKENIZER_INFOS_LOCK:
        info = _TOKENIZER_INFOS.get(vocabulary.fingerprint)
        if info is None:
            vocab_type = {"byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
                          "raw": xgr.VocabType.RAW}[vocabulary.vocab_type]
            info = xgr.TokenizerInfo(list(vocabulary.tokens), vocab_type, vocab_size=vocabulary.vocab_size,
                                     stop_token_ids=list(vocabulary.stop_token_ids))
            _TOKENIZER_INFOS[vocabulary.fingerprint] = info
        return info


class GrammarCompiler:
    """Parses constraints at admission and compiles them in a thread pool, with an LRU cache of
    compiled grammars keyed by (schema_type, schema, vocabulary fingerprint)."""

    def __init__(self, vocabulary: Vocabulary, config: StructuredOutputConfig) -> None:
        self.vocabulary = vocabulary
        self.config = config
        self._compiler = None  # xgrammar.GrammarCompiler, created with the first submit
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, str, str], Future] = OrderedDict()
        self._lock = threading.Lock()

    def _start(self) -> None:
        import xgrammar as xgr

        self._compiler = xgr.GrammarCompiler(tokenizer_info(self.vocabulary), max_threads=self.config.compiler_threads,
                                             cache_enabled=False)  # this class caches, with its own bound
        self._pool = ThreadPoolExecutor(self.config.compile_workers, thread_name_prefix="deepinfer-grammar")

    def parse(self, constraint: Constraint):
        """The xgrammar `Grammar` of a constraint; `RequestRejected` (naming the type) if invalid."""
        import xgrammar as xgr

        try:
            if constraint.schema_type == "regex":
                return xgr.Grammar.from_regex(constraint.schema)
            if constraint.schema_type == "ebnf":
                return xgr.Grammar.from_ebnf(constraint.schema)
            problem = unsupported_keyword(json.loads(constraint.schema))
            if problem is not None:
                raise RequestRejected(f"invalid json constraint in so_args: {problem}")
            options: dict[str, Any] = dict(any_whitespace=self.config.any_whitespace,
                                           strict_mode=self.config.strict_json)
            if self.config.any_whitespace and self.config.max_whitespace is not None:
                options["max_whitespace_cnt"] = self.config.max_whitespace
            grammar = xgr.Grammar.from_json_schema(constraint.schema, **options)
        except RequestRejected:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with its parser's message
            raise RequestRejected(f"invalid {constraint.schema_type} constraint in so_args: {xgrammar_message(e)}"
                                  ) from None
        if self.config.strict_json:
            text = str(grammar)
            fixed = fix_bounded_json_strings(text)
            if fixed != text:
                try:
                    grammar = xgr.Grammar.from_ebnf(fixed)
                except Exception as e:  # keep xgrammar's own grammar rather than fail the request
                    logger.warning("could not make length-bounded JSON strings strict (%s); raw control "
                                   "characters may appear in them", xgrammar_message(e))
        return grammar

    def submit(self, constraint: Constraint) -> Future:
        """A future of the `CompiledGrammar`; raises `RequestRejected` at once for a bad constraint."""
        key = (constraint.schema_type, constraint.schema, self.vocabulary.fingerprint)
        with self._lock:
            if self._compiler is None:
                self._start()
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        grammar = self.parse(constraint)  # outside the lock: errors stay with their request
        future = self._pool.submit(self._compiler.compile_grammar, grammar)
        if self.config.cache_size > 0:
            with self._lock:
                self._cache[key] = future
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
            future.add_done_callback(lambda f: (f.cancelled() or f.exception() is not None) and self._forget(key, f))
        return future

    def _forget(self, key: tuple[str, str, str], future: Future) -> None:
        with self._lock:
            if self._cache.get(key) is future:
                del self._cache[key]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
