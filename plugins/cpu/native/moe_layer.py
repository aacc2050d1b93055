"""moe_layer_bf16 and moe_layer_quant, the MoE sub-layer of a decode step in one call (moe_layer.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer.accelerator.quantized_weight import FP4_GROUP, QuantizedWeight
from deepinfer_plugins.cpu.native.binding import Bound, Kernel, threads
from deepinfer_plugins.cpu.native.packed_gemm import packed_shape
from deepinfer_plugins.cpu.native.quant_experts import expert_stacks

_MOE_LAYER_BF16 = Kernel("moe_layer_bf16")

_MOE_LAYER_QUANT = Kernel("moe_layer_quant")

#: the router scoring functions the C code knows (moe_layer.c's SCORE_*)
SCORING_CODES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


def _usable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype is dtype and t.is_cpu and t.is_contiguous() and not t.requires_grad


def _packed_ptr(lib: ctypes.CDLL, packed: torch.Tensor | None, weight: torch.Tensor | None) -> int | None:
    """`packed`'s address if it is pack_bf16(weight) in this build's layout, else None (that product reads
    the plain weight)."""
    if packed is None or weight is None or not _usable(packed, torch.bfloat16):
        return None
    want = (*weight.shape[:-2], *packed_shape(lib, *weight.shape[-2:]))
    return packed.data_ptr() if tuple(packed.shape) == want else None


def _router(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, hash_ids: torch.Tensor | None,
            top_k: int, scoring_func: str) -> tuple[int, torch.Tensor | None] | None:
    """(scoring code, hash ids as int64) for the C call, or None where it does not take these inputs."""
    scoring = SCORING_CODES.get(scoring_func)
    if (scoring is None or x.dim() != 2 or not _usable(x, torch.bfloat16) or not _usable(gate, torch.float32)
            or gate.shape != (gate.shape[0], x.shape[1]) or not 0 < top_k <= gate.shape[0]):
        return None
    if bias is not None and not (_usable(bias, torch.float32) and bias.shape == (gate.shape[0],)):
        return None
    if hash_ids is not None:
        if hash_ids.shape != (x.shape[0], top_k) or not hash_ids.is_cpu:
            return None
        hash_ids = hash_ids.long().contiguous()
    return scoring, hash_ids


def _bf16_shared(sw13: torch.Tensor | None, sw2: torch.Tensor | None, D: int) -> dict | None:
    """The C arguments of a bf16 shared expert (`sw13 [2SI, D]`, `sw2 [D, SI]`) or of none (both None);
    None for anything else."""
    if sw13 is None or sw2 is None:
        return dict(sw13=None, sw2=None, SI=0) if sw13 is sw2 else None
    if not (_usable(sw13, torch.bfloat16) and _usable(sw2, torch.bfloat16)):
        return None
    si = sw2.shape[1]
    if sw13.shape != (2 * si, D) or sw2.shape != (D, si):
        return None
    return dict(sw13=sw13.data_ptr(), sw2=sw2.data_ptr(), SI=si)


def moe_layer_bf16(lib: ctypes.CDLL, *args, **kwargs) -> torch.Tensor | None:
    """`moe_layer_arguments`' call made: the `[T, D]` result, or None (input it does not take, or a hash id
    outside the experts: the reference reports it)."""
    bound = moe_layer_arguments(lib, *args, **kwargs)
    return None if bound is None or bound.call(lib) else bound.outputs


def moe_layer_arguments(lib: ctypes.CDLL, x: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor | None,
                        hash_ids: torch.Tensor | None, w13: torch.Tensor, w2: torch.Tensor,
                        shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None, top_k: int,
                        routed_scaling_factor: float, scoring_func: str, swiglu_limit: float, round_silu: bool = False,
                        packed_experts: tuple[torch.Tensor, torch.Tensor] | None = None,
                        packed_shared: tuple[torch.Tensor | None, torch.Tensor | None] | None = None) -> Bound | None:
    """The MoE sub-layer (`MoEOps.moe_sublayer`) of a few bf16 tokens `x [T, D]` with bf16 experts and an fp32
    router, as a checked call (outputs: the `[T, D]` result, valid where its status is 0), not made; None for
    anything else. `round_silu`: the shared expert's swiglu rounds where torch's bf16 ops do (silu, then the
    product), else once, as the C swiglu and expert kernels. `packed_experts` (pack_bf16 of w13 and w2): the
    routed experts on the register tiles (packed_gemm.c), else on the multi-token GEMVs; `packed_shared`
    (pack_bf16 of shared_w13, shared_w2, either None): those products on the tiles. A packed copy of another
    shape than its weight's is not used."""
    router = _router(x, gate, gate_bias, hash_ids, top_k, scoring_func)
    if router is None or not (_usable(w13, torch.bfloat16) and _usable(w2, torch.bfloat16)) or w13.dim() != 3:
        return None
    scoring, hash_ids = router
    T, D = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    if gate.shape[0] != E or w13.shape[2] != D or two_i % 2 or w2.shape != (E, D, inter):
        return None
    shared = _bf16_shared(shared_w13, shared_w2, D)
    if shared is None:
        return None
    pw13, pw2 = (None, None) if packed_experts is None else packed_experts
    pw13, pw2 = _packed_ptr(lib, pw13, w13), _packed_ptr(lib, pw2, w2)
    if pw13 is None or pw2 is None:
        pw13 = pw2 = None
    psw13, psw2 = (None, None) if packed_shared is None else packed_shared
    out = torch.empty((T, D), dtype=torch.bfloat16)
    values = dict(x=x.data_ptr(), T=T, D=D, gate=gate.data_ptr(),
                  bias=None if gate_bias is None else gate_bias.data_ptr(),
                  hash_ids=None if hash_ids is None else hash_ids.data_ptr(), E=E, k=top_k,
                  scaling=routed_scaling_factor, scoring=scoring, w13=w13.data_ptr(), w2=w2.data_ptr(), I=inter,
                  **shared, pw13=pw13, pw2=pw2, psw13=_packed_ptr(lib, psw13, shared_w13),
                  psw2=_packed_ptr(lib, psw2, shared_w2), limit=swiglu_limit, round_silu=int(round_silu),
                  out=out.data_ptr(), num_threads=threads())
    return Bound(_MOE_LAYER_BF16, values, out, (hash_ids,))


