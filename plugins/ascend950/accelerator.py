"""Huawei Ascend 950 back end: torch_npu kernels, HCCL collectives.

Not run on hardware (none exists where this was written): see docs/backends.md. torch_npu is
imported in `__init__` (never at module import) so listing and probing stay safe without CANN."""
from __future__ import annotations

import importlib

import torch

from deepinfer.accelerator.interface import Accelerator, Capabilities, MemoryInfo, ProbeResult
from deepinfer_plugins.ascend950 import probe as _probe
from deepinfer_plugins.cpu.accelerator import TorchDistributedCollectives
from deepinfer_plugins.cpu.kernels import CpuKernels


class AscendAccelerator(TorchDistributedCollectives, CpuKernels, Accelerator):
    name = "ascend"
    package = "deepinfer"
    collective_backend = "hccl"

    @classmethod
    def probe(cls) -> ProbeResult:
        return _probe.probe()

    def __init__(self) -> None:
        self.torch_npu = importlib.import_module("torch_npu")
        built_for = getattr(getattr(self.torch_npu, "npu", None), "get_soc_version", lambda: None)()
        problem = _probe.check_soc(str(built_for) if built_for else None, _probe.query_soc())
        if problem:
            raise RuntimeError(problem)

    def capabilities(self) -> Capabilities:
        return Capabilities(name=self.name, device_type="npu", dtypes=("float32", "bfloat16"),
                            token_bitmask=True, rejection_sampling=False, graph_capture=False,
                            collectives="hccl")

    def device(self, index: int = 0) -> torch.device:
        return torch.device("npu", index)

    def memory_info(self) -> MemoryInfo:
        free, total = self.torch_npu.npu.mem_get_info()
        return MemoryInfo(free_bytes=free, total_bytes=total)

    def synchronize(self) -> None:
        self.torch_npu.npu.synchronize()
