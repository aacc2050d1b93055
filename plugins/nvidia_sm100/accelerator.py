"""NVIDIA back end: torch-CUDA kernels (SM80 and newer), NCCL collectives, and the vendor fast
paths (FlashMLA, DeepGEMM) when they are installed and the GPU is SM100/SM103.

Not run on a GPU where it was written (a CPU-only machine): see docs/backends.md for what is
verified and how. Importing and probing never initialise CUDA; `__init__` does.
"""
from __future__ import annotations

from typing import Iterable

import torch

from deepinfer.accelerator.interface import Accelerator, Capabilities, MemoryInfo, ProbeResult
from deepinfer.accelerator.quantized_weight import FP8_BLOCK128
from deepinfer.accelerator.reference import TorchCollectives
from deepinfer_plugins.nvidia_sm100 import probe as _probe
from deepinfer_plugins.nvidia_sm100.kernels import CudaKernels, build_fast_paths


class NvidiaAccelerator(TorchCollectives, CudaKernels, Accelerator):
    name = "nvidia"
    package = "deepinfer"
    collective_backend = "nccl"

    @classmethod
    def probe(cls) -> ProbeResult:
        return _probe.probe()

    def __init__(self, expert_precision: str = "bf16", fast_paths: Iterable[str] | None = None,
                 keep_fp8_weights: bool = False) -> None:
        """`expert_precision`: "bf16" or "fp8" (lossy, DeepGEMM only). `fast_paths`: None = every
        installed library the GPU supports; an explicit tuple (e.g. `()`) overrides that choice.
        `keep_fp8_weights` (needs expert_precision="fp8"): declare `fp8_block128`, so that a
        checkpoint's 128x128-block FP8 weights stay FP8 in GPU memory; FP8 experts (V4-Flash-Base)
        then run on DeepGEMM's FP8 GEMM as stored, and FP8 dense projections take the reference
        path (dequantised tile by tile: less memory, slower)."""
        if not torch.cuda.is_available():
            raise RuntimeError("the NVIDIA back end needs a visible CUDA GPU (torch.cuda.is_available() is False); "
                               "run `deepinfer doctor` to see why")
        self._capability = torch.cuda.get_device_capability(0)
        names = _probe.active_fast_paths(self._capability) if fast_paths is None else tuple(fast_paths)
        if expert_precision not in ("bf16", "fp8"):
            raise ValueError(f"expert_precision={expert_precision!r}: use 'bf16' or 'fp8'")
        if expert_precision == "fp8" and "deep_gemm" not in names:
            raise ValueError("expert_precision='fp8' needs the DeepGEMM fast path (deep_gemm installed and an "
                             f"SM100/SM103 GPU; this GPU is sm_{self._capability[0]}{self._capability[1]}, "
                             f"fast paths {names or 'none'})")
        if keep_fp8_weights and expert_precision != "fp8":
            raise ValueError("keep_fp8_weights=True needs expert_precision='fp8' (DeepGEMM's FP8 expert GEMM is the "
                             "only kernel here that computes on FP8 weights)")
        self.fast = build_fast_paths(names, self, expert_precision)
        self.expert_precision = expert_precision
        self.weight_formats = (FP8_BLOCK128,) if keep_fp8_weights else ()

    def capabilities(self) -> Capabilities:
        return Capabilities(name=self.name, device_type="cuda", dtypes=("float32", "bfloat16"),
                            token_bitmask=True, rejection_sampling=True, collectives="nccl",
                            fast_paths=self.fast.names, weight_formats=self.weight_formats)

    # ----- device and memory -----
    def device(self, index: int = 0) -> torch.device:
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ValueError(f"CUDA device {index} does not exist: {count} visible (check CUDA_VISIBLE_DEVICES)")
        return torch.device("cuda", index)

    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info(torch.cuda.current_device())
        return MemoryInfo(free_bytes=free, total_bytes=total)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    # ----- collectives -----
    def init_process_group(self, rank: int, world_size: int, init_method: str) -> None:
        # NCCL binds a rank to the current device: one GPU per local rank, round robin
        torch.cuda.set_device(rank % torch.cuda.device_count())
        super().init_process_group(rank, world_size, init_method)
