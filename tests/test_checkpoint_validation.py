"""Load-time validation of checkpoints: config.json types and ranges, safetensors file integrity,
shard-index paths and the hash-routing tables. Every problem is a `CheckpointError` raised while the
model is loaded (never later, inside generate) that names the key or file, the bad value and what
would be valid."""
from __future__ import annotations

import json
import math
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

from deepinfer.models.deepseek_v4.checkpoint import CheckpointError, load_checkpoint, parse_config, read_config
from deepinfer.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from deepinfer.models.deepseek_v4.make_model import SIZES, make_model, model_config, random_weights, write_safetensors


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("valid") / "sharded", "tiny", seed=3, max_shard_bytes=300_000)


@pytest.fixture(scope="module")
def tiny_config(tiny_v4) -> dict:
    return json.loads((tiny_v4 / "config.json").read_text())


def _config_only(path: Path, config) -> Path:
    """A checkpoint folder holding just `config.json`: the config is checked before any weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))  # NaN / Infinity as Python's json writes them
    return path


def _with(config: dict, **changes) -> dict:
    out = json.loads(json.dumps(config))
    for key, value in changes.items():
        node, *path = key.split("__")
        target = out
        for p in [node, *path][:-1]:
            target = target[p]
        target[[node, *path][-1]] = value
    return out


NAN, INF = float("nan"), float("inf")

# (key, bad value, words the message must contain: the key, the value as written, the valid range)
BAD_VALUES = [
    ("rms_norm_eps", -1e-6, ["rms_norm_eps", "-1e-06", ">= 0"]),
    ("rms_norm_eps", NAN, ["rms_norm_eps", "nan", "finite number >= 0"]),
    ("rms_norm_eps", INF, ["rms_norm_eps", "inf", "finite number >= 0"]),
    ("routed_scaling_factor", NAN, ["routed_scaling_factor", "nan", "finite number > 0"]),
    ("routed_scaling_factor", -INF, ["routed_scaling_factor", "-inf", "> 0"]),
    ("routed_scaling_factor", -1.5, ["routed_scaling_factor", "-1.5", "> 0"]),
    ("sliding_window", 0, ["sliding_window", "= 0", "integer in [1, "]),
    ("sliding_window", -8, ["sliding_window", "-8", "integer in [1, "]),
    ("max_position_embeddings", 0, ["max_position_embeddings", "= 0", "integer in [1, "]),
    ("max_position_embeddings", -512, ["max_position_embeddings", "-512", "integer in [1, "]),
    ("index_topk", 0, ["index_topk", "= 0", "integer in [1, "]),
    ("index_topk", -4, ["index_topk", "-4", "integer in [1, "]),
    ("hc_sinkhorn_iters", -1, ["hc_sinkhorn_iters", "-1", "integer in [1, "]),
    ("hc_sinkhorn_iters", 0, ["hc_sinkhorn_iters", "= 0", "integer in [1, "]),
    ("hidden_size", [64], ["hidden_size", "[64]", "a list", "integer in [1, "]),
    ("hidden_size", "64", ["hidden_size", "'64'", "a string", "integer in [1, "]),
    ("hidden_size", 64.0, ["hidden_size", "64.0", "a float", "integer in [1, "]),
    ("num_hidden_layers", True, ["num_hidden_layers", "True", "a bool", "integer in [1, "]),
    ("num_hidden_layers", 0, ["num_hidden_layers", "= 0", "integer in [1, "]),
    ("vocab_size", 0, ["vocab_size", "= 0", "integer in [1, "]),
    ("num_attention_heads", 0, ["num_attention_heads", "= 0", "integer in [1, "]),
    ("head_dim", 33, ["head_dim", "33", "even"]),
    ("q_lora_rank", 0, ["q_lora_rank", "= 0", "integer in [1, "]),
    ("o_lora_rank", -16, ["o_lora_rank", "-16", "integer in [1, "]),
    ("o_groups", 0, ["o_groups", "= 0", "integer in [1, "]),
    ("o_groups", 3, ["o_groups", "3", "divide num_attention_heads * head_dim = 128"]),
    ("index_n_heads", 0, ["index_n_heads", "= 0", "integer in [1, "]),
    ("index_head_dim", 4, ["qk_rope_head_dim", "8", "<= index_head_dim = 4"]),
    ("n_routed_experts", 0, ["n_routed_experts", "= 0", "integer in [1, "]),
    ("num_experts_per_tok", 9, ["num_experts_per_tok", "9", "<= n_routed_experts = 8"]),
    ("num_experts_per_tok", 0, ["num_experts_per_tok", "= 0", "integer in [1, "]),
    ("n_shared_experts", 2, ["n_shared_experts", "2", "integer in [0, 1]"]),
    ("moe_intermediate_size", 0, ["moe_intermediate_size", "= 0", "integer in [1, "]),
    ("swiglu_limit", -1.0, ["swiglu_limit", "-1.0", "finite number >= 0"]),
    ("rope_theta", 0, ["rope_theta", "= 0", "finite number > 1"]),
    ("compress_rope_theta", NAN, ["compress_rope_theta", "nan", "finite number > 1"]),
    ("hc_mult", 0, ["hc_mult", "= 0", "integer in [1, "]),
    ("hc_eps", NAN, ["hc_eps", "nan", "finite number >= 0"]),
    ("num_nextn_predict_layers", -1, ["num_nextn_predict_layers", "-1", "integer in [0, "]),
    ("partial_rotary_factor", 2.0, ["partial_rotary_factor", "2.0", "finite number in (0, 1]"]),
    ("scoring_func", 3, ["scoring_func", "3", "sqrtsoftplus"]),
    ("layer_types", "sliding_attention", ["layer_types", "'sliding_attention'", "a list"]),
    ("compress_rates", {CSA: 0, HCA: 16}, ["compress_rates", CSA, "= 0", "integer in [1, "]),
    ("compress_rates", [4, 16], ["compress_rates", "[4, 16]", "an object"]),
    ("rope_parameters__compress__factor", 0, ["factor", "= 0", "finite number >= 1"]),
    ("rope_parameters__compress__original_max_position_embeddings", 0,
     ["original_max_position_embeddings", "= 0", "integer in [1, "]),
    ("rope_parameters__compress__beta_fast", -32, ["beta_fast", "-32", "finite number > 0"]),
    ("bos_token_id", 512, ["bos_token_id", "512", "[0, 512)"]),
    ("eos_token_id", -1, ["eos_token_id", "-1", "[0, 512)"]),
    ("eos_token_id", [1, 600], ["eos_token_id", "600", "[0, 512)"]),
    ("eos_token_id", "1", ["eos_token_id", "'1'", "integer"]),
    ("quantization_config", [1], ["quantization_config", "[1]", "an object"]),
    # upper bounds: values that set work or memory (a hang, an allocation of terabytes)
    ("hc_sinkhorn_iters", 1000000000, ["hc_sinkhorn_iters", "1000000000", "integer in [1, 1000]"]),
    ("vocab_size", 2**40, ["vocab_size", str(2**40), "integer in [1, 4194304]"]),
    ("max_position_embeddings", 2**31, ["max_position_embeddings", str(2**31), "integer in [1, 16777216]"]),
    ("num_hidden_layers", 100000, ["num_hidden_layers", "100000", "integer in [1, 1024]"]),
    ("hc_mult", 4096, ["hc_mult", "4096", "integer in [1, 64]"]),
    ("sliding_window", 2**30, ["sliding_window", str(2**30), "integer in [1, 16777216]"]),
    ("rope_parameters__compress__original_max_position_embeddings", 2**40,
     ["original_max_position_embeddings", str(2**40), "integer in [1, 16777216]"]),
    # values that were accepted and ignored
    ("eos_token_id", [], ["eos_token_id = []", "empty", "null for none"]),
    ("tie_word_embeddings", "yes", ["tie_word_embeddings", "'yes'", "a string", "must be false"]),
    ("tie_word_embeddings", True, ["tie_word_embeddings = true", "separate output head"]),
    ("quantization_config", {"quant_method": "awq", "bits": 4},
     ["quantization_config.quant_method = 'awq'", "'fp8'", "keys deepinfer does not read: ['bits']"]),
    ("quantization_config", {"quant_method": "fp8", "activation_scheme": "static"},
     ["quantization_config.activation_scheme = 'static'", "'dynamic'"]),
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [64, 128]},
     ["quantization_config.weight_block_size = [64, 128]", "two equal integers"]),
    ("expert_dtype", "int4", ["expert_dtype = 'int4'", "'fp4' or 'fp8'"]),
    ("rope_parameters__main__rope_theta", 50000.0, ["rope_parameters.main.rope_theta = 50000.0",
                                                   "disagrees with rope_theta = 10000.0"]),
    ("rope_parameters__compress__rope_theta", 1.5, ["rope_parameters.compress.rope_theta = 1.5",
                                                   "disagrees with compress_rope_theta = 160000.0"]),
    ("rope_parameters__main__rope_type", "yarn", ["rope_parameters.main.rope_type = 'yarn'", "only the compress RoPE"]),
]


@pytest.mark.parametrize("key, value, words", BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES])
def test_bad_config_values_are_refused_when_loading(tmp_path, tiny_config, key, value, words):
    path = _config_only(tmp_path / "bad", _with(tiny_config, **{key: value}))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    message = str(e.value)
    assert "config.json" in message
    for w in words:
        assert w in message, (w, message)


@pytest.mark.parametrize("key, value, words", [
    ("window_size", 0, ["window_size", "= 0", "integer in [1, "]),  # an alias is reported under its own name
    ("n_hash_layers", -1, ["n_hash_layers", "-1", "integer in [0, "]),
    ("compress_ratios", [0, 4, -16, 0], ["compress_ratios", "-16", "integer in [0, "]),
    ("rope_factor", "16", ["rope_factor", "'16'", "finite number >= 1"]),
    ("original_seq_len", 32.5, ["original_seq_len", "32.5", "integer in [0, "]),
    ("route_scale", NAN, ["route_scale", "nan", "finite number > 0"]),
])
def test_official_spellings_are_checked_under_their_own_names(key, value, words):
    from test_model_config import OFFICIAL_ARGS

    with pytest.raises(CheckpointError) as e:
        DeepseekV4Config.from_dict({**OFFICIAL_ARGS, key: value})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("change, words", [
    (dict(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0, 0, 0]), ["compress_ratios has 46 entries", "one per layer",
                                                                    "num_hidden_layers = 43", "one 0 per MTP layer"]),
    (dict(compress_ratios=[0, 0] + [4, 128] * 20), ["compress_ratios has 42 entries", "num_hidden_layers = 43"]),
    (dict(num_hash_layers=100), ["num_hash_layers = 100", "<= num_hidden_layers = 43"]),
    (dict(rope_scaling={"factor": 0.5, "original_max_position_embeddings": 65536}),
     ["rope_scaling.factor = 0.5", "without rope_type 'yarn'"]),
    (dict(rope_scaling={"type": "default", "factor": 4}), ["rope_scaling.factor = 4", "without rope_type 'yarn'"]),
    (dict(rope_parameters={"compress": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}},
          rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 65536}),
     ["rope_parameters.compress and rope_scaling disagree"]),
], ids=["ratios-too-long", "ratios-too-short", "hash-layers", "factor-without-yarn", "factor-default-type",
        "two-scalings"])
def test_hub_values_that_were_silently_ignored_are_refused(change, words):
    from test_model_config import FLASH_HUB

    with pytest.raises(CheckpointError) as e:
        DeepseekV4Config.from_dict({**FLASH_HUB, **change})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_official_rope_factor_is_checked_even_without_yarn():
    from test_model_config import OFFICIAL_ARGS

    with pytest.raises(CheckpointError, match=r"rope_factor = 0.5 is out of range"):
        DeepseekV4Config.from_dict({**OFFICIAL_ARGS, "original_seq_len": 0, "rope_factor": 0.5})


def test_quantization_config_weight_block_size_is_used(tmp_path, tiny_config):
    """An FP8 block size other than the official 128 is read (not ignored): the tiny FP8 checkpoint's
    128-blocks then no longer fit their scales."""
    from test_model_config import FLASH_HUB

    transformers_block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                          "modules_to_not_convert": None, "dequantize": False, "scale_fmt": "float",
                          "expert_dtype": "fp8"}  # what transformers' FineGrainedFP8Config writes
    assert DeepseekV4Config.from_dict({**FLASH_HUB, "quantization_config": transformers_block})
    path = make_model(tmp_path / "fp8", "tiny", seed=3, quantize="fp8")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"does not fit the fp8 weight .* expected \("):
        load_checkpoint(path)


def test_every_problem_is_listed_in_one_error(tmp_path, tiny_config):
    path = _config_only(tmp_path / "bad", _with(tiny_config, sliding_window=0, rms_norm_eps=-1.0, hidden_size="x"))
    with pytest.raises(CheckpointError, match=r"has 3 invalid settings") as e:
        load_checkpoint(path)
    for key in ("sliding_window", "rms_norm_eps", "hidden_size"):
        assert key in str(e.value)


@pytest.mark.parametrize("document", [[], [{"hidden_size": 64}], "deepseek_v4", 3, None])
def test_config_json_must_be_an_object(tmp_path, document):
    path = _config_only(tmp_path / "bad", document)
    with pytest.raises(CheckpointError, match=r"config.json must hold a JSON object.*got"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="JSON object"):
        parse_config(document)


def test_config_json_that_is_not_json(tmp_path):
    path = tmp_path / "bad"
    path.mkdir()
    (path / "config.json").write_bytes(b"\xff\xfe{not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON"):
        read_config(path)


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match=r"sliding_window = 0 is out of range: must be an integer in \[1, 16777216\]"):
        DeepseekV4Config(sliding_window=0, layer_types=("sliding_attention",) * 43,
                         mlp_layer_types=("moe",) * 43)
    with pytest.raises(ValueError, match=r"(?s)invalid make-model settings.*rms_norm_eps = -1.0 is out of range"):
        model_config("tiny", rms_norm_eps=-1.0)


def test_llm_refuses_a_bad_config_when_built(tmp_path, tiny_config):
    from deepinfer import LLM

    path = _config_only(tmp_path / "bad", _with(tiny_config, sliding_window=0))
    with pytest.raises(CheckpointError,
                       match=r"sliding_window = 0 is out of range: must be an integer in \[1, 16777216\]"):
        LLM(model=str(path), accelerator="cpu")


@pytest.mark.parametrize("size", sorted(SIZES))
def test_presets_pass_validation(size):
    config, _ = model_config(size)
    assert DeepseekV4Config.from_dict(config.to_hf_dict()) == config


# --- safetensors file integrity ----------------------------------------------------------------------

def _split(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _pack(header, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _edit_header(edit):
    def mutate(raw: bytes) -> bytes:
        header, data = _split(raw)
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        edit(header, names, len(data))
        return _pack(header, data)
    return mutate


def _set(field, value_of):
    def edit(header, names, data_len):
        header[names[-1]][field] = value_of(header[names[-1]], data_len)
    return edit


CORRUPTIONS = {
    "empty": (lambda raw: b"", r"0 bytes, too short for the 8-byte header length"),
    "five bytes": (lambda raw: raw[:5], r"5 bytes, too short for the 8-byte header length"),
    "header longer than the file": (lambda raw: struct.pack("<Q", len(raw)) + raw[8:],
                                    r"header claims \d+ bytes but only \d+ follow"),
    "absurd header length": (lambda raw: struct.pack("<Q", 2**63) + raw[8:],
                             r"header claims 9223372036854775808 bytes"),
    "truncated data": (lambda raw: raw[:-100], r"ends at byte \d+ of the data but the file holds only \d+"),
    "trailing bytes": (lambda raw: raw + bytes(16), r"16 bytes after the last tensor"),
    "header not JSON": (lambda raw: raw[:8] + bytes(len(raw) - 8 - len(_split(raw)[1])) + _split(raw)[1],
                        r"header is not valid JSON"),
    "header a JSON list": (lambda raw: _pack([], _split(raw)[1]), r"header is not a JSON object"),
    "tensor entry not an object": (_edit_header(lambda h, names, n: h.__setitem__(names[0], [0, 1])),
                                   r"tensor \S+ must be an object with dtype, shape and data_offsets"),
    "offsets outside the file": (_edit_header(_set("data_offsets", lambda t, n: [t["data_offsets"][0], n + 64])),
                                 r"ends at byte \d+ of the data but the file holds only \d+"),
    "offsets reversed": (_edit_header(_set("data_offsets", lambda t, n: t["data_offsets"][::-1])),
                         r"data_offsets .* must be two integers 0 <= begin <= end"),
    "unknown dtype": (_edit_header(_set("dtype", lambda t, n: "Q7")), r"unsupported dtype 'Q7'"),
    "shape does not fit the bytes": (_edit_header(_set("shape", lambda t, n: [2 * x for x in t["shape"]])),
                                     r"shape \[.*\] x \d+ bytes = \d+ bytes but data_offsets span \d+"),
    "negative dimension": (_edit_header(_set("shape", lambda t, n: [-1] + t["shape"][1:])),
                           r"shape .* must be a list of non-negative integers"),
    "overlapping tensors": (_edit_header(lambda h, names, n: h[names[1]].__setitem__(
        "data_offsets", [h[names[0]]["data_offsets"][0], h[names[0]]["data_offsets"][0]
                         + h[names[1]]["data_offsets"][1] - h[names[1]]["data_offsets"][0]])),
        r"overlap|gap"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_safetensors_files_are_named(tiny_v4, tmp_path, case):
    mutate, pattern = CORRUPTIONS[case]
    bad = tmp_path / "bad"
    shutil.copytree(tiny_v4, bad)
    file = bad / "model.safetensors"
    file.write_bytes(mutate(file.read_bytes()))
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_checkpoint(bad)
    assert str(file) in str(e.value) and "truncated or corrupt" in str(e.value)


def test_an_intact_copy_loads(tiny_v4, tmp_path):
    good = tmp_path / "good"
    shutil.copytree(tiny_v4, good)
    file = good / "model.safetensors"
    file.write_bytes(_edit_header(lambda h, names, n: None)(file.read_bytes()))  # re-packed header, same data
    assert set(load_checkpoint(good, torch.float32)[1]) == set(load_checkpoint(tiny_v4, torch.float32)[1])


# --- non-finite values ---------------------------------------------------------------------------------

def _poisoned_copy(source: Path, dest: Path, change) -> Path:
    """A copy of a single-file checkpoint with `change(tensors)` applied to its tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _set(name: str, index, value: float):
    def change(tensors):
        tensors[name][index] = value
    return change


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("valid") / "fp8", "tiny", seed=3, quantize="fp8")


