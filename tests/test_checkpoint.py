"""Checkpoint loading: naming forms, FP8/FP4 dequantisation, shards, errors, model resolution."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.models.deepseek_v4 import checkpoint as ckpt
from deepinfer.models.deepseek_v4.checkpoint import CheckpointError, CheckpointTooLargeError, load_checkpoint
from deepinfer.models.deepseek_v4.make_model import make_model, model_config, random_weights
from deepinfer.models.deepseek_v4.weights import to_hf_names
from deepinfer.models.resolve import resolve_model

from conftest import TINY_SEED


@pytest.fixture(scope="module")
def reference():
    """The tiny model's tensors as generated (official names, fp32)."""
    config, _ = model_config("tiny")
    return random_weights(config, seed=TINY_SEED, with_mtp=True, dtype=torch.float32)


def _write(path: Path, tensors: dict, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def _config_dict(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# --- naming forms --------------------------------------------------------------------------------

def test_hf_names_load_to_the_generated_tensors(tiny_v4, reference):
    config, tensors = load_checkpoint(tiny_v4, torch.float32)
    assert config.num_nextn_predict_layers == 1 and any(k.startswith("mtp.0.") for k in tensors)
    _assert_same(tensors, {k: v.long() if k.endswith("tid2eid") else v for k, v in reference.items()})


def test_official_hf_and_hybrid_names_give_identical_tensors(tiny_v4, reference, tmp_path):
    from transformers import DeepseekV4ForCausalLM

    _, from_hf = load_checkpoint(tiny_v4, torch.float32)
    official = _write(tmp_path / "official", {k: v.to(torch.int32) if k.endswith("tid2eid") else v
                                              for k, v in reference.items()}, _config_dict(tiny_v4))
    _, from_official = load_checkpoint(official, torch.float32)
    _assert_same(from_official, from_hf)

    # transformers' save_pretrained writes the hybrid naming (and drops mtp.*)
    model = DeepseekV4ForCausalLM.from_pretrained(tiny_v4, dtype=torch.float32)
    model.save_pretrained(tmp_path / "hybrid")
    saved = set(load_file(str(next((tmp_path / "hybrid").glob("*.safetensors")))))
    assert "model.layers.0.attn.wq_a.weight" in saved  # really the hybrid form
    config, from_hybrid = load_checkpoint(tmp_path / "hybrid", torch.float32)
    assert config.num_nextn_predict_layers == 0  # no mtp.* tensors: loaded without MTP
    _assert_same(from_hybrid, {k: v for k, v in from_hf.items() if not k.startswith("mtp.")})


def _our_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    from model_harness import Runner, accelerator

    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    config, tensors = load_checkpoint(path, torch.float32)
    model = DeepseekV4ForCausalLM(config, accelerator(), dtype=torch.float32, device="cpu")
    model.load_weights(tensors)
    runner = Runner(model)
    runner.add("seq")
    return runner.step({"seq": tokens})["seq"]


def test_naming_forms_give_identical_logits_that_match_transformers(tiny_v4, reference, tmp_path):
    from model_harness import hf_logits, max_rel_diff
    from transformers import DeepseekV4ForCausalLM

    hf_model = DeepseekV4ForCausalLM.from_pretrained(tiny_v4, dtype=torch.float32).eval()
    hf_model.save_pretrained(tmp_path / "hybrid")
    official = _write(tmp_path / "official", reference, _config_dict(tiny_v4))
    tokens = [0, 5, 9, 17, 33, 65, 129, 257, 300, 12, 7, 3, 99, 100, 101, 102, 103, 104, 7, 8]  # past index_topk*4
    from_hf = _our_logits(tiny_v4, tokens)
    assert torch.equal(_our_logits(official, tokens), from_hf)
    assert torch.equal(_our_logits(tmp_path / "hybrid", tokens), from_hf)
    assert max_rel_diff(from_hf, hf_logits(hf_model, tokens)) < 1e-5


def test_load_dtypes(tiny_v4):
    _, tensors = load_checkpoint(tiny_v4, "bfloat16")
    assert tensors["embed.weight"].dtype == torch.bfloat16
    assert tensors["layers.0.attn.attn_sink"].dtype == torch.float32  # kept in fp32
    assert tensors["layers.0.hc_attn_fn"].dtype == torch.float32
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert load_checkpoint(tiny_v4, "auto")[1]["embed.weight"].dtype == torch.float32  # tiny is stored in fp32


# --- quantised checkpoints -------------------------------------------------------------------------

def _e4m3_value(byte: int) -> float:
    """FP8 e4m3fn from its bits, written out independently of torch's float8 support."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3 = torch.tensor([_e4m3_value(b) for b in range(256)], dtype=torch.float64)
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _ue8m0(scale: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, scale.view(torch.uint8).to(torch.float64) - 127)


def _independent_dequant(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.float8_e4m3fn:  # 128x128 blocks
        values = E4M3[weight.view(torch.uint8).long()]
        out = torch.empty_like(values)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
                out[rows, cols] = values[rows, cols] * _ue8m0(scale[i:i + 1, j:j + 1])
        return out
    packed = weight.view(torch.uint8).long()  # FP4: low nibble = even element
    values = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.float64)
    values[:, 0::2], values[:, 1::2] = E2M1[packed & 0xF], E2M1[packed >> 4]
    return values * _ue8m0(scale).repeat_interleave(32, dim=1)


@pytest.mark.parametrize("mode", ["fp8", "fp4-experts"])
def test_quantised_checkpoint_matches_independent_dequantisation(mode, tmp_path):
    path = make_model(tmp_path / mode, "tiny", seed=1, quantize=mode)
    raw = load_file(str(path / "model.safetensors"))
    expert = "layers.1.ffn.experts.3.w2.weight"
    assert raw[expert].dtype == (torch.int8 if mode == "fp4-experts" else torch.float8_e4m3fn)
    assert raw["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert raw["layers.1.attn.compressor.wkv.weight"].dtype == torch.bfloat16  # stays unquantised
    assert _config_dict(path)["expert_dtype"] == ("fp4" if mode == "fp4-experts" else "fp8")

    config, fp32 = load_checkpoint(path, torch.float32)
    _, bf16 = load_checkpoint(path, torch.bfloat16)
    assert config.expert_dtype == ("fp4" if mode == "fp4-experts" else "fp8")
    assert not any(k.endswith(".scale") for k in fp32)
    quantised = [k for k in raw if k.endswith(".weight") and k[: -len(".weight")] + ".scale" in raw]
    assert expert in quantised and "mtp.0.e_proj.weight" in quantised
    for name in quantised:
        want = _independent_dequant(raw[name], raw[name.replace(".weight", ".scale")])
        assert torch.equal(fp32[name], want.to(torch.float32)), name
        assert torch.equal(bf16[name], want.to(torch.float32).to(torch.bfloat16)), name


def test_transformers_quantised_names_load_the_same(tmp_path):
    """`weight_scale_inv` and fused `gate_up_proj`/`_scale_inv` packed-FP4 experts (transformers' names)."""
    path = make_model(tmp_path / "q", "tiny", seed=1, quantize="fp4-experts")
    raw = load_file(str(path / "model.safetensors"))
    hf = to_hf_names(raw)
    assert hf["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.int8
    assert "model.layers.1.self_attn.q_a_proj.weight_scale_inv" in hf
    _write(tmp_path / "hf", hf, _config_dict(path))
    _assert_same(load_checkpoint(tmp_path / "hf", torch.float32)[1], load_checkpoint(path, torch.float32)[1])


def test_fp8_scale_and_shape_problems_are_reported(tmp_path):
    path = make_model(tmp_path / "q", "tiny", seed=1, quantize="fp8")
    raw = load_file(str(path / "model.safetensors"))
    del raw["layers.0.attn.wq_a.scale"]
    raw["layers.0.attn.wq_b.scale"] = torch.ones(3, 3).to(torch.float8_e8m0fnu)
    _write(tmp_path / "bad", raw, _config_dict(path))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "bad")
    assert "layers.0.attn.wq_a.weight (torch.float8_e4m3fn) has no scale tensor" in str(e.value)
    assert "layers.0.attn.wq_b.scale: shape (3, 3)" in str(e.value)


def test_fp4_experts_are_never_read_as_fp8(tmp_path):
    path = make_model(tmp_path / "q", "tiny", seed=1, quantize="fp4-experts")
    config = _config_dict(path)
    (path / "config.json").write_text(json.dumps({**config, "expert_dtype": "fp8"}))
    with pytest.raises(CheckpointError, match=r"layers.0.ffn.experts.0.w1.weight is packed FP4 .* expert_dtype 'fp8'"):
        load_checkpoint(path)


# --- shards ------------------------------------------------------------------------------------------

def test_sharded_checkpoint(tiny_v4, tmp_path):
    sharded = make_model(tmp_path / "sharded", "tiny", seed=TINY_SEED, max_shard_bytes=300_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (sharded / "model.safetensors").exists()
    _assert_same(load_checkpoint(sharded, torch.float32)[1], load_checkpoint(tiny_v4, torch.float32)[1])
    (sharded / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[1]):
        load_checkpoint(sharded)


# --- errors ------------------------------------------------------------------------------------------

def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^HF checkpoint requires config.json: .*config.json"):
        load_checkpoint(tmp_path)


def test_unsupported_model_type(tiny_v4, tmp_path):
    bad = tmp_path / "llama"
    shutil.copytree(tiny_v4, bad)
    (bad / "config.json").write_text(json.dumps({**_config_dict(tiny_v4), "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"model_type 'llama' is not supported; supported model types: deepseek_v4"):
        load_checkpoint(bad)


def test_missing_unexpected_and_misshaped_tensors_in_one_error(reference, tiny_v4, tmp_path):
    tensors = dict(reference)
    del tensors["layers.2.attn.wq_a.weight"]
    del tensors["mtp.0.e_proj.weight"]
    tensors["layers.9.extra.weight"] = torch.zeros(2)
    tensors["layers.0.attn.wkv.weight"] = torch.zeros(5, 5)
    _write(tmp_path / "bad", tensors, _config_dict(tiny_v4))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "bad")
    message = str(e.value)
    assert "missing tensors (2)" in message and "layers.2.attn.wq_a.weight" in message
    assert "mtp.0.e_proj.weight" in message
    assert "unexpected tensors (1)" in message and "layers.9.extra.weight" in message
    assert "layers.0.attn.wkv.weight: checkpoint (5, 5), config expects (32, 64)" in message


def test_too_large_for_ram(tiny_v4, monkeypatch):
    from deepinfer.models.common import checkpoint as common_checkpoint

    # the memory check is the family-independent loader's (V4's checkpoint module re-exports it)
    assert ckpt.available_memory_bytes is common_checkpoint.available_memory_bytes
    monkeypatch.setattr(common_checkpoint, "available_memory_bytes", lambda: 100_000)
    with pytest.raises(CheckpointTooLargeError, match=r"needs about 2.\d MiB of RAM once loaded as float32 .* but only 0.1 MiB is available"):
        load_checkpoint(tiny_v4, torch.float32)


# --- model resolution --------------------------------------------------------------------------------

def test_hf_id_resolves_from_local_cache_only(tiny_v4, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match=r"not in the local Hugging Face cache.*huggingface-cli download org/tiny"):
        resolve_model("org/tiny")
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(tiny_v4, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    resolved = resolve_model("org/tiny")
    assert resolved.path == repo / "snapshots" / "abc123" and resolved.source == "hf-cache"
    assert not resolved.is_default


def test_local_directory_and_missing_config(tiny_v4, tmp_path):
    assert resolve_model(str(tiny_v4)).path == tiny_v4.resolve()
    with pytest.raises(FileNotFoundError, match=r"^HF checkpoint requires config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="neither an existing directory nor a Hugging Face id"):
        resolve_model(str(tmp_path / "nope" / "deeper" / "x"))


def test_hf_model_dir_replaces_only_the_default(tiny_v4, tmp_path, monkeypatch):
    other = make_model(tmp_path / "other", "tiny", seed=5, num_hidden_layers=2)
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tiny_v4))
    resolved = resolve_model(None)
    assert resolved.path == tiny_v4.resolve() and resolved.source == "env" and not resolved.is_default
    assert resolve_model(str(other)).path == other.resolve()  # an explicit model always wins
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="HF checkpoint requires config.json"):
        resolve_model(None)


# the default model (no model given) and the seeds' default id: tests/test_model_resolve.py
