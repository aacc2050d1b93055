"""NVIDIA back end: torch-CUDA kernels (SM80 and newer), NCCL collectives, and the vendor fast
paths (FlashMLA, DeepGEMM, DeepEP) when they are installed and the GPU is SM100/SM103.

The generic kernels are the reference PyTorch implementations run on CUDA tensors."""
from __future__ import annotations

import torch

from deepinfer.accelerator.interface import Accelerator, Capabilities, MemoryInfo, ProbeResult
from deepinfer_plugins.cpu.accelerator import TorchDistributedCollectives
from deepinfer_plugins.cpu.kernels import CpuKernels
from deepinfer_plugins.nvidia_sm100 import probe as _probe


class NvidiaAccelerator(TorchDistributedCollectives, CpuKernels, Accelerator):
    name = "nvidia"
    package = "deepinfer"
    collective_backend = "nccl"

    @classmethod
    def probe(cls) -> ProbeResult:
        return _probe.probe()

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the NVIDIA back end needs a visible CUDA GPU; run `deepinfer doctor`")
        self._capability = torch.cuda.get_device_capability(0)
        self._fast_paths = _probe.active_fast_paths(self._capability)

    def capabilities(self) -> Capabilities:
        return Capabilities(name=self.name, device_type="cuda", dtypes=("float32", "bfloat16"),
                            token_bitmask=True, rejection_sampling=False, graph_capture=False,
                            fp8_weights=False, collectives="nccl", fast_paths=self._fast_paths)

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cuda", index)

    def memory_info(self) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info()
        return MemoryInfo(free_bytes=free, total_bytes=total)

    def synchronize(self) -> None:
        torch.cuda.synchronize()
