"""The Ascend 950 back end without Ascend hardware, CANN or the real torch_npu.

- the probe's reasons for real (torch_npu absent here) and for simulated machines (npu-smi output,
  CANN directories, ASCEND_RT_VISIBLE_DEVICES, a torch-npu wheel for another torch);
- importing and probing never import torch_npu;
- **plumbing tests**: every kernel run through `tests/fake_torch_npu` (a CPU stand-in of the ops
  the plugin calls, written from torch_npu's documentation) and compared with the CPU reference,
  checking that the fused op was (or was deliberately not) used. They prove argument order,
  layouts and index conventions; they say nothing about Ascend numerics or speed;
- the SoC and start-up errors; the conformance kit against a test-only plugin that runs the
  Ascend kernels on CPU tensors through the stand-in.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_plugins.ascend950 import devices
from deepinfer_plugins.ascend950 import probe as ascprobe
from deepinfer.models.deepseek_v4.ops import resolve_ops
from deepinfer_plugins.ascend950.kernels import FUSED_OPS, AscendDeepseekV4Ops, AscendKernels
from deepinfer_plugins.cpu.kernels import CpuKernels

FAKE_DIR = Path(__file__).with_name("fake_torch_npu")
REF = CpuKernels()
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}

NPU_SMI_950 = """
        NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
        0                              0                              0                              Ascend 950PR
        0                              1                              -                              Mcu
        1                              0                              1                              Ascend 950PR
        2                              0                              2                              Ascend 950PR
"""
NPU_SMI_910B = """
        NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
        0                              0                              0                              Ascend 910B3
