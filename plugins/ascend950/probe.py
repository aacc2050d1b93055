"""Import-light probe of the Ascend back end.

`torch_npu` is never imported here: without CANN its import fails (libhccl.so) and, once
installed, it can break `import torch` itself (machine.md §5). The probe looks for the package
with `importlib.util.find_spec`, for the CANN toolkit on disk, and asks `npu-smi` (a separate
process) for the chip; it never initialises the NPU runtime."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from deepinfer.accelerator.interface import ProbeResult

SUPPORTED_SOC_PREFIX = "Ascend950"
CANN_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")
CANN_DEFAULT_DIRS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")


def find_cann() -> Path | None:
    for var in CANN_ENV_VARS:
        value = os.environ.get(var)
        if value and Path(value).is_dir():
            return Path(value)
    for d in CANN_DEFAULT_DIRS:
        if Path(d).is_dir():
            return Path(d)
    return None


def query_soc() -> str | None:
    """The chip name reported by npu-smi (e.g. 'Ascend950PR'), or None when unavailable."""
    exe = shutil.which("npu-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "info", "-t", "board", "-i", "0"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("chip name", "soc version", "chip type"):
            return value.strip()
    return None


def check_soc(built_for: str | None, running_on: str | None) -> str | None:
    """A mismatch message when torch_npu was built for another SoC than the one present."""
    if running_on and not running_on.startswith(SUPPORTED_SOC_PREFIX):
        return f"this NPU is {running_on}; the Ascend back end supports {SUPPORTED_SOC_PREFIX} only"
    if built_for and running_on and built_for != running_on:
        return f"torch_npu/CANN is installed for {built_for}, but this machine runs {running_on}; reinstall for {running_on}"
    return None


def probe() -> ProbeResult:
    if importlib.util.find_spec("torch_npu") is None:
        return ProbeResult(usable=False, reason="torch_npu is not installed (it needs CANN 9.2 and the torch-npu "
                                                "wheel matching torch 2.13.0; never install it without CANN)")
    cann = find_cann()
    if cann is None:
        return ProbeResult(usable=False, reason="the CANN toolkit was not found (set ASCEND_HOME_PATH or source "
                                                "set_env.sh of CANN 9.2); torch_npu cannot load without it")
    soc = query_soc()
    if soc is None:
        return ProbeResult(usable=False, reason="no Ascend NPU found (npu-smi missing or lists no device)",
                           details={"cann": str(cann)})
    problem = check_soc(None, soc)
    if problem:
        return ProbeResult(usable=False, reason=problem, details={"cann": str(cann), "soc": soc})
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "all")
    return ProbeResult(usable=True, reason=f"{soc}, CANN at {cann}, ASCEND_RT_VISIBLE_DEVICES={visible}",
                       details={"cann": str(cann), "soc": soc})
