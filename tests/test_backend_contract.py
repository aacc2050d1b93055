"""The back-end contract after the split into generic ops and per-model op tables:

- no plugin package imports another one (each builds on core's public interfaces only);
- DeepSeek-V4's own ops resolve once to the back end's declared table or the plain-torch defaults;
- the cpu back end's table delegates to its kernels (so the C paths stay in use);
- core's plain-torch reference kernels agree with the cpu back end's.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from deepinfer.accelerator import interface as api
from deepinfer.accelerator.reference import TorchKernels
from deepinfer.models.deepseek_v4 import ops as v4ops
from deepinfer.models.registry import OpDefaults

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "plugins"


def plugin_packages() -> dict[str, Path]:
    """Import name -> folder of every plugin package: plugins/<name>, plugins/features/<name>, and the
    third-party example under tests/plugins."""
    found = {f"deepinfer_plugins.{p.name}": p for p in PLUGINS.iterdir()
             if (p / "__init__.py").exists() and p.name != "features"}
    found.update({f"deepinfer_plugins.features.{p.name}": p for p in (PLUGINS / "features").iterdir()
                  if (p / "__init__.py").exists()})
    found["deepinfer_acme"] = ROOT / "tests" / "plugins" / "acme" / "deepinfer_acme"
    return found


def imported_modules(source: str, module: str) -> list[str]:
    """Every module (or module attribute) a source imports, as absolute dotted names; relative imports
    are resolved against `module`. `from a import b` gives `a.b` (b may be a submodule)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level > module.count("."):
                names.append("<outside>")  # climbs above the top-level package
                continue
            base = module.split(".")[:-node.level] if node.level else []
            parent = ".".join(base + ([node.module] if node.module else []))
            names += [f"{parent}.{alias.name}" for alias in node.names]
    return names


def foreign_imports(package: str, folder: Path, packages: dict[str, Path]) -> list[str]:
    problems = []
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).with_suffix("").parts
        module = ".".join((package,) + (rel[:-1] if rel[-1] == "__init__" else rel)) + \
            (".__init__" if rel[-1] == "__init__" else "")
        for name in imported_modules(path.read_text(), module):
            own = name == package or name.startswith(package + ".")
            plugin = name.split(".")[0] in {p.split(".")[0] for p in packages} or name == "<outside>"
            if plugin and not own:
                problems.append(f"{package}: {path.relative_to(folder)} imports {name}")
    return problems


def test_no_plugin_package_imports_another():
    packages = plugin_packages()
    assert {"deepinfer_plugins.cpu", "deepinfer_plugins.nvidia_sm100", "deepinfer_plugins.ascend950",
            "deepinfer_plugins.features.dspark"} <= set(packages)
    problems = [p for name, folder in packages.items() for p in foreign_imports(name, folder, packages)]
    assert problems == []


def test_the_import_scan_catches_a_cross_plugin_import(tmp_path):
    folder = tmp_path / "nvidia_sm100"
    folder.mkdir()
    (folder / "__init__.py").write_text("from deepinfer.accelerator.interface import Accelerator\n")
    (folder / "kernels.py").write_text("def f():\n    from deepinfer_plugins.cpu.kernels import CpuKernels\n")
    (folder / "probe.py").write_text("from . import kernels\nfrom .. import cpu\n")
    packages = {"deepinfer_plugins.nvidia_sm100": folder, "deepinfer_plugins.cpu": tmp_path / "cpu"}
    problems = foreign_imports("deepinfer_plugins.nvidia_sm100", folder, packages)
    assert problems == ["deepinfer_plugins.nvidia_sm100: kernels.py imports deepinfer_plugins.cpu.kernels.CpuKernels",
                        "deepinfer_plugins.nvidia_sm100: probe.py imports deepinfer_plugins.cpu"]


def test_model_specific_ops_are_not_in_the_accelerator_interface():
    for op in v4ops.OPS:
        assert not hasattr(api.Accelerator, op), op
        assert callable(getattr(v4ops.DeepseekV4Ops, op))
    assert api.INTERFACE_VERSION == "3.1"
    # 3.0 moved V4's attention halves out: a 2.x plugin may override them on the accelerator, which no
    # model calls any more, so it is refused (the error names both versions) until migrated
    assert api.interface_compatible("3.0") and not api.interface_compatible("2.7")
    assert api.interface_compatible("3.1") and not api.interface_compatible("3.2")
    assert not api.interface_compatible("1.1")
    assert "graph_capture" not in api.Capabilities.model_fields and "fp8_weights" not in api.Capabilities.model_fields


class _Plain(TorchKernels):
    pass


class _Declares(TorchKernels):
    class Ops(v4ops.DeepseekV4Ops):
        def compress_pool(self, kv, score):
            return super().compress_pool(kv, score) * 2

    def model_ops(self, family):
        return self.Ops() if family == v4ops.FAMILY else None


class _Wrong(TorchKernels):
    def model_ops(self, family):
        return object()


def test_op_table_resolution():
    assert type(v4ops.resolve_ops(_Plain())) is v4ops.DeepseekV4Ops
    assert type(v4ops.resolve_ops(object())) is v4ops.DeepseekV4Ops  # no model_ops at all
    assert isinstance(v4ops.resolve_ops(_Declares()), _Declares.Ops)
    with pytest.raises(TypeError, match="DeepseekV4Ops"):
        v4ops.resolve_ops(_Wrong())


