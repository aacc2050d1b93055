"""Structured outputs: the xgrammar logits processor driven by a fake-logits loop over the real
DeepSeek-V4 tokenizer (129,280 ids), the sample validators, and the feature plugin's declaration."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from deepinfer.logits_processor import RequestRejected
from deepinfer.tokenizer import Tokenizer, default_tokenizer_path
from deepinfer_plugins.features.structured_output import StructuredOutputConfig, plugin
from deepinfer_plugins.features.structured_output.grammar import fix_bounded_json_strings
from deepinfer_plugins.features.structured_output.processor import DEAD_END, StructuredOutputProcessor
from deepinfer_plugins.features.structured_output.vocabulary import Vocabulary, vocabulary_from_tokenizer
from example_modules import load_example

samples = load_example("_structured_output.py")

REGEX = r"[A-Z]{2}-[0-9]{3}"
EBNF = 'root ::= "answer=" ("yes" | "no") ";level=" [1-3]'
# Nested objects, an array, bounded integers, booleans, an optional property, a length-bounded free
# string (the xgrammar control-character bug) and a nullable field.
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "pos": {"type": "object",
                "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "ok": {"type": "boolean"}},
                "required": ["x", "ok"], "additionalProperties": False},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "enum": ["hi", "yo"]}]},
    },
    "required": ["name", "tags", "pos"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "regex": {"schema_type": "regex", "schema": REGEX},
    "json": {"schema_type": "json", "schema": json.dumps(samples.SAMPLE_JSON_SCHEMA)},
    "ebnf": {"schema_type": "ebnf", "schema": EBNF},
    "nested_json": {"schema_type": "json", "schema": json.dumps(NESTED_SCHEMA)},
}
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


def params(so_args):
    return SimpleNamespace(so_args=so_args)


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> set[int]:
    allowed = (bitmask_row.unsqueeze(-1) & _BITS).ne(0).flatten()[:vocab_size]
    return set(torch.nonzero(allowed).flatten().tolist())


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(default_tokenizer_path())


@pytest.fixture(scope="module")
def vocabulary(tokenizer) -> Vocabulary:
    return vocabulary_from_tokenizer(tokenizer, tokenizer.vocab_size)


@pytest.fixture
def processor(vocabulary):
    proc = StructuredOutputProcessor(vocabulary)
    yield proc
    proc.shutdown()


def generate(proc: StructuredOutputProcessor, so_args: dict, runs: int, seed: int, max_steps: int = 96):
    """`runs` requests sampled together at temperature 1 from random logits; returns the token ids
    of each (EOS included) and whether the processor finished it."""
    vocab = proc.vocabulary
    ids = [f"r{seed}-{i}" for i in range(runs)]
    for rid in ids:
        assert proc.add_request(rid, params(so_args))
    rng = np.random.default_rng(seed)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finished: dict[str, bool] = {rid: False for rid in ids}
    active = list(ids)
    for _ in range(max_steps):
        if not active:
            break
        bitmask = torch.full((len(active), vocab.bitmask_width), -1, dtype=torch.int32)
        proc.fill_bitmask(active, bitmask)
        assert not proc.pop_failures()
        # Sampling at temperature 1 from fresh i.i.d. random logits picks each allowed token with
        # equal chance, so draw that directly (numpy: fast and free of torch thread start-up).
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : vocab.vocab_size]
        sampled = [int(rng.choice(np.flatnonzero(row))) for row in allowed]
        still = []
        for rid, token in zip(active, sampled):
            tokens[rid].append(token)
            if proc.accept(rid, [token]):
                finished[rid] = True
            else:
                still.append(rid)
        active = still
    for rid in ids:
        proc.remove_request(rid)
    return [(tokens[rid], finished[rid]) for rid in ids]


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name == "nested_json" else name
                                  for name in CONSTRAINTS])  # the fast lane samples the flat JSON schema
def test_sampled_outputs_satisfy_constraint_and_end_on_eos(processor, tokenizer, name):
    so_args = CONSTRAINTS[name]
    results = generate(processor, so_args, runs=50, seed=sum(map(ord, name)))
    texts = set()
    for token_ids, finished in results:
        assert finished, f"not finished after {len(token_ids)} tokens: {tokenizer.decode(token_ids)!r}"
        assert token_ids[-1] == tokenizer.eos_token_id
        assert not set(token_ids[:-1]) & set(processor.vocabulary.blocked_token_ids)
        text = tokenizer.decode(token_ids[:-1])
        assert samples.validate(so_args, text) is None, samples.validate(so_args, text)
        texts.add(text)
    assert len(texts) > 1  # sampling really varied


def test_json_schema_as_dict_and_string_share_the_compiled_grammar(processor):
    as_dict = {"schema_type": "json", "schema": samples.SAMPLE_JSON_SCHEMA}
    assert processor.add_request("d", params(as_dict))
    assert processor.add_request("s", params(CONSTRAINTS["json"]))
    assert processor._requests["d"].compiled is processor._requests["s"].compiled  # one cache entry
    [(token_ids, finished)] = generate(processor, as_dict, runs=1, seed=3)
    assert finished


@pytest.mark.parametrize("schema_type,schema", [
    ("regex", "[A-Z"), ("ebnf", 'root ::= "a" |'), ("ebnf", 'start ::= "a"'),
    ("json", '{"type": "strin"}'), ("json", "{not json"),
])
def test_bad_constraint_rejects_only_that_request(processor, schema_type, schema):
    with pytest.raises(RequestRejected, match=f"invalid {schema_type} constraint in so_args: .+") as err:
        processor.add_request("bad", params({"schema_type": schema_type, "schema": schema}))
    assert "/project/cpp" not in str(err.value)  # xgrammar's log prefix is stripped
    assert not processor.is_tracking("bad")
    [(token_ids, finished)] = generate(processor, CONSTRAINTS["regex"], runs=1, seed=1)  # others still run
    assert finished


def test_unsupported_schema_type_names_the_supported_ones(processor):
    with pytest.raises(RequestRejected, match="'xml' is not supported; use one of regex, json, ebnf"):
        processor.add_request("x", params({"schema_type": "xml", "schema": "<a/>"}))
    with pytest.raises(RequestRejected, match="must be a non-empty string"):
        processor.add_request("x", params({"schema_type": "regex", "schema": ""}))


def test_unconstrained_request_is_not_tracked_and_its_row_untouched(processor, vocabulary):
    assert processor.add_request("plain", params(None)) is False
    assert processor.add_request("c", params(CONSTRAINTS["regex"]))
    bitmask = torch.full((2, vocabulary.bitmask_width), -1, dtype=torch.int32)
    processor.fill_bitmask(["plain", "c"], bitmask)
    assert bool((bitmask[0] == -1).all())
    assert allowed_ids(bitmask[1], vocabulary.vocab_size) and not bool((bitmask[1] == -1).all())


def test_bitmask_shape_is_checked(processor, vocabulary):
    assert processor.add_request("c", params(CONSTRAINTS["regex"]))
    with pytest.raises(ValueError, match="bitmask has 2 rows but 1 requests"):
        processor.fill_bitmask(["c"], torch.full((2, vocabulary.bitmask_width), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="bitmask must be int32"):
        processor.fill_bitmask(["c"], torch.full((1, 10), -1, dtype=torch.int32))


def test_control_tokens_blocked_inside_a_json_string(processor, tokenizer, vocabulary):
    free_string = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    assert processor.add_request("c", params({"schema_type": "json", "schema": json.dumps(free_string)}))
    assert not processor.accept("c", tokenizer.encode('{"s": "ab'))
    bitmask = torch.full((1, vocabulary.bitmask_width), -1, dtype=torch.int32)
    processor.fill_bitmask(["c"], bitmask)
    allowed = allowed_ids(bitmask[0], vocabulary.vocab_size)
    for name in ("<think>", "</think>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁call▁begin｜>",
                 "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"):
        assert tokenizer.token_to_id(name) not in allowed, name
    assert set(tokenizer.control_token_ids) <= set(vocabulary.blocked_token_ids)
    assert tokenizer.encode("<")[0] in allowed  # the same characters as ordinary text stay allowed
    assert len(allowed) > 100_000


def test_control_tokens_allowed_when_blocking_is_off(tokenizer):
    vocab = vocabulary_from_tokenizer(tokenizer, tokenizer.vocab_size, block_added_tokens=False)
    proc = StructuredOutputProcessor(vocab, StructuredOutputConfig(block_control_tokens=False))
    free_string = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    proc.add_request("c", params({"schema_type": "json", "schema": json.dumps(free_string)}))
    proc.accept("c", tokenizer.encode('{"s": "ab'))
    bitmask = torch.full((1, vocab.bitmask_width), -1, dtype=torch.int32)
    proc.fill_bitmask(["c"], bitmask)
    assert tokenizer.token_to_id("<think>") in allowed_ids(bitmask[0], vocab.vocab_size)  # xgrammar alone: allowed


def test_eos_allowed_exactly_when_the_grammar_may_end(processor, tokenizer, vocabulary):
    assert processor.add_request("e", params({"schema_type": "regex", "schema": "ab(c)?"}))
    bitmask = torch.full((1, vocabulary.bitmask_width), -1, dtype=torch.int32)
    processor.fill_bitmask(["e"], bitmask)
    assert tokenizer.eos_token_id not in allowed_ids(bitmask[0], vocabulary.vocab_size)
    assert not processor.accept("e", tokenizer.encode("ab"))
    processor.fill_bitmask(["e"], bitmask)
    assert tokenizer.eos_token_id in allowed_ids(bitmask[0], vocabulary.vocab_size)  # "ab" is complete
    assert processor.accept("e", [tokenizer.eos_token_id]) is True


def test_draft_checking(processor, tokenizer, vocabulary):
    eos = tokenizer.eos_token_id
    assert processor.add_request("s", params(CONSTRAINTS["ebnf"]))
    good = tokenizer.encode("answer=yes;level=2")
    assert processor.count_valid_draft("s", good + [eos, 5]) == len(good) + 1  # nothing after EOS
    assert processor.count_valid_draft("s", tokenizer.encode("answer=maybe")) == len(tokenizer.encode("answer="))
    assert processor.count_valid_draft("s", []) == 0
    assert processor.accept("s", good + [eos]) is True  # checking drafts left the state untouched


def test_fill_with_draft_tokens_gives_one_row_per_position(processor, tokenizer, vocabulary):
    eos = tokenizer.eos_token_id
    assert processor.add_request("s", params(CONSTRAINTS["ebnf"]))
    assert processor.add_request("t", params(CONSTRAINTS["regex"]))
    prefix = tokenizer.encode("answer=yes;level=")
    processor.accept("s", prefix)
    drafts = [[tokenizer.encode("2")[0], eos], tokenizer.encode("A")]
    bitmask = torch.full((5, vocabulary.bitmask_width), -1, dtype=torch.int32)
    processor.fill_bitmask(["s", "t"], bitmask, draft_tokens=drafts)
    rows = [allowed_ids(bitmask[r], vocabulary.vocab_size) for r in range(5)]
    assert rows[0] == {tokenizer.encode(d)[0] for d in "123"}
    assert rows[1] == {eos}  # after the draft "2" only EOS
    assert drafts[1][0] in rows[3] and eos not in rows[4] and rows[4]  # regex rows: start, after "A"
    assert processor.accept("s", [tokenizer.encode("3")[0], eos]) is True  # state unchanged by the drafts


def test_dead_end_reports_the_request_instead_of_sampling_from_nothing():
    # A vocabulary without the letter "z": the grammar `z` can never be produced.
    vocab = Vocabulary(tokens=("<eos>", "a", "b", "ab"), vocab_size=40, stop_token_ids=(0,), vocab_type="raw")
    proc = StructuredOutputProcessor(vocab)
    assert proc.add_request("dead", params({"schema_type": "regex", "schema": "z"}))
    assert proc.add_request("fine", params({"schema_type": "regex", "schema": "ab"}))
    bitmask = torch.full((2, vocab.bitmask_width), -1, dtype=torch.int32)
    proc.fill_bitmask(["dead", "fine"], bitmask)
    failures = proc.pop_failures()
    assert list(failures) == ["dead"]
    reason, message = failures["dead"]
    assert reason == DEAD_END and "admits no token" in message
    assert int(bitmask[0].count_nonzero()) == 0  # all masked: the engine must not sample this row
    assert allowed_ids(bitmask[1], 40) == {1, 3}
    assert proc.accept("dead", [1]) is True  # ends it even if the engine asked no question
    assert proc.pop_failures() == {}
    assert proc.accept("fine", [3]) is False and proc.accept("fine", [0]) is True


def test_bounded_json_strings_reject_raw_control_characters():
    bad = r'root_prop_0_characters ::= (([^\"\\\r\n]))'
    fixed = fix_bounded_json_strings(bad)
    assert r"[^\0-\x1f\"\\]" in fixed and r"[^\"\\\r\n]" not in fixed
    vocab = Vocabulary(tokens=("<eos>", '"', "\x01", "a", "\\", "n", "{", "}", ":", " ", "s", ","),
                       vocab_size=32, stop_token_ids=(0,), vocab_type="raw")
    proc = StructuredOutputProcessor(vocab)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]}
    proc.add_request("j", params({"schema_type": "json", "schema": schema}))
    for token in [6, 1, 10, 1, 8, 9, 1]:  # {"s": "
        assert proc.count_valid_draft("j", [token]) == 1
        proc.accept("j", [token])
    assert proc.count_valid_draft("j", [2]) == 0  # a raw control character
    assert proc.count_valid_draft("j", [4, 5, 3, 1, 7, 0]) == 6  # "\na" is 2 characters: allowed


def test_strict_json_off_keeps_xgrammar_behaviour():
    vocab = Vocabulary(tokens=("<eos>", '"', "\x01", "{", "}", ":", " ", "s"), vocab_size=32,
                       stop_token_ids=(0,), vocab_type="raw")
    proc = StructuredOutputProcessor(vocab, StructuredOutputConfig(strict_json=False))
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]}
    proc.add_request("j", params({"schema_type": "json", "schema": schema}))
    proc.accept("j", [3, 1, 7, 1, 5, 6, 1])
    assert proc.count_valid_draft("j", [2]) == 1


def test_validators_catch_violations():
    assert samples.validate(CONSTRAINTS["regex"], "AB-123") is None
    assert samples.validate(CONSTRAINTS["regex"], "AB-1234")
    assert samples.validate(CONSTRAINTS["json"], '{"color": "red", "count": 2}') is None
    assert "violates" in samples.validate(CONSTRAINTS["json"], '{"color": "pink", "count": 2}')
    assert "not valid JSON" in samples.validate(CONSTRAINTS["json"], '{"color": "r\x01", "count": 2}')
    assert samples.validate(CONSTRAINTS["ebnf"], "answer=no;level=3") is None
    assert samples.validate(CONSTRAINTS["ebnf"], "answer=no;level=4")
    assert samples.validate(CONSTRAINTS["ebnf"], "answer=no;level=")


@pytest.mark.slow
def test_feature_spec_and_lazy_xgrammar_import():
    spec = plugin.deepinfer_feature_spec()
    assert spec.name == "structured_output" and spec.enabled_by_default
    assert spec.required_capabilities == ("token_bitmask",)
    assert all(hasattr(plugin, hook) for hook in spec.hooks)
    with pytest.raises(Exception, match="extra"):
        StructuredOutputConfig(strict=True)
    # Importing the feature and creating its processor must not import xgrammar.
    code = ("import sys; from deepinfer_plugins.features.structured_output import plugin;"
            "from deepinfer_plugins.features.structured_output.processor import StructuredOutputProcessor;"
            "p = StructuredOutputProcessor(lambda: 1/0); p.fill_bitmask([], None);"
            "assert p.add_request('x', type('P', (), {'so_args': None})()) is False;"
            "assert 'xgrammar' not in sys.modules")
    import subprocess
    subprocess.run([sys.executable, "-c", code], check=True)


# -- end to end through LLM.generate: a tiny random checkpoint with the real 129,280-token tokenizer --


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_v4_real_vocab):
    # its 32k context: examples/offline_inference.py asks for max_model_len 32768
    return tiny_v4_real_vocab


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    from deepinfer import LLM

    engine = LLM(model=str(tiny_checkpoint), accelerator="cpu", dtype="float32", max_num_seqs=8, max_model_len=256,
                 async_pipeline=True)  # the pipeline path with real grammars (the cpu default is sync)
    yield engine
    engine.shutdown()  # joins the async worker before the interpreter exits


def test_generate_mixes_constrained_and_unconstrained_requests(llm):
    from deepinfer import SamplingParams

    prompts, sample_params = samples.sample_requests(max_tokens=64)  # greedy, as in the seeds
    sampled = [SamplingParams(temperature=1.0, max_tokens=64, seq_seed=i, so_args=dict(CONSTRAINTS[name]))
               for i, name in enumerate(CONSTRAINTS)]
    sampled.append(SamplingParams(temperature=1.0, max_tokens=64, seq_seed=7,
                                  so_args={"schema_type": "json", "schema": NESTED_SCHEMA}))  # a dict schema
    free = [SamplingParams(temperature=1.0, max_tokens=6, seq_seed=9), SamplingParams(temperature=0, max_tokens=5)]
    params = sample_params + sampled + free
    outputs = llm.generate(prompts + ["Fill in:"] * len(sampled) + ["Hello", "Hi"], params, use_tqdm=False)
    assert samples.check_outputs(params, outputs, llm.tokenizer.eos_token_id) == []
    for out in outputs[-2:]:
        assert out.outputs[0].finish_reason == "length" and out.error is None


def test_bad_constraints_fail_alone(llm):
    from deepinfer import SamplingParams

    bad_regex = SamplingParams(temperature=0, max_tokens=32, so_args={"schema_type": "regex", "schema": "[a-"})
    bad_json = SamplingParams(temperature=0, max_tokens=32, so_args={"schema_type": "json", "schema": '{"type": 5}'})
    good = SamplingParams(temperature=0, max_tokens=32, so_args=dict(CONSTRAINTS["ebnf"]))
    outputs = llm.generate(["a", "b", "c"], [bad_regex, good, bad_json], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "stop", "error"]
    assert "invalid regex constraint" in outputs[0].error and "invalid json constraint" in outputs[2].error
    assert samples.check_outputs([good], [outputs[1]], llm.tokenizer.eos_token_id) == []


def test_check_outputs_reports_violations_and_missing_eos(llm):
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, so_args=dict(CONSTRAINTS["regex"]))
    [out] = llm.generate(["a"], [params], use_tqdm=False)
    eos = llm.tokenizer.eos_token_id
    assert samples.check_outputs([params], [out], eos) == []
    out.outputs[0].text += "x"
    assert "does not fully match" in samples.check_outputs([params], [out], eos)[0]
    out.outputs[0].finish_reason = "length"
    assert any("did not end on EOS" in p for p in samples.check_outputs([params], [out], eos))


def test_engine_ends_a_dead_end_request_with_a_clear_reason():
    from deepinfer.sampling_params import SamplingParams

    from engine_helpers import TOY_EOS, ToyTokenizer, run_all, toy_engine

    alphabet = ToyTokenizer.ALPHABET
    tokens = tuple(["<bos>", "<eos>"] + list(alphabet[2:]))[:64]
    vocab = Vocabulary(tokens=tokens, vocab_size=64, stop_token_ids=(TOY_EOS,), vocab_type="raw")
    proc = StructuredOutputProcessor(vocab)
    engine = toy_engine(processors=[proc])
    params = [SamplingParams(temperature=0, max_tokens=8, so_args={"schema_type": "regex", "schema": "ab(é)"}),
              SamplingParams(temperature=0, max_tokens=8, so_args={"schema_type": "regex", "schema": "ab"})]
    dead, fine = run_all(engine, ["x", "y"], params)
    assert dead.outputs[0].finish_reason == DEAD_END and "admits no token after 2 generated tokens" in dead.error
    assert dead.outputs[0].text == "ab"
    assert fine.outputs[0].finish_reason == "stop" and fine.outputs[0].text == "ab"
    assert fine.outputs[0].token_ids[-1] == TOY_EOS


@pytest.mark.slow
def test_engine_imports_xgrammar_only_for_the_first_constrained_request(tiny_checkpoint):
    import subprocess
    import textwrap

    code = textwrap.dedent(f"""
        import sys
        from deepinfer import LLM, SamplingParams
        with LLM(model={str(tiny_checkpoint)!r}, accelerator="cpu", dtype="float32", max_model_len=64) as llm:
            llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
            assert "xgrammar" not in sys.modules, "xgrammar imported without a constrained request"
            [out] = llm.generate(["hi"], SamplingParams(max_tokens=8, so_args={{"schema_type": "regex", "schema": "ok"}}),
                                 use_tqdm=False)
            assert "xgrammar" in sys.modules and out.outputs[0].text == "ok", out
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_offline_inference_check_passes(tiny_checkpoint, capsys):
    offline_inference = load_example("offline_inference.py")

    assert offline_inference.main(["--model_name", str(tiny_checkpoint), "--check_structured_output"]) == 0
    captured = capsys.readouterr()
    assert "structured output check passed" in captured.err
    # only sample lines start with "DP <rank>;" on stdout: scripts parse them
    assert all(line.startswith("DP 0; INPUT: ") for line in captured.out.splitlines() if line.startswith("DP "))


