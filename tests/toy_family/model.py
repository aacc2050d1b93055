"""The toy dense transformer on ragged batches with engine-managed state (the `Model` protocol).

Per layer: x += Wo·attn(RoPE(Wq·n(x)), RoPE(Wk·n(x)), Wv·n(x)); x += W_down·SwiGLU(W_gate·n(x), W_up·n(x)),
n = RMSNorm. State (`cache_layout`):
- full-attention layers: `kv` block group, one entry per token, tensors `k`, `v` `[H*d]`; owned by
  the layers that keep their own KV, READ by the layers whose `kv_source` names an owner;
- sliding-window layers: slot rings `window_k`, `window_v` `[sliding_window + max_rollback, H*d]`,
  indexed by absolute position mod ring size (so a rollback of <= max_rollback tokens is exact).
The addressing comes from the shared `RaggedPlan`; the kernels used from the accelerator are the
ones `family.py` declares (linear, rms_norm, swiglu); attention itself is plain torch.

A layer is written once, as calls through a `call(op, **args)` function (`_layer`): run eagerly it is
the forward; given a program builder's `call` it describes a decode step (`decode_program`), which the
model runs for steps of decode tokens, so a back end may prepare it (the cpu back end binds the
linears and norms to its C calls) without any code of its own for this family.
"""
from __future__ import annotations

import torch

from deepinfer.models.batch import ForwardBatch, ForwardOutput
from deepinfer.models.cache_layout import BlockGroup, CacheLayout, CacheTensors, StateTensor
from deepinfer.models.common.checkpoint import compare_shapes
from deepinfer.models.common.ragged import RaggedPlan, take_rows
from deepinfer.program import Builder, Program, Programs
from toy_family.config import FULL, SLIDING, ToyConfig
from toy_family.weights import expected_shapes, target_dtype

KV_GROUP, K, V = "kv", "k", "v"
WINDOW_K, WINDOW_V = "window_k", "window_v"


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head: x `[T, H, d]`, cos/sin `[T, d/2]`."""
    h = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :h], xf[..., h:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class ToyStep:
    """What a step's layers read: the plan and the RoPE tables at its positions."""

    def __init__(self, plan: RaggedPlan, inv_freq: torch.Tensor):
        freqs = plan.positions.float().unsqueeze(-1) * inv_freq
        self.plan, self.cos, self.sin = plan, freqs.cos(), freqs.sin()


