"""The accelerator contract: what a back end (CPU, NVIDIA, Ascend, a third party's) must provide.

An accelerator is one class made of small sub-interfaces (device and memory, small ops, attention,
MoE, sampling kernels, collectives) plus a frozen `Capabilities` model and an import-light `probe()`.
These are the generic ops every model family uses. A family's own fused ops (DeepSeek-V4's mHC,
compressor pooling, indexer and attention halves) are not part of this contract: they live in the
family's op table, which has plain-torch defaults and which a back end may override through
`Accelerator.model_ops`. A back end may also prepare a model's step program once and replay it
(`Accelerator.prepare_program`): the seam for fast paths every family gets by describing its step.
`deepinfer.accelerator.reference` has a plain-torch implementation of every generic op and
collectives over torch.distributed, for back ends to build on.
The core resolves the kernels it needs once at start-up into plain attributes; nothing on the hot
path goes through a registry.

Tensor conventions used by every kernel below:
- token-major ragged layout: `T` tokens of many sequences flattened, no padding, unless a kernel
  says `B` (batch of sequences) and takes an explicit mask;
- weights in the `nn.Linear` layout `[out_features, in_features]`;
- `*_fp32` arguments are float32 whatever the activation dtype.

Subclass method signatures are checked when the subclass is defined (`__init_subclass__`): a
back end that renames or drops a parameter fails at import, not in the middle of a forward pass.
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from deepinfer.accelerator.quantized_weight import WEIGHT_FORMATS, QuantizedWeight, is_weight_format
from deepinfer.program import Program, Runnable

#: Version of this contract. A plugin built against another *major* version is refused at
#: selection with both versions in the message; a newer minor on the core side is accepted.
#: 1.1 added the optional kernel `argmax_logsumexp` (with a default).
#: 2.0 moved the model-specific ops (hc_pre, hc_post, hc_head, compress_pool, indexer_topk) out of
#: the interface into DeepSeek-V4's op table (`Accelerator.model_ops`), and removed the unused
#: capabilities `graph_capture` and `fp8_weights`.
#: 2.1 added the capability `batch_invariant` and `Accelerator.set_batch_invariant` (default refuses).
#: 2.2 added the capability `weight_formats`: quantised weights (`QuantizedWeight`) reach linear,
#: grouped_linear and moe_experts in the formats a back end declares (default none: all dequantised).
#: 2.3 added sub-groups: `Collectives.new_group` (default refuses) and the optional `group` argument of
#: all_reduce / all_gather / all_to_all. A plugin written against an older minor may leave `group` out
#: of its overrides (see `_check_signatures`); it then runs only layouts of one EP and one CP group.
#: 2.4 added the optional kernels `moe_sublayer` (the whole routed + shared MoE of one layer) and
#: `rms_norm_rotary`, each with a default composed of the kernels it fuses.
#: 2.5 added the optional kernel `sink_attention_rows` (sink attention over keys read by index from
#: cache tensors), with a default composed of row gathers and `sink_attention`.
#: 2.6 added the optional kernels `attention_projections` (the attention's input projections, norms and
#: rotaries) and `decode_attention_output` (a decode step's attention from the own key's write to the
#: output projection), each with a default composed of the kernels it fuses.
#: 2.7 added the optional `Accelerator.prepare_memory` (called once the weights are loaded and the cache
#: is bound; default does nothing).
#: 3.0 the interface holds generic ops only: `attention_projections` and `decode_attention_output` (V4's
#: attention shapes) moved into DeepSeek-V4's op table, which a back end overrides through `model_ops`
#: (its defaults compose the generic ops). Added the optional `Accelerator.prepare_program` (a model's
#: step program prepared once and replayed: `deepinfer.program`; default None, run eagerly).
#: Migrating a 2.x plugin: move overrides of those two methods onto your subclass of
#: `DeepseekV4Ops` (same signatures), build that table with your accelerator as its `kernels`, and
#: set `interface_version = "3.0"`.
#: 3.1 added the optional kernel `prepare_weights` (a model's weights by the op that reads them, once they
#: are loaded: the back end makes its copies laid out for its kernels there; default does nothing).
INTERFACE_VERSION = "3.1"


class ProbeResult(BaseModel):
    """What `probe()` found, without initialising any device runtime."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    usable: bool
    reason: str = ""  # why not usable (or a one-line description when usable)
    #: free-form facts for `deepinfer doctor`; by convention "devices" is the number of devices this
    #: process may use (the parallel launcher refuses a layout that needs more)
    details: dict[str, str] = {}


