"""Tokenizer wrapper: the real DeepSeek-V4 tokenizer, control tokens, streaming, no-tokenizer mode."""
from __future__ import annotations

import json

import pytest

from deepinfer.tokenizer import (
    NoTokenizer, Tokenizer, default_tokenizer_path, load_tokenizer, shrink_tokenizer_json)

TEXT = "  Hello <think>reasoning</think> 你好 🙂 world!\n\n12345 <｜User｜>x<｜Assistant｜>"


@pytest.fixture(scope="module")
def real() -> Tokenizer:
    return Tokenizer.from_file(default_tokenizer_path())


def test_real_tokenizer_ids(real):
    assert real.vocab_size == 129280
    assert (real.bos_token_id, real.eos_token_id) == (0, 1)
    assert real.encode("<think>") == [128821]
    assert real.encode("hi", add_bos=True)[0] == 0
    assert real.encode("hi")[0] != 0  # DeepSeek's tokenizer never adds BOS by itself


def test_round_trip(real):
    ids = real.encode(TEXT, add_bos=True)
    assert real.decode(ids) == "<｜begin▁of▁sentence｜>" + TEXT
    assert real.decode(ids, skip_special_tokens=True) == TEXT


def test_control_tokens_are_the_non_special_added_tokens(real):
    ids = set(real.control_token_ids)
    assert len(ids) == 53  # DeepSeek's added tokens not marked special
    for token, token_id in [("<think>", 128821), ("</think>", 128822), ("<｜User｜>", 128803),
                            ("<｜Assistant｜>", 128804), ("<｜tool▁call▁begin｜>", 128808)]:
        assert real.token_to_id(token) == token_id and token_id in ids
    assert not ids & set(real.special_token_ids)
    assert {0, 1} <= set(real.special_token_ids)


def test_stream_decoder_matches_full_decode(real):
    ids = real.encode(TEXT)
    stream = real.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == real.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never emits half a UTF-8 character
    chunked = real.stream_decoder()
    assert "".join(chunked.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) == real.decode(ids)


def test_load_order(tmp_path, real):
    # checkpoint without tokenizer.json and the full vocabulary: the default DeepSeek tokenizer
    assert load_tokenizer(tmp_path, vocab_size=129280).vocab_size == 129280
    # a small model cannot use it: token ids only, text is a clear error
    tok = load_tokenizer(tmp_path, vocab_size=512)
    assert isinstance(tok, NoTokenizer) and tok.eos_token_id == 1
    with pytest.raises(ValueError, match="prompts must be token ids"):
        tok.encode("hello")
    assert tok.decode([5, 6]) == ""
    # the checkpoint's own tokenizer.json wins
    (tmp_path / "tokenizer.json").write_text(json.dumps(shrink_tokenizer_json(default_tokenizer_path(), 512)))
    own = load_tokenizer(tmp_path, vocab_size=512)
    assert isinstance(own, Tokenizer) and own.vocab_size == 512
    # explicit "none"
    assert isinstance(load_tokenizer(tmp_path, "none", vocab_size=512), NoTokenizer)
    # a tokenizer larger than the model's vocabulary is refused
    with pytest.raises(ValueError, match="more than the model's vocab_size 100"):
        load_tokenizer(tmp_path, vocab_size=100)
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        load_tokenizer(tmp_path, tmp_path / "missing.json")


def test_shrunk_tokenizer_keeps_text_and_control_tokens(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(shrink_tokenizer_json(default_tokenizer_path(), 512)))
    tok = Tokenizer.from_file(path)
    ids = tok.encode(TEXT, add_bos=True)
    assert max(ids) < 512 and ids[0] == 0
    assert tok.decode(ids) == "<｜begin▁of▁sentence｜>" + TEXT
    assert len(tok.control_token_ids) == 53 and tok.token_to_id("<think>") in tok.control_token_ids
    assert tok.special_token_ids == (0, 1, 2)
    with pytest.raises(ValueError, match="too small"):
        shrink_tokenizer_json(default_tokenizer_path(), 300)
