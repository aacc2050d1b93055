"""The NVIDIA back end as far as a CPU-only machine can check it (no GPU run has happened).

- probe reasons for simulated nvidia-smi listings (SM90, SM100, SM75, CUDA_VISIBLE_DEVICES) and
  for the CPU build of torch; importing and probing never initialise CUDA;
- fast-path selection (find_spec simulated) and construction wiring (torch.cuda simulated);
- the fast paths' own torch code (FlashMLA key lists, DeepGEMM contiguous layout, FP8 scaling)
  against CPU stand-ins of `flash_mla` / `deep_gemm` written from their documented semantics,
  compared with the CPU reference kernels: plumbing, not GPU numerics;
- the generic kernels (core's plain-torch reference) and DeepSeek-V4's default op table create
  nothing on a fixed device (run on the meta device).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import types

import pytest
import torch

from deepinfer.accelerator.interface import MoEDispatch
from deepinfer_plugins.cpu.kernels import CpuKernels
from deepinfer.models.deepseek_v4.ops import resolve_ops
from deepinfer_plugins.nvidia_sm100 import deep_gemm_experts, flash_mla_attention, kernels
from deepinfer_plugins.nvidia_sm100 import probe as nvprobe

REF = CpuKernels()

SMI = {
    "h100": "0, NVIDIA H100 80GB HBM3, 9.0, GPU-aaaa\n1, NVIDIA H100 80GB HBM3, 9.0, GPU-bbbb\n",
    "b200": "0, NVIDIA B200, 10.0, GPU-cccc\n",
    "t4": "0, Tesla T4, 7.5, GPU-dddd\n",
    "t4_and_b200": "0, Tesla T4, 7.5, GPU-dddd\n1, NVIDIA B200, 10.0, GPU-cccc\n",
}


@pytest.fixture
def fake_cuda_machine(monkeypatch):
    """A CUDA build of torch with nvidia-smi printing `listing`; CUDA must never be initialised."""
    def setup(listing: str | None, installed: tuple[str, ...] = (), visible: str | None = None):
        monkeypatch.setattr(torch.version, "cuda", "13.0")
        monkeypatch.setattr(torch.cuda, "_lazy_init", _forbidden)
        monkeypatch.setattr(torch.cuda, "init", _forbidden)
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        monkeypatch.setattr(nvprobe.shutil, "which", lambda exe: None if listing is None else f"/usr/bin/{exe}")
        monkeypatch.setattr(nvprobe.subprocess, "run",
                            lambda *a, **k: subprocess.CompletedProcess(a[0], 0, stdout=listing, stderr=""))
        real = importlib.util.find_spec
        monkeypatch.setattr(nvprobe.importlib.util, "find_spec",
                            lambda name, *a: object() if name in installed else (
                                None if name in nvprobe.FAST_PATH_MODULES.values() else real(name, *a)))
    return setup


def _forbidden(*args, **kwargs):
    raise AssertionError("the probe initialised CUDA")


# ------------------------------------------------------------------------------------------ probe


def test_cpu_build_of_torch_is_not_usable(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)  # as in a CPU build of torch (CI's); real on a GPU machine
    result = nvprobe.probe()
    assert not result.usable and "not a CUDA build" in result.reason and "CUDA 13" in result.reason


def test_sm90_is_usable_with_generic_kernels(fake_cuda_machine):
    fake_cuda_machine(SMI["h100"], installed=("flash_mla", "deep_gemm"))
    result = nvprobe.probe()
    assert result.usable, result.reason
    assert "2x NVIDIA H100" in result.reason and "sm_90" in result.reason
    assert "generic torch-CUDA kernels" in result.reason and "only on sm_100/sm_103" in result.reason
    assert result.details["fast_paths"] == ""


def test_sm100_activates_installed_fast_paths(fake_cuda_machine):
    fake_cuda_machine(SMI["b200"], installed=("flash_mla", "deep_gemm"))
    result = nvprobe.probe()
    assert result.usable and "sm_100" in result.reason
    assert "fast paths: flash_mla, deep_gemm" in result.reason
    assert result.details["fast_paths"] == "flash_mla,deep_gemm"


def test_sm100_without_libraries_says_so(fake_cuda_machine):
    fake_cuda_machine(SMI["b200"])
    result = nvprobe.probe()
    assert result.usable and "no FlashMLA/DeepGEMM installed" in result.reason


def test_sm75_is_refused_with_the_fix(fake_cuda_machine):
    fake_cuda_machine(SMI["t4"])
    result = nvprobe.probe()
    assert not result.usable
    assert "Tesla T4" in result.reason and "7.5" in result.reason and "8.0 or newer" in result.reason
    assert "CUDA_VISIBLE_DEVICES" in result.reason


def test_cuda_visible_devices_is_honoured(fake_cuda_machine):
    fake_cuda_machine(SMI["t4_and_b200"], visible="1")  # hide the T4
    result = nvprobe.probe()
    assert result.usable and "1x NVIDIA B200" in result.reason
    fake_cuda_machine(SMI["t4_and_b200"], visible="GPU-cc")  # UUID prefix, as CUDA accepts it
    assert nvprobe.probe().usable
    fake_cuda_machine(SMI["t4_and_b200"], visible="7")
    result = nvprobe.probe()
    assert not result.usable and "selects none" in result.reason


def test_no_nvidia_smi_and_no_device(fake_cuda_machine, monkeypatch):
    fake_cuda_machine(None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    result = nvprobe.probe()
    assert not result.usable and "no NVIDIA GPU is visible" in result.reason


def test_parse_skips_unusable_rows():
    gpus = nvprobe.parse_nvidia_smi("index, name, compute_cap, uuid\n0, A100, 8.0, GPU-1\n1, X, [N/A], GPU-2\n")
    assert [(g.index, g.capability) for g in gpus] == [(0, (8, 0))]


IMPORT_AND_PROBE = """
import json, sys, torch
import deepinfer_plugins.nvidia_sm100 as plugin
result = plugin.NvidiaAccelerator.probe()
print(json.dumps({"cuda_initialized": torch.cuda.is_initialized(), "usable": result.usable,
                  "vendor_imported": sorted(m for m in ("flash_mla", "deep_gemm") if m in sys.modules)}))