@pytest.mark.parametrize("name, index, value", [
    ("model.norm.weight", (5,), NAN),  # a norm weight
    ("model.layers.1.self_attn.kv_norm.weight", (0,), INF),
    ("model.embed_tokens.weight", (300, 7), NAN),  # one embedding row: the embedding is read whole
    ("model.layers.2.mlp.gate.e_score_correction_bias", (2,), -INF),
    ("model.layers.1.attn_hc.scale", (1,), NAN),  # an mHC parameter
], ids=["final-norm", "kv-norm", "embedding-row", "router-bias", "mhc-scale"])
def test_non_finite_weights_are_refused_at_load(tiny_v4, tmp_path, name, index, value):
    bad = _poisoned_copy(tiny_v4, tmp_path / "bad", _set(name, index, value))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad, torch.float32)
    message = str(e.value)
    assert f"tensor {name}" in message and f"at index {list(index)}" in message and "non-finite" in message
    assert str(bad / "model.safetensors") in message


def test_a_nan_fp8_scale_is_refused_at_load(fp8_tiny, tmp_path):
    def change(tensors):
        scale = tensors["layers.0.attn.wkv.scale"]
        scale.view(torch.uint8)[0, 0] = 0xFF  # ue8m0's NaN encoding
    bad = _poisoned_copy(fp8_tiny, tmp_path / "bad", change)
    for kept in ((), ("fp8_block128", "fp4_e2m1")):  # dequantised on load, or kept quantised
        with pytest.raises(CheckpointError, match=r"tensor layers\.0\.attn\.wkv\.scale .* holds a non-finite value "
                                                  r"\(nan\) at index \[0, 0\]"):
            load_checkpoint(bad, torch.float32, weight_formats=kept)


