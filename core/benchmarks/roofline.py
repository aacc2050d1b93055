"""The machine's two ceilings, measured in the benchmark's own process, and the bounds they set.

- Memory bandwidth: `dst.copy_(src)` between two preallocated fp32 tensors, counting read + write
  bytes (the destination is touched first, so page faults are not timed).
- Matmul throughput: bf16 `F.linear(x[M, K], W[N, K])` at a prefill-like shape.

Each is the median of a few short trials (well under a second in all). The benchmark measures them
right before every timed phase, so each phase is compared with the machine as it was at that
moment (this machine throttles after ~25 s of load; a bound measured once at the start would make
later phases look worse than they are). Bounds (see `model_cost` for what is counted):

- prefill tokens/s/device <= matmul FLOP/s / FLOPs per prefill token;
- decode steps/s <= 1 / max(bytes per step / bandwidth, FLOPs per step / matmul FLOP/s).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.benchmarks import model_cost


@dataclass(frozen=True)
class Machine:
    bandwidth_gbs: float  # GB/s, copy, read + write (median of the trials)
    bandwidth_trials: list[float]
    matmul_gflops: float  # GFLOP/s, bf16 (median of the trials)
    matmul_trials: list[float]
    threads: int
    copy_mib: int
    matmul_shape: tuple[int, int, int]  # M, N, K

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Machine":
        return cls(**{**d, "matmul_shape": tuple(d["matmul_shape"])})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(copy_mib: int = 512, trials: int = 5, device: str | torch.device = "cpu") -> list[float]:
    """GB/s of `dst.copy_(src)` (read + write) per trial."""
    device = torch.device(device)
    n = copy_mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.zeros(n, dtype=torch.float32, device=device)
    dst.copy_(src)  # warm-up
    out = []
    for _ in range(trials):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        out.append(2 * n * 4 / (time.perf_counter() - t) / 1e9)
    return out


def measure_matmul(m: int = 512, n: int = 4096, k: int = 4096, trials: int = 5,
                   device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16) -> list[float]:
    """GFLOP/s of `F.linear(x[m, k], w[n, k])` per trial."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(n, k, generator=g).to(device=device, dtype=dtype)
    out = []
    with torch.inference_mode():
        F.linear(x, w)  # warm-up (oneDNN primitive creation)
        for _ in range(trials):
            _sync(device)
            t = time.perf_counter()
            F.linear(x, w)
            _sync(device)
            out.append(2 * m * n * k / (time.perf_counter() - t) / 1e9)
    return out


def measure_machine(trials: int = 5, copy_mib: int = 512, shape: tuple[int, int, int] = (512, 4096, 4096),
                    device: str | torch.device = "cpu") -> Machine:
    bw = measure_bandwidth(copy_mib, trials, device)
    mm = measure_matmul(*shape, trials=trials, device=device)
    return Machine(statistics.median(bw), bw, statistics.median(mm), mm, torch.get_num_threads(), copy_mib, shape)


@dataclass(frozen=True)
class WorkloadCost:
    """Machine-independent cost of the benchmark's workload on one device."""

    prefill_flops_per_token: float
    decode_bytes_per_step: float
    decode_flops_per_step: float
    active_bytes_per_token: int
    active_params_per_token: int
    bytes_by_group: dict[str, int]
    # (defaults: records written before these were counted still load)
    model_type: str = ""
    cache_read_bytes_per_sequence: int = 0  # one decode token at the decode context
    cache_bytes_per_context_token: float = 0.0  # what the model stores per token of context

    def to_json(self) -> dict:
        return asdict(self)