class ToyDenseForCausalLM:
    def __init__(self, config: ToyConfig, accelerator, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", attention_dtype: torch.dtype = torch.float32):
        self.config, self.accel, self.dtype = config, accelerator, dtype
        self.device = torch.device(device)
        self.attention_dtype = attention_dtype
        d = config.head_dim
        self.inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=self.device) / d)
        self.w: dict[str, torch.Tensor] = {}
        self.cache: CacheTensors | None = None
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._window: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._ring = 0
        self.programs = Programs(accelerator)  # decode steps by token count

    # ----- Model protocol -----
    def drafter_heads(self) -> None:
        return None

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        expected = expected_shapes(self.config)
        missing, unexpected, wrong = compare_shapes(expected, {k: tuple(v.shape) for k, v in weights.items()})
        if missing or unexpected or wrong:
            raise ValueError(f"toy weights do not fit the config: missing {missing}, unexpected {unexpected}, "
                             f"wrong shape {wrong}")
        self.w = {k: v.to(self.device, target_dtype(k, self.dtype)).contiguous() for k, v in weights.items()}
        self.programs.clear()
        # every matrix but the embedding is a linear's weight: the back end makes its copies of them now
        self.accel.prepare_weights(("linear", t) for k, t in self.w.items() if t.dim() == 2 and k != "embed.weight")

    def cache_layout(self, max_rollback: int) -> CacheLayout:
        c = self.config
        width = c.num_heads * c.head_dim
        full_owners = tuple(i for i in range(c.num_layers) if c.layer_types[i] == FULL and c.owns_kv(i))
        readers = {i: c.kv_source[i] for i in range(c.num_layers) if not c.owns_kv(i)}
        sliding = tuple(i for i in range(c.num_layers) if c.layer_types[i] == SLIDING)
        ring = c.sliding_window + max_rollback
        slot = tuple(StateTensor(n, (ring, width), self.dtype, sliding) for n in (WINDOW_K, WINDOW_V)) if sliding else ()
        groups = ()
        if full_owners:
            tensors = tuple(StateTensor(n, (width,), self.dtype, full_owners, readers) for n in (K, V))
            groups = (BlockGroup(KV_GROUP, 1, tensors),)
        return CacheLayout(slot_tensors=slot, block_groups=groups, max_rollback=max_rollback)

    def bind_cache(self, cache: CacheTensors) -> None:
        if cache.layout is None or cache.num_slots is None:
            raise ValueError("allocate the cache with allocate_cache_tensors(model.cache_layout(...), ...)")
        layout = self.cache_layout(cache.layout.max_rollback)
        if cache.layout != layout:
            raise ValueError("the cache was allocated from another layout; use model.cache_layout()")
        c = self.config
        self.cache, self._ring = cache, c.sliding_window + layout.max_rollback
        self._kv = {i: (cache.block_view(KV_GROUP, K, i), cache.block_view(KV_GROUP, V, i))
                    for i in range(c.num_layers) if c.layer_types[i] == FULL}
        self._window = {i: (cache.slot_view(WINDOW_K, i), cache.slot_view(WINDOW_V, i))
                        for i in range(c.num_layers) if c.layer_types[i] == SLIDING}
        self.programs.clear()

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if self.cache is None or not self.w:
            raise RuntimeError("load_weights() and bind_cache() first")
        c, a, w = self.config, self.accel, self.w
        step = ToyStep(RaggedPlan(batch, self.cache.num_slots, self.cache.block_size), self.inv_freq)
        x = w["embed.weight"][batch.input_ids.to(self.device)]
        if step.plan.decode_only and step.plan.T <= 64:  # a program a back end may prepare
            x, = self.programs.get(("decode", step.plan.T), lambda: self.decode_program(step.plan.T)).run(step, x=x)
        else:
            x = self._layers(self._eager, x, step.plan, step.cos, step.sin)
        picked = x[batch.logits_indices.to(self.device)]
        logits = a.linear(a.rms_norm(picked, w["norm.weight"], c.rms_norm_eps), w["head.weight"]).float()
        return ForwardOutput(logits=logits)

    def decode_program(self, tokens: int) -> Program:
        """The layers of a step of `tokens` decode tokens as a program: the calls `_layers` makes."""
        b = Builder({"kernels": self.accel})
        plan, cos, sin = (b.input(n, lambda s, n=n: getattr(s, n)) for n in ("plan", "cos", "sin"))
        return b.build((self._layers(b.call, b.input("x"), plan, cos, sin),), key=("decode", tokens))

    def _eager(self, op, outs=1, view=False, **args):
        """`call` that runs at once (the forward): "kernels.<op>" on the accelerator, else the callable."""
        fn = getattr(self.accel, op.partition(".")[2]) if isinstance(op, str) else op
        return fn(**args)

    def _layers(self, call, x, plan, cos, sin):
        """Every layer through `call`: eagerly (`_eager`) or into a program (`Builder.call`)."""
        c, w, eps = self.config, self.w, self.config.rms_norm_eps
        for i in range(c.num_layers):
            p = f"layers.{i}."
            h = call("kernels.rms_norm", x=x, weight=w[p + "attn_norm.weight"], eps=eps)
            q = call(self._heads, y=call("kernels.linear", x=h, weight=w[p + "attn.wq.weight"]), cos=cos, sin=sin)
            k = v = None
            if c.owns_kv(i):
                k = call(self._heads, y=call("kernels.linear", x=h, weight=w[p + "attn.wk.weight"]), cos=cos, sin=sin)
                v = call(self._heads, y=call("kernels.linear", x=h, weight=w[p + "attn.wv.weight"]))
            attend = self._full if c.layer_types[i] == FULL else self._sliding
            o = call(self._rows, t=call(attend, layer=i, plan=plan, q=q, k=k, v=v))
            x = call(torch.add, input=x, other=call("kernels.linear", x=o, weight=w[p + "attn.wo.weight"]))
            h = call("kernels.rms_norm", x=x, weight=w[p + "mlp_norm.weight"], eps=eps)
            gate = call("kernels.linear", x=h, weight=w[p + "mlp.w_gate.weight"])
            up = call("kernels.linear", x=h, weight=w[p + "mlp.w_up.weight"])
            down = call("kernels.linear", x=call("kernels.swiglu", gate=gate, up=up, limit=0.0),
                        weight=w[p + "mlp.w_down.weight"])
            x = call(torch.add, input=x, other=down)
        return x

    def _heads(self, y: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
               ) -> torch.Tensor:
        """A projection `[T, H*d]` as heads `[T, H, d]`, rotated when cos/sin are given."""
        heads = y.view(y.shape[0], self.config.num_heads, self.config.head_dim)
        return heads if cos is None else rope(heads, cos, sin)

    @staticmethod
    def _rows(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], -1)

    # ----- attention -----
    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q `[S, H, d]`, k/v `[L, H, d]`, mask `[S, L]` -> `[S, H, d]`."""
        dt = self.attention_dtype
        scores = torch.einsum("shd,lhd->hsl", q.to(dt), k.to(dt)) * q.shape[-1] ** -0.5
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return torch.einsum("hsl,lhd->shd", probs, v.to(dt)).to(q.dtype)

    def _full(self, layer: int, plan: RaggedPlan, q, k, v) -> torch.Tensor:
        """Every earlier position, from the `kv` block group (an owner writes this step's keys
        first; a reader only reads its owner's)."""
        cache_k, cache_v = self._kv[layer]
        T, H, d = q.shape
        if k is not None:
            rows = plan.entry_rows(KV_GROUP, plan.row_seq, plan.positions.unsqueeze(1),
                                   torch.ones((T, 1), dtype=torch.bool, device=q.device)).squeeze(1)
            cache_k[rows] = k.reshape(T, H * d)
            cache_v[rows] = v.reshape(T, H * d)
        out = torch.empty_like(q)
        for i in range(plan.num_seqs):
            a, n, end = plan.row_start[i], plan.q_lens[i], plan.seq_end(i)
            key_pos = torch.arange(end, device=q.device)
            rows = plan.entry_rows(KV_GROUP, torch.tensor([i], device=q.device), key_pos.unsqueeze(0),
                                   torch.ones((1, end), dtype=torch.bool, device=q.device))[0]
            keys, values = take_rows(cache_k, rows).view(end, H, d), take_rows(cache_v, rows).view(end, H, d)
            mask = key_pos.unsqueeze(0) <= plan.positions[a:a + n].unsqueeze(1)
            out[a:a + n] = self._attend(q[a:a + n], keys, values, mask)
        return out

    def _sliding(self, layer: int, plan: RaggedPlan, q, k, v) -> torch.Tensor:
        """The last `sliding_window` positions: earlier ones from the ring, this step's from k/v;
        then the last `ring` new positions of each sequence go into the ring."""
        ring_k, ring_v = self._window[layer]
        T, H, d = q.shape
        W, R = self.config.sliding_window, self._ring
        flat_k, flat_v = ring_k.view(-1, H * d), ring_v.view(-1, H * d)
        out = torch.empty_like(q)
        for i in range(plan.num_seqs):
            a, n, ctx = plan.row_start[i], plan.q_lens[i], plan.ctx[i]
            old = torch.arange(max(0, ctx - W + 1), ctx, device=q.device)
            rows = plan.slots[i] * R + old % R
            keys = torch.cat((take_rows(flat_k, rows).view(-1, H, d), k[a:a + n]))
            values = torch.cat((take_rows(flat_v, rows).view(-1, H, d), v[a:a + n]))
            key_pos = torch.cat((old, plan.positions[a:a + n]))
            q_pos = plan.positions[a:a + n].unsqueeze(1)
            mask = (key_pos.unsqueeze(0) <= q_pos) & (key_pos.unsqueeze(0) > q_pos - W)
            out[a:a + n] = self._attend(q[a:a + n], keys, values, mask)
        write = plan.ring_write(R)
        flat_k[write.ring_row] = k.reshape(T, H * d)[write.rows]
        flat_v[write.ring_row] = v.reshape(T, H * d)[write.rows]
        return out
