import pytest

from deepinfer import SamplingParams as LazySamplingParams
from deepinfer.sampling_params import SamplingParams


def test_public_imports_are_the_same_class():
    assert LazySamplingParams is SamplingParams


def test_defaults_are_vllm_like():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1.0, 1.0, 0, 0.0, 16)
    assert p.stop_strings == [] and p.stop_token_ids is None and p.logprobs is None
    assert not p.greedy


def test_normalisation():
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(top_k=-1).effective_top_k == 0
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize("field, value, words", [
    ("temperature", -0.1, ">= 0"),
    ("temperature", float("nan"), "finite"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_k", -2, "0 / -1"),
    ("top_k", 2.5, "integer"),
    ("min_p", 1.5, "[0, 1]"),
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", True, "integer"),
    ("min_tokens", -1, ">= 0"),
    ("logprobs", -1, ">= 0"),
    ("seq_seed", "7", "integer"),
    ("stop", [1, 2], "strings"),
    ("stop", [""], "empty"),
    ("stop_token_ids", [-1], "non-negative"),
    ("ignore_eos", 1, "True or False"),
    ("so_args", {"schema": "x"}, "schema_type"),
    ("so_args", {"schema_type": "yaml", "schema": "x"}, "regex, json, ebnf"),
    ("so_args", {"schema_type": "json", "schema": 3}, "json.dumps"),
    ("so_args", {"schema_type": "regex", "schema": ""}, "non-empty"),
])
def test_invalid_values_raise_clear_value_error(field, value, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert f"SamplingParams.{field}" in message and words in message


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="must not exceed max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_so_args_is_opaque_but_shaped():
    so = {"schema_type": "regex", "schema": "[a-z]+"}
    assert SamplingParams(so_args=so).so_args == so


def test_clone_validates_changes():
    p = SamplingParams(temperature=0.5, stop="x")
    assert p.clone(max_tokens=3).max_tokens == 3 and p.clone().stop_strings == ["x"]
    with pytest.raises(ValueError):
        p.clone(top_p=0)
