"""DeepSeek-V4.1 checkpoints: config parsing, the release layout make-model writes, loading (dequantised
weights, memory-mapped Engram tables, the tokenizer-derived Engram vocabulary) and the errors, with
NVIDIA NeMo AutoModel's V4.1 as the independent oracle for the format."""
from __future__ import annotations

import json
import logging
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.models.common import quant
from deepinfer.models.common.errors import CheckpointError
from deepinfer.models.common.safetensors_io import read_headers, safetensors_files, write_safetensors
from deepinfer.models.deepseek_v41.checkpoint import TOKEN_MAP, load_checkpoint, parse_config
from deepinfer.models.deepseek_v41.config import FULL, REINDEX, REUSE, SLIDING
from deepinfer.models.deepseek_v41.engram_vocab import compressed_token_map
from deepinfer.entrypoints.make_model import main
from deepinfer.models.deepseek_v41.make_model import SIZES, count_parameters, make_model, model_config
from deepinfer.models.deepseek_v41.weights import canonicalize, expected_weight_shapes, weight_kind
from deepinfer.tokenizer import default_tokenizer_path, load_tokenizer
from conftest import TINY_SEED
from v41_oracle import build_nemo_model, fast_tokenizer, read_release_tensors

NEMO_REASON = "nemo-automodel (the independent DeepSeek-V4.1 oracle) is not installed; see scripts/setup_env.sh"


@pytest.fixture(scope="module")
def loaded(tiny_v41):
    return load_checkpoint(tiny_v41, torch.float32)


@pytest.fixture(scope="module")
def nemo_model(tiny_v41):
    pytest.importorskip("nemo_automodel.components.models.deepseek_v41.model", reason=NEMO_REASON)
    return build_nemo_model(tiny_v41)


def copy_with(src: Path, dst: Path, edit=None, rename=None, single_file: bool = False) -> Path:
    """A copy of a checkpoint whose tensors went through `edit(dict)` (in place) and `rename(name)`."""
    tensors = read_release_tensors(src)
    if edit is not None:
        edit(tensors)
    if rename is not None:
        tensors = {rename(k): v for k, v in tensors.items()}
    dst.mkdir(parents=True)
    write_safetensors(tensors, dst, max_shard_bytes=2**40 if single_file else 256 * 2**10)
    shutil.copyfile(src / "config.json", dst / "config.json")
    shutil.copytree(src / "tokenizer", dst / "tokenizer")
    return dst


# --- config ----------------------------------------------------------------------------------

def test_config_errors_name_the_keys(tiny_v41):
    good = json.loads((tiny_v41 / "config.json").read_text())
    bad = {**good, "text_config": {**good["text_config"], "hidden_size": -4, "index_topk": "many"}}
    with pytest.raises(CheckpointError) as e:
        parse_config(bad, "x/config.json")
    assert "text_config.hidden_size" in str(e.value) and "text_config.index_topk" in str(e.value)

    blocks = {**good, "quantization_config": {**good["quantization_config"], "weight_block_size": [32, 64]}}
    with pytest.raises(CheckpointError, match=r"quantization_config\.weight_block_size = \[32, 64\]"):
        parse_config(blocks)
    with pytest.raises(CheckpointError, match="model_type 'deepseek_v4' is not supported.*deepseek_v41"):
        parse_config({**good, "model_type": "deepseek_v4"})
    roles = {**good, "text_config": {**good["text_config"], "engram_head_dim": 48}}
    with pytest.raises(CheckpointError, match="text_config.engram_head_dim = 48 must be a multiple of 32"):
        parse_config(roles)


def _text(**changes):
    return ("text_config", changes)


