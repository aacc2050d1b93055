"""Huawei Ascend 950 back end: torch_npu fused ops (kernels.py), HCCL collectives.

Not run on Ascend hardware where it was written (none was available): the op plumbing is tested
against a CPU stand-in of torch_npu (tests/fake_torch_npu), which says nothing about Ascend
numerics or speed; see docs/backends.md. torch_npu is imported in `__init__`, never at module
import, so listing and probing stay safe on machines without CANN. CANN's switches for readable
errors (ASCEND_LAUNCH_BLOCKING, ASCEND_SLOG_PRINT_TO_STDOUT) are honoured as debugging.py says.
"""
from __future__ import annotations

import importlib
import os

import torch

from deepinfer.accelerator.interface import Accelerator, Capabilities, MemoryInfo, ProbeResult
from deepinfer.accelerator.reference import TorchCollectives
from deepinfer_plugins.ascend950 import debugging, devices
from deepinfer_plugins.ascend950 import probe as _probe
from deepinfer_plugins.ascend950.kernels import FUSED_OPS, AscendKernels


class AscendAccelerator(TorchCollectives, AscendKernels, Accelerator):
    name = "ascend"
    package = "deepinfer"
    collective_backend = "hccl"

    @classmethod
    def probe(cls) -> ProbeResult:
        return _probe.probe()

    def __init__(self) -> None:
        self.npu = self._load_torch_npu()
        self.fused = frozenset(op for op in FUSED_OPS if hasattr(self.npu, op))
        self.visible = self._check_runtime()

    # ----- start-up (overridable: the plumbing tests replace the runtime checks) -----
    @staticmethod
    def _load_torch_npu():
        problem = devices.check_torch_npu_version(torch.__version__)
        if problem:
            raise RuntimeError(problem)
        try:
            return importlib.import_module("torch_npu")
        except (ImportError, OSError, RuntimeError) as exc:
            hint = debugging.readable_errors_hint()
            raise RuntimeError(f"torch_npu is installed but does not load ({type(exc).__name__}: {exc}); source "
                               f"CANN 9.2's set_env.sh (libhccl.so and libascendcl.so come from CANN) and "
                               f"run `deepinfer doctor`" + (f"; {hint}" if hint else "")) from exc

    def _check_runtime(self) -> list[devices.Chip]:
        """The SoC torch_npu runs on must be an Ascend 950 that CANN's kernels were installed for."""
        chips = devices.query_chips() or []
        visible, problem = devices.visible_chips(chips, os.environ.get(devices.VISIBLE_DEVICES_VAR))
        if problem and chips:
            raise RuntimeError(problem)
        running_on = str(self.npu.npu.get_device_name(0))
        problem = devices.check_soc(devices.installed_families(devices.find_cann()), running_on)
        if problem:
            raise RuntimeError(problem)
        return visible

    def capabilities(self) -> Capabilities:
        # ASCEND_LAUNCH_BLOCKING=1 asks for synchronous operators to read an error: then no async
        # pipeline either, so the engine finishes each step before preparing the next (debugging.py)
        return Capabilities(name=self.name, device_type="npu", dtypes=("float32", "bfloat16"),
                            token_bitmask=True, rejection_sampling=True, collectives="hccl",
                            fast_paths=tuple(sorted(self.fused)), host_overlap=not debugging.launch_blocking())

    # ----- device and memory -----
    def device(self, index: int = 0) -> torch.device:
        count = int(self.npu.npu.device_count())
        if not 0 <= index < count:
            mapping = f" (logical->chip {devices.describe_mapping(self.visible)})" if self.visible else ""
            raise ValueError(f"NPU {index} does not exist: {count} visible{mapping}; check "
                             f"{devices.VISIBLE_DEVICES_VAR}")
        return torch.device("npu", index)

    def memory_info(self) -> MemoryInfo:
        free, total = self.npu.npu.mem_get_info()
        return MemoryInfo(free_bytes=free, total_bytes=total)

    def synchronize(self) -> None:
        self.npu.npu.synchronize()

    # ----- collectives -----
    def init_process_group(self, rank: int, world_size: int, init_method: str) -> None:
        # HCCL binds a rank to the current NPU: one NPU per local rank, round robin
        self.npu.npu.set_device(rank % int(self.npu.npu.device_count()))
        super().init_process_group(rank, world_size, init_method)
