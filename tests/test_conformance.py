"""The conformance kit passes for the cpu back end, compared with the kit's own float64 reference
kernels (not with itself), and catches broken back ends, the cpu one included."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


TESTS = Path(__file__).resolve().parent
#: runs that check something else leave out the multi-process collective level (its 2- and 4-rank
#: launches are the slowest tests of the kit); the cpu and torchref runs keep it
NO_COLLECTIVES = ("-k", "not collectives")


def run_kit(name: str, report, extra_path: str | None = None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "deepinfer.cli", "conformance", name,
                           f"--conformance-report={report}", *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.slow
def test_cpu_passes_every_level(tmp_path):
    out = run_kit("cpu", tmp_path / "cpu.json")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "cpu.json").read_text())
    assert report["summary"]["failed"] == 0 and report["summary"]["passed"] >= 15
    levels = {r["level"] for r in report["tests"].values()}
    assert {0, 1, 2, 3, 4, 5} <= levels
    assert report["tests"]["test_collectives_on_sub_groups_four_ranks"]["outcome"] == "passed"


BROKEN = '''
import torch
from deepinfer_plugins.cpu import CpuAccelerator

class WrongNorm(CpuAccelerator):
    name = "wrongnorm"
    def rms_norm(self, x, weight, eps):  # forgets the weight: numerically wrong
        return super().rms_norm(x, None, eps)
'''


@pytest.mark.slow
def test_kit_fails_a_numerically_wrong_back_end(tmp_path, fake_distribution):
    root = fake_distribution("wrong-norm", "0.1", {"deepinfer.accelerators": {"wrongnorm": "wrong_norm_mod:WrongNorm"}},
                             {"wrong_norm_mod": BROKEN})
    out = run_kit("wrongnorm", tmp_path / "w.json", str(root), *NO_COLLECTIVES)
    assert out.returncode != 0
    report = json.loads((tmp_path / "w.json").read_text())
    assert report["tests"]["test_rms_norm"]["outcome"] == "failed"
    assert report["tests"]["test_linear"]["outcome"] == "passed"


# Breaks the cpu back end itself (its pure-torch compress_pool, which no C kernel replaces): a kit
# that compared the cpu back end with the cpu back end would pass it.
BROKEN_CPU = '''
import torch
from deepinfer_plugins.cpu import CpuAccelerator
from deepinfer_plugins.cpu.kernels import CpuKernels

def compress_pool(self, kv, score):  # forgets the gate: a plain mean over the slots
    return kv.float().mean(dim=-2)

CpuKernels.compress_pool = compress_pool

class SelfBroken(CpuAccelerator):
    name = "selfbroken"
'''


@pytest.mark.slow
def test_kit_checks_the_cpu_back_end_against_an_independent_reference(tmp_path, fake_distribution):
    root = fake_distribution("self-broken", "0.1",
                             {"deepinfer.accelerators": {"selfbroken": "self_broken_mod:SelfBroken"}},
                             {"self_broken_mod": BROKEN_CPU})
    out = run_kit("selfbroken", tmp_path / "s.json", str(root), *NO_COLLECTIVES)
    assert out.returncode != 0
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["tests"]["test_compress_pool"]["outcome"] == "failed"
    assert report["tests"]["test_rms_norm"]["outcome"] == "passed"


INDEPENDENT = r"""
import sys, torch
from deepinfer.testing.conformance import ReferenceAccelerator
ref = ReferenceAccelerator()
g = torch.Generator().manual_seed(0)
x, w = torch.randn(3, 8, generator=g), torch.randn(5, 8, generator=g)
assert torch.allclose(ref.linear(x, w), x @ w.T, atol=1e-6)
assert torch.allclose(ref.rms_norm(x, None, 0.0).square().mean(-1), torch.ones(3), atol=1e-6)
rows, plan = ref.moe_dispatch(x, torch.tensor([[2, 0], [0, 1], [2, 1]]), 3)
assert plan.tokens_per_expert.tolist() == [2, 2, 2] and plan.source_token.tolist() == [0, 1, 1, 2, 0, 2]
assert plan.source_slot.tolist() == [1, 0, 1, 1, 0, 0] and torch.equal(rows, x[plan.source_token])
print(sorted(m for m in sys.modules if m.startswith("deepinfer_plugins")))
"""


def test_reference_is_plain_torch_and_imports_no_back_end():
    out = subprocess.run([sys.executable, "-c", INDEPENDENT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


# A back end made only of core's public plain-torch reference (what the NVIDIA and Ascend back ends
# build on): the kit checks those kernels like any back end's.
TORCH_REFERENCE = '''
import os
import torch
from deepinfer.accelerator.interface import Accelerator, Capabilities, MemoryInfo, ProbeResult
from deepinfer.accelerator.reference import TorchCollectives, TorchKernels

class TorchReference(TorchCollectives, TorchKernels, Accelerator):
    name = "torchref"

    @classmethod
    def probe(cls):
        return ProbeResult(usable=True, reason="core reference kernels on the CPU")

    def capabilities(self):
        return Capabilities(name=self.name, device_type="cpu", token_bitmask=True, rejection_sampling=True,
                            host_overlap=False, collectives="gloo")

    def device(self, index=0):
        return torch.device("cpu")

    def memory_info(self):
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(free_bytes=os.sysconf("SC_AVPHYS_PAGES") * page,
                          total_bytes=os.sysconf("SC_PHYS_PAGES") * page)

    def synchronize(self):
        return None
'''


@pytest.mark.slow
def test_kit_passes_the_core_reference_kernels(tmp_path, fake_distribution):
    root = fake_distribution("torch-ref", "0.1",
                             {"deepinfer.accelerators": {"torchref": "torch_ref_mod:TorchReference"}},
                             {"torch_ref_mod": TORCH_REFERENCE})
    out = run_kit("torchref", tmp_path / "t.json", extra_path=str(root))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["summary"]["failed"] == 0
    for test in ("test_rms_norm", "test_sink_attention_ragged_masks", "test_hc_pre_post_head", "test_indexer_topk",
                 "test_model_ops_are_declared_as_op_tables", "test_collectives_on_sub_groups_four_ranks"):
        assert report["tests"][test]["outcome"] == "passed", test


# --- the kit on another model family: the test-only toy_dense family (tests/toy_family) ---------

V4_OWN_OPS = ("test_hc_pre_post_head", "test_compress_pool", "test_indexer_topk")
TOY_FAMILY_MODULE = "--family-module=toy_family.family:TOY_FAMILY"


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory) -> Path:
    from toy_family import TOY_FAMILY

    out = tmp_path_factory.mktemp("toy") / "ckpt"
    TOY_FAMILY.make_checkpoint.make(out, "tiny", seed=2)
    return out


@pytest.mark.slow
def test_kit_passes_the_cpu_back_end_on_a_toy_family_checkpoint(tmp_path, toy_checkpoint):
    out = run_kit("cpu", tmp_path / "toy.json", str(TESTS), f"--checkpoint={toy_checkpoint}", TOY_FAMILY_MODULE,
                  *NO_COLLECTIVES)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "toy.json").read_text())
    assert report["family"] == "toy_dense" and report["checkpoint"] == str(toy_checkpoint)
    assert report["summary"]["failed"] == 0
    for test in ("test_tiny_checkpoint_greedy_matches_the_reference", "test_model_ops_are_declared_as_op_tables",
                 "test_rms_norm", "test_swiglu"):
        assert report["tests"][test]["outcome"] == "passed", test
    for test in V4_OWN_OPS:  # DeepSeek-V4's op table does not apply: skipped, saying why
        entry = report["tests"][test]
        assert entry["outcome"] == "skipped", test
        assert "deepseek_v4" in entry["reason"] and "'toy_dense'" in entry["reason"], entry["reason"]


BROKEN_SWIGLU = '''
from deepinfer_plugins.cpu import CpuAccelerator

class WrongSwiglu(CpuAccelerator):
    name = "wrongswiglu"
    def swiglu(self, gate, up, limit):  # `up` replaced by its sign times its mean size: numerically wrong
        return super().swiglu(gate, up.sign() * up.abs().mean(), limit)
'''


@pytest.mark.slow
def test_kit_fails_a_broken_kernel_on_the_toy_family_end_to_end(tmp_path, toy_checkpoint, fake_distribution):
    root = fake_distribution("wrong-swiglu", "0.1",
                             {"deepinfer.accelerators": {"wrongswiglu": "wrong_swiglu_mod:WrongSwiglu"}},
                             {"wrong_swiglu_mod": BROKEN_SWIGLU})
    out = run_kit("wrongswiglu", tmp_path / "w.json", f"{root}{os.pathsep}{TESTS}", f"--checkpoint={toy_checkpoint}",
                  TOY_FAMILY_MODULE, "-k", "swiglu or rms_norm or greedy")
    assert out.returncode != 0
    report = json.loads((tmp_path / "w.json").read_text())
    assert report["tests"]["test_tiny_checkpoint_greedy_matches_the_reference"]["outcome"] == "failed"
    assert report["tests"]["test_swiglu"]["outcome"] == "failed"
    assert report["tests"]["test_rms_norm"]["outcome"] == "passed"


@pytest.mark.slow
def test_kit_names_an_unknown_family_and_a_broken_family_module(tmp_path, toy_checkpoint):
    out = run_kit("cpu", tmp_path / "a.json", str(TESTS), f"--checkpoint={toy_checkpoint}")
    assert out.returncode != 0
    assert "model_type 'toy_dense' is not supported" in out.stderr and "--family-module" in out.stderr
    out = run_kit("cpu", tmp_path / "b.json", str(TESTS), "--family-module=toy_family.no_such_module")
    assert out.returncode != 0
    assert "--family-module toy_family.no_such_module: ModuleNotFoundError" in out.stderr
