"""examples/compare_llamacpp.py: the released config keys it writes, its refusals, the alternating
rounds and ratios, and one whole race against stand-in llama.cpp binaries. The conversion itself needs
a llama.cpp source tree (LLAMA_CPP_DIR); without one that test skips and says so."""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.models.deepseek_v4.checkpoint import load_checkpoint
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.make_model import make_model, model_config
from example_modules import load_example

cmp = load_example("compare_llamacpp.py")


@pytest.mark.parametrize("size", ["tiny", "default"])
def test_hub_config_parses_back_to_the_same_config(size):
    config, _ = model_config(size)
    hub = config.to_hub_dict()
    assert "layer_types" not in hub and "mlp_layer_types" not in hub and "rope_parameters" not in hub
    assert hub["compress_ratios"] == list(config.compress_ratios)
    assert len(hub["compress_ratios"]) == config.num_hidden_layers + config.num_nextn_predict_layers
    assert hub["num_hash_layers"] == sum(t == "hash_moe" for t in config.mlp_layer_types)
    assert DeepseekV4Config.from_dict(hub) == config
    if config.rope_scaling is not None:
        assert hub["rope_scaling"]["type"] == "yarn"


def test_hub_config_refuses_a_schedule_it_cannot_express():
    config, _ = model_config("tiny")
    types = list(config.mlp_layer_types)
    shuffled = config.model_copy(update={"mlp_layer_types": tuple(["moe"] + types[1:] + ["hash_moe"])[:len(types)]})
    with pytest.raises(ValueError, match="hash layers must come first"):
        shuffled.to_hub_dict()