"""


@pytest.mark.slow
def test_import_and_probe_never_initialise_cuda():
    out = subprocess.run([sys.executable, "-c", IMPORT_AND_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    # usable only on a machine with a GPU; never a CUDA context or a vendor import either way
    assert facts == {"cuda_initialized": False, "usable": facts["usable"], "vendor_imported": []}
    if torch.version.cuda is None:
        assert facts["usable"] is False


# ----------------------------------------------------------------------------- fast-path selection


BOTH = ("flash_mla", "deep_gemm")


@pytest.mark.parametrize("capability, expected", [((10, 0), BOTH), ((10, 3), BOTH), ((9, 0), ()), ((12, 0), ()),
                                                  ((8, 0), ())])
def test_fast_paths_need_library_and_sm100(fake_cuda_machine, capability, expected):
    fake_cuda_machine(SMI["b200"], installed=("flash_mla", "deep_gemm"))
    assert nvprobe.active_fast_paths(capability) == expected


def _fake_flash_mla() -> types.ModuleType:
    """flash_mla_sparse_fwd as FlashMLA documents it (interface docstring + tests/ref.py semantics)."""
    mod = types.ModuleType("flash_mla")

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        assert q.dtype == kv.dtype == torch.bfloat16 and indices.dtype == torch.int32
        s_q, h_q, d_qk = q.shape
        assert kv.dim() == 3 and indices.shape[:2] == (s_q, kv.shape[1]) and d_v == 512 and d_qk in (512, 576)
        idx = indices[:, 0].long()
        if topk_length is not None:
            idx = torch.where(torch.arange(idx.shape[1]) < topk_length.long().unsqueeze(1), idx, -1)
        invalid = (idx < 0) | (idx >= kv.shape[0])
        keys = kv[:, 0][idx.clamp(min=0)].float()  # [s_q, topk, d_qk]
        p = torch.einsum("shd,skd->shk", q.float(), keys) * sm_scale
        p = p.masked_fill(invalid.unsqueeze(1), float("-inf"))
        lse = torch.logsumexp(p, dim=-1)
        lse_o = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.view(1, -1))
        lse_o = torch.where(torch.isinf(lse_o) & (lse_o < 0), torch.full_like(lse_o, float("inf")), lse_o)
        out = torch.einsum("shk,skd->shd", torch.exp(p - lse_o.unsqueeze(-1)), keys[..., :d_v])
        return out.to(torch.bfloat16), p.amax(-1), lse

    mod.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    return mod


def _fake_deep_gemm(alignment: int = 128) -> types.ModuleType:
    """The contiguous-layout grouped GEMMs as DeepGEMM documents them: d[i] = a[i] @ b[layout[i]].T."""
    mod = types.ModuleType("deep_gemm")
    mod.calls = []

    def grouped(a, b, d, layout):
        assert d.dtype == torch.bfloat16 and layout.dtype == torch.int32 and a.shape[0] == layout.shape[0] == d.shape[0]
        assert a.shape[0] % alignment == 0
        for e in range(b.shape[0]):
            rows = layout == e
            d[rows] = (a[rows].float() @ b[e].float().t()).to(d.dtype)
        d[layout == -1] = 0

    def bf16(a, b, d, grouped_layout, compiled_dims="nk", use_psum_layout=False, ensure_zero_padding=True,
             expected_m_for_psum_layout=None):
        assert a.dtype == b.dtype == torch.bfloat16
        mod.calls.append("bf16")
        grouped(a, b, d, grouped_layout)

    def fp8(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
            disable_ue8m0_cast=False, use_psum_layout=False, ensure_zero_padding=True, expected_m_for_psum_layout=None):
        (a8, sa), (b8, sb) = a, b
        assert a8.dtype == b8.dtype == torch.float8_e4m3fn and sa.dtype == sb.dtype == torch.float32
        mod.calls.append("fp8")
        a_deq = (a8.float().unflatten(1, (-1, 128)) * sa.unsqueeze(-1)).flatten(1)
        blocks = b8.float().unflatten(1, (-1, 128)).unflatten(3, (-1, 128)) * sb[:, :, None, :, None]
        b_deq = blocks.flatten(3).flatten(1, 2)
        grouped(a_deq, b_deq, d, grouped_layout)

    mod.m_grouped_bf16_gemm_nt_contiguous = bf16
    mod.m_grouped_fp8_gemm_nt_contiguous = fp8
    mod.get_mk_alignment_for_contiguous_layout = lambda: alignment
    return mod


@pytest.fixture
def fake_libraries(monkeypatch):
    libs = {"flash_mla": _fake_flash_mla(), "deep_gemm": _fake_deep_gemm()}
    for name, mod in libs.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return libs


def test_build_fast_paths_wires_each_library(fake_libraries):
    k = kernels.CudaKernels()
    paths = kernels.build_fast_paths(("flash_mla", "deep_gemm"), k, expert_precision="fp8")
    assert isinstance(paths.attention, flash_mla_attention.FlashMlaAttention)
    assert isinstance(paths.experts, deep_gemm_experts.DeepGemmExperts) and paths.experts.precision == "fp8"
    assert paths.names == ("flash_mla", "deep_gemm")
    empty = kernels.build_fast_paths((), k)
    assert empty.attention is None and empty.experts is None
    for unknown in ("cutlass", "deep_ep"):  # DeepEP was never used by the engine; the path is gone
        with pytest.raises(ValueError, match="unknown NVIDIA fast path"):
            kernels.build_fast_paths((unknown,), k)


def test_installed_but_broken_library_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import raises ImportError
    with pytest.raises(RuntimeError, match=r"does not import.*fast_paths=\(\)"):
        kernels.build_fast_paths(("flash_mla",), kernels.CudaKernels())


def test_accelerator_declares_what_it_selected(fake_cuda_machine, fake_libraries, monkeypatch):
    from deepinfer_plugins.nvidia_sm100 import NvidiaAccelerator

    fake_cuda_machine(SMI["b200"], installed=("flash_mla", "deep_gemm"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    caps = NvidiaAccelerator().capabilities()
    assert caps.fast_paths == ("flash_mla", "deep_gemm") and caps.device_type == "cuda"
    assert caps.collectives == "nccl" and caps.token_bitmask and caps.rejection_sampling
    generic = NvidiaAccelerator(fast_paths=()).capabilities()
    assert generic.fast_paths == ()
    assert NvidiaAccelerator(expert_precision="fp8").fast.experts.precision == "fp8"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert NvidiaAccelerator().capabilities().fast_paths == ()
    with pytest.raises(ValueError, match="needs the DeepGEMM fast path.*sm_90"):
        NvidiaAccelerator(expert_precision="fp8")


def test_constructor_without_gpu_says_why(monkeypatch):
    from deepinfer_plugins.nvidia_sm100 import NvidiaAccelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # already so without a GPU

    with pytest.raises(RuntimeError, match="needs a visible CUDA GPU"):
        NvidiaAccelerator()


# ------------------------------------------------------------------------- FlashMLA plumbing


def test_sparse_indices_list_visible_keys_first():
    mask = torch.tensor([[[True, False, True], [False, False, False]],
                         [[False, True, True], [True, True, True]]])
    indices, lengths = flash_mla_attention.sparse_indices(mask)
    assert indices.shape == (4, 1, flash_mla_attention.TOPK_MULTIPLE) and indices.dtype == torch.int32
    assert indices[:, 0, :3].tolist() == [[0, 2, -1], [-1, -1, -1], [4, 5, -1], [3, 4, 5]]
    assert (indices[:, :, 3:] == -1).all() and lengths.tolist() == [2, 0, 2, 3]


def test_flash_mla_path_matches_reference(fake_libraries):
    g = torch.Generator().manual_seed(0)
    B, S, H, d, L = 2, 3, 64, 512, 9
    q = torch.randn(B, S, H, d, generator=g).bfloat16()
    kv = torch.randn(B, L, d, generator=g).bfloat16()
    mask = torch.rand(B, S, L, generator=g) > 0.5
    mask[0, 1] = False  # nothing visible: output 0
    mask[1, :, 5:] = False  # ragged key set
    sinks = torch.randn(H, generator=g)
    got = flash_mla_attention.FlashMlaAttention()(q, kv, mask, sinks, d ** -0.5)
    want = REF.sink_attention(q, kv, mask, sinks, d ** -0.5)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    assert (got[0, 1] == 0).all()


def test_flash_mla_eligibility():
    q = torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16)
    kv = torch.zeros(1, 4, 512, dtype=torch.bfloat16)
    assert not flash_mla_attention.eligible(q, kv)  # CPU tensors: generic path
    assert not flash_mla_attention.eligible(q.float(), kv.float())


# ------------------------------------------------------------------------- DeepGEMM plumbing


def test_contiguous_layout_aligns_every_expert():
    counts = torch.tensor([3, 0, 5, 1])
    dest, layout = deep_gemm_experts.contiguous_layout(counts, 9, alignment=4)
    assert dest.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 12]
    assert layout.tolist() == [0, 0, 0, -1, 2, 2, 2, 2, 2, -1, -1, -1, 3, -1, -1, -1]
    static = deep_gemm_experts.static_padded_rows(9, 4, 4)
    _, padded = deep_gemm_experts.contiguous_layout(counts, 9, alignment=4, padded_rows=static)
    assert static % 4 == 0 and static >= 16 and padded[:16].tolist() == layout.tolist() and (padded[16:] == -1).all()


@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_quantisation_round_trip(pow2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=g) * 3
    q, s = deep_gemm_experts.quantize_per_token(x, pow2)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2)
    back = (q.float().view(5, 2, 128) * s.unsqueeze(-1)).view(5, 256)
    assert ((back - x).abs() <= x.abs() * 0.07 + 1e-3).all()
    w = torch.randn(3, 256, 128, generator=g)
    wq, ws = deep_gemm_experts.quantize_per_block(w, pow2)
    assert ws.shape == (3, 2, 1)
    if pow2:
        assert torch.equal(torch.log2(ws), torch.log2(ws).round())  # exact in UE8M0
    assert wq.float().abs().max() <= 448


def _moe_inputs(T=10, E=4, K=2, D=128, inter=128, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w13 = (torch.randn(E, 2 * inter, D, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(E, D, inter, generator=g) * 0.1).bfloat16()
    rows, plan = REF.moe_dispatch(x, ids, E)
    return rows, plan, w13, w2


def test_deep_gemm_bf16_path_matches_reference(fake_libraries):
    rows, plan, w13, w2 = _moe_inputs()
    experts = deep_gemm_experts.DeepGemmExperts(REF.swiglu)
    got = experts(rows, plan, w13, w2, 7.0)
    want = REF.moe_experts(rows, plan, w13, w2, 7.0)
    assert fake_libraries["deep_gemm"].calls == ["bf16", "bf16"]
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_deep_gemm_fp8_path_is_close_to_reference(fake_libraries):
    rows, plan, w13, w2 = _moe_inputs()
    experts = deep_gemm_experts.DeepGemmExperts(REF.swiglu, precision="fp8")
    got = experts(rows, plan, w13, w2, 7.0).float()
    want = REF.moe_experts(rows, plan, w13, w2, 7.0).float()
    assert fake_libraries["deep_gemm"].calls == ["fp8", "fp8"]
    assert (got - want).norm() / want.norm() < 0.1  # FP8 is lossy; this checks the plumbing, not accuracy
    assert len(experts._fp8_cache) == 2  # weights quantised once each
    experts(rows, plan, w13, w2, 7.0)
    assert len(experts._fp8_cache) == 2
    with pytest.raises(ValueError, match="precision"):
        deep_gemm_experts.DeepGemmExperts(REF.swiglu, precision="fp4")


def test_deep_gemm_fp8_path_runs_checkpoint_fp8_experts_as_stored(fake_libraries):
    from deepinfer.accelerator.quantized_weight import QuantizedWeight, stack
    from deepinfer.models.common.quant import quantize_fp8_block

    rows, plan, w13, w2 = _moe_inputs()

    def fp8(w):  # the checkpoint format: 128x128 blocks, ue8m0 scales, one expert at a time
        return stack([QuantizedWeight(*quantize_fp8_block(w[e].float()), 128, torch.bfloat16)
                      for e in range(w.shape[0])])

    q13, q2 = fp8(w13), fp8(w2)
    experts = deep_gemm_experts.DeepGemmExperts(REF.swiglu, precision="fp8")
    got = experts(rows, plan, q13, q2, 7.0).float()
    want = REF.moe_experts(rows, plan, q13, q2, 7.0).float()  # the reference path on the same weights
    assert fake_libraries["deep_gemm"].calls == ["fp8", "fp8"] and not experts._fp8_cache  # no re-quantisation
    assert (got - want).norm() / want.norm() < 0.05  # only the activations are quantised here
    cuda_rows = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=rows.shape)
    assert deep_gemm_experts.eligible(cuda_rows, q13, q2, "fp8")
    assert not deep_gemm_experts.eligible(cuda_rows, q13, q2, "bf16")  # the bf16 GEMM takes no FP8 weights
    assert not deep_gemm_experts.eligible(cuda_rows, q13, w2, "fp8")


def test_keep_fp8_weights_declares_fp8_block128(fake_cuda_machine, fake_libraries, monkeypatch):
    from deepinfer_plugins.nvidia_sm100 import NvidiaAccelerator

    fake_cuda_machine(SMI["b200"], installed=("flash_mla", "deep_gemm"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert NvidiaAccelerator().capabilities().weight_formats == ()
    caps = NvidiaAccelerator(expert_precision="fp8", keep_fp8_weights=True).capabilities()
    assert caps.weight_formats == ("fp8_block128",)
    with pytest.raises(ValueError, match="keep_fp8_weights=True needs expert_precision='fp8'"):
        NvidiaAccelerator(keep_fp8_weights=True)


# --------------------------------------------------------------------- generic kernels, any device


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


META_CALLS = {
    "linear": lambda k: k.linear(_meta(7, 48), _meta(24, 48)),
    "rms_norm": lambda k: k.rms_norm(_meta(5, 32), _meta(32), 1e-6),
    "rotary": lambda k: k.rotary(_meta(6, 4, 32), _meta(6, 4), _meta(6, 4), True),
    "swiglu": lambda k: k.swiglu(_meta(9, 16), _meta(9, 16), 10.0),
    "hc_pre": lambda k: resolve_ops(k).hc_pre(_meta(5, 4, 16), _meta(24, 64), _meta(24), _meta(3), 20, 1e-6, 1e-6),
    "hc_post": lambda k: resolve_ops(k).hc_post(_meta(5, 16), _meta(5, 4, 16), _meta(5, 4), _meta(5, 4, 4)),
    "hc_head": lambda k: resolve_ops(k).hc_head(_meta(5, 4, 16), _meta(4, 64), _meta(4), _meta(1), 1e-6, 1e-6),
    "sink_attention": lambda k: k.sink_attention(_meta(2, 3, 4, 32), _meta(2, 7, 32), _meta(2, 3, 7, dtype=torch.bool),
                                                 _meta(4), 0.1),
    "compress_pool": lambda k: resolve_ops(k).compress_pool(_meta(2, 3, 8, 16), _meta(2, 3, 8, 16)),
    "indexer_topk": lambda k: resolve_ops(k).indexer_topk(_meta(2, 5, 4, 8), _meta(2, 5, 4), _meta(2, 12, 8),
                                             _meta(2, 5, 12, dtype=torch.bool), 4),
    "moe_route": lambda k: k.moe_route(_meta(13, 8), _meta(8), 2, 1.5, None),
    "apply_token_bitmask": lambda k: k.apply_token_bitmask(_meta(4, 100), _meta(4, 4, dtype=torch.int32)),
    "moe_dispatch": lambda k: k.moe_dispatch(_meta(13, 16), _meta(13, 2, dtype=torch.long), 8)[0],
    "moe_combine": lambda k: k.moe_combine(
        _meta(26, 16), MoEDispatch(*(_meta(n, dtype=torch.long) for n in (8, 26, 26)), num_tokens=13), _meta(13, 2)),
}


def test_sync_free_dispatch_equals_reference():
    ids = torch.randint(0, 8, (13, 2), generator=torch.Generator().manual_seed(3))
    x = torch.randn(13, 16)
    rows, plan = kernels.CudaKernels().moe_dispatch(x, ids, 8)
    ref_rows, ref_plan = REF.moe_dispatch(x, ids, 8)
    assert torch.equal(rows, ref_rows)
    for field in ("tokens_per_expert", "source_token", "source_slot"):
        assert torch.equal(getattr(plan, field), getattr(ref_plan, field)), field


@pytest.mark.parametrize("kernel", sorted(META_CALLS))
def test_generic_kernels_follow_their_inputs_device(kernel):
    """On the meta device any tensor a kernel creates on a fixed device (CPU) makes it fail."""
    out = META_CALLS[kernel](kernels.CudaKernels())
    for t in (out if isinstance(out, tuple) else (out,)):
        assert t is None or t.device.type == "meta"


def test_samplers_reject_a_generator_on_another_device():
    wrong = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"sample: the generator of row 1.*torch.Generator\(device='cpu'\)"):
        kernels.CudaKernels().sample(torch.full((2, 4), 0.25), [None, wrong])
    with pytest.raises(ValueError, match=r"rejection_sample: the generator of row 0"):
        kernels.CudaKernels().rejection_sample(torch.full((2, 4), 0.25), None, torch.tensor([1]), [1], [wrong])


def test_rejection_sampling_is_the_reference_one():
    g = torch.Generator().manual_seed(4)
    target = torch.softmax(torch.randn(5, 10, generator=g), -1)
    draft = torch.softmax(torch.randn(3, 10, generator=g), -1)
    ids = torch.tensor([2, 7, 1])

    def run(k):
        gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
        return k.rejection_sample(target, draft, ids, [2, 1], gens)

    assert torch.equal(run(kernels.CudaKernels()), run(REF))