"""


@pytest.fixture
def torch_npu(monkeypatch):
    """The CPU stand-in, importable as `torch_npu` for this test only."""
    monkeypatch.syspath_prepend(str(FAKE_DIR))
    sys.modules.pop("torch_npu", None)
    import torch_npu as fake

    assert fake.FAKE
    yield fake
    sys.modules.pop("torch_npu", None)  # later tests must see "torch_npu is not installed" again


@pytest.fixture
def ascend_machine(monkeypatch, tmp_path):
    """A simulated host: torch_npu findable, CANN in tmp_path, npu-smi printing `listing`."""
    def setup(listing: str | None = NPU_SMI_950, kernels_for: tuple[str, ...] = ("ascend950",),
              visible: str | None = None, with_cann: bool = True):
        real_find_spec = ascprobe.importlib.util.find_spec
        monkeypatch.setattr(ascprobe.importlib.util, "find_spec",
                            lambda name, *a: object() if name == "torch_npu" else real_find_spec(name, *a))
        for var in devices.CANN_ENV_VARS:
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setattr(devices, "CANN_DEFAULT_DIRS", ())
        if with_cann:
            cann = tmp_path / "cann"
            for family in kernels_for:
                (cann / devices.KERNEL_DIRS[0] / family).mkdir(parents=True, exist_ok=True)
            monkeypatch.setenv("ASCEND_HOME_PATH", str(cann))
        if visible is None:
            monkeypatch.delenv(devices.VISIBLE_DEVICES_VAR, raising=False)
        else:
            monkeypatch.setenv(devices.VISIBLE_DEVICES_VAR, visible)
        monkeypatch.setattr(devices.shutil, "which", lambda exe: None if listing is None else f"/usr/bin/{exe}")
        monkeypatch.setattr(devices.subprocess, "run",
                            lambda *a, **k: subprocess.CompletedProcess(a[0], 0, stdout=listing, stderr=""))
    return setup


# ------------------------------------------------------------------------------------------ probe


def test_probe_without_torch_npu_is_clear():
    result = ascprobe.probe()  # this machine: no torch_npu, no CANN
    assert not result.usable and "torch_npu is not installed" in result.reason and "CANN" in result.reason


def test_probe_usable_on_a_950_host(ascend_machine):
    ascend_machine()
    before = dict(os.environ)
    result = ascprobe.probe()
    assert result.usable, result.reason
    assert "3x Ascend950PR" in result.reason and result.details["visible"] == "0->0, 1->1, 2->2"
    assert result.details["cann_kernels_for"] == "ascend950"
    assert dict(os.environ) == before and "torch_npu" not in sys.modules


def test_visible_devices_map_logical_to_chip(ascend_machine):
    ascend_machine(visible="2,1")
    result = ascprobe.probe()
    assert result.usable and "ASCEND_RT_VISIBLE_DEVICES=2,1" in result.reason
    assert result.details["visible"] == "0->2, 1->1"


@pytest.mark.parametrize("visible, message", [("7", "names chip 7, but npu-smi lists logic ids 0, 1, 2"),
                                              ("", "empty string"), ("0,npu1", "not a chip logic id")])
def test_bad_visible_devices_are_explained(ascend_machine, visible, message):
    ascend_machine(visible=visible)
    result = ascprobe.probe()
    assert not result.usable and message in result.reason


def test_probe_refuses_another_soc(ascend_machine):
    ascend_machine(listing=NPU_SMI_910B, kernels_for=("ascend910b",))
    result = ascprobe.probe()
    assert not result.usable and "Ascend910B3" in result.reason and "Ascend 950" in result.reason


def test_probe_reports_cann_installed_for_another_soc(ascend_machine):
    ascend_machine(kernels_for=("ascend910b", "ascend910_93"))
    result = ascprobe.probe()
    assert not result.usable
    assert "CANN is installed for ascend910_93, ascend910b, but this machine runs Ascend950PR" in result.reason


def test_probe_without_cann_or_npu(ascend_machine):
    ascend_machine(with_cann=False)
    assert "CANN toolkit was not found" in ascprobe.probe().reason
    ascend_machine(listing=None)
    assert "no Ascend NPU found" in ascprobe.probe().reason


def test_torch_npu_built_for_another_torch(ascend_machine, monkeypatch):
    ascend_machine()
    monkeypatch.setattr(devices.metadata, "version", lambda dist: "2.12.0.post3")
    result = ascprobe.probe()
    assert not result.usable
    assert "torch-npu 2.12.0.post3 is built for torch 2.12.0" in result.reason and "torch-npu==2.13.0" in result.reason


def test_soc_family_names():
    assert [devices.soc_family(s) for s in ("Ascend950PR", "Ascend 950DT", "Ascend910B3", "Ascend910_9391")] == \
        ["ascend950", "ascend950", "ascend910b", "ascend910_93"]


IMPORT_AND_PROBE = """
import json, os, sys
before = dict(os.environ)
import deepinfer_plugins.ascend950 as plugin
result = plugin.AscendAccelerator.probe()
print(json.dumps({"torch_npu_imported": "torch_npu" in sys.modules, "env_changed": dict(os.environ) != before}))
"""


@pytest.mark.slow  # a fresh interpreter that imports torch
def test_import_and_probe_never_import_torch_npu():
    env = dict(os.environ, PYTHONPATH=str(FAKE_DIR))  # even when a torch_npu is importable
    out = subprocess.run([sys.executable, "-c", IMPORT_AND_PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"torch_npu_imported": False, "env_changed": False}


# ---------------------------------------------------------------------------------- op plumbing


@pytest.fixture
def npu_kernels(torch_npu, monkeypatch):
    """AscendKernels over the stand-in, with a record of which fused ops ran."""
    calls: list[str] = []
    for op in FUSED_OPS:
        original = getattr(torch_npu, op)
        monkeypatch.setattr(torch_npu, op, functools.partial(_counted, calls, op, original))
    k = AscendKernels()
    k.npu, k.fused = torch_npu, frozenset(FUSED_OPS)
    k.calls = calls
    return k


def _counted(calls, op, original, *args, **kwargs):
    calls.append(op)
    return original(*args, **kwargs)


def _close(got, want, dtype, what):
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype], msg=lambda m: f"{what} ({dtype}): {m}")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_ops_through_fused_ops(npu_kernels, dtype):
    k, g = npu_kernels, _gen(1)
    x, w = torch.randn(5, 3, 32, generator=g).to(dtype), torch.rand(32, generator=g) + 0.5
    _close(k.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6), dtype, "rms_norm")
    _close(k.rms_norm(x, None, 1e-6), REF.rms_norm(x, None, 1e-6), dtype, "rms_norm(unweighted)")
    for shape in ((6, 4, 32), (6, 24)):  # per-head q, and a single shared kv head
        x = torch.randn(*shape, generator=g).to(dtype)
        ang = torch.rand(6, 4, generator=g) * 6
        for inverse in (False, True):
            _close(k.rotary(x, ang.cos(), ang.sin(), inverse), REF.rotary(x, ang.cos(), ang.sin(), inverse), dtype,
                   f"rotary{shape}")
    a, b = (torch.randn(9, 16, generator=g) * 8).to(dtype), (torch.randn(9, 16, generator=g) * 8).to(dtype)
    for limit in (10.0, 0.0):
        _close(k.swiglu(a, b, limit), REF.swiglu(a, b, limit), dtype, f"swiglu(limit={limit})")
    assert k.calls.count("npu_rms_norm") == 2 and k.calls.count("npu_rotary_mul") == 4
    assert k.calls.count("npu_clipped_swiglu") == 1 and k.calls.count("npu_swiglu") == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_hyper_connections(npu_kernels, dtype):
    k, g = npu_kernels, _gen(2)
    n, d = 4, 16
    streams = torch.randn(5, n, d, generator=g).to(dtype)
    fn, base = torch.randn((2 + n) * n, n * d, generator=g) * 0.1, torch.randn((2 + n) * n, generator=g) * 0.1
    scale = torch.rand(3, generator=g) + 0.5
    ops = k.model_ops("deepseek_v4")  # the V4 op table the Ascend back end declares
    assert isinstance(ops, AscendDeepseekV4Ops) and isinstance(resolve_ops(k), AscendDeepseekV4Ops)
    got = ops.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    want = REF.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    for name, a, b in zip(("collapsed", "post", "comb"), got, want):
        _close(a, b, dtype, f"hc_pre.{name}")
    y = torch.randn(5, d, generator=g).to(dtype)
    _close(ops.hc_post(y, streams, want[1], want[2]), REF.hc_post(y, streams, want[1], want[2]), dtype, "hc_post")
    fused = dtype == torch.bfloat16  # the mHC ops take bf16/fp16 streams only; fp32 uses the reference
    assert ("npu_mhc_pre" in k.calls) == fused and ("npu_mhc_sinkhorn" in k.calls) == fused
    assert ("npu_mhc_post" in k.calls) == fused


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [4, 72])  # 72: more than 64 query heads per kv head, split in two calls
def test_sink_attention(npu_kernels, dtype, heads):
    k, g = npu_kernels, _gen(3)
    for S in (5, 1):  # prefill and decode (different inner_precise rules)
        q = torch.randn(3, S, heads, 32, generator=g).to(dtype)
        kv = torch.randn(3, 11, 32, generator=g).to(dtype)
        mask = torch.rand(3, S, 11, generator=g) > 0.4
        mask[1] = False  # nothing visible: 0, not NaN (the stand-in returns NaN there)
        mask[2, :, 7:] = False
        sinks = torch.randn(heads, generator=g)
        got = k.sink_attention(q, kv, mask, sinks, 32 ** -0.5)
        assert torch.isfinite(got.float()).all()
        _close(got, REF.sink_attention(q, kv, mask, sinks, 32 ** -0.5), dtype, f"sink_attention(S={S})")
    expected_calls = 0 if dtype == torch.float32 else 2 * (1 + heads // 65)
    assert k.calls.count("npu_fused_infer_attention_score_v2") == expected_calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_pipeline(npu_kernels, dtype):
    k, g = npu_kernels, _gen(4)
    T, E, K, D, inter = 13, 8, 2, 16, 12
    scores = torch.nn.functional.softplus(torch.randn(T, E, generator=g)).sqrt()
    x = torch.randn(T, D, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, D, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(E, D, inter, generator=g) * 0.3).to(dtype)
    weights, ids = REF.moe_route(scores, torch.randn(E, generator=g) * 0.1, K, 1.5, None)
    rows, plan = k.moe_dispatch(x, ids, E)
    ref_rows, ref_plan = REF.moe_dispatch(x, ids, E)
    assert torch.equal(rows, ref_rows)
    for field in ("tokens_per_expert", "source_token", "source_slot"):
        assert torch.equal(getattr(plan, field), getattr(ref_plan, field)), field
    for limit in (10.0, 0.0):
        out = k.moe_experts(rows, plan, w13, w2, limit)
        _close(out, REF.moe_experts(ref_rows, ref_plan, w13, w2, limit), dtype, f"moe_experts(limit={limit})")
        _close(k.moe_combine(out, plan, weights), REF.moe_combine(out, ref_plan, weights), torch.float32, "moe_combine")
    assert k.calls.count("npu_moe_init_routing_v2") == 1 and k.calls.count("npu_grouped_matmul") == 4
    assert k.calls.count("npu_moe_finalize_routing") == 2


def test_missing_ops_fall_back_to_the_reference(npu_kernels):
    k, g = npu_kernels, _gen(5)
    k.fused = frozenset()  # an older torch_npu without these ops
    x = torch.randn(4, 8, generator=g).bfloat16()
    _close(k.rms_norm(x, None, 1e-6), REF.rms_norm(x, None, 1e-6), torch.bfloat16, "rms_norm")
    _close(k.swiglu(x, x, 5.0), REF.swiglu(x, x, 5.0), torch.bfloat16, "swiglu")
    assert k.calls == []


def test_sample_checks_generator_device(npu_kernels):
    probs = torch.full((2, 4), 0.25)
    assert npu_kernels.sample(probs, [torch.Generator().manual_seed(0), None]).shape == (2,)

    class Elsewhere:
        device = torch.device("npu", 0) if hasattr(torch, "npu") else torch.device("meta")

    with pytest.raises(ValueError, match="sample: the generator of row 0"):
        npu_kernels.sample(probs, [Elsewhere(), None])
    with pytest.raises(ValueError, match="rejection_sample: the generator of row 0"):
        npu_kernels.rejection_sample(probs, None, torch.tensor([1]), [1], [Elsewhere()])
    target = torch.softmax(torch.randn(3, 6, generator=_gen(6)), -1)
    gens = lambda: [torch.Generator().manual_seed(9)]  # noqa: E731
    assert torch.equal(npu_kernels.rejection_sample(target, None, torch.tensor([2, 4]), [2], gens()),
                       REF.rejection_sample(target, None, torch.tensor([2, 4]), [2], gens()))


# --------------------------------------------------------------------------- start-up and errors


def test_accelerator_over_the_stand_in(torch_npu, ascend_machine):
    from deepinfer_plugins.ascend950 import AscendAccelerator

    ascend_machine(visible="1,2")
    acc = AscendAccelerator()
    caps = acc.capabilities()
    assert caps.device_type == "npu" and caps.collectives == "hccl" and caps.fast_paths == tuple(sorted(FUSED_OPS))
    assert caps.token_bitmask and caps.rejection_sampling
    # (device(0) itself needs torch_npu's "npu" device type, which the stand-in does not register)
    with pytest.raises(ValueError, match=r"NPU 3 does not exist: 1 visible \(logical->chip 0->1, 1->2\)"):
        acc.device(3)


def test_soc_mismatch_installed_for_x_running_on_y(torch_npu, ascend_machine, monkeypatch):
    from deepinfer_plugins.ascend950 import AscendAccelerator

    ascend_machine(kernels_for=("ascend910b",))
    with pytest.raises(RuntimeError, match="CANN is installed for ascend910b, but this machine runs Ascend950PR"):
        AscendAccelerator()
    ascend_machine()
    monkeypatch.setattr(torch_npu.npu, "get_device_name", lambda device=None: "Ascend910B3")
    with pytest.raises(RuntimeError, match="this NPU is Ascend910B3; the ascend back end supports Ascend 950"):
        AscendAccelerator()


def test_torch_npu_that_does_not_load_is_explained(monkeypatch):
    from deepinfer_plugins.ascend950 import AscendAccelerator

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails, like libhccl.so missing
    with pytest.raises(RuntimeError, match="does not load.*set_env.sh"):
        AscendAccelerator()


@pytest.fixture
def no_switches(monkeypatch):
    for var in ("ASCEND_LAUNCH_BLOCKING", "ASCEND_SLOG_PRINT_TO_STDOUT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_readable_error_switches_are_honoured(torch_npu, ascend_machine, no_switches):
    """The seeds' ASCEND_LAUNCH_BLOCKING=1 / ASCEND_SLOG_PRINT_TO_STDOUT=1: doctor shows them, and with
    operators synchronous the engine runs its steps synchronously too (no host_overlap, so the async
    pipeline is off by default and an NPU error surfaces in the step that caused it)."""
    from deepinfer_plugins.ascend950 import AscendAccelerator

    ascend_machine()
    assert AscendAccelerator().capabilities().host_overlap
    assert "ASCEND_" not in ascprobe.probe().reason.replace("ASCEND_HOME_PATH", "")
    no_switches.setenv("ASCEND_LAUNCH_BLOCKING", "1")
    no_switches.setenv("ASCEND_SLOG_PRINT_TO_STDOUT", "1")
    assert not AscendAccelerator().capabilities().host_overlap
    reason = ascprobe.probe().reason
    assert "ASCEND_LAUNCH_BLOCKING=1 (operators run synchronously" in reason
    assert "ASCEND_SLOG_PRINT_TO_STDOUT=1 (CANN's logs go to stdout)" in reason


def test_an_npu_start_up_failure_names_the_switches_that_are_off(no_switches):
    from deepinfer_plugins.ascend950 import AscendAccelerator

    no_switches.setitem(sys.modules, "torch_npu", None)  # import fails, like libhccl.so missing
    with pytest.raises(RuntimeError, match="rerun with ASCEND_LAUNCH_BLOCKING=1 ASCEND_SLOG_PRINT_TO_STDOUT=1"):
        AscendAccelerator()
    no_switches.setenv("ASCEND_LAUNCH_BLOCKING", "1")
    with pytest.raises(RuntimeError) as failed:
        AscendAccelerator()
    assert "rerun with ASCEND_SLOG_PRINT_TO_STDOUT=1 (CANN's logs go to stdout)" in str(failed.value)
    no_switches.setenv("ASCEND_SLOG_PRINT_TO_STDOUT", "1")
    with pytest.raises(RuntimeError) as failed:
        AscendAccelerator()
    assert "rerun with" not in str(failed.value) and "does not load" in str(failed.value)


# ------------------------------------------------------------------------------ conformance kit

PLUMBING_PLUGIN = '''
"""Test-only plugin: the Ascend kernels on CPU tensors through the torch_npu stand-in."""
import importlib.util

import torch

from deepinfer.accelerator.interface import ProbeResult
from deepinfer_plugins.ascend950 import AscendAccelerator
from deepinfer_plugins.cpu.accelerator import _meminfo


class AscendPlumbing(AscendAccelerator):
    name = "ascend_plumbing"
    collective_backend = "gloo"

    @classmethod
    def probe(cls):
        found = importlib.util.find_spec("torch_npu") is not None
        return ProbeResult(usable=found, reason="torch_npu CPU stand-in (plumbing only)" if found
                           else "tests/fake_torch_npu is not on the path")

    def _check_runtime(self):
        return []  # no npu-smi, no CANN: the SoC checks have their own tests

    def capabilities(self):
        return super().capabilities().model_copy(update={"name": self.name, "device_type": "cpu",
                                                         "collectives": "gloo"})

    def device(self, index=0):
        return torch.device("cpu")

    def memory_info(self):
        return _meminfo()

    def synchronize(self):
        return None
'''


@pytest.mark.slow
def test_conformance_kit_with_the_stand_in(tmp_path, fake_distribution):
    root = fake_distribution("ascend-plumbing", "0.1",
                             {"deepinfer.accelerators": {"ascend_plumbing": "ascend_plumbing_mod:AscendPlumbing"}},
                             {"ascend_plumbing_mod": PLUMBING_PLUGIN})
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(FAKE_DIR), env.get("PYTHONPATH", "")])
    report = tmp_path / "ascend.json"
    # levels 3 and 4 are left out: with the stand-in, memory is the host's RAM and the collectives
    # are gloo's, so they would test the CPU back end again, not Ascend code
    out = subprocess.run([sys.executable, "-m", "deepinfer.cli", "conformance", "ascend_plumbing",
                          f"--conformance-report={report}", "-k", "not collectives and not memory"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    results = json.loads(report.read_text())
    assert results["summary"]["failed"] == 0 and results["summary"]["passed"] >= 15
    # level 5 runs the whole engine on a tiny checkpoint through the Ascend kernels
    assert {r["level"] for r in results["tests"].values()} == {0, 1, 2, 5}