def workload_cost(config: Any, *, prefill_len: int, decode_batch: int, decode_context: int,
                  float_bytes: int = 2) -> WorkloadCost:
    """The workload's cost from a parsed config of any family `model_cost` counts (`float_bytes`:
    the model dtype's size; caches in that dtype or in the family's fixed formats)."""
    family = model_cost.family_cost(config)
    cost = model_cost.token_cost(config, float_bytes)
    return WorkloadCost(
        model_cost.prefill_flops_per_token(config, prefill_len),
        model_cost.decode_step_bytes(config, decode_batch, decode_context, float_bytes),
        model_cost.decode_step_flops(config, decode_batch, decode_context),
        cost.active_bytes, cost.active_params, dict(cost.bytes_by_group), family.model_type,
        model_cost.cache_bytes_per_token(config, decode_context, float_bytes),
        model_cost.context_bytes_per_token(config, float_bytes))


def prefill_bound(cost: WorkloadCost, machine: Machine) -> float:
    """Most prefill tokens/s the matmul throughput allows."""
    return machine.matmul_gflops * 1e9 / cost.prefill_flops_per_token


def decode_bound(cost: WorkloadCost, machine: Machine) -> tuple[float, str]:
    """Most decode steps/s, and whether memory or compute sets it."""
    t_mem = cost.decode_bytes_per_step / (machine.bandwidth_gbs * 1e9)
    t_flop = cost.decode_flops_per_step / (machine.matmul_gflops * 1e9)
    return 1.0 / max(t_mem, t_flop), "memory" if t_mem >= t_flop else "compute"


def _spread(values: list[float], fmt: str) -> str:
    text = format(statistics.median(values), fmt)
    return text if len(values) == 1 else f"{text} (median of {len(values)}; {min(values):{fmt}}-{max(values):{fmt}})"


def report(cost: WorkloadCost, machines: list[Machine], prefill: list[tuple[float, Machine]],
           decode: list[tuple[float, Machine]]) -> str:
    """Human-readable roofline. `prefill` / `decode`: (measured tokens/s or steps/s, the machine
    measured right before that phase); each is shown as a fraction of its own phase's bound."""
    m0 = machines[0]
    groups = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in cost.bytes_by_group.items())
    lines = [
        f"roofline (one device, {cost.model_type or 'model'}; what is counted: deepinfer/benchmarks/model_cost.py)",
        f"  memory bandwidth (copy {m0.copy_mib} MiB, read+write): "
        f"{_spread([m.bandwidth_gbs for m in machines], '.1f')} GB/s",
        f"  bf16 matmul [{m0.matmul_shape[0]}x{m0.matmul_shape[2]}] x [{m0.matmul_shape[2]}x{m0.matmul_shape[1]}]: "
        f"{_spread([m.matmul_gflops for m in machines], '.0f')} GFLOP/s, {m0.threads} threads",
        f"  active weights per decode token: {cost.active_params_per_token / 1e6:.1f} M parameters, "
        f"{cost.active_bytes_per_token / 1e6:.1f} MB ({groups} MB)",
        f"  cache: {cost.cache_read_bytes_per_sequence / 1e6:.3f} MB read per sequence per decode step; "
        f"{cost.cache_bytes_per_context_token:,.1f} B stored per token of context",
        f"  decode step: {cost.decode_bytes_per_step / 1e6:.1f} MB read (weights + caches), "
        f"{cost.decode_flops_per_step / 1e9:.2f} GFLOP -> bound "
        f"{_spread([decode_bound(cost, m)[0] for m in machines], '.1f')} steps/s "
        f"({decode_bound(cost, m0)[1]}-bound)",
        f"  prefill: {cost.prefill_flops_per_token / 1e9:.3f} GFLOP/token -> bound "
        f"{_spread([prefill_bound(cost, m) for m in machines], ',.0f')} tokens/s",
    ]
    if prefill:
        fractions = [tps / prefill_bound(cost, m) * 100 for tps, m in prefill]
        lines.append(f"  measured prefill = {_spread(fractions, '.1f')} % of the matmul bound")
    if decode:
        fractions = [sps / decode_bound(cost, m)[0] * 100 for sps, m in decode]
        lines.append(f"  measured decode = {_spread(fractions, '.1f')} % of the {decode_bound(cost, m0)[1]} bound")
    return "\n".join(lines)
