"""`deepinfer make-model`: random V4 checkpoints that transformers loads with 0 missing keys."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deepinfer.models.deepseek_v4.checkpoint import load_checkpoint
from deepinfer.entrypoints.make_model import main
from deepinfer.models.deepseek_v4.make_model import SIZES, count_parameters, make_model, model_config
from deepinfer.models.deepseek_v4.weights import to_hf_names

from conftest import TINY_SEED


def test_transformers_loads_it_with_no_missing_keys_and_our_tensors(tiny_v4):
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(tiny_v4, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    _, ours = load_checkpoint(tiny_v4, torch.float32)
    hf_state = model.state_dict()
    ours_hf = {k: v for k, v in to_hf_names(ours).items() if not k.startswith("mtp.")}
    assert set(ours_hf) == set(hf_state)
    for name, tensor in ours_hf.items():
        assert torch.equal(hf_state[name].to(tensor.dtype), tensor), name
    logits = model(torch.tensor([[0, 5, 9, 17, 33, 65, 129, 257, 300, 12, 7, 3, 99, 100, 101, 102, 103, 104]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1  # random weights give non-trivial logits


def test_files_config_and_mtp(tiny_v4):
    raw = load_file(str(tiny_v4 / "model.safetensors"))
    assert "mtp.0.e_proj.weight" in raw and "mtp.0.ffn.experts.0.w1.weight" in raw
    assert "model.layers.1.mlp.experts.gate_up_proj" in raw  # transformers' fused layout
    config = json.loads((tiny_v4 / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["num_nextn_predict_layers"] == 1
    assert config["layer_types"] == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                                     "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"]
    marker = json.loads((tiny_v4 / "deepinfer_make_model.json").read_text())
    assert marker["size"] == "tiny" and marker["seed"] == TINY_SEED and marker["tokenizer"]
    assert (tiny_v4 / "tokenizer.json").is_file()  # cut down to the 512-token vocabulary


def test_parameters_that_default_init_zeroes_are_random(tiny_v4):
    _, w = load_checkpoint(tiny_v4, torch.float32)
    for name in ["layers.0.attn.attn_sink", "layers.1.attn.compressor.ape", "layers.1.attn.indexer.compressor.ape",
                 "layers.0.hc_attn_base", "layers.3.ffn.gate.bias", "hc_head_base", "mtp.0.hc_head_base"]:
        assert w[name].abs().min() > 0 and w[name].std() > 0.01, name
    for name in ["layers.0.hc_attn_scale", "layers.2.attn_norm.weight", "norm.weight", "layers.1.attn.kv_norm.weight",
                 "mtp.0.enorm.weight"]:
        assert not torch.all(w[name] == 1.0) and w[name].std() > 0.01, name
    tid2eid = w["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.shape == (512, 2) and int(tid2eid.min()) >= 0 and int(tid2eid.max()) < 8
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()  # distinct experts per token
    assert len(set(map(tuple, tid2eid.tolist()))) > 20


def test_seeded_and_mtp_independent(tiny_v4, tmp_path):
    _, a = load_checkpoint(tiny_v4, torch.float32)
    _, same = load_checkpoint(make_model(tmp_path / "same", "tiny", seed=TINY_SEED), torch.float32)
    config, no_mtp = load_checkpoint(make_model(tmp_path / "nomtp", "tiny", seed=TINY_SEED, with_mtp=False), torch.float32)
    _, other = load_checkpoint(make_model(tmp_path / "other", "tiny", seed=TINY_SEED + 1), torch.float32)
    assert all(torch.equal(a[k], same[k]) for k in a)
    assert config.num_nextn_predict_layers == 0 and not any(k.startswith("mtp.") for k in no_mtp)
    assert all(torch.equal(a[k], no_mtp[k]) for k in no_mtp)  # the trunk does not depend on with_mtp
    assert not torch.equal(a["embed.weight"], other["embed.weight"])


def test_overrides_and_refusing_to_overwrite(tmp_path):
    path = make_model(tmp_path / "two", "tiny", num_hidden_layers=3, vocab_size=1024, dtype="bfloat16")
    config, w = load_checkpoint(path, "auto")
    assert config.num_hidden_layers == 3 and config.vocab_size == 1024
    assert config.layer_types == ("sliding_attention", "compressed_sparse_attention", "sliding_attention")
    assert w["embed.weight"].dtype == torch.bfloat16
    with pytest.raises(FileExistsError, match="not empty"):
        make_model(path, "tiny")
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        make_model(tmp_path / "x", "huge")


def test_cli(tmp_path, capsys):
    assert main([str(tmp_path / "cli"), "--size", "tiny", "--seed", "2", "--set", "num_hidden_layers=2",
                 "--quantize", "fp4-experts"]) == 0
    assert "parameters" in capsys.readouterr().out
    config, w = load_checkpoint(tmp_path / "cli")
    assert config.num_hidden_layers == 2 and config.expert_dtype == "fp4"
    assert main([str(tmp_path / "cli")]) == 2  # exists
    assert "--force" in capsys.readouterr().err
    assert main([str(tmp_path / "cli"), "--force", "--no-mtp", "--no-tokenizer"]) == 0
    assert not (tmp_path / "cli" / "tokenizer.json").exists()


def test_size_presets():
    counts = {size: count_parameters(model_config(size)[0], with_mtp=False) for size in SIZES}
    assert counts["tiny"] < 1_000_000
    assert 500_000_000 <= counts["bench"] <= 1_500_000_000
    for size in ("default", "bench"):
        config, _ = model_config(size)
        assert config.vocab_size == 129280 and config.num_nextn_predict_layers == 1
        assert {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"} <= set(config.layer_types)


def test_family_option_takes_the_model_type_or_an_alias(tmp_path, capsys):
    assert main([str(tmp_path / "alias"), "--family", "v4", "--seed", "4", "--no-tokenizer"]) == 0
    assert main([str(tmp_path / "type"), "--family=deepseek_v4", "--seed", "4", "--no-tokenizer"]) == 0
    _, a = load_checkpoint(tmp_path / "alias", torch.float32)
    _, b = load_checkpoint(tmp_path / "type", torch.float32)
    assert all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    assert main([str(tmp_path / "x"), "--family", "llama"]) == 2
    err = capsys.readouterr().err
    assert "unknown model family 'llama'" in err and "deepseek_v4 (alias v4)" in err


def test_family_option_dispatches_to_another_familys_maker_and_flags(tmp_path, capsys):
    from dataclasses import replace

    from toy_family import TOY_FAMILY, registered

    from deepinfer.models.registry import load_model_checkpoint

    with registered():
        assert main([str(tmp_path / "toy"), "--family", "toy", "--size", "small", "--seed", "3",
                     "--sliding-window", "7"]) == 0
        assert "toy_dense small, seed 3, sliding window 7" in capsys.readouterr().out
        family, config, _ = load_model_checkpoint(tmp_path / "toy")
        assert family is TOY_FAMILY and config.sliding_window == 7 and config.hidden_size == 64
        with pytest.raises(SystemExit):  # V4's flags are not the toy family's
            main([str(tmp_path / "toy2"), "--family", "toy", "--quantize", "fp8"])
        with pytest.raises(SystemExit):  # nor are its sizes
            main([str(tmp_path / "toy2"), "--family", "toy", "--size", "bench"])
        assert main([str(tmp_path / "toy"), "--family", "toy"]) == 2  # exists; --force replaces it
        assert main([str(tmp_path / "toy"), "--family", "toy", "--force"]) == 0
    with registered(replace(TOY_FAMILY, make_checkpoint=None, aliases=())):
        capsys.readouterr()
        assert main([str(tmp_path / "none"), "--family", "toy_dense"]) == 2
        err = capsys.readouterr().err
        assert "model family 'toy_dense' cannot write random checkpoints" in err and "deepseek_v4 (alias v4)" in err
