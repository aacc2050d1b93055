"""examples/bench_spec.py: the speculative-decoding measurement runs end to end and reports every mode."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from example_modules import load_example


@pytest.fixture(scope="module")
def bench():
    return load_example("bench_spec.py")


def test_a_small_run_reports_each_mode_losslessly(bench, tiny_v4, tmp_path, capsys, one_thread):
    out = tmp_path / "spec.json"
    assert bench.main(["--model_name", str(tiny_v4), "--batch_sizes", "2", "--max_tokens", "6", "--rounds", "1",
                       "--prompt_tokens", "8", "--dtype", "float32", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| 2 | off |" in table and "| 2 | fixed k=5 |" in table and "| 2 | variable length |" in table
    modes = json.loads(out.read_text())["results"][0]["modes"]
    assert all(m["lossless"] and m["ms_per_step"] > 0 for m in modes.values())
    assert modes["fixed k=5"]["draft_ms_per_step"] > 0 and "draft_ms_per_step" not in modes["off"]
    assert len(modes["fixed k=5"]["acceptance_by_position"]) == 5


def test_held_out_prompts_come_from_the_demo_models_text(bench):
    from deepinfer.models.deepseek_v41.demo_model import SHIPPED_FILE, held_out_windows

    args = SimpleNamespace(prompt_source="auto", prompt_tokens=16)
    demo = SimpleNamespace(build_info=SimpleNamespace(is_default_model=True))
    prompts = bench.make_prompts(args, 4, demo)
    stream = held_out_windows(SHIPPED_FILE).flatten().tolist()
    assert len(prompts) == 4 and all(len(p) == 16 for p in prompts)
    assert prompts[0] == stream[:16] and len({tuple(p) for p in prompts}) == 4
    other = SimpleNamespace(build_info=SimpleNamespace(is_default_model=False), engine=SimpleNamespace(vocab_size=512))
    assert all(3 <= t < 512 for p in bench.make_prompts(args, 2, other) for t in p)
    with pytest.raises(SystemExit, match="too short"):
        bench.make_prompts(SimpleNamespace(prompt_source="heldout", prompt_tokens=10**6), 2, demo)