def _quant_shared(sw13: QuantizedWeight, sw2: QuantizedWeight, D: int) -> dict | None:
    """The C arguments of a quantised shared expert (`sw13 [2SI, D]`, `sw2 [D, SI]`, one format), or None."""
    if not isinstance(sw13, QuantizedWeight) or not isinstance(sw2, QuantizedWeight):
        return None
    if not all(w.dim() == 2 and w.data.is_cpu and w.scale.is_cpu and w.data.is_contiguous() and w.scale.is_contiguous()
               for w in (sw13, sw2)):
        return None
    si = sw2.shape[1]
    fp4 = sw13.kind == "fp4"
    if (sw13.kind != sw2.kind or sw13.scale.dtype != sw2.scale.dtype or (not fp4 and sw13.block != sw2.block)
            or sw13.shape != (2 * si, D) or sw2.shape != (D, si) or (fp4 and (D % FP4_GROUP or si % FP4_GROUP))):
        return None
    return dict(sw13=sw13.data.data_ptr(), sw2=sw2.data.data_ptr(), ss13=sw13.scale.data_ptr(),
                ss2=sw2.scale.data_ptr(), s_fp4=int(fp4), s_scale_e8m0=int(sw13.scale.dtype == torch.float8_e8m0fnu),
                s_block=sw13.block, SI=si)


def moe_layer_quant(lib: ctypes.CDLL, *args, **kwargs) -> torch.Tensor | None:
    """`moe_layer_quant_arguments`' call made, as `moe_layer_bf16`."""
    bound = moe_layer_quant_arguments(lib, *args, **kwargs)
    return None if bound is None or bound.call(lib) else bound.outputs


def moe_layer_quant_arguments(lib: ctypes.CDLL, x: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor | None,
                              hash_ids: torch.Tensor | None, w13: QuantizedWeight, w2: QuantizedWeight,
                              shared_w13: torch.Tensor | QuantizedWeight | None,
                              shared_w2: torch.Tensor | QuantizedWeight | None, top_k: int,
                              routed_scaling_factor: float, scoring_func: str, swiglu_limit: float,
                              round_silu: bool = False,
                              packed_shared: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
                              ) -> Bound | None:
    """`moe_layer_arguments` with the routed experts kept quantised (FP4 or FP8-block stacks, as quant_experts
    takes them) and the shared expert bf16 (`packed_shared` as there), quantised (both FP4 or both FP8) or
    absent; None for anything else."""
    router = _router(x, gate, gate_bias, hash_ids, top_k, scoring_func)
    if router is None:
        return None
    scoring, hash_ids = router
    T, D = x.shape
    stacks = expert_stacks(w13, w2, D)
    if stacks is None or stacks["E"] != gate.shape[0]:
        return None
    if isinstance(shared_w13, QuantizedWeight):
        shared = _quant_shared(shared_w13, shared_w2, D)
    else:
        shared = _bf16_shared(shared_w13, shared_w2, D)
        if shared is not None:
            shared.update(ss13=None, ss2=None, s_fp4=-1, s_scale_e8m0=0, s_block=0)
    if shared is None:
        return None
    psw13, psw2 = (None, None) if packed_shared is None else packed_shared  # the C code ignores them when quantised
    out = torch.empty((T, D), dtype=torch.bfloat16)
    values = dict(x=x.data_ptr(), T=T, D=D, gate=gate.data_ptr(),
                  bias=None if gate_bias is None else gate_bias.data_ptr(),
                  hash_ids=None if hash_ids is None else hash_ids.data_ptr(), k=top_k, scaling=routed_scaling_factor,
                  scoring=scoring, **stacks, **shared, psw13=_packed_ptr(lib, psw13, shared_w13),
                  psw2=_packed_ptr(lib, psw2, shared_w2), limit=swiglu_limit, round_silu=int(round_silu),
                  out=out.data_ptr(), num_threads=threads())
    return Bound(_MOE_LAYER_QUANT, values, out, (hash_ids,))
