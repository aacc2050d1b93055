"""The CPU back end: core's plain-torch reference kernels with CPU performance paths (kernels.py),
the element-wise ones fused in C where a compiler is available (native_kernels.py), DeepSeek-V4's
own ops declared through `model_ops` (kernels.py), plus device, memory and gloo. It runs
everywhere; the conformance kit checks it like every other back end."""
from __future__ import annotations

import os

import torch

from deepinfer import envs
from deepinfer.accelerator.interface import Accelerator, Capabilities, MemoryInfo, ProbeResult
from deepinfer.accelerator.quantized_weight import WEIGHT_FORMATS
from deepinfer.accelerator.reference import TorchCollectives
from deepinfer_plugins.cpu import huge_pages, native, packed_weights
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


def _decode_kernels() -> str:
    """Which C decode kernels this CPU and DEEPINFER_CPU_NATIVE(_ISA) select, from the CPU's feature
    flags (nothing is compiled): the bf16 GEMV tier, and AMX tiles for the decode batches."""
    if not native.enabled():
        return "C kernels off (DEEPINFER_CPU_NATIVE=0)"
    try:
        isa = native.planned_isa()
    except ValueError as exc:  # a DEEPINFER_CPU_NATIVE_ISA that is not a switch
        return f"C kernels: {exc}"
    if isa is None:
        return "C kernels: instruction sets unknown (no /proc/cpuinfo)"
    tiles = " + AMX tiles" if "amx" in isa else ""
    return (f"C decode kernels: {native.gemv_tier_for(isa)}{tiles} (DEEPINFER_CPU_NATIVE_ISA={native.build_variant()}: "
            f"-march={native.planned_target()})")


class CpuAccelerator(TorchCollectives, NativeCpuKernels, Accelerator):
    name = "cpu"
    package = "deepinfer"

    def __init__(self) -> None:
        retain_freed_memory()  # activations reuse freed memory instead of faulting in new pages
        # FP8/FP4 weights kept quantised (memory) or dequantised at load (speed, the default): the
        # kernels compute on quantised weights tile by tile through the reference path
        self.weight_formats = WEIGHT_FORMATS if envs.get_bool("DEEPINFER_CPU_QUANTIZED_WEIGHTS", False) else ()
        # decode steps as their prepared programs (program.py) or call by call
        self.prepared_programs = envs.get_bool("DEEPINFER_CPU_DECODE_BLOCKS", True)
        self.pack_weights = packed_weights.enabled()
        self.use_huge_pages = huge_pages.enabled()

    @classmethod
    def probe(cls) -> ProbeResult:
        threads = torch.get_num_threads()
        isa = torch.backends.cpu.get_cpu_capability()
        kernels = _decode_kernels()
        return ProbeResult(usable=True, reason=f"{os.cpu_count()} CPUs, {threads} torch threads, {isa}; {kernels}",
                           details={"torch": torch.__version__, "cpu_capability": isa, "decode_kernels": kernels})

    def capabilities(self) -> Capabilities:
        return Capabilities(name=self.name, device_type="cpu", dtypes=("float32", "bfloat16"),
                            token_bitmask=True, rejection_sampling=True, host_overlap=False, collectives="gloo",
                            batch_invariant=self.native_library is not None,  # its mode runs on the C kernels
                            fast_paths=("native_c",) if self.native_library is not None else (),
                            weight_formats=self.weight_formats)

    def prepare_memory(self) -> None:
        # the weights, the cache and the heap the activations come from onto huge pages (huge_pages.py): at
        # batch 1 the forward outside the LM head ran 1.02-1.13x faster in 10 of 11 process pairs (docs/performance.md)
        if self.use_huge_pages:
            huge_pages.collapse_process_memory()

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> MemoryInfo:
        return _meminfo()

    def synchronize(self) -> None:
        return None
