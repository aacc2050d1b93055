"""A model's step program with its C calls bound once (the cpu back end's `prepare_program`).

Module by module, a decode step makes the same calls every step, and around each C call ran tens of
microseconds of Python: the model's glue, the wrappers' checks, new output tensors, ctypes matching
~25 keyword arguments. A `PreparedProgram` checks and binds each call it has a binder for once (the
wrapper's own `*_arguments`, with the kernel choices the composed op makes for the step's shapes),
owns its outputs, and per step only replaces the arguments that change — the program's inputs (the
step's rows, masks and RoPE tables) and what the calls it runs as they are (the model's own torch
code) produced — before calling them: the same calls on the same values, so the same bits as
`Program.run`.

Binders are per op (`BINDERS`, keyed by the program's "<table>.<op>" names) and know nothing of the
model that uses the op: any family whose program calls these ops gets them bound. An op table whose ops
differ from those names' (DeepSeek-V4.1's: its own site entries, projections without the query head
norm, coded caches) names its binders (`program_binders`, here `V41_BINDERS`). A call without a
binder, or whose binder declines the inputs, runs as it is, in its place.

The kernel choices (which packed copy a product reads, which kernel a row count takes) are asked once, at
the first step, as the composed ops ask them: the packed copies are made at load (`prepare_weights`), so
they hold for good. A call whose inputs of a step do not fit its binding (a layout it does not take), or
whose C status says it did not run, runs as the composed op that step, its results copied into the call's
buffers.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.program import Call, Program, Ref, bind_outputs, resolve
from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.native.attention_layer import check_output_status
from deepinfer_plugins.cpu.native.binding import Bound, PreparedCall, threads

if TYPE_CHECKING:
    from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels

#: how a changing argument reaches a bound call: (the call, the new value) -> False when the call cannot take it
Patch = Callable[[PreparedCall, Any], bool]


@dataclass
class Binding:
    """One call bound: its prepared C call, what it returns (the op's results), the setters of the
    arguments that change per step, and what its C status means (`check`: True = ran; may raise)."""

    call: PreparedCall
    outputs: Any
    patches: dict[str, Patch] = field(default_factory=dict)
    check: Callable[[Any], bool] = lambda status: True


class Binder:
    """How one op becomes a C call: `choices` (asked once, with the call's constant and bound arguments)
    names the kernels the composed op would pick for them, None where that is not one C call (a function
    of the packed copies and of constants only); `bind` binds the call on example values of every
    argument."""

    #: the op's arguments that may change per step, and how each reaches the C call
    patches: dict[str, Patch] = {}

    def choices(self, kernels: NativeCpuKernels, args: dict[str, Any]) -> tuple | None:
        return ()

    def bind(self, kernels: NativeCpuKernels, args: dict[str, Any], choices: tuple) -> Binding | None:
        raise NotImplementedError


def pointer(*names: str, dtype: torch.dtype | None = None) -> Patch:
    """A tensor argument that becomes C's `names` pointer: contiguous, of the bound dtype (and shape)."""
    def patch(call: PreparedCall, t: torch.Tensor | None) -> bool:
        if t is None or not t.is_contiguous() or (dtype is not None and t.dtype is not dtype):
            return False
        for name in names:
            call.arguments[call.index(name)] = t.data_ptr()
        return True
    return patch


def optional_pointer(name: str) -> Patch:
    """A tensor-or-None argument: its pointer, or NULL."""
    def patch(call: PreparedCall, t: torch.Tensor | None) -> bool:
        if t is not None and not t.is_contiguous():
            return False
        call.arguments[call.index(name)] = None if t is None else t.data_ptr()
        return True
    return patch


def table_pointer(name: str) -> Patch:
    """A RoPE table the C call reads where it is: fp32 and contiguous (else the wrapper would copy it)."""
    return pointer(name, dtype=torch.float32)


def _bound(k: NativeCpuKernels, bound: Bound | None, patches: dict[str, Patch],
           check: Callable[[Any], bool] | None = None) -> Binding | None:
    if bound is None:
        return None
    binding = Binding(bound.prepared(k.native_library), bound.outputs, patches)
    if check is not None:
        binding.check = check
    return binding


def _set(call: PreparedCall, name: str, value: Any) -> None:
    call.arguments[call.index(name)] = value


def _quantised(*weights: Any) -> bool:
    return any(isinstance(w, QuantizedWeight) for w in weights)


# ----- binders -----------------------------------------------------------------------------------------

class HcPreNorm(Binder):
    patches = {"streams": pointer("streams")}

    def choices(self, k, a):
        return (k._hc_fn_t(a["streams"], a["fn"]),)

    def bind(self, k, a, choices):
        return _bound(k, native.hc_pre_arguments(k.native_library, **a, fn_t=choices[0]), self.patches)


class HcPostPreNorm(Binder):
    patches = {"y": pointer("y"), "streams": pointer("streams"), "post": pointer("post_in", dtype=torch.float32),
               "comb": pointer("comb_in", dtype=torch.float32)}

    def choices(self, k, a):
        return (k._hc_fn_t(a["streams"], a["fn"]),)

    def bind(self, k, a, choices):
        out = native.hc_outputs(*a["streams"].shape, a["streams"].dtype)
        return _bound(k, native.hc_post_pre_norm_arguments(k.native_library, **a, fn_t=choices[0], out=out),
                      self.patches)


class HcMixCollapseNorm(Binder):
    """DeepSeek-V4.1's site entry (`hc_mix_collapse_norm`): one C call, each row computed alone."""

    patches = {"streams": pointer("streams"), "pre_in": pointer("pre_in", dtype=torch.float32)}

    def bind(self, k, a, choices):
        binding = _bound(k, native.hc_mix_collapse_norm_arguments(**a), self.patches)
        if binding is not None:
            out = binding.outputs
            binding.outputs = (out.normed, out.pre, out.post, out.comb)  # the op's results
        return binding


class HcPostMixCollapseNorm(Binder):
    """A V4.1 site's `hc_post` and the next site's entry (`hc_post_mix_collapse_norm`) in one C call."""

    patches = {"y": pointer("y"), "streams": pointer("streams"), "post": pointer("post_in", dtype=torch.float32),
               "comb": pointer("comb_in", dtype=torch.float32), "pre_in": pointer("pre_in", dtype=torch.float32)}

    def bind(self, k, a, choices):
        return _bound(k, native.hc_post_mix_collapse_norm_arguments(**a), self.patches)


class AttentionProjections(Binder):
    """`attention_projections` in one C call; `q_head_norm=False`: DeepSeek-V4.1's (its query heads only rotated)."""

    def __init__(self, q_head_norm: bool = True):
        self.q_head_norm = q_head_norm

    patches = {"x": pointer("x"), "cos": table_pointer("cos_t"), "sin": table_pointer("sin_t"),
               "index_cos": table_pointer("icos"), "index_sin": table_pointer("isin")}

    def choices(self, k, a):
        return k.fused_copies(a["x"].shape[0], ("linear", a["fused_x"]), ("linear", a["fused_qr"]))

    def bind(self, k, a, choices):
        if a["x"].dtype is not torch.bfloat16:
            return None
        bound = native.attention_projections_arguments(k.native_library, **a, packed_x=choices[0],
                                                       packed_qr=choices[1], q_head_norm=self.q_head_norm)
        tables = (a["cos"], a["sin"], a["index_cos"] if a["index_heads"] else a["cos"],
                  a["index_sin"] if a["index_heads"] else a["sin"])
        if bound is None or [bound.values[n] for n in ("cos_t", "sin_t", "icos", "isin")] != [
                t.data_ptr() for t in tables]:
            return None  # a table it would copy: read where it is, or not this way
        patches = dict(self.patches)
        if not a["index_heads"]:  # the C call reads the main tables in the indexer's place
            patches["cos"] = pointer("cos_t", "icos", dtype=torch.float32)
            patches["sin"] = pointer("sin_t", "isin", dtype=torch.float32)
        return _bound(k, bound, patches)


class CompressStore(Binder):
    patches = {"position_mod": pointer("position_mod", dtype=torch.long),
               "ring_row": pointer("ring_row", dtype=torch.long)}

    def bind(self, k, a, choices):
        return _bound(k, native.compress_store_arguments(k.native_library, **a), self.patches,
                      check=lambda status: status == 0)  # else the composed op reports the row


def _key_rows(parts: int) -> Patch:
    """The key parts' row tensors `[B, L_i]` (int64): pointers and lengths. With one part the C call reads
    the window's rows in the second part's place too, with no length (as the wrapper binds it)."""
    def patch(call: PreparedCall, rows: tuple[torch.Tensor, ...]) -> bool:
        if len(rows) != parts or any(r.dtype is not torch.long or not r.is_contiguous() for r in rows):
            return False
        r0, r1 = rows[0], rows[-1]
        _set(call, "rows0", r0.data_ptr())
        _set(call, "L0", r0.shape[1])
        _set(call, "rows1", r1.data_ptr())
        if parts == 2:
            _set(call, "L1", r1.shape[1])
        return True
    return patch


def _key_masks(parts: int) -> Patch:
    """The key parts' masks `[B, 1, L_i]` (bool), each as long as its rows (patched before them)."""
    def patch(call: PreparedCall, masks: tuple[torch.Tensor, ...]) -> bool:
        lengths = (call.arguments[call.index("L0")], call.arguments[call.index("L1")])
        if len(masks) != parts or any(m.dtype is not torch.bool or not m.is_contiguous() or m.shape[-1] != n
                                      for m, n in zip(masks, lengths)):
            return False
        _set(call, "mask0", masks[0].data_ptr())
        _set(call, "mask1", masks[-1].data_ptr())
        return True
    return patch


class AttentionOutput(Binder):
    """`decode_attention_output` in one C call; `coded_keys=True`: DeepSeek-V4.1's FP8 / NVFP4-coded caches."""

    def __init__(self, coded_keys: bool = False):
        self.coded_keys = coded_keys

    def choices(self, k, a):
        return k.fused_copies(a["q"].shape[0], ("grouped_linear", a["wo_a"]), ("linear", a["wo_b"]))

    def bind(self, k, a, choices):
        parts = len(a["caches"])
        if a["q"].dtype is not torch.bfloat16 or parts not in (1, 2):
            return None
        bound = native.attention_output_arguments(k.native_library, **a, packed_wo_a=choices[0],
                                                  packed_wo_b=choices[1], coded_keys=self.coded_keys)
        tables = (a["cos"].data_ptr(), a["sin"].data_ptr())
        if bound is None or (bound.values["cos_t"], bound.values["sin_t"]) != tables:
            return None  # a RoPE table it would copy: read where it is, or not this way
        patches = {"q": pointer("q"), "kv": pointer("kv"), "key_rows": pointer("key_rows", dtype=torch.long),
                   "rows": _key_rows(parts), "masks": _key_masks(parts), "cos": table_pointer("cos_t"),
                   "sin": table_pointer("sin_t")}
        caches = a["caches"]
        return _bound(k, bound, patches, check=lambda status: check_output_status(status, caches) or True)


class MoESublayer(Binder):
    patches = {"x": pointer("x"), "hash_ids": optional_pointer("hash_ids")}

    def choices(self, k, a):
        x, w13, w2, sw13, sw2 = a["x"], a["w13"], a["w2"], a["shared_w13"], a["shared_w2"]
        if x.dim() != 2:
            return None
        if _quantised(w13, w2, sw13, sw2):
            return k.quant_moe_layer_products(x.shape[0], w13, w2, sw13, sw2)
        return k.moe_layer_products(x.shape[0], x.dtype, w13, w2, sw13, sw2, a["top_k"])

    def bind(self, k, a, choices):
        if _quantised(a["w13"], a["w2"], a["shared_w13"], a["shared_w2"]):
            packed_shared, round_silu = choices
            bound = native.moe_layer_quant_arguments(k.native_library, **a, round_silu=round_silu,
                                                     packed_shared=packed_shared)
        else:
            experts, packed_shared, round_silu = choices
            bound = native.moe_layer_arguments(k.native_library, **a, round_silu=round_silu, packed_experts=experts,
                                               packed_shared=packed_shared)
        return _bound(k, bound, self.patches, check=lambda status: status == 0)  # else the composed op


class Linear(Binder):
    """`linear` of bf16 rows `[M, K]` where it is one C call: the packed register tiles (their copy made), or
    one row's GEMV. Other paths (AMX tiles, oneDNN, quantised weights) run as the composed op."""

    patches = {"x": pointer("X", dtype=torch.bfloat16)}

    def choices(self, k, a):
        x, weight = a["x"], a["weight"]
        if isinstance(weight, QuantizedWeight) or x.dim() != 2 or x.dtype is not torch.bfloat16:
            return None
        packed = k.linear_tiles(x.shape[0], x.dtype, weight)
        if packed is not None:
            return (packed,)
        return (None,) if x.shape[0] == 1 and k.native_library is not None else None

    def bind(self, k, a, choices):
        x, weight, packed = a["x"], a["weight"], choices[0]
        if packed is not None:
            return _bound(k, native.packed_linear_arguments(k.native_library, x, packed, weight.shape), self.patches)
        bound = native.gemv_bf16_arguments(k.native_library, weight, x)
        if bound is None:
            return None
        binding = _bound(k, bound, {"x": pointer("x", dtype=torch.bfloat16)})
        binding.outputs = binding.outputs.view(1, -1)  # linear's [1, N]
        return binding


class RmsNorm(Binder):
    """`rms_norm` of contiguous 2-D rows."""

    patches = {"x": pointer("x")}

    def bind(self, k, a, choices):
        x = a["x"]
        if x.dim() != 2 or not x.is_contiguous():
            return None
        return _bound(k, native.rms_norm_arguments(k.native_library, x, a["weight"], a["eps"]), self.patches)


#: the ops this back end binds, by the programs' names
BINDERS: dict[str, Binder] = {
    "ops.hc_pre_norm": HcPreNorm(),
    "ops.hc_post_pre_norm": HcPostPreNorm(),
    "ops.attention_projections": AttentionProjections(),
    "ops.compress_store": CompressStore(),
    "ops.decode_attention_output": AttentionOutput(),
    "kernels.moe_sublayer": MoESublayer(),
    "kernels.linear": Linear(),
    "kernels.rms_norm": RmsNorm(),
}

#: DeepSeek-V4.1's op table's binders (its `program_binders`, for its "ops.*" calls; its "kernels.*" calls are
#: the accelerator's, bound by `BINDERS`)
V41_BINDERS: dict[str, Binder] = {
    "ops.hc_mix_collapse_norm": HcMixCollapseNorm(),
    "ops.hc_post_mix_collapse_norm": HcPostMixCollapseNorm(),
    "ops.attention_projections": AttentionProjections(q_head_norm=False),
    "ops.decode_attention_output": AttentionOutput(coded_keys=True),
}


# ----- the prepared program ---------------------------------------------------------------------------

@dataclass
class _Step:
    """One call of the prepared program: bound (`binding`), or run as it is."""

    call: Call
    binding: Binding | None = None
    dynamic: tuple[tuple[str, Any], ...] = ()  # (parameter, its Ref(s)) that change per step: patched
    threads_at: int = -1  # the bound call's num_threads argument, or -1


def _is_static(value: Any, static: dict[str, Any]) -> bool:
    """A constant of the program, or Refs to values whose storage the prepared program owns."""
    if isinstance(value, Ref):
        return value.name in static
    if isinstance(value, tuple):
        return all(_is_static(v, static) for v in value)
    return True


class PreparedProgram:
    """`program` with the calls this back end binds bound once (see the module doc)."""

    def __init__(self, kernels: NativeCpuKernels, program: Program):
        self.kernels, self.program = kernels, program
        self.steps: list[_Step] = []  # bound at the first run, on its values
        self.static: dict[str, Any] = {}  # the bound calls' outputs and views of them: fixed storage
        self.threads = threads()

    def run(self, step: Any, **given: Any) -> tuple[Any, ...]:
        program = self.program
        env = program.feed(step, given)
        if not self.steps:
            self._bind(env)  # the first step: bind (running this step)
            return tuple(env[name] for name in program.outputs)
        if threads() != self.threads:  # torch's thread count changed: the calls use it, as the composed ops do
            self.threads = threads()
            for s in self.steps:
                if s.threads_at >= 0:
                    s.binding.call.arguments[s.threads_at] = self.threads
        env.update(self.static)
        for s in self.steps:
            call, binding = s.call, s.binding
            if binding is None:
                if not (call.view and call.outs[0] in self.static):
                    bind_outputs(call, program.op(call)(**{k: resolve(v, env) for k, v in call.args.items()}), env)
            elif not (all(binding.patches[p](binding.call, resolve(ref, env)) for p, ref in s.dynamic)
                      and binding.check(binding.call())):
                # inputs the call cannot take, or it did not run: the composed op, into the call's buffers
                _copy_into(binding.outputs, program.op(call)(**{k: resolve(v, env) for k, v in call.args.items()}))
        return tuple(env[name] for name in program.outputs)

    def _bind(self, env: dict[str, Any]) -> None:
        """Run the program on `env` (a step's inputs) call by call, binding each call a binder takes on the
        values it sees before making it (so this step's results come from the bound calls too)."""
        program, k = self.program, self.kernels
        self.threads = threads()
        for call in program.calls:
            s, binder = _Step(call), self._binder(call)
            args = {name: resolve(v, env) for name, v in call.args.items()}
            if binder is not None:
                chosen = binder.choices(k, args)
                dynamic = tuple((p, v) for p, v in call.args.items() if not _is_static(v, self.static))
                binding = None if chosen is None else binder.bind(k, args, chosen)
                if binding is not None and all(p in binding.patches for p, _ in dynamic):
                    s.binding, s.dynamic = binding, dynamic
                    s.threads_at = binding.call.index("num_threads") if "num_threads" in binding.call.names else -1
            if s.binding is not None:
                if not s.binding.check(s.binding.call()):
                    _copy_into(s.binding.outputs, program.op(call)(**args))
                bind_outputs(call, s.binding.outputs, env)
                self.static.update((name, env[name]) for name in call.outs)
            else:
                bind_outputs(call, program.op(call)(**args), env)
                if call.view and _is_static(tuple(call.args.values()), self.static):
                    self.static.update((name, env[name]) for name in call.outs)
            self.steps.append(s)

    def _binder(self, call: Call) -> Binder | None:
        """The binder of a table's op: the table's own (`program_binders`), else this back end's `BINDERS`."""
        if not isinstance(call.op, str):
            return None
        table = self.program.tables[call.op.partition(".")[0]]
        return getattr(table, "program_binders", BINDERS).get(call.op)


def _copy_into(buffers: Any, result: Any) -> None:
    """A composed op's result into a bound call's output buffers (the same structure)."""
    if buffers is None:
        return
    if isinstance(buffers, torch.Tensor):
        buffers.copy_(result)
        return
    for buf, value in zip(buffers, result):
        _copy_into(buf, value)
