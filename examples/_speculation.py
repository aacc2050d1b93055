"""Whether the examples' model can run speculative decoding (the seeds turn it on by default).

The answer comes from the model registry, not from the model's name: the checkpoint's config.json
gives its family (`deepinfer.models.registry.checkpoint_family`); a model class with
`drafter_unsupported_for(checkpoint)` answers for that checkpoint (DeepSeek-V4.1: whether it brings
the DSpark drafter's weights), else its `drafter_unsupported` (a reason string, or None) does. A
model that cannot draft makes the examples leave the seeds' DEEPINFER_USE_NEXTN_DECODE default out
and say why; a value the user sets is never changed (> 0 on such a model is the engine's error,
which names the reason).
"""
from __future__ import annotations

NEXTN_VAR = "DEEPINFER_USE_NEXTN_DECODE"


def drafter_unsupported(model_name: str | None) -> str | None:
    """Why the model `model_name` resolves to (None: the default model) cannot run speculative
    decoding, or None when it can. None too when the model cannot be resolved or its family looked
    up: the engine reports that, in its own words, when it is built."""
    from deepinfer.models.registry import checkpoint_family
    from deepinfer.models.resolve import resolve_model

    try:
        path = resolve_model(model_name).path
        family, _ = checkpoint_family(path)
        for_checkpoint = getattr(family.model_class, "drafter_unsupported_for", None)
        if for_checkpoint is not None:
            return for_checkpoint(path) or None
    except (OSError, ValueError, RuntimeError):
        return None
    return getattr(family.model_class, "drafter_unsupported", None) or None


def speculation_off_note(default: str, reason: str) -> str:
    """The one line the examples print when they skip the seeds' speculative-decoding default."""
    return (f"note: speculative decoding is off for this model (the seeds' default {NEXTN_VAR}={default} is not "
            f"applied): {reason}")
