"""A minimal third-party back end: the "Acme" accelerator runs on the host CPU.

It is what a vendor package looks like: its own distribution, an entry point under
`deepinfer.accelerators`, a subclass of the Accelerator interface. Its kernels reuse the CPU
reference implementations; its probe can be told (ACME_DEVICE_PRESENT=0) that the hardware is
missing, so the not-usable path can be tested end to end."""
import os

from deepinfer.accelerator.interface import Capabilities, ProbeResult
from deepinfer_plugins.cpu import CpuAccelerator


class AcmeAccelerator(CpuAccelerator):
    name = "acme"
    package = "deepinfer-acme"

    @classmethod
    def probe(cls) -> ProbeResult:
        if os.environ.get("ACME_DEVICE_PRESENT", "1") == "0":
            return ProbeResult(usable=False, reason="no Acme device found (/dev/acme0 missing)")
        return ProbeResult(usable=True, reason="Acme emulated on the host CPU")

    def capabilities(self) -> Capabilities:
        return super().capabilities().model_copy(update={"name": self.name})


class LegacyAcmeAccelerator(AcmeAccelerator):
    """Built against an old, incompatible interface: selecting it must fail with both versions."""

    name = "acme-legacy"
    interface_version = "0.3"
