"""The errors a checkpoint load raises, shared by every model family."""
from __future__ import annotations


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded: a config.json value of the wrong type or out of range, a
    corrupt or truncated safetensors file, a shard index that points outside the folder, or tensors
    that do not fit the config. Always raised while the model is loaded, never during generation."""


class CheckpointTooLargeError(MemoryError):
    """Loading the checkpoint would need more RAM than is available."""


class UnknownModelTypeError(CheckpointError):
    """config.json names a `model_type` no registered model family handles (the message lists the
    supported ones)."""


class ModelFamilyPluginError(RuntimeError):
    """A `deepinfer.model_families` entry point (a third-party model family) failed to import, or
    registered no family under its name; the message names the entry point and its distribution."""
