"""The embedded models' greedy decode perplexities against tests/models/offline_decode_ppl.json
(ppl_baseline.py): a kernel or model change that moves them fails here, and a deliberate 1e-3
perturbation of one kernel is shown to."""
from __future__ import annotations

import json

import pytest

from .ppl_baseline import Baselines, Case, ModelBuild, measure, output_path, own_samples

V4 = ModelBuild("v4")
V41 = ModelBuild("v41")
#: the embedded default model (DeepSeek-V4.1, the real vocabulary; stored in bf16, measured in fp32)
DEFAULT = ModelBuild("v41", size="default")

CASES = [
    pytest.param(V4, Case(), id="v4-tiny-single"),
    pytest.param(V41, Case(), id="v41-tiny-single"),
    pytest.param(DEFAULT, Case(), id="v41-default-single", marks=pytest.mark.slow),
    pytest.param(V4, Case(dp=2), id="v4-tiny-dp2", marks=pytest.mark.slow),
    pytest.param(V4, Case(ep=2), id="v4-tiny-ep2", marks=pytest.mark.slow),
    pytest.param(V41, Case(ep=2), id="v41-tiny-ep2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("build, case", CASES)
def test_decode_ppl_matches_the_baseline(build, case, built, baselines):
    baselines.check(built(build), build, case)


@pytest.mark.parametrize("build", [V4, pytest.param(V41, marks=pytest.mark.slow)], ids=["v4", "v41"])
def test_a_kernel_perturbed_by_1e_3_fails_the_baseline(build, built, baselines, monkeypatch):
    from deepinfer.plugins import select_accelerator_class

    cpu = select_accelerator_class("cpu")
    rms_norm = cpu.rms_norm
    monkeypatch.setattr(cpu, "rms_norm", lambda self, x, weight, eps: rms_norm(self, x, weight, eps) + 1e-3)
    assert baselines.expected(build, Case()) is not None, "the unperturbed baseline is missing"
    values = measure(built(build), Case())
    assert baselines.mismatches(build, Case(), values), "a perturbed kernel went unnoticed"


def test_a_candidate_merges_only_what_was_measured(tmp_path):
    base = {"relative_tolerance": 1e-4, "baselines": {"m": {"ep1-dp1-cp1": {"decode": [1.0, 2.0, 3.0, 4.0]}}}}
    found = Baselines(tmp_path / "b.json", base)
    found.measured[("m", "ep1-dp1-cp1", "decode")] = {1: 2.5}
    found.measured[("n", "ep1-dp2-cp1", "decode")] = {0: 7.0, 2: 8.0}
    target = tmp_path / "candidate.json"
    found.write(target)
    out = json.loads(target.read_text())
    assert out["baselines"]["m"]["ep1-dp1-cp1"]["decode"] == [1.0, 2.5, 3.0, 4.0]
    assert out["baselines"]["n"]["ep1-dp2-cp1"]["decode"] == [7.0, None, 8.0]
    # a second node's run merges its own samples into the same file
    other = Baselines(tmp_path / "b.json", base)
    other.measured[("n", "ep1-dp2-cp1", "decode")] = {1: 9.0, 3: 10.0}
    other.write(target)
    assert json.loads(target.read_text())["baselines"]["n"]["ep1-dp2-cp1"]["decode"] == [7.0, 9.0, 8.0, 10.0]
    assert found.mismatches(V4, Case(), {0: 1.0})[0].startswith("no baseline for model v4-tiny")


def test_output_is_single_node_and_nodes_keep_to_their_ranks():
    from deepinfer.parallel.layout import resolve_layout

    assert output_path(None, 1) is None
    assert output_path("x.json", 1).name == "x.json"
    assert output_path("default", 2).name == "offline_decode_ppl.json"
    with pytest.raises(ValueError, match="single node only.*without a path"):
        output_path("x.json", 2)
    two_nodes = [resolve_layout(1, 4, 1, "cpu", {"WORLD_SIZE": "2", "RANK": str(n)}) for n in (0, 1)]
    assert [own_samples(layout, 8) for layout in two_nodes] == [{0, 1, 4, 5}, {2, 3, 6, 7}]
    assert own_samples(resolve_layout(1, 2, 1, "cpu", {}), 4) == {0, 1, 2, 3}
