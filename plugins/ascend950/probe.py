"""Import-light probe of the Ascend back end.

`torch_npu` is never imported here: without CANN its import fails (libhccl.so) and, once installed,
it can break `import torch` itself (torch auto-loads it through its `torch.backends` entry point).
The probe looks for the package with `importlib.util.find_spec`, for the CANN toolkit on disk, and
asks `npu-smi` (a separate process) for the chips; it never initialises the NPU runtime and never
changes the environment.
"""
from __future__ import annotations

import importlib.util
import os

from deepinfer.accelerator.interface import ProbeResult
from deepinfer_plugins.ascend950 import debugging, devices


def probe() -> ProbeResult:
    import torch

    if importlib.util.find_spec("torch_npu") is None:
        return ProbeResult(usable=False, reason="torch_npu is not installed (it needs CANN 9.2 and the torch-npu "
                                                f"wheel matching torch {torch.__version__.split('+')[0]}; never "
                                                "install it without CANN)")
    mismatch = devices.check_torch_npu_version(torch.__version__)
    if mismatch:
        return ProbeResult(usable=False, reason=mismatch)
    cann = devices.find_cann()
    if cann is None:
        return ProbeResult(usable=False, reason="the CANN toolkit was not found (set ASCEND_HOME_PATH or source "
                                                "set_env.sh of CANN 9.2); torch_npu cannot load without it")
    chips = devices.query_chips()
    if not chips:
        return ProbeResult(usable=False, reason="no Ascend NPU found (npu-smi is missing, failed, or lists no chip)",
                           details={"cann": str(cann)})
    visible_var = os.environ.get(devices.VISIBLE_DEVICES_VAR)
    visible, problem = devices.visible_chips(chips, visible_var)
    if problem:
        return ProbeResult(usable=False, reason=problem, details={"cann": str(cann)})
    installed = devices.installed_families(cann)
    problem = devices.check_soc(installed, visible[0].soc)
    if problem:
        return ProbeResult(usable=False, reason=problem, details={"cann": str(cann), "soc": visible[0].soc})
    mapping = devices.describe_mapping(visible)
    shown = f", {devices.VISIBLE_DEVICES_VAR}={visible_var}" if visible_var is not None else ""
    switches = debugging.switches_on()
    return ProbeResult(usable=True, reason=f"{len(visible)}x {visible[0].soc}, CANN at {cann}{shown} "
                                           f"(logical->chip {mapping})" + (f"; {switches}" if switches else ""),
                       details={"cann": str(cann), "soc": visible[0].soc, "visible": mapping, "devices": str(len(visible)),
                                "cann_kernels_for": ",".join(sorted(installed))})
