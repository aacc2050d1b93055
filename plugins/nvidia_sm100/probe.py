"""Import-light probe of the NVIDIA back end: never creates a CUDA context.

It reads the torch build's CUDA version and asks `nvidia-smi` (a separate process) for the GPUs'
names and compute capabilities, honouring `CUDA_VISIBLE_DEVICES` (nvidia-smi itself ignores it).
Only when nvidia-smi is missing does it fall back to `torch.cuda.device_count()`, which asks the
driver without creating a context.

It also decides which vendor fast paths are active (`active_fast_paths`): a library is used only
when it is installed *and* the GPU is SM100/SM103, the architecture its kernels are built for.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass

from deepinfer.accelerator.interface import ProbeResult

#: fast-path name -> the Python module that provides it (looked up with find_spec, never imported here)
FAST_PATH_MODULES = {"flash_mla": "flash_mla", "deep_gemm": "deep_gemm"}
#: compute capabilities the fast paths are used on (SM100 = B200/GB200, SM103 = B300/GB300)
FAST_PATH_CAPABILITIES = {(10, 0), (10, 3)}
#: the generic torch-CUDA kernels need bf16 tensor cores
MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Gpu:
    index: int  # physical index as nvidia-smi numbers it
    name: str
    capability: tuple[int, int]
    uuid: str = ""

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Rows of `nvidia-smi --query-gpu=index,name,compute_cap,uuid --format=csv,noheader`."""
    gpus = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 3:
            continue
        try:
            index = int(fields[0])
            major, _, minor = fields[2].partition(".")
            capability = (int(major), int(minor or 0))
        except ValueError:
            continue  # a header or "[N/A]" row: not a usable GPU description
        gpus.append(Gpu(index, fields[1], capability, fields[3] if len(fields) > 3 else ""))
    return gpus


def query_nvidia_smi() -> list[Gpu] | None:
    """All GPUs nvidia-smi lists; None when nvidia-smi is not installed, [] when it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=index,name,compute_cap,uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_nvidia_smi(out)


def visible_gpus(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs a CUDA process sees, in CUDA's order (logical index = position in the result).

    Entries are physical indices or UUID prefixes, as CUDA accepts them; CUDA stops at the first
    entry it cannot resolve, and so does this. MIG entries cannot be mapped without the driver
    API, so they leave the list unfiltered."""
    if cuda_visible_devices is None:
        return list(gpus)
    picked: list[Gpu] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.startswith("MIG-"):
            return list(gpus)
        match = None
        if entry.lstrip("-").isdigit():
            match = next((g for g in gpus if g.index == int(entry)), None)
        elif entry:
            match = next((g for g in gpus if g.uuid and g.uuid.startswith(entry)), None)
        if match is None or match in picked:
            break
        picked.append(match)
    return picked


def active_fast_paths(capability: tuple[int, int]) -> tuple[str, ...]:
    """The vendor libraries used on a GPU of this capability (installed and SM100/SM103)."""
    if tuple(capability) not in FAST_PATH_CAPABILITIES:
        return ()
    return tuple(name for name, module in FAST_PATH_MODULES.items() if importlib.util.find_spec(module) is not None)


def fast_path_report(capability: tuple[int, int]) -> str:
    """One line for `deepinfer doctor`: which path each kernel family takes and why."""
    active = active_fast_paths(capability)
    installed = [n for n, m in FAST_PATH_MODULES.items() if importlib.util.find_spec(m) is not None]
    if active:
        return "fast paths: " + ", ".join(active)
    if installed and tuple(capability) not in FAST_PATH_CAPABILITIES:
        return (f"generic torch-CUDA kernels ({', '.join(installed)} installed but used only on "
                f"sm_100/sm_103)")
    return "generic torch-CUDA kernels (no FlashMLA/DeepGEMM installed)"


def probe() -> ProbeResult:
    import torch

    if torch.version.cuda is None:
        return ProbeResult(usable=False, reason=f"the installed torch ({torch.__version__}) is not a CUDA build; "
                                                "install a CUDA 13 build of torch")
    all_gpus = query_nvidia_smi()
    if all_gpus is None:
        count = torch.cuda.device_count()
        if count == 0:
            return ProbeResult(usable=False, reason="no NVIDIA GPU is visible (nvidia-smi not found, "
                                                    "torch.cuda.device_count() == 0); check the driver and "
                                                    "CUDA_VISIBLE_DEVICES")
        return ProbeResult(usable=True, reason=f"{count} GPU(s) visible (compute capability unknown without "
                                               "nvidia-smi; generic torch-CUDA kernels)",
                           details={"cuda": str(torch.version.cuda), "gpus": str(count), "devices": str(count),
                                    "fast_paths": ""})
    if not all_gpus:
        return ProbeResult(usable=False, reason="nvidia-smi lists no GPU (or failed); check the driver")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible_gpus(all_gpus, cvd)
    if not gpus:
        return ProbeResult(usable=False, reason=f"CUDA_VISIBLE_DEVICES={cvd!r} selects none of the GPUs nvidia-smi "
                                                f"lists ({', '.join(str(g.index) for g in all_gpus)})")
    too_old = [g for g in gpus if g.capability < MIN_CAPABILITY]
    if too_old:
        g = too_old[0]
        return ProbeResult(usable=False, reason=f"GPU {g.index} ({g.name}) has compute capability "
                                                f"{g.capability[0]}.{g.capability[1]}; the NVIDIA back end needs "
                                                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (bf16 tensor "
                                                "cores); hide it with CUDA_VISIBLE_DEVICES or use another back end")
    first = gpus[0]
    paths = active_fast_paths(first.capability)
    mixed = len({g.capability for g in gpus}) > 1
    names = f"{len(gpus)}x {first.name}" + (" (mixed models)" if mixed else "")
    return ProbeResult(usable=True,
                       reason=f"{names} ({first.sm}), CUDA {torch.version.cuda}; {fast_path_report(first.capability)}",
                       details={"gpu": first.name, "compute_capability": f"{first.capability[0]}.{first.capability[1]}",
                                "cuda": str(torch.version.cuda), "gpus": str(len(gpus)), "devices": str(len(gpus)),
                                "fast_paths": ",".join(paths)})
