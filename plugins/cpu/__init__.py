"""CPU reference back end (entry point `cpu` in `deepinfer.accelerators`)."""
from deepinfer_plugins.cpu.accelerator import CpuAccelerator

__all__ = ["CpuAccelerator"]