def test_prepare_refuses_a_checkpoint_the_converter_cannot_read(tiny_v4, tmp_path, capsys):
    plain = tiny_v4
    tree = tmp_path / "llama.cpp"
    tree.mkdir()
    (tree / "convert_hf_to_gguf.py").write_text("raise SystemExit('must not run')\n")
    rc = cmp.main(["prepare", "--model", str(plain), "--llama-cpp", str(tree), "--out", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert rc == 2 and "FP4 routed experts" in err and "--quantize fp4-experts" in err
    hca32 = make_model(tmp_path / "hca32", "tiny", seed=0, quantize="fp4-experts", hca_compress_rate=32)
    rc = cmp.main(["prepare", "--model", str(hca32), "--llama-cpp", str(tree), "--out", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert rc == 2 and "[32]" in err and "hca_compress_rate=128" in err


def test_rounds_alternate_which_engine_goes_first_and_ratios_are_per_round():
    calls = []

    def side(name, rates):
        def run(fig):
            calls.append((fig.name, name))
            return rates.pop(0)
        return run

    figs = cmp.figures_of([4])
    assert [f.name for f in figs] == ["prefill, one prompt", "decode, batch 1", "decode, 4 sequences (aggregate)"]
    # rounds: deepinfer 10/20/30 vs llama.cpp 20/20/20 on every figure -> ratios 0.5, 1.0, 1.5
    a = [10.0] * 3 + [20.0] * 3 + [30.0] * 3
    b = [20.0] * 9
    rates = cmp.race_rounds(figs, 3, {"deepinfer": side("deepinfer", a), "llama.cpp": side("llama.cpp", b)},
                            progress=lambda _: None)
    assert calls[:2] == [(figs[0].name, "deepinfer"), (figs[0].name, "llama.cpp")]
    assert calls[6:8] == [(figs[0].name, "llama.cpp"), (figs[0].name, "deepinfer")]  # round 2 starts with the other
    rows = cmp.summarise(rates)
    assert [r["ratio"] for r in rows] == [1.0, 1.0, 1.0]
    assert rows[0]["ratio_min"] == 0.5 and rows[0]["ratio_max"] == 1.5
    assert rows[0]["deepinfer"] == 20.0 and rows[0]["llama.cpp"] == 20.0
    assert "| prefill, one prompt | 20.0 | 20.0 | 1.00x (0.50-1.50) |" in cmp.format_table(rows)


FAKE_BENCH = """#!{python}
import json, sys
a = sys.argv[1:]
assert a[a.index("-t") + 1] == "1", a
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
assert int(a[a.index("-d") + 1]) == (16 if n else 0), a  # batch-1 decode after --context tokens
assert a[a.index("-r") + 1] == "3", a  # --repeats samples in one run
# the figure is the median of the samples, not their mean
samples = [1000.0, 900.0, 1300.0] if p else [50.0, 40.0, 70.0]
print(json.dumps([{{"n_prompt": p, "n_gen": n, "avg_ts": sum(samples) / 3, "samples_ts": samples}}]))
"""
FAKE_BATCHED = """#!{python}
import json, sys
from pathlib import Path
a = sys.argv[1:]
pl = int(a[a.index("-npl") + 1])
# no repetitions in one run: the race runs it --repeats times and keeps the median (runs: 1x, 4x, 2x)
runs = Path(sys.argv[0]).with_suffix(".runs")
k = int(runs.read_text()) if runs.exists() else 0
runs.write_text(str(k + 1))
print("some log line")
print(json.dumps({{"pp": 16, "tg": 4, "pl": pl, "speed_tg": 12.5 * pl * (1, 4, 2)[k % 3]}}))
"""


@pytest.mark.slow
def test_a_whole_race_against_stand_in_binaries(tiny_v4, tmp_path, clean_env):
    model = tiny_v4
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("llama-bench", FAKE_BENCH), ("llama-batched-bench", FAKE_BATCHED)):
        path = bin_dir / name
        path.write_text(text.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "race.json"
    rc = cmp.main(["race", "--model", str(model), "--gguf", str(gguf), "--llama-bin", str(bin_dir), "--threads", "1",
                   "--rounds", "1", "--repeats", "3", "--prompt-tokens", "32", "--decode-tokens", "4",
                   "--context", "16", "--batches", "2", "--json", str(out)])
    assert rc == 0
    saved = json.loads(out.read_text())
    by_name = {r["figure"]: r for r in saved["summary"]}
    assert by_name["prefill, one prompt"]["llama.cpp"] == 1000.0
    assert by_name["decode, batch 1"]["llama.cpp"] == 50.0
    assert by_name["decode, 2 sequences (aggregate)"]["llama.cpp"] == 50.0
    for row in saved["summary"]:  # deepinfer's side really ran and the ratio is its rate over llama.cpp's
        assert row["deepinfer"] > 0
        assert row["ratio"] == pytest.approx(row["deepinfer"] / row["llama.cpp"])


def test_race_names_what_is_missing(tmp_path, capsys):
    rc = cmp.main(["race", "--model", str(tmp_path), "--gguf", "x.gguf", "--llama-bin", str(tmp_path)])
    assert rc == 2 and "llama-bench is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cmp.main(["race", "--model", "m", "--gguf", "g", "--llama-bin", "b", "--batches", "0"])


def test_the_trees_gguf_package_loads_by_path_with_its_submodules(tmp_path, monkeypatch):
    """llama.cpp's gguf-py is imported from the tree by its path (nothing is added to sys.path), and
    its own imports of its submodules work."""
    package = tmp_path / "gguf-py" / "gguf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from .constants import MAGIC\n")
    (package / "constants.py").write_text("MAGIC = 'GGUF'\n")
    (package / "quants.py").write_text("def dequantize(data, kind):\n    return ('dequantized', data)\n")
    monkeypatch.delitem(sys.modules, "gguf", raising=False)
    path = list(sys.path)
    gguf = cmp.load_gguf(tmp_path / "gguf-py")
    from gguf import quants

    assert gguf.MAGIC == "GGUF" and quants.dequantize(1, 2) == ("dequantized", 1)
    assert quants.__file__ == str(package / "quants.py") and sys.path == path
    for name in [n for n in sys.modules if n == "gguf" or n.startswith("gguf.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(cmp.CompareError, match="nowhere/gguf/__init__.py is missing: --llama-cpp must be a llama.cpp source tree"):
        cmp.load_gguf(tmp_path / "nowhere")


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"),
                    reason="set LLAMA_CPP_DIR to a llama.cpp source tree to test the conversion (not part of CI)")
def test_prepare_writes_a_gguf_whose_experts_equal_deepinfers(tmp_path):
    tree = Path(os.environ["LLAMA_CPP_DIR"])
    model = make_model(tmp_path / "m", "tiny", seed=3, quantize="fp4-experts", hca_compress_rate=128,
                       vocab_size=129280)
    assert cmp.main(["prepare", "--model", str(model), "--llama-cpp", str(tree), "--out", str(tmp_path / "w")]) == 0
    gguf = cmp.load_gguf(tree / "gguf-py")
    from gguf import quants

    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "w" / "model-bf16.gguf").tensors}
    _, weights = load_checkpoint(model)
    layer = next(i for i in range(6) if f"blk.{i}.ffn_gate_exps.weight" in tensors)
    t = tensors[f"blk.{layer}.ffn_gate_exps.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.BF16
    experts = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).copy())
    for e in range(experts.shape[0]):
        assert torch.equal(experts[e], weights[f"layers.{layer}.ffn.experts.{e}.w1.weight"].float())