V41_BAD = [
    (_text(hc_sinkhorn_iters=1000000000), ["text_config.hc_sinkhorn_iters = 1000000000", "integer in [1, 1000]"]),
    (_text(vocab_size=2**40), ["text_config.vocab_size", "integer in [1, 4194304]"]),
    (_text(num_hidden_layers=5000), ["text_config.num_hidden_layers = 5000", "integer in [1, 1024]"]),
    (_text(engram_num_embeddings=[601, 2**50]), ["text_config.engram_num_embeddings", "row counts in [1, "]),
    (_text(compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0, 0]),
     ["text_config.compress_ratios has 13 entries", "one 0 per DSpark stage"]),
    (_text(num_nextn_predict_layers=3, dspark_target_layer_ids=[5, 6, 7],
           compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0, 4, 0]),
     ["DSpark stages", "must be 0", "[0, 4, 0]"]),
    (_text(tie_word_embeddings="yes"), ["text_config.tie_word_embeddings = 'yes'", "must be false"]),
    (("tie_word_embeddings", True), ["tie_word_embeddings = true", "separate output head"]),
    (("eos_token_id", []), ["eos_token_id = [] is empty"]),
    (("quantization_config", {"quant_method": "gptq"}), ["quantization_config.quant_method = 'gptq'"]),
    (("quantization_config", [1]), ["quantization_config = [1]", "an object"]),
    (("vision_config", "none"), ["vision_config = 'none'", "an object or null"]),
    (_text(rope_scaling={"type": "linear", "factor": 0.5}), ["text_config.rope_scaling.type = 'linear'"]),
    (_text(rope_scaling={"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}),
     ["text_config.rope_scaling.factor = 0.5 is out of range"]),
]


@pytest.mark.parametrize("change, words", V41_BAD, ids=[f"{k}:{sorted(v) if isinstance(v, dict) else v!r:.40}"
                                                       for (k, v), _ in V41_BAD])
def test_values_that_were_unbounded_or_ignored_are_refused(tiny_v41, change, words):
    good = json.loads((tiny_v41 / "config.json").read_text())
    key, value = change
    bad = {**good, "text_config": {**good["text_config"], **value}} if key == "text_config" else {**good, key: value}
    with pytest.raises(CheckpointError) as e:
        parse_config(bad)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert "text_config.eos_token_id" not in str(e.value)  # top-level keys are named as spelt


def test_tiny_has_every_role_and_exact_engram_rows(tiny_v41, loaded):
    config, _ = loaded
    assert config.layer_roles == (SLIDING, SLIDING, FULL, REUSE, FULL, REUSE, REINDEX, REUSE)
    assert config.compress_ratios[2] == 2 and config.compress_ratios[4] == 1
    assert config.uses_candidates(6) and config.candidate_source_layer_id == 4
    assert [config.layer_roles[i] for i in config.engram_layer_ids] == [SLIDING, FULL]
    # the next unused primes above engram_vocab_size - 1, per layer, order and head (seen set shared)
    assert config.engram_num_embeddings == (601 + 607 + 613 + 617 + 619 + 631, 641 + 643 + 647 + 653 + 659 + 661)
    assert config.engram_compressed_vocab_size == compressed_token_map(tiny_v41 / "tokenizer" / "tokenizer.json")[1]


def test_other_sizes_are_valid():
    default, _ = model_config("default")
    bench, _ = model_config("bench")
    assert default.vocab_size == bench.vocab_size == 129280
    assert set(default.layer_roles) == {SLIDING, FULL, REUSE, REINDEX}
    assert count_parameters(default) < 30e6 and 0.5e9 < count_parameters(bench) < 1.5e9
    demo, _ = model_config("demo")  # the trained demo model's shape: every layer role, the real vocabulary
    assert set(demo.layer_roles) == {SLIDING, FULL, REUSE, REINDEX} and demo.vocab_size == 129280
    assert demo.num_nextn_predict_layers == 3 and demo.hidden_size == 256
    assert set(SIZES) == {"tiny", "default", "demo", "bench"}


# --- the files make-model writes ----------------------------------------------------------------

def test_release_layout_and_loaded_shapes(tiny_v41, loaded):
    config, tensors = loaded
    files = safetensors_files(tiny_v41)
    assert len(files) >= 2 and (tiny_v41 / "model.safetensors.index.json").is_file()
    assert all(f.name.startswith("model-0000") for f in files)
    assert (tiny_v41 / "tokenizer" / "tokenizer.json").is_file() and not (tiny_v41 / "tokenizer.json").exists()
    expected = expected_weight_shapes(config)
    assert set(tensors) == set(expected) | {TOKEN_MAP}
    assert {k: tuple(v.shape) for k, v in tensors.items() if k != TOKEN_MAP} == expected
    for name, t in tensors.items():
        kind = "map" if name == TOKEN_MAP else weight_kind(name)
        want = {"map": torch.int64, "fp32": torch.float32, "float": torch.float32}.get(kind)
        if kind == "quantized":
            want = torch.float8_e8m0fnu if name.endswith(".scale") else torch.float8_e4m3fn
        assert t.dtype == want, name
    assert "layers.4.attn.compressor.wgate.weight" not in tensors  # Full layer with ratio 1
    assert "layers.2.attn.compressor.wgate.weight" in tensors
    assert "layers.6.attn.indexer.wq_b.weight" in tensors and "layers.6.attn.indexer.wk.weight" not in tensors
    assert not any(k.startswith(("layers.3.attn.indexer", "layers.3.attn.compressor")) for k in tensors)


def test_every_quantised_tensor_is_quantised_on_disk(tiny_v41, loaded):
    config, _ = loaded
    entries = read_headers(safetensors_files(tiny_v41))
    checked = {"fp8": 0, "fp4": 0, "engram": 0}
    for name, shape in expected_weight_shapes(config).items():
        e, base = entries[name], name.removesuffix(".weight")
        if ".engram.embed." in name:
            if name.endswith(".weight"):
                assert e.dtype == torch.float8_e4m3fn and e.shape == shape
                assert entries[base + ".scale"].dtype == torch.float8_e8m0fnu
                assert entries[base + ".scale"].shape == (shape[0], shape[1] // 32)
                checked["engram"] += 1
        elif ".ffn.experts." in name:
            assert e.dtype == torch.int8 and e.shape == (shape[0], shape[1] // 2), name
            assert entries[base + ".scale"].shape == (shape[0], shape[1] // 32)
            assert entries[base + ".scale"].dtype == torch.float8_e8m0fnu
            checked["fp4"] += 1
        elif any(p in name for p in (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.",
                                     ".attn.indexer.wq_b.", ".shared_experts.", ".engram.wkv.")):
            assert e.dtype == torch.float8_e4m3fn, name
            assert entries[base + ".scale"].shape == tuple(math.ceil(n / 32) for n in shape)
            assert entries[base + ".scale"].dtype == torch.float8_e8m0fnu
            checked["fp8"] += 1
        else:
            assert e.dtype == torch.float32 and base + ".scale" not in entries, name
    # per layer 5 attention projections + 3 shared experts; 3 indexers (Full, Full, Reindex); 2 Engram wkv
    assert checked == {"fp8": 8 * 8 + 3 + 2, "fp4": 8 * 8 * 3, "engram": 2}


def test_make_model_is_deterministic_and_has_a_cli(tiny_v41, tmp_path, capsys):
    assert main([str(tmp_path / "same"), "--family", "v41", "--size", "tiny", "--seed", str(TINY_SEED)]) == 0
    assert "DeepSeek-V4.1 tiny" in capsys.readouterr().out
    for file in safetensors_files(tiny_v41):
        assert (tmp_path / "same" / file.name).read_bytes() == file.read_bytes()
    other = make_model(tmp_path / "other", seed=TINY_SEED + 1)
    assert read_release_tensors(other)["embed.weight"].ne(read_release_tensors(tiny_v41)["embed.weight"]).any()
    assert main([str(tmp_path / "same"), "--family", "v41"]) == 2  # exists


# --- loading ------------------------------------------------------------------------------------

def test_engram_tables_stay_memory_mapped(tiny_v41, loaded):
    config, tensors = loaded
    shards = {str(f.resolve()) for f in safetensors_files(tiny_v41)}
    mapped = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] in shards:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            mapped.append((lo, hi))
    for i in config.engram_layer_ids:
        for leaf in ("weight", "scale"):
            t = tensors[f"layers.{i}.engram.embed.{leaf}"]
            start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            assert any(lo <= start and end <= hi for lo, hi in mapped), f"layer {i} table {leaf} is not file-backed"
    assert not any(lo <= tensors["layers.0.attn.wq_a.weight"].data_ptr() < hi for lo, hi in mapped)  # dequantised


def test_memory_check_leaves_the_engram_tables_out(tiny_v41, loaded, monkeypatch):
    from deepinfer.models.common import checkpoint as common
    from deepinfer.models.common.errors import CheckpointTooLargeError

    config, _ = loaded
    in_ram = sum(math.prod(s) * 4 for k, s in expected_weight_shapes(config).items() if weight_kind(k) != "quantized")
    in_ram += config.vocab_size * 8  # the token map
    monkeypatch.setattr(common, "available_memory_bytes", lambda: in_ram)
    load_checkpoint(tiny_v41, torch.float32)  # fits exactly: the memory-mapped tables are not counted
    monkeypatch.setattr(common, "available_memory_bytes", lambda: in_ram - 1)
    with pytest.raises(CheckpointTooLargeError, match="make-model --family v41"):
        load_checkpoint(tiny_v41, torch.float32)


def test_token_map_is_the_tokenizers_compressed_vocabulary(tiny_v41, loaded):
    config, tensors = loaded
    token_map, size = compressed_token_map(tiny_v41 / "tokenizer" / "tokenizer.json")
    assert tensors[TOKEN_MAP].tolist() == token_map and len(token_map) == config.vocab_size
    assert size == config.engram_compressed_vocab_size == int(tensors[TOKEN_MAP].max()) + 1


def test_engram_vocabulary_size_must_match(tiny_v41, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_v41, bad)
    data = json.loads((bad / "config.json").read_text())
    right = data["text_config"]["engram_compressed_vocab_size"]
    data["text_config"]["engram_compressed_vocab_size"] = right + 1
    (bad / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad)
    message = str(e.value)
    assert "text_config.engram_compressed_vocab_size" in message and f"{right} " in message
    assert str(right + 1) in message and "checkpoint's own" in message

    (bad / "config.json").write_text((tiny_v41 / "config.json").read_text())
    shutil.move(bad / "tokenizer" / "tokenizer.json", bad / "tokenizer.json")  # root tokenizer also works
    assert TOKEN_MAP in load_checkpoint(bad)[1]
    (bad / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="Engram layers .* but no tokenizer"):
        load_checkpoint(bad)


def test_load_tokenizer_finds_the_tokenizer_folder(tiny_v41):
    tok = load_tokenizer(tiny_v41, vocab_size=512)
    assert tok.source.endswith("tokenizer/tokenizer.json") and tok.vocab_size == 512


def test_encoding_py_is_never_executed(tiny_v41, tmp_path):
    ckpt = tmp_path / "with_encoding"
    shutil.copytree(tiny_v41, ckpt)
    marker = tmp_path / "executed"
    (ckpt / "encoding").mkdir()
    (ckpt / "encoding" / "encoding.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nraise RuntimeError('encoding.py must never run')\n")
    (ckpt / "encoding" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config, tensors = load_checkpoint(ckpt)
    load_tokenizer(ckpt, vocab_size=config.vocab_size)
    assert not marker.exists() and "encoding" not in sys.modules and "encoding.encoding" not in sys.modules


def test_non_backbone_tensors_are_skipped(tiny_v41, tmp_path, caplog):
    def add(t):
        t["mtp.0.attn.wq_a.weight"] = torch.zeros(4, 4)
        t["vision.patch_embed.weight"] = torch.zeros(2)
        t["aligner.proj.weight"] = torch.zeros(2)
        t["image_start"] = torch.zeros(64)
    ckpt = copy_with(tiny_v41, tmp_path / "extra", edit=add)
    with caplog.at_level(logging.INFO, logger="deepinfer.models.deepseek_v41.checkpoint"):
        _, tensors = load_checkpoint(ckpt, torch.float32)
    assert not any(k.startswith(("mtp.", "vision.", "aligner.", "image_")) for k in tensors)
    assert "mtp.*: 1" in caplog.text and "vision.*: 1" in caplog.text and "image_start*: 1" in caplog.text


def test_prefixed_single_file_checkpoint_loads_the_same(tiny_v41, loaded, tmp_path):
    ckpt = copy_with(tiny_v41, tmp_path / "prefixed", rename=lambda k: "model." + k, single_file=True)
    assert (ckpt / "model.safetensors").is_file() and not (ckpt / "model.safetensors.index.json").exists()
    _, tensors = load_checkpoint(ckpt, torch.float32)
    assert tensors.keys() == loaded[1].keys()
    assert all(torch.equal(tensors[k].view(torch.uint8) if tensors[k].itemsize == 1 else tensors[k],
                           v.view(torch.uint8) if v.itemsize == 1 else v) for k, v in loaded[1].items())


def test_problems_are_listed_together_by_name(tiny_v41, tmp_path):
    def damage(t):
        del t["layers.2.attn.compressor.norm.weight"]  # missing
        t["layers.0.attn.attn_sink"] = torch.zeros(5)  # wrong shape
        del t["layers.5.attn.wkv.scale"]  # FP8 weight without its scale
        t["layers.3.ffn.shared_experts.w2.scale"] = torch.ones(1, 1).to(torch.float8_e8m0fnu)  # wrong scale shape
        t["layers.4.attn.compressor.wgate.weight"] = torch.zeros(32, 64)  # ratio 1: no gate
        t["layers.1.engram.embed.weight"] = t["layers.1.engram.embed.weight"].to(torch.bfloat16)  # not FP8
    ckpt = copy_with(tiny_v41, tmp_path / "damaged", edit=damage)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt)
    message = str(e.value)
    for name in ("layers.2.attn.compressor.norm.weight", "layers.0.attn.attn_sink", "layers.5.attn.wkv.weight",
                 "layers.5.attn.wkv.scale", "layers.3.ffn.shared_experts.w2.scale",
                 "layers.4.attn.compressor.wgate.weight", "layers.1.engram.embed.weight"):
        assert name in message, name
    assert "missing tensors" in message and "unexpected tensors" in message and "wrong shape" in message


@pytest.mark.parametrize("name, index, value", [
    ("norm.weight", (3,), float("nan")),
    ("embed.weight", (200, 5), float("inf")),
    ("layers.5.attn.wkv.scale", (0, 0), None),  # ue8m0's NaN encoding in an FP8 scale
    ("layers.1.engram.embed.scale", (0, 0), None),  # a memory-mapped Engram table's scale
], ids=["norm", "embedding-row", "fp8-scale", "engram-scale"])
def test_non_finite_values_are_refused_at_load(tiny_v41, tmp_path, name, index, value):
    def poison(t):
        if value is None:
            t[name].view(torch.uint8)[index] = 0xFF
        else:
            t[name][index] = value
    ckpt = copy_with(tiny_v41, tmp_path / "poisoned", edit=poison)
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} .* holds a non-finite value .* at index "
                                              rf"{re.escape(str(list(index)))}"):
        load_checkpoint(ckpt, torch.float32)


def test_canonicalize_accepts_nemo_native_names():
    D, I, E = 4, 2, 3
    gate_up, down = torch.randn(E, D, 2 * I), torch.randn(E, I, D)
    out = canonicalize({"model.embed_tokens.weight": torch.zeros(1), "lm_head.weight": torch.zeros(1),
                        "model.norm.weight": torch.zeros(1), "model.layers.0.attn_hc.fn": torch.zeros(1),
                        "model.layers.0.ffn_hc.scale": torch.zeros(1),
                        "model.layers.0.attn.sinks_param.weight": torch.zeros(1),
                        "model.layers.0.ffn.gate.e_score_correction_bias": torch.zeros(1),
                        "model.layers.0.ffn.shared_experts.up_proj.weight": torch.zeros(1),
                        "model.layers.0.ffn.experts.gate_and_up_projs": gate_up,
                        "model.layers.0.ffn.experts.down_projs": down,
                        "layers.1.attn.wq_a.weight_scale_inv": torch.zeros(1)})
    assert {"embed.weight", "head.weight", "norm.weight", "layers.0.hc_attn_fn", "layers.0.hc_ffn_scale",
            "layers.0.attn.attn_sink", "layers.0.ffn.gate.bias", "layers.0.ffn.shared_experts.w3.weight",
            "layers.1.attn.wq_a.scale"} <= set(out)
    assert torch.equal(out["layers.0.ffn.experts.2.w1.weight"], gate_up[2, :, :I].T)
    assert torch.equal(out["layers.0.ffn.experts.2.w3.weight"], gate_up[2, :, I:].T)
    assert torch.equal(out["layers.0.ffn.experts.1.w2.weight"], down[1].T)


# --- NeMo AutoModel as the oracle --------------------------------------------------------------

@pytest.mark.slow
def test_make_model_output_loads_into_nemo_strictly_with_the_same_weights(nemo_model, loaded):
    """build_nemo_model loads with strict=True (no missing or unexpected key); NeMo's own
    dequantisation of every tensor equals ours (Engram tables: ours kept FP8, dequantised here)."""
    config, tensors = loaded
    native = canonicalize(nemo_model.state_dict())
    expected = expected_weight_shapes(config)
    assert set(native) == {k for k in expected if not k.endswith(".engram.embed.scale")}
    for name, value in native.items():
        ours = tensors[name]
        if name.endswith(".engram.embed.weight"):
            ours = quant.dequantize_fp8_rows(ours, tensors[name.removesuffix(".weight") + ".scale"])
        assert torch.equal(ours.float(), value.float()), name
    assert torch.equal(nemo_model.model.engram_hash.token_map, tensors[TOKEN_MAP])


@pytest.mark.slow
def test_nemo_dequantisation_of_the_stored_tensors_matches(tiny_v41, loaded):
    pytest.importorskip("nemo_automodel.components.models.deepseek_v41.model", reason=NEMO_REASON)
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight

    raw, tensors = read_release_tensors(tiny_v41), loaded[1]
    for name in ("layers.2.attn.wq_b.weight", "layers.6.attn.indexer.wq_b.weight", "layers.4.engram.wkv.weight",
                 "layers.0.ffn.experts.5.w2.weight", "layers.7.ffn.shared_experts.w1.weight"):
        nemo = dequantize_checkpoint_weight(raw[name], raw[name.removesuffix(".weight") + ".scale"],
                                            dtype=torch.float32)
        assert torch.equal(nemo, tensors[name]), name
    table = "layers.1.engram.embed."
    nemo = dequantize_checkpoint_weight(raw[table + "weight"], raw[table + "scale"], dtype=torch.float32, rowwise=True)
    assert torch.equal(nemo, quant.dequantize_fp8_rows(tensors[table + "weight"], tensors[table + "scale"]))


@pytest.mark.parametrize("which", ["real", "tiny"])
@pytest.mark.slow
def test_compressed_vocabulary_equals_nemos(which, tiny_v41):
    pytest.importorskip("nemo_automodel.components.models.deepseek_v41.engram", reason=NEMO_REASON)
    from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map

    path = default_tokenizer_path() if which == "real" else tiny_v41 / "tokenizer" / "tokenizer.json"
    ours, size = compressed_token_map(path)
    theirs, their_size = _compressed_token_map(fast_tokenizer(path))
    assert (ours, size) == (list(theirs), their_size)
    assert size == (99092 if which == "real" else len(set(ours)))
    assert len(ours) == (129280 if which == "real" else 512)
