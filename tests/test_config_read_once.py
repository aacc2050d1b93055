"""Configuration is read once, when the engine is built: no step reads a DEEPINFER_* variable (a switch
flipped mid-run must not change what a running engine does, and a lookup per op per step costs time)."""
from __future__ import annotations

import os
from collections.abc import Iterator, MutableMapping

import pytest

from deepinfer import LLM, SamplingParams


class ReadRecorder(MutableMapping):
    """`os.environ` as it is, recording the DEEPINFER_* names read and whether it was listed."""

    def __init__(self, environ: MutableMapping[str, str]):
        self.environ, self.read = environ, []

    def __getitem__(self, name: str) -> str:
        if name.startswith("DEEPINFER_"):
            self.read.append(name)
        return self.environ[name]

    def __setitem__(self, name: str, value: str) -> None:
        self.environ[name] = value

    def __delitem__(self, name: str) -> None:
        del self.environ[name]

    def __iter__(self) -> Iterator[str]:
        self.read.append("(listed)")
        return iter(self.environ)

    def __len__(self) -> int:
        return len(self.environ)


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_no_step_reads_the_environment(family, tmp_path, monkeypatch):
    if family == "v4":
        from deepinfer.models.deepseek_v4.make_model import make_model
    else:
        from deepinfer.models.deepseek_v41.make_model import make_model
    path = make_model(tmp_path / "ckpt", "tiny", seed=0)
    # bf16 on the cpu back end: its packed copies, prepared programs and huge pages are in play
    llm = LLM(model=str(path), accelerator="cpu", dtype="bfloat16", max_model_len=64, max_num_seqs=4,
              async_pipeline=False)
    recorder = ReadRecorder(os.environ)
    monkeypatch.setattr(os, "environ", recorder)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for prompts in ([[1, 2, 3]], [[4, 5, 6, 7], [8, 9], [10, 11, 12]]):  # one, then a batch (new shapes)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    monkeypatch.undo()
    llm.shutdown()
    assert recorder.read == [], f"read in a step: {sorted(set(recorder.read))} (read it once when the engine is built)"