def test_llm_refuses_nan_weights_instead_of_emitting_token_0_forever(tiny_v4, tmp_path):
    from deepinfer import LLM

    bad = _poisoned_copy(tiny_v4, tmp_path / "bad", lambda t: t["model.norm.weight"].fill_(NAN))
    with pytest.raises(CheckpointError, match=r"tensor model\.norm\.weight .* non-finite"):
        LLM(model=str(bad), accelerator="cpu", dtype="float32", max_model_len=64, max_num_seqs=2)


def test_first_nonfinite_reads_small_tensors_whole_and_large_ones_at_sampled_rows():
    from deepinfer.models.common.finite import SAMPLED_ROWS, WHOLE_LIMIT, first_nonfinite

    small = torch.zeros(64, 64)
    small[37, 5] = NAN
    assert first_nonfinite(small) == (37, 5)
    rows = 4 * WHOLE_LIMIT // 256
    large = torch.zeros(rows, 256, dtype=torch.bfloat16)
    large[rows - 1, 3] = INF  # the last row is always among the sampled ones
    assert first_nonfinite(large) == (rows - 1, 3)
    large[rows - 1, 3] = 0
    large[1, 9] = NAN  # not a sampled row (the rows are spread over the tensor)
    assert SAMPLED_ROWS < rows // 2 and first_nonfinite(large) is None and first_nonfinite(large, whole=True) == (1, 9)
    codes = torch.zeros(4, 8, dtype=torch.uint8)
    codes[2, 6] = 0x7F  # FP8 e4m3's NaN
    assert first_nonfinite(codes.view(torch.float8_e4m3fn)) == (2, 6)
    codes[2, 6] = 0xFF  # ue8m0's NaN
    assert first_nonfinite(codes.view(torch.float8_e8m0fnu)) == (2, 6)
    assert first_nonfinite(codes.view(torch.int8)) is None  # packed FP4 / integers: no NaN to have
    assert first_nonfinite(torch.tensor(float("nan"))) == ()  # a scalar


