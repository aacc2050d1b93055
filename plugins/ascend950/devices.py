"""What the Ascend back end can learn about the machine without importing torch_npu.

- the CANN toolkit directory and the SoC families its operator kernels are installed for;
- the chips `npu-smi info -m` lists (logic id and chip name) and the SoC each one is;
- which of them `ASCEND_RT_VISIBLE_DEVICES` exposes, in the runtime's order (logical device i of
  torch_npu is the i-th entry), read here and nowhere else in deepinfer;
- whether the installed torch-npu wheel was built for the installed torch.

Everything is best effort from the public CANN/torch_npu documentation; none of it has run on an
Ascend machine (docs/backends.md).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

#: the SoC family this back end supports (Ascend 950PR / 950DT)
SUPPORTED_FAMILY = "ascend950"
CANN_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")
CANN_DEFAULT_DIRS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")
#: where CANN keeps one sub-directory of built-in operator kernels per SoC family
KERNEL_DIRS = ("opp/built-in/op_impl/ai_core/tbe/kernel", "opp/built-in/op_impl/ai_core/tbe/config")
#: longest prefix first: ascend910_93 (Atlas A3) before ascend910b (A2) before ascend910
KNOWN_FAMILIES = ("ascend910_93", "ascend910b", "ascend910", "ascend950", "ascend310p", "ascend310b", "ascend310")
VISIBLE_DEVICES_VAR = "ASCEND_RT_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Chip:
    logic_id: int  # what ASCEND_RT_VISIBLE_DEVICES refers to
    npu_id: int
    soc: str  # e.g. "Ascend950PR"


def soc_family(soc: str) -> str:
    """'Ascend950PR' -> 'ascend950', 'Ascend910B3' -> 'ascend910b', 'Ascend910_9391' -> 'ascend910_93'."""
    name = soc.lower().replace(" ", "")
    return next((f for f in KNOWN_FAMILIES if name.startswith(f)), name)


def find_cann() -> Path | None:
    for var in CANN_ENV_VARS:
        value = os.environ.get(var)
        if value and Path(value).is_dir():
            # ASCEND_OPP_PATH points at <cann>/opp; the toolkit root is its parent
            return Path(value).parent if Path(value).name == "opp" else Path(value)
    return next((Path(d) for d in CANN_DEFAULT_DIRS if Path(d).is_dir()), None)


def installed_families(cann: Path | None) -> set[str]:
    """SoC families CANN has operator kernels for; empty when the layout is not recognised."""
    found: set[str] = set()
    for rel in KERNEL_DIRS if cann else ():
        d = cann / rel
        if d.is_dir():
            found |= {soc_family(p.name) for p in d.iterdir() if p.is_dir() and p.name.lower().startswith("ascend")}
    return found


def parse_npu_smi_mapping(text: str) -> list[Chip]:
    """Rows of `npu-smi info -m`: NPU ID, Chip ID, Chip Logic ID ('-' for MCUs), Chip Name."""
    chips = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or not (parts[0].isdigit() and parts[2].isdigit()):
            continue  # header, or a management chip without a logic id
        name = "".join(parts[3:])
        if name.lower().startswith("ascend"):
            chips.append(Chip(logic_id=int(parts[2]), npu_id=int(parts[0]), soc=name))
    return sorted(chips, key=lambda c: c.logic_id)


def query_chips() -> list[Chip] | None:
    """The chips npu-smi reports; None when npu-smi is missing or fails."""
    exe = shutil.which("npu-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "info", "-m"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_npu_smi_mapping(out)


def visible_chips(chips: list[Chip], visible: str | None) -> tuple[list[Chip], str | None]:
    """(chips in logical-device order, problem). `visible` is ASCEND_RT_VISIBLE_DEVICES' value."""
    if visible is None:
        return list(chips), None
    if visible.strip() == "":
        return [], f"{VISIBLE_DEVICES_VAR} is set to an empty string, which hides every NPU; unset it or list chip ids"
    by_id = {c.logic_id: c for c in chips}
    picked: list[Chip] = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry.isdigit():
            return [], f"{VISIBLE_DEVICES_VAR}={visible!r}: {entry!r} is not a chip logic id (comma-separated integers)"
        if int(entry) not in by_id:
            known = ", ".join(str(i) for i in sorted(by_id)) or "none"
            return [], f"{VISIBLE_DEVICES_VAR}={visible!r} names chip {entry}, but npu-smi lists logic ids {known}"
        picked.append(by_id[int(entry)])
    return picked, None


def describe_mapping(chips: list[Chip]) -> str:
    """'0->4, 1->5': logical torch_npu device -> chip logic id."""
    return ", ".join(f"{i}->{c.logic_id}" for i, c in enumerate(chips))


def check_soc(installed: set[str], running_on: str | None) -> str | None:
    """A message when the chip is not an Ascend 950 or CANN's kernels are for another SoC."""
    if running_on is None:
        return None
    family = soc_family(running_on)
    if family != SUPPORTED_FAMILY:
        return (f"this NPU is {running_on}; the ascend back end supports Ascend 950 ({SUPPORTED_FAMILY}) only; "
                f"choose another back end with DEEPINFER_ACCELERATOR")
    if installed and family not in installed:
        return (f"CANN is installed for {', '.join(sorted(installed))}, but this machine runs {running_on} "
                f"({family}); install the CANN 9.2 toolkit and kernels package for {family}")
    return None


def _release(version: str) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(x) for x in m.groups()) if m else None


def check_torch_npu_version(torch_version: str) -> str | None:
    """torch-npu X.Y.Z is built for torch X.Y.Z exactly; a mismatch fails at import in obscure ways."""
    try:
        npu_version = metadata.version("torch-npu")
    except metadata.PackageNotFoundError:
        return None
    want, have = _release(npu_version), _release(torch_version)
    if want and have and want != have:
        return (f"torch-npu {npu_version} is built for torch {'.'.join(map(str, want))}, but torch {torch_version} is "
                f"installed; install torch-npu=={'.'.join(map(str, have))} (or the matching torch)")
    return None
