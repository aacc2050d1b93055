"""The CPU reference back end: plain PyTorch kernels (kernels.py), with the element-wise ones fused in
C where a compiler is available (native_kernels.py), plus device, memory and gloo.

It runs everywhere and is the numerical oracle for every other back end (the conformance kit
compares against it)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from deepinfer.accelerator.interface import Accelerator, Capabilities, MemoryInfo, ProbeResult
from deepinfer_plugins.cpu.host_memory import retain_freed_memory
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels


def _meminfo() -> MemoryInfo:
    """Available and total RAM from /proc/meminfo (no extra dependency); os.sysconf elsewhere."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
        return MemoryInfo(free_bytes=fields.get("MemAvailable", fields["MemFree"]), total_bytes=fields["MemTotal"])
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(free_bytes=os.sysconf("SC_AVPHYS_PAGES") * page, total_bytes=os.sysconf("SC_PHYS_PAGES") * page)


class TorchDistributedCollectives:
    """Collectives over the default torch.distributed process group (gloo, nccl or hccl)."""

    collective_backend = "gloo"

    def init_process_group(self, rank: int, world_size: int, init_method: str) -> None:
        if not dist.is_initialized():
            dist.init_process_group(self.collective_backend, rank=rank, world_size=world_size, init_method=init_method)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=0)

    def all_to_all(self, tensor: torch.Tensor, input_splits: list[int], output_splits: list[int]) -> torch.Tensor:
        out = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits)
        return out


class CpuAccelerator(TorchDistributedCollectives, NativeCpuKernels, Accelerator):
    name = "cpu"
    package = "deepinfer"

    def __init__(self) -> None:
        retain_freed_memory()  # activations reuse freed memory instead of faulting in new pages

    @classmethod
    def probe(cls) -> ProbeResult:
        threads = torch.get_num_threads()
        isa = torch.backends.cpu.get_cpu_capability()
        return ProbeResult(usable=True, reason=f"{os.cpu_count()} CPUs, {threads} torch threads, {isa}",
                           details={"torch": torch.__version__, "cpu_capability": isa})

    def capabilities(self) -> Capabilities:
        return Capabilities(name=self.name, device_type="cpu", dtypes=("float32", "bfloat16"),
                            token_bitmask=True, rejection_sampling=True, graph_capture=False,
                            host_overlap=False, collectives="gloo",
                            fast_paths=("native_c",) if self.native_library is not None else ())

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> MemoryInfo:
        return _meminfo()

    def synchronize(self) -> None:
        return None
