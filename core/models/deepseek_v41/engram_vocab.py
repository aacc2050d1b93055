"""The tokenizer-derived compressed vocabulary that Engram hashes n-grams over.

Every token id `0 .. n-1` of the tokenizer (n counts the added tokens) is decoded on its own,
special tokens included. When the text holds U+FFFD (a partial UTF-8 sequence) the key is the raw
token string; otherwise the key is the text normalised by the `tokenizers` normalizers NFKC, NFD,
StripAccents, Lowercase, Replace(regex `[ \\t\\r\\n]+` -> " "), Replace(regex `^ $` -> U+E000),
Strip, Replace(U+E000 -> " ") -- a lone space survives the strip -- or the decoded text itself when
that normalises to nothing. Equal keys share one compressed id; ids are numbered in first-seen
order. DeepSeek-V4.1-Flash's own tokenizer gives 99,092 compressed ids for its 129,280 tokens
(`text_config.engram_compressed_vocab_size`). Nothing is cached: the map is rebuilt from the
tokenizer file on every call (about a second for the full vocabulary).
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, normalizers

from deepinfer.tokenizer import Tokenizer as TextTokenizer

_SENTINEL = "\ue000"
_REPLACEMENT = "\ufffd"


def _key_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def compressed_ids(tokenizer: Tokenizer) -> tuple[list[int], int]:
    """(compressed id of every token id, number of compressed ids) for a loaded tokenizer."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    normalizer = _key_normalizer()
    key_ids: dict[str, int] = {}
    token_map: list[int] = []
    for token_id, text in enumerate(texts):
        if _REPLACEMENT in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map.append(key_ids.setdefault(key, len(key_ids)))
    return token_map, len(key_ids)


def compressed_token_map(tokenizer_json: Path) -> tuple[list[int], int]:
    """(compressed id of every token id, number of compressed ids) for a `tokenizer.json` file.

    Raises FileNotFoundError when the file is missing and ValueError when `tokenizers` cannot
    parse it.
    """
    return compressed_ids(TextTokenizer.from_file(Path(tokenizer_json)).backend)