class Capabilities(BaseModel):
    """What a back end declares it supports. Features and the conformance kit read this."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    device_type: str  # torch device type: "cpu", "cuda", "npu", ...
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    token_bitmask: bool = False  # apply_token_bitmask is implemented (structured outputs)
    rejection_sampling: bool = False  # rejection_sample is implemented (speculative decoding)
    # The forward runs on cores the host thread does not use, so preparing step N+1 while step N
    # runs (the async pipeline) gains time. False on the cpu back end: there the two threads share
    # the cores, and libgomp's second thread pool throttles every parallel region (docs/engine.md).
    host_overlap: bool = True
    collectives: str = "none"  # torch.distributed backend: "gloo", "nccl", "hccl", "none"
    # set_batch_invariant(True) is implemented: every kernel then reduces in an order that does not
    # depend on the batch (row count, other sequences, padding, chunking); the batch_invariant feature
    batch_invariant: bool = False
    fast_paths: tuple[str, ...] = ()  # vendor libraries active on this machine (e.g. "flash_mla")
    # quantised weight formats (`quantized_weight.WEIGHT_FORMATS`: fp8_block128, fp8_block32,
    # fp4_e2m1) this back end computes on directly: the loader then keeps such weights quantised and
    # linear / grouped_linear / moe_experts receive them as QuantizedWeight; others arrive dequantised
    weight_formats: tuple[str, ...] = ()

    @field_validator("weight_formats")
    @classmethod
    def _known_formats(cls, formats: tuple[str, ...]) -> tuple[str, ...]:
        bad = [f for f in formats if not is_weight_format(f)]
        if bad:
            raise ValueError(f"unknown weight formats {bad}; use names like {', '.join(WEIGHT_FORMATS)} "
                             f"(fp8_block<B> for other FP8 block sizes)")
        return formats


@dataclass(frozen=True)
class MemoryInfo:
    free_bytes: int
    total_bytes: int


@dataclass
class MoEDispatch:
    """How routed (token, expert) pairs were grouped by expert; produced by `moe_dispatch`."""

    tokens_per_expert: torch.Tensor  # [num_local_experts] int64, counts of grouped rows
    source_token: torch.Tensor  # [N] int64, the token each grouped row came from
    source_slot: torch.Tensor  # [N] int64, which of the token's top-k choices it is
    num_tokens: int


def _check_signatures(cls: type, interface: type) -> None:
    """An override must have the interface's parameters, names and kinds; it may leave out trailing
    parameters that have a default in the interface (added by a later minor version, e.g. the
    collectives' `group`), so a plugin written against an older minor still defines. The core
    passes such a parameter only to back ends that accept it."""
    for name, member in vars(interface).items():
        if not getattr(member, "__isabstractmethod__", False):
            continue
        impl = getattr(cls, name, None)
        if impl is None or getattr(impl, "__isabstractmethod__", False):
            continue
        # getattr binds classmethods the same way on both sides, so their signatures compare
        params = list(inspect.signature(getattr(interface, name)).parameters.values())
        want = [(p.name, p.kind) for p in params]
        got = [(p.name, p.kind) for p in inspect.signature(impl).parameters.values()]
        optional_tail = all(p.default is not inspect.Parameter.empty for p in params[len(got):])
        if want != got and not (want[:len(got)] == got and optional_tail):
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__}.{name} has signature "
                f"({', '.join(n for n, _ in got)}) but the accelerator interface "
                f"{interface.__name__}.{name} requires ({', '.join(n for n, _ in want)})"
            )


class _Interface(ABC):
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for base in cls.__mro__[1:]:
            if base is not _Interface and issubclass(base, _Interface) and base.__module__ == __name__:
                _check_signatures(cls, base)


class DeviceMemory(_Interface):
    """Device placement, memory accounting and synchronisation."""

    @abstractmethod
    def device(self, index: int = 0) -> torch.device:
        """The torch device for local device `index`."""

    @abstractmethod
    def memory_info(self) -> MemoryInfo:
        """Free and total bytes of the memory the back end allocates from (RAM on CPU)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all queued work on the current device has finished."""


class SmallOps(_Interface):
    """Dense linear algebra and element-wise ops."""

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        """`x @ weight.T`; x `[..., in]`, weight `[out, in]`; result in x's dtype.

        `weight` is a `QuantizedWeight` only in a format the back end declares in
        `Capabilities.weight_formats` (then the product is that of `weight.dequantize(x.dtype)`)."""

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        """Per-group `x[:, g] @ weight[g].T`; x `[T, G, in]`, weight `[G, out, in]` -> `[T, G, out]`
        (the attention output's grouped low-rank projection); a `QuantizedWeight` only in a declared
        format (as for `linear`). Optional: this default runs one `linear` per group; a back end
        overrides it with one batched product."""
        return torch.stack([self.linear(x[:, g], weight[g]) for g in range(weight.shape[0])], dim=1)

    def prepare_weights(self, uses: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """A model's weights, each with the name of the op that will read it, given once they are loaded
        ("linear", "grouped_linear", "moe_experts", or a family op table's op such as
        DeepSeek-V4's "hc_pre"). The ops are later called with these same tensor objects. A back end that
        reads weights in a layout of its own (packed tiles) makes those copies here, so every call, the
        first included, takes the same path; it ignores uses it has no layout for. Optional: this default
        does nothing. Must not change any tensor's values."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim, computed in fp32, cast back to x's dtype once.

        `weight` is None for the unweighted normalisation (per-head q norm)."""

    @abstractmethod
    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        """Interleaved RoPE on the last `2 * cos.shape[-1]` dims of x, the other dims unchanged.

        x `[T, ..., d]`; cos/sin `[T, r/2]` fp32 (broadcast over the middle dims). Pairs are dims
        (2i, 2i+1). `inverse=True` rotates by the negative angle (attention-output de-rotation).
        Returns a new tensor of x's dtype."""

    def rms_norm_rotary(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
        """`rotary(rms_norm(x, weight, eps), cos, sin, inverse=False)` (the attention's query and key
        rows), the norm rounded to x's dtype as between the two calls. Optional: this default makes
        the two calls; a back end fuses them."""
        return self.rotary(self.rms_norm(x, weight, eps), cos, sin, False)

    @abstractmethod
    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        """`silu(min(gate, limit)) * clamp(up, -limit, limit)`; limit <= 0 disables the clamps."""


class AttentionOps(_Interface):
    """Attention with sinks over an explicit key set."""

    @abstractmethod
    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                       sinks: torch.Tensor, scale: float) -> torch.Tensor:
        """Shared-KV (MQA) attention with a per-head sink logit in the softmax denominator.

        q `[B, S, H, d]`; kv `[B, L, d]` (K = V); mask `[B, S, L]` bool, True = attend;
        sinks `[H]` fp32. Returns `[B, S, H, d]` in q's dtype. A row with no visible key
        attends to nothing (output 0; the sink absorbs all mass)."""

    def sink_attention_rows(self, q: torch.Tensor, caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                            masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float) -> torch.Tensor:
        """`sink_attention` over keys read by index: item b's keys are `caches[i][rows[i][b]]` for each
        part i in turn (cache `[N_i, d]`, rows `[B, L_i]` int64 within `[0, N_i)`), masked by
        `masks[i]` `[B, S, L_i]` -> `[B, S, H, d]`. Optional: this default gathers the rows and
        concatenates the parts (keys and masks) before `sink_attention`; a back end reads the rows in
        place (a decode step's window ring and compressed entries, without the copies)."""
        if not caches or not len(caches) == len(rows) == len(masks):
            raise ValueError(f"sink_attention_rows needs one or more parts with one rows and one mask tensor each; "
                             f"got {len(caches)} caches, {len(rows)} rows, {len(masks)} masks")
        keys = [c.index_select(0, r.reshape(-1)).view(*r.shape, c.shape[-1]) for c, r in zip(caches, rows)]
        kv = keys[0] if len(keys) == 1 else torch.cat(keys, dim=1)
        mask = masks[0] if len(masks) == 1 else torch.cat(masks, dim=2)
        return self.sink_attention(q, kv, mask, sinks, scale)


def routing_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """The router's affinity scores from its fp32 logits: "sqrtsoftplus", "sigmoid" or softmax."""
    if scoring_func == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def shared_expert(kernels: SmallOps, x: torch.Tensor, w13: torch.Tensor | QuantizedWeight,
                  w2: torch.Tensor | QuantizedWeight, swiglu_limit: float) -> torch.Tensor:
    """The dense SwiGLU expert every token passes through, `linear(swiglu(x w1^T, x w3^T), w2)` with
    w1 and w3 fused into `w13` `[2I, D]`, composed of `kernels`' linear and swiglu."""
    gate_up = kernels.linear(x, w13)
    inter = w2.shape[1]
    return kernels.linear(kernels.swiglu(gate_up[..., :inter], gate_up[..., inter:], swiglu_limit), w2)


class MoEOps(_Interface):
    """Routing and expert computation: route -> dispatch -> grouped experts -> combine."""

    @abstractmethod
    def moe_route(self, scores: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                  routed_scaling_factor: float, hash_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick experts from fp32 affinity scores `[T, E]` (already sqrt-softplus'ed).

        Selection: `hash_ids` `[T, k]` when given (hash layers), else top-k of `scores + bias`.
        Weights: the selected scores normalised to sum 1, times `routed_scaling_factor`.
        Returns (weights `[T, k]` fp32, ids `[T, k]` int64)."""

    @abstractmethod
    def moe_dispatch(self, x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, MoEDispatch]:
        """Group the (token, choice) pairs by expert. Returns (rows `[N, D]`, plan)."""

    @abstractmethod
    def moe_experts(self, rows: torch.Tensor, plan: MoEDispatch, w13: torch.Tensor | QuantizedWeight,
                    w2: torch.Tensor | QuantizedWeight, swiglu_limit: float) -> torch.Tensor:
        """Clamped-SwiGLU experts on grouped rows. w13 `[E, 2I, D]` (gate rows first, then up),
        w2 `[E, D, I]`. Returns `[N, D]` in rows' dtype. Either weight may be a stacked
        `QuantizedWeight` in a format the back end declares (`Capabilities.weight_formats`); the two
        need not be in the same form."""

    @abstractmethod
    def moe_combine(self, out_rows: torch.Tensor, plan: MoEDispatch, weights: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's expert outputs, accumulated in fp32 -> `[T, D]` fp32."""

    def moe_sublayer(self, x: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor | None,
                     hash_ids: torch.Tensor | None, w13: torch.Tensor | QuantizedWeight,
                     w2: torch.Tensor | QuantizedWeight, shared_w13: torch.Tensor | None,
                     shared_w2: torch.Tensor | None, top_k: int, routed_scaling_factor: float, scoring_func: str,
                     swiglu_limit: float) -> torch.Tensor:
        """A whole MoE layer on x `[T, D]` with every expert local: the fp32 router (`gate` `[E, D]`,
        `routing_scores`), `moe_route` (`gate_bias`, or the given `hash_ids` `[T, k]`), dispatch, the
        routed experts (`w13`, `w2` as in `moe_experts`), the fp32 combine, plus the shared expert
        (`shared_w13` `[2I', D]` gate rows then up rows, `shared_w2` `[D, I']`, or None) -> `[T, D]`
        in x's dtype. Optional: this default composes the kernels above; a back end fuses them for
        decode-sized batches (one call instead of ~20 ops per layer)."""
        weights, ids = self.moe_route(routing_scores(self.linear(x.float(), gate), scoring_func), gate_bias, top_k,
                                      routed_scaling_factor, hash_ids)
        rows, plan = self.moe_dispatch(x, ids, w13.shape[0])
        y = self.moe_combine(self.moe_experts(rows, plan, w13, w2, swiglu_limit), plan, weights)
        if shared_w13 is not None:
            y = y.add_(shared_expert(self, x, shared_w13, shared_w2, swiglu_limit))  # into the fresh fp32 sum
        return y.to(x.dtype)


class SamplingOps(_Interface):
    """Sampler kernels. The policy (which request gets what) lives in the core."""

    @abstractmethod
    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place: logits `[B, V]`; bitmask `[B, ceil(V/32)]` int32, bit (v % 32) of word v // 32
        set = token v allowed; disallowed logits become -inf."""

    @abstractmethod
    def sample(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """Draw one token per row of `probs` `[B, V]` fp32 (rows sum to 1). A row's generator, when
        given, makes its draw independent of the other rows. Returns `[B]` int64."""

    def argmax_logsumexp(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of fp32 logits `[L, V]`: the first maximal index (`[L]` int64, as `argmax`) and
        the log-sum-exp (`[L]` fp32): greedy tokens and the normaliser of their log-probabilities.
        The log-sum-exp of a row with a NaN or +inf, or with every logit -inf, must not be finite
        (as torch's): the engine fails that row's request by it. Optional: this default runs `max`
        and `logsumexp` (two passes over the logits); a back end fuses them."""
        return logits.max(dim=-1).indices, torch.logsumexp(logits, dim=-1)

    def rejection_sample(self, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                         draft_token_ids: torch.Tensor, num_drafts: list[int],
                         generators: list[torch.Generator | None]) -> torch.Tensor:
        """Speculative rejection sampling over B requests (optional: `Capabilities.rejection_sampling`).

        Request b has `m_b = num_drafts[b]` drafts, ragged and concatenated: `target_probs`
        `[sum(m_b + 1), V]` fp32, the distribution each of its m_b + 1 positions is sampled from
        (after temperature, filters and masks); `draft_probs` `[sum(m_b), V]` fp32, the distribution
        each draft was drawn from, or None when every draft was chosen deterministically (one-hot);
        `draft_token_ids` `[sum(m_b)]` int64. Draft i passes with probability
        `min(1, p_i(d_i) / q_i(d_i))`; at the first failure one token is drawn from
        `normalise(max(p_i - q_i, 0))` and the request stops; when every draft passes, a bonus token
        is drawn from `p_{m_b}`. The emitted tokens are then distributed exactly as sampling from p
        one position at a time. A position whose p has no mass (every token masked) emits nothing.
        Request b draws only from `generators[b]` when given (m_b uniforms, then one categorical
        draw), so its result does not depend on the other requests.
        Returns `[B, 1 + max(m_b)]` int64: each request's emitted tokens, then -1."""
        raise NotImplementedError(f"{type(self).__name__} does not implement rejection_sample; a back end that does "
                                  f"declares Capabilities.rejection_sampling=True")


class Collectives(_Interface):
    """torch.distributed process group over the back end's communication library.

    Sub-groups (interface 2.3): `new_group(ranks)` returns a handle for a subset of the world's
    ranks, and every collective takes it as `group` (None: the whole world). The parallel layouts
    use them for several expert-parallel or context-parallel groups in one world
    (docs/parallelism.md)."""

    @abstractmethod
    def init_process_group(self, rank: int, world_size: int, init_method: str) -> None:
        """Join the process group (gloo / nccl / hccl)."""

    def new_group(self, ranks: list[int]) -> object:
        """A handle for the sub-group of the world's `ranks` (global ranks, ascending), to pass as
        `group`. Collective over the whole world: every rank calls it, for every group, with the same
        `ranks` in the same order, also ranks that are not members (their handle is unusable).
        Optional: this default refuses, so a back end without it runs only layouts whose EP and CP
        groups span the whole world (or a single rank)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement Collectives.new_group (sub-groups of "
                                  f"ranks); a back end built on TorchCollectives has it")

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, group: object | None = None) -> torch.Tensor:
        """Sum across the ranks of `group` (None: the world), in place; returns the tensor."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, group: object | None = None) -> torch.Tensor:
        """Concatenate every rank's tensor along dim 0, in the group's rank order (None: the world)."""

    @abstractmethod
    def all_to_all(self, tensor: torch.Tensor, input_splits: list[int], output_splits: list[int],
                   group: object | None = None) -> torch.Tensor:
        """Uneven all-to-all along dim 0 (EP dispatch and combine) among the ranks of `group` (None:
        the world); split `i` goes to / comes from the group's `i`-th rank."""


class Accelerator(DeviceMemory, SmallOps, AttentionOps, MoEOps, SamplingOps, Collectives):
    """Base class of every accelerator plugin.

    Register a subclass under the entry-point group `deepinfer.accelerators`; the entry-point name
    is what users put in `DEEPINFER_ACCELERATOR`. `probe()` must be import-light: it may look for
    libraries and devices but must not initialise a device runtime, raise, or change the
    environment. `__init__` may initialise the device.
    """

    #: Entry-point name, e.g. "cpu".
    name: ClassVar[str] = ""
    #: The INTERFACE_VERSION this plugin was written against.
    interface_version: ClassVar[str] = INTERFACE_VERSION
    #: Shown by `deepinfer plugins` / errors: the pip package that provides this plugin.
    package: ClassVar[str] = "deepinfer"

    @classmethod
    @abstractmethod
    def probe(cls) -> ProbeResult:
        """Is this back end usable on this machine? Never raises; never initialises a device."""

    @abstractmethod
    def capabilities(self) -> Capabilities:
        """The frozen capability declaration of this instance."""

    def model_ops(self, family: str) -> object | None:
        """This back end's op table for model family `family` (e.g. "deepseek_v4"), or None.

        Optional: None (this default) means the family's plain-torch op table is used. A back end
        with faster versions of a family's own ops returns an instance of a subclass of that table
        (for DeepSeek-V4, `deepinfer.models.deepseek_v4.ops.DeepseekV4Ops`). The model asks once,
        at construction."""
        return None

    def prepare_program(self, program: Program) -> Runnable | None:
        """A model's step program (`deepinfer.program`) prepared to run again and again: each
        call this back end has a fast version of bound once (its outputs in buffers it owns, the
        program's constants at fixed addresses), replayed on every step, with the same values as
        `program.run` (the same bits for the calls it binds as their op-table methods give). The
        model asks once per program (per step size, per binding of its weights and cache) and runs
        what it gets every step. Optional: None (this default) runs the program eagerly."""
        return None

    def prepare_memory(self) -> None:
        """Called once by the engine's builder when the model's weights are loaded and its cache is bound,
        before the first step: a back end may lay out or advise that memory for speed here (the cpu back end
        puts it on transparent huge pages). Optional: this default does nothing. Must not change any
        tensor's values."""

    def set_batch_invariant(self, enabled: bool) -> None:
        """Switch every kernel into (or out of) batch-invariant mode: a row's result then depends only
        on that row's inputs, bit for bit, whatever else the call holds (row count, other sequences,
        padding, key order, prefill chunk). Called once, before the first forward, by the
        batch_invariant feature. Optional: a back end that implements it declares
        `Capabilities.batch_invariant`; this default refuses to enable it."""
        if enabled:
            raise NotImplementedError(f"accelerator '{self.name}' has no batch-invariant mode "
                                      f"(Capabilities.batch_invariant is false); disable the batch_invariant "
                                      f"feature (DEEPINFER_BATCH_INVARIANT=0) or use a back end that declares it")


def interface_compatible(plugin_version: str, core_version: str = INTERFACE_VERSION) -> bool:
    """Same major version, and the plugin's minor is not newer than the core's."""
    try:
        p_major, p_minor = (int(v) for v in plugin_version.split(".")[:2])
        c_major, c_minor = (int(v) for v in core_version.split(".")[:2])
    except ValueError:
        return False
    return p_major == c_major and p_minor <= c_minor
