"""Import-light probe of the NVIDIA back end: never creates a CUDA context.

It reads the torch build's CUDA version and asks `nvidia-smi` (a separate process) for the GPUs'
names and compute capabilities; only when nvidia-smi is missing does it fall back to
`torch.cuda.device_count()`, which queries the driver without creating a context."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess

from deepinfer.accelerator.interface import ProbeResult

#: Vendor fast paths, used only when installed *and* the GPU is SM100/SM103 (what they are built for).
FAST_PATH_MODULES = {"flash_mla": "flash_mla", "deep_gemm": "deep_gemm", "deep_ep": "deep_ep"}
FAST_PATH_CAPABILITIES = {(10, 0), (10, 3)}
MIN_CAPABILITY = (8, 0)


def _query_nvidia_smi() -> list[tuple[str, tuple[int, int]]] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, _, cap = line.rpartition(",")
        major, _, minor = cap.strip().partition(".")
        gpus.append((name.strip(), (int(major), int(minor or 0))))
    return gpus


def active_fast_paths(capability: tuple[int, int]) -> tuple[str, ...]:
    if capability not in FAST_PATH_CAPABILITIES:
        return ()
    return tuple(name for name, module in FAST_PATH_MODULES.items() if importlib.util.find_spec(module) is not None)


def probe() -> ProbeResult:
    import torch

    if torch.version.cuda is None:
        return ProbeResult(usable=False, reason=f"the installed torch ({torch.__version__}) is not a CUDA build; "
                                                "install a CUDA 13 build of torch")
    gpus = _query_nvidia_smi()
    if gpus is None:
        count = torch.cuda.device_count()
        if count == 0:
            return ProbeResult(usable=False, reason="no NVIDIA GPU is visible (nvidia-smi not found, "
                                                    "torch.cuda.device_count() == 0); check the driver and CUDA_VISIBLE_DEVICES")
        return ProbeResult(usable=True, reason=f"{count} GPU(s) visible (capability unknown without nvidia-smi)",
                           details={"cuda": torch.version.cuda, "gpus": str(count)})
    if not gpus:
        return ProbeResult(usable=False, reason="nvidia-smi lists no GPU; check the driver and CUDA_VISIBLE_DEVICES")
    name, cap = gpus[0]
    if cap < MIN_CAPABILITY:
        return ProbeResult(usable=False, reason=f"{name} has compute capability {cap[0]}.{cap[1]}; the NVIDIA back end "
                                                f"needs {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
    paths = active_fast_paths(cap)
    path_text = ", ".join(paths) if paths else "generic torch-CUDA kernels"
    return ProbeResult(usable=True, reason=f"{len(gpus)}x {name} (sm_{cap[0]}{cap[1]}), CUDA {torch.version.cuda}; {path_text}",
                       details={"gpu": name, "compute_capability": f"{cap[0]}.{cap[1]}", "cuda": torch.version.cuda,
                                "fast_paths": ",".join(paths)})