@pytest.mark.slow
def test_offline_inference_check_exits_non_zero_on_a_violation(tiny_checkpoint):
    import subprocess
    import textwrap

    # The injected violation: the regex validator expects lower-case letters the constraint forbids.
    # `python -c` runs with the current folder first on sys.path: examples/, where the helper is.
    code = textwrap.dedent(f"""
        import runpy, sys
        import _structured_output as S
        S.VALIDATORS["regex"] = lambda schema, text: S.validate_regex("[a-z]{{2}}-[0-9]{{3}}", text)
        sys.argv = ["offline_inference.py", "--model_name", {str(tiny_checkpoint)!r}, "--check_structured_output"]
        runpy.run_path({str(EXAMPLES / "offline_inference.py")!r}, run_name="__main__")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=EXAMPLES)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "structured output check FAILED" in result.stderr
    assert "(regex): " in result.stderr and "does not fully match the regex '[a-z]{2}-[0-9]{3}'" in result.stderr
    assert "(json)" not in result.stderr  # only the injected violation is reported


def test_end_to_end_bench_prints_one_row_per_constraint_and_batch(tiny_checkpoint, capsys):
    """examples/structured_output_bench.py --end_to_end: output format only (no timing checked)."""
    structured_output_bench = load_example("structured_output_bench.py")

    assert structured_output_bench.main(["--end_to_end", str(tiny_checkpoint), "--pairs", "1", "--batches", "2",
                                         "--prompt_tokens", "4", "--max_tokens", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| constraint | batch | decode steps |")
    assert [row.split(" | ")[:2] for row in rows[1:]] == [["| json free strings", "2"], ["| regex (seed)", "2"]]
    for row in rows[1:]:
        assert len(row.strip("|").split(" | ")) == 9


def test_schema_keywords_the_grammar_cannot_enforce_are_found_where_they_are():
    from deepinfer.json_schema_support import unsupported_keyword

    ok = {"type": "object", "properties": {"not": {"type": "string", "maxLength": 3},  # a property named "not"
                                           "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}},
          "$defs": {"x": {"allOf": [{"type": "integer"}]}}}
    assert unsupported_keyword(ok) is None
    nested = {"type": "object", "properties": {"tags": {"type": "array", "items": {"anyOf": [
        {"type": "string"}, {"type": "array", "uniqueItems": True}]}}}}
    problem = unsupported_keyword(nested, "response_format.json_schema.schema")
    assert problem.startswith("response_format.json_schema.schema.properties.tags.items.anyOf.1: the JSON schema "
                              "keyword 'uniqueItems'")
    assert "'allOf' with 2 schemas" in unsupported_keyword({"allOf": [{"type": "integer"}, {"minimum": 3}]})


def test_an_offline_json_constraint_with_an_unenforceable_keyword_fails_alone(tiny_llm_for_schema):
    from deepinfer import SamplingParams

    bad = {"schema_type": "json", "schema": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}
    out_bad, out_ok = tiny_llm_for_schema.generate(
        [[5, 6], [5, 6]], [SamplingParams(so_args=bad, max_tokens=4),
                           SamplingParams(so_args={"schema_type": "json", "schema": {"type": "integer"}},
                                          max_tokens=4)],
        use_tqdm=False)
    assert out_bad.outputs[0].finish_reason == "error" and "'if'" in out_bad.error
    assert out_ok.outputs[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def tiny_llm_for_schema(tmp_path_factory):
    from deepinfer import LLM
    from deepinfer.models.deepseek_v4.make_model import make_model

    path = make_model(tmp_path_factory.mktemp("schema") / "m", "tiny", seed=0, with_mtp=False)
    llm = LLM(model=str(path), accelerator="cpu", dtype="float32", max_model_len=256)
    yield llm
    llm.shutdown()
