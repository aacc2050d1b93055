"""NVIDIA back end (entry point `nvidia`). Importing it never touches the GPU."""
from deepinfer_plugins.nvidia_sm100.accelerator import NvidiaAccelerator

__all__ = ["NvidiaAccelerator"]
