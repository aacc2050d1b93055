"""A minimal third-party back end: the "Acme" accelerator runs on the host CPU.

It is what a vendor package looks like: its own distribution, an entry point under
`deepinfer.accelerators`, a subclass of the Accelerator interface built on core's public plain-torch
reference kernels and torch.distributed collectives (it imports no other plugin). Its probe can be
told (ACME_DEVICE_PRESENT=0) that the hardware is missing, so the not-usable path can be tested end
to end."""
import os

import torch

from deepinfer.accelerator.interface import Accelerator, Capabilities, MemoryInfo, ProbeResult
from deepinfer.accelerator.reference import TorchCollectives, TorchKernels


class AcmeAccelerator(TorchCollectives, TorchKernels, Accelerator):
    name = "acme"
    package = "deepinfer-acme"
    interface_version = "3.0"

    @classmethod
    def probe(cls) -> ProbeResult:
        if os.environ.get("ACME_DEVICE_PRESENT", "1") == "0":
            return ProbeResult(usable=False, reason="no Acme device found (/dev/acme0 missing)")
        return ProbeResult(usable=True, reason="Acme emulated on the host CPU")

    def capabilities(self) -> Capabilities:
        return Capabilities(name=self.name, device_type="cpu", dtypes=("float32", "bfloat16"), token_bitmask=True,
                            rejection_sampling=True, host_overlap=False, collectives="gloo")

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> MemoryInfo:
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(free_bytes=os.sysconf("SC_AVPHYS_PAGES") * page,
                          total_bytes=os.sysconf("SC_PHYS_PAGES") * page)

    def synchronize(self) -> None:
        return None


class LegacyAcmeAccelerator(AcmeAccelerator):
    """Built against an old, incompatible interface: selecting it must fail with both versions."""

    name = "acme-legacy"
    interface_version = "0.3"
