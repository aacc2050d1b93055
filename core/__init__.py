"""deepinfer: a plugin-based inference engine for the DeepSeek-V4 model family."""
from __future__ import annotations

from deepinfer.version import __version__
from deepinfer.hookspecs import hookimpl

__all__ = ["__version__", "hookimpl", "LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: `import deepinfer` must stay cheap (the CLI, plugin listing and probes import it).
    if name == "LLM":
        from deepinfer.llm import LLM
        return LLM
    if name == "SamplingParams":
        from deepinfer.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