def test_op_table_overrides_keep_the_signatures():
    with pytest.raises(TypeError, match=r"hc_post has signature \(self, y, streams, post\)"):
        class Bad(v4ops.DeepseekV4Ops):  # noqa: F841
            def hc_post(self, y, streams, post):
                return y


def test_family_names_its_op_table_and_its_ops_count_as_present():
    from deepinfer.models.registry import get_model_family

    family = get_model_family("deepseek_v4")
    assert family.op_defaults.model_ops is v4ops.DeepseekV4Ops
    assert set(v4ops.OPS) <= set(family.op_defaults.required_ops)
    assert family.op_defaults.missing_ops(_Plain()) == []  # generic kernels + the table's defaults
    assert OpDefaults(required_ops=("hc_pre",)).missing_ops(_Plain()) == ["hc_pre"]  # no table named
    with pytest.raises(ValueError, match="model_ops must be a class"):
        OpDefaults(model_ops=v4ops.DeepseekV4Ops())


def test_cpu_table_delegates_to_the_kernels_and_the_model_resolves_it_once():
    from deepinfer_plugins.cpu import CpuAccelerator
    from deepinfer_plugins.cpu.ops_v4 import CpuDeepseekV4Ops

    acc = CpuAccelerator()
    table = acc.model_ops("deepseek_v4")
    assert isinstance(table, CpuDeepseekV4Ops) and table.kernels is acc
    assert acc.model_ops("other_family") is None
    calls = []
    acc.hc_post = lambda *args: calls.append(args) or "native"  # what the native kernels object provides
    assert table.hc_post(1, 2, 3, 4) == "native" and calls == [(1, 2, 3, 4)]


def test_model_resolves_its_table_once_and_every_module_uses_it():
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from deepinfer.models.deepseek_v4.weights import canonicalize
    from deepinfer_plugins.cpu.kernels import CpuKernels
    from model_harness import build_hf_model, our_config

    class Counting(CpuKernels):
        asked = 0

        def model_ops(self, family):
            Counting.asked += 1
            return super().model_ops(family)

    hf = build_hf_model()
    model = DeepseekV4ForCausalLM(our_config(hf), Counting(), dtype=torch.float32, device="cpu")
    model.load_weights(canonicalize(hf.state_dict()))
    assert Counting.asked == 1 and model.ops.kernels is model.accel
    modules = [m for blk in model.blocks for m in blk.modules]
    hyper = [m for m in modules if hasattr(m, "fn")]
    assert hyper and all(m.ops is model.ops for m in hyper)
    attentions = [m.layer for m in hyper if hasattr(m.layer, "compressor")]
    compressors = [c for a in attentions for c in (a.compressor, a.indexer_compressor) if c is not None]
    assert compressors and all(a.ops is model.ops for a in attentions) and all(c.ops is model.ops for c in compressors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_kernels_agree_with_the_cpu_back_end(dtype):
    from deepinfer_plugins.cpu.kernels import CpuKernels

    ref, cpu, g = TorchKernels(), CpuKernels(), torch.Generator().manual_seed(0)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    x, w = torch.randn(40, 32, generator=g).to(dtype), torch.randn(24, 32, generator=g).to(dtype)
    torch.testing.assert_close(ref.linear(x, w), cpu.linear(x, w), **tol)
    torch.testing.assert_close(ref.rms_norm(x, w[0], 1e-6), cpu.rms_norm(x, w[0], 1e-6), **tol)
    q, kv = torch.randn(2, 20, 4, 32, generator=g).to(dtype), torch.randn(2, 9, 32, generator=g).to(dtype)
    mask = torch.rand(2, 20, 9, generator=g) > 0.3
    mask[1, 3] = False
    sinks = torch.randn(4, generator=g)
    torch.testing.assert_close(ref.sink_attention(q, kv, mask, sinks, 0.2), cpu.sink_attention(q, kv, mask, sinks, 0.2),
                               **tol)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(30)])
    rows, plan = ref.moe_dispatch(x[:30], ids, 6)
    crows, cplan = cpu.moe_dispatch(x[:30], ids, 6)
    assert torch.equal(rows, crows) and torch.equal(plan.tokens_per_expert, cplan.tokens_per_expert)
    w13, w2 = torch.randn(6, 16, 32, generator=g).to(dtype), torch.randn(6, 32, 8, generator=g).to(dtype)
    out = ref.moe_experts(rows, plan, w13, w2, 7.0)
    torch.testing.assert_close(out, cpu.moe_experts(rows, plan, w13, w2, 7.0), **tol)
    weights = torch.rand(30, 2, generator=g)
    torch.testing.assert_close(ref.moe_combine(out, plan, weights), cpu.moe_combine(out, plan, weights), **tol)
    logits, bitmask = torch.randn(3, 70, generator=g), torch.randint(-2**31, 2**31 - 1, (3, 3), generator=g,
                                                                          dtype=torch.int32)
    a, b = logits.clone(), logits.clone()
    ref.apply_token_bitmask(a, bitmask)
    cpu.apply_token_bitmask(b, bitmask)
    assert torch.equal(a, b)
