"""Capture a decode step as a CUDA graph and replay it (`torch.cuda.CUDAGraph`).

A graph replays the exact kernels it recorded on the exact memory it recorded, so the callable
is captured over *static* input buffers; each replay copies the new inputs into them and returns
the *static* output tensors, which the next replay overwrites (copy or consume them first).

    graph = capture_graph(step, example_ids, example_positions)   # warms up, then records
    logits = graph(ids, positions)                                # copy in, replay, same outputs

`GraphSet` keeps one graph per batch-size bucket, the usual way to cover decode batches of
varying size: the caller pads its inputs to the bucket's size.

What can be captured: kernels without host synchronisation. The generic `moe_experts` reads the
per-expert counts on the host (`.tolist()`), so a forward pass that uses it cannot be captured
(the accelerator declares `graph_capture` only when the DeepGEMM path replaces it); the DeepGEMM
path (static row bound under capture), the FlashMLA path, the sync-free `moe_dispatch` and the
other forward kernels do not synchronise. Sampling stays outside the graph. Capture itself fails
loudly on a synchronising op.

The graph factory and capture context are parameters so that the buffer logic is testable
without a GPU (tests pass an emulation); the defaults are torch's CUDA implementations.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if not all(isinstance(t, torch.Tensor) for t in outs):
        raise TypeError("a captured callable must return a tensor or a tuple of tensors")
    return tuple(outs)


class CapturedGraph:
    """One recorded call of `fn` over static inputs; call it with same-shaped tensors to replay."""

    def __init__(self, fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], warmup: int = 2,
                 pool: Any = None, graph_factory: Callable[[], Any] | None = None,
                 capture_context: Callable[..., Any] | None = None) -> None:
        if not example_inputs or not all(isinstance(t, torch.Tensor) for t in example_inputs):
            raise TypeError("capture_graph needs the example inputs as tensors (they become the static buffers)")
        self.static_inputs = tuple(t.clone() for t in example_inputs)
        graph_factory = graph_factory or torch.cuda.CUDAGraph
        capture_context = capture_context or torch.cuda.graph
        side = torch.cuda.Stream() if graph_factory is torch.cuda.CUDAGraph else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # the input copies above must be done
        # warm-up on a side stream: lazy initialisation (cuBLAS handles, autotuning, allocator
        # growth) must not be recorded into the graph
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for _ in range(warmup):
                fn(*self.static_inputs)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        self.graph = graph_factory()
        with capture_context(self.graph, pool=pool):
            out = fn(*self.static_inputs)
        self._single = isinstance(out, torch.Tensor)
        self.static_outputs = _as_tuple(out)

    def pool(self) -> Any:
        """The memory pool of this graph, to share with graphs captured after it."""
        return self.graph.pool()

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if len(inputs) != len(self.static_inputs):
            raise TypeError(f"the graph was captured with {len(self.static_inputs)} inputs, got {len(inputs)}")
        for i, (buf, new) in enumerate(zip(self.static_inputs, inputs)):
            if new.shape != buf.shape or new.dtype != buf.dtype:
                raise ValueError(f"graph input {i}: got {tuple(new.shape)} {new.dtype}, captured with "
                                 f"{tuple(buf.shape)} {buf.dtype}; pad to the captured shape or capture another graph")
            if new.data_ptr() != buf.data_ptr():
                buf.copy_(new, non_blocking=True)
        self.graph.replay()
        return self.static_outputs[0] if self._single else self.static_outputs


def capture_graph(fn: Callable[..., Any], *example_inputs: torch.Tensor, warmup: int = 2,
                  pool: Any = None) -> CapturedGraph:
    """Warm `fn` up and record it as a CUDA graph over copies of `example_inputs`."""
    return CapturedGraph(fn, example_inputs, warmup=warmup, pool=pool)


class GraphSet:
    """Graphs of one step function for a set of batch sizes, sharing one memory pool.

    `make_inputs(batch)` returns example inputs for a batch of that size; `get(n)` returns the graph
    of the smallest captured batch size >= n (the caller pads to `graph.batch`), or None."""

    def __init__(self, fn: Callable[..., Any], make_inputs: Callable[[int], Sequence[torch.Tensor]],
                 batch_sizes: Sequence[int], capture: Callable[..., CapturedGraph] | None = None) -> None:
        self.graphs: dict[int, CapturedGraph] = {}
        capture = capture or (lambda f, inputs, pool: CapturedGraph(f, inputs, pool=pool))
        pool = None
        for batch in sorted(set(batch_sizes), reverse=True):  # largest first: later graphs reuse its memory
            graph = capture(fn, tuple(make_inputs(batch)), pool)
            graph.batch = batch
            self.graphs[batch] = graph
            pool = graph.pool() if pool is None else pool

    def get(self, n: int) -> CapturedGraph | None:
        fits = [b for b in self.graphs if b >= n]
        return self.graphs[min(fits)] if fits else None
