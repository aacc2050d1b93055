"""Huawei Ascend 950 back end (entry point `ascend`). Importing it never imports torch_npu."""
from deepinfer_plugins.ascend950.accelerator import AscendAccelerator

__all__ = ["AscendAccelerator"]