# --- shard index paths -------------------------------------------------------------------------------

def _rewrite_index(folder: Path, change) -> str:
    """Point the entries of one shard elsewhere; returns the first tensor (in index order) of that shard."""
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    names = [k for k, v in index["weight_map"].items() if v == shard]
    for k in names:
        index["weight_map"][k] = change(shard)
    index_file.write_text(json.dumps(index))
    return names[0]


def test_index_entry_with_parent_directory(sharded, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(sharded, bad)
    shard = sorted(p.name for p in bad.glob("*.safetensors"))[0]
    shutil.copy(bad / shard, tmp_path / shard)  # the file really exists outside the folder
    tensor = _rewrite_index(bad, lambda s: f"../{s}")
    pattern = rf"weight_map entry '{re.escape(tensor)}': '\.\./{shard}' points outside"
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(bad)


def test_index_entry_with_absolute_path(sharded, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(sharded, bad)
    shard = sorted(p.name for p in bad.glob("*.safetensors"))[0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(bad / shard, elsewhere / shard)
    _rewrite_index(bad, lambda s: str(elsewhere / s))
    pattern = rf"'{re.escape(str(elsewhere / shard))}' points outside the checkpoint folder"
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(bad)


def test_index_entry_that_is_a_symlink_out_of_the_folder(sharded, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(sharded, bad)
    shard = sorted(p.name for p in bad.glob("*.safetensors"))[0]
    (bad / shard).rename(tmp_path / shard)
    (bad / shard).symlink_to(tmp_path / shard)
    pattern = rf"'{shard}' is a symlink to {re.escape(str((tmp_path / shard).resolve()))}, outside"
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(bad)


def test_hugging_face_cache_blob_symlinks_are_allowed(sharded, tmp_path):
    """The hub cache keeps every file in `blobs/` and links it from `snapshots/<revision>/`."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(sharded.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    assert set(load_checkpoint(snapshot, torch.float32)[1]) == set(load_checkpoint(sharded, torch.float32)[1])


def test_single_file_symlink_out_of_the_folder_is_refused_like_an_index_entry(tiny_v4, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(tiny_v4, bad)
    (bad / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (bad / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    pattern = (rf"the checkpoint file {re.escape(str(bad / 'model.safetensors'))} is a symlink to "
               rf"{re.escape(str((tmp_path / 'elsewhere.safetensors').resolve()))}, outside the checkpoint folder")
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(bad)
    inside = tmp_path / "inside"  # a link to a file inside the folder is fine
    shutil.copytree(tiny_v4, inside)
    (inside / "model.safetensors").rename(inside / "weights.bin")
    (inside / "model.safetensors").symlink_to("weights.bin")
    assert set(load_checkpoint(inside, torch.float32)[1]) == set(load_checkpoint(tiny_v4, torch.float32)[1])


def test_hugging_face_cache_single_file_blob_is_allowed(tiny_v4, tmp_path):
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(p for p in tiny_v4.iterdir() if p.is_file())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    assert set(load_checkpoint(snapshot, torch.float32)[1]) == set(load_checkpoint(tiny_v4, torch.float32)[1])


def _replace_with(path: Path, kind: str) -> str:
    """Put a `kind` thing where the file `path` was; the words the error must use for it."""
    import os

    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
        return "is a named pipe (FIFO), not a regular file"
    if kind == "directory":
        path.mkdir()
        return "is a directory, not a regular file"
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
        return "is a character device, not a regular file"
    path.symlink_to(path.parent / "gone")  # a dangling symlink
    return "is a symlink to"


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero", "dangling"])
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "model.safetensors.index.json", "shard"])
def test_special_files_are_named_not_reported_missing(tiny_v4, sharded, tmp_path, name, kind):
    from deepinfer import LLM

    bad = tmp_path / "ckpt"
    shutil.copytree(sharded if name in ("model.safetensors.index.json", "shard") else tiny_v4, bad)
    target = bad / (sorted(p.name for p in bad.glob("model-*.safetensors"))[0] if name == "shard" else name)
    words = _replace_with(target, kind)
    for load in (lambda: load_checkpoint(bad), lambda: LLM(model=str(bad), accelerator="cpu")):
        with pytest.raises(CheckpointError) as e:
            load()
        assert str(target) in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.parametrize("index, pattern", [
    ({"weight_map": {"embed.weight": 3}}, r"weight_map entry 'embed.weight': 3 must be a file name"),
    ({"weight_map": {"embed.weight": ""}}, r"weight_map entry 'embed.weight': '' must be a file name"),
    ({"weight_map": ["model-00001-of-00002.safetensors"]}, r"'weight_map' must be an object"),
    ([], r"must hold a JSON object"),
])
def test_malformed_index(sharded, tmp_path, index, pattern):
    bad = tmp_path / "ckpt"
    shutil.copytree(sharded, bad)
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(bad)


# --- the hash-routing table --------------------------------------------------------------------------

def _official_checkpoint(path: Path, change) -> Path:
    config, _ = model_config("tiny")
    weights = random_weights(config, seed=3, with_mtp=True)
    change(weights)
    path.mkdir(parents=True)
    write_safetensors(weights, path)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return path


@pytest.mark.parametrize("value", [8, 1000, -1])
def test_tid2eid_out_of_range_is_refused_at_load(tmp_path, value):
    def change(w):
        w["layers.1.ffn.gate.tid2eid"][5, 1] = value

    path = _official_checkpoint(tmp_path / "bad", change)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    message = str(e.value)
    assert "layers.1.ffn.gate.tid2eid" in message and "[0, 8)" in message and "n_routed_experts" in message
    assert f"token 5 -> expert {value}" in message


def test_tid2eid_must_be_integers(tmp_path):
    def change(w):
        w["layers.0.ffn.gate.tid2eid"] = w["layers.0.ffn.gate.tid2eid"].float() + 0.5

    path = _official_checkpoint(tmp_path / "bad", change)
    with pytest.raises(CheckpointError, match=r"layers.0.ffn.gate.tid2eid: dtype torch.float32, expected an integer"):
        load_checkpoint(path)


def test_model_load_weights_checks_tid2eid_too():
    from model_harness import accelerator

    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    config, _ = model_config("tiny")
    weights = random_weights(config, seed=3, with_mtp=False)
    weights["layers.0.ffn.gate.tid2eid"][0, 0] = config.n_routed_experts
    model = DeepseekV4ForCausalLM(config, accelerator(), dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"layers.0.ffn.gate.tid2eid.*token 0 -> expert 8"):
        model.load_weights(weights)


def test_valid_values_are_still_accepted(tiny_config):
    # the edges of the ranges: zero epsilons, swiglu_limit 0 (no clamp), a single expert per token
    cfg = DeepseekV4Config.from_dict(_with(tiny_config, rms_norm_eps=0.0, hc_eps=0, swiglu_limit=0,
                                           num_experts_per_tok=1, index_topk=1, sliding_window=1,
                                           max_position_embeddings=1, eos_token_id=[1, 511]))
    assert cfg.sliding_window == 1 and cfg.eos_token_id == (1, 511) and math.isclose(cfg.rms_norm_eps, 0.0)
