"""The cpu back end keeps freed activation memory in the process (plugins/cpu/host_memory.py)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter that imports torch

SNIPPET = r"""
import ctypes, sys, torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "backend":
    from deepinfer_plugins.cpu import CpuAccelerator
    CpuAccelerator()
block = torch.ones(5 << 20)  # 20 MiB of activations
print(libc.mallinfo2().hblkhd)  # bytes in blocks glibc mmapped (returned to the kernel when freed)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_activations_come_from_the_retained_heap_once_the_backend_is_created():
    def mmapped(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", SNIPPET, mode], capture_output=True, text=True, timeout=120)
        if out.returncode and "mallinfo2" in out.stderr:
            pytest.skip("the C library has no mallinfo2 (not glibc >= 2.33)")
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    # glibc's default maps a fresh 20 MiB block (and unmaps it when freed: the next one faults and
    # is zeroed again); with the cpu back end's settings it comes from the heap, which is kept
    assert mmapped("plain") >= 20 << 20
    assert mmapped("backend") < 20 << 20
