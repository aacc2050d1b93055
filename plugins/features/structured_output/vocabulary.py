"""The vocabulary as xgrammar needs it: token strings by id, the stop tokens, the blocked tokens.

Built from a `tokenizers.Tokenizer` (the engine's `deepinfer.tokenizer.Tokenizer.backend`) without
importing xgrammar, so the engine pays nothing until the first constrained request.

Blocked tokens: xgrammar (0.2.9) marks none of DeepSeek's added tokens as special, so a
constraint would happily emit `<think>`, `<｜User｜>` or even BOS as "text" (for example inside a
JSON string). Every added token except the stop tokens is therefore blocked: the 53 control tokens
the tokenizer marks non-special and the special ones (BOS, pad, placeholders).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

VOCAB_TYPES = ("byte_level", "byte_fallback", "raw")


@dataclass(frozen=True)
class Vocabulary:
    """Everything the grammar side needs to know about the tokenizer and the model's logits."""

    tokens: tuple[str, ...]  # encoded token string of each id (byte-level form: "Ġ" for a space)
    vocab_size: int  # width of the model's logits; ids >= len(tokens) are padding, never allowed
    stop_token_ids: tuple[int, ...]
    blocked_token_ids: tuple[int, ...] = ()  # never produced inside a constraint
    vocab_type: str = "byte_level"
    fingerprint: str = field(default="", compare=False)  # identifies the vocabulary in cache keys

    def __post_init__(self) -> None:
        if self.vocab_type not in VOCAB_TYPES:
            raise ValueError(f"vocab_type {self.vocab_type!r} is not one of {', '.join(VOCAB_TYPES)}")
        if len(self.tokens) > self.vocab_size:
            raise ValueError(f"the tokenizer has {len(self.tokens)} ids but the model's logits only "
                             f"{self.vocab_size}; use the tokenizer that belongs to the checkpoint")
        if not self.stop_token_ids:
            raise ValueError("structured outputs need at least one stop token id (EOS)")
        for tid in (*self.stop_token_ids, *self.blocked_token_ids):
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"token id {tid} is outside the vocabulary [0, {self.vocab_size})")
        if not self.fingerprint:
            digest = hashlib.sha1("\x00".join(self.tokens).encode("utf-8", "surrogatepass"))
            digest.update(repr((self.vocab_size, self.stop_token_ids, self.blocked_token_ids,
                                self.vocab_type)).encode())
            object.__setattr__(self, "fingerprint", digest.hexdigest()[:16])

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32


def _vocab_type(backend) -> str:
    decoder = getattr(backend, "decoder", None)
    state = decoder.__getstate__() if decoder is not None else b""
    text = state.decode() if isinstance(state, bytes) else str(state)
    if '"ByteLevel"' in text:
        return "byte_level"
    if '"ByteFallback"' in text:
        return "byte_fallback"
    return "raw"


def vocabulary_from_backend(backend, vocab_size: int | None, stop_token_ids: Iterable[int],
                            block_added_tokens: bool = True) -> Vocabulary:
    """A `Vocabulary` from a `tokenizers.Tokenizer`; `vocab_size` is the model's logits width
    (None: the tokenizer's size)."""
    size = backend.get_vocab_size(with_added_tokens=True)
    tokens = [""] * size
    for text, tid in backend.get_vocab(with_added_tokens=False).items():
        tokens[tid] = text
    added = backend.get_added_tokens_decoder()
    for tid, token in added.items():  # added tokens may reuse BPE ids (DeepSeek: BOS, EOS, pad)
        tokens[tid] = token.content
    stops = tuple(sorted(set(stop_token_ids)))
    blocked = tuple(sorted(set(added) - set(stops))) if block_added_tokens else ()
    return Vocabulary(tokens=tuple(tokens), vocab_size=vocab_size or size, stop_token_ids=stops,
                      blocked_token_ids=blocked, vocab_type=_vocab_type(backend))


def vocabulary_from_tokenizer(tokenizer, vocab_size: int | None, block_added_tokens: bool = True,
                              stop_token_ids: Iterable[int] | None = None) -> Vocabulary:
    """A `Vocabulary` from the engine's `deepinfer.tokenizer.Tokenizer`; the stop tokens are
    `stop_token_ids` (the engine's EOS ids), else the tokenizer's EOS."""
    if not getattr(tokenizer, "has_text", False) or not hasattr(tokenizer, "backend"):
        reason = getattr(tokenizer, "reason", "the engine has no tokenizer")
        raise ValueError(f"structured outputs need the model's tokenizer, but {reason}; give the checkpoint "
                         f"a tokenizer.json (or pass `tokenizer=`)")
    stops = sorted(stop_token_ids) if stop_token_ids else [tokenizer.eos_token_id]
    if None in stops:
        raise ValueError(f"the tokenizer {tokenizer.source} has no EOS token, which structured outputs "
                         f"need to end a constrained output")
    return vocabulary_from_backend(tokenizer.backend, vocab_size, stops, block_added_tokens)
