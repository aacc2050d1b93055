"""The extension API of deepinfer: every hook a feature plugin can implement.

This one file is the contract for feature plugins (speculative decoding, structured outputs,
expert load balancing, ...). Hooks are control-plane only: registration, configuration,
lifecycle, per-step scheduler events, and *contributing objects* (a logits processor, a draft
proposer) that the core then calls directly. (The expert-placement hook arrives with the EPLB
feature, together with the engine code that calls it.) Nothing per layer or
per token goes through pluggy (a pluggy call costs ~1.7 µs).

Conventions, as in pytest:
- hook names start with `deepinfer_`; implement them with `@deepinfer.hookimpl`;
- a plugin may implement any subset and may omit trailing arguments it does not need;
- `firstresult` hooks stop at the first non-None result;
- "process": all hooks run in the engine process of each data-parallel rank.

A misspelled hook implementation is an error at start-up (`PluginManager.check_pending`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from deepinfer.config import EngineConfig
    from deepinfer.features import FeatureSpec
    from deepinfer.logits_processor import LogitsProcessor

PROJECT = "deepinfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(historic=True)
def deepinfer_feature_spec() -> FeatureSpec:
    """Declare the feature: name, config model, hooks, requirements, slots.

    Called once per feature plugin when it is registered (historic: plugins registered later are
    called too). Must return the plugin's `FeatureSpec`; the core validates the whole combination
    of enabled features against it before the engine starts.
    """


@hookspec
def deepinfer_validate_config(config: EngineConfig, feature_config: Any) -> list[str] | None:
    """Check the engine configuration as a whole, from this feature's point of view.

    `feature_config` is this feature's own validated config model. Return a list of problems
    (each a sentence that names the fix) or None. Called once at start-up, after every feature
    config has been parsed; all problems of all features are reported together.
    """


@hookspec
def deepinfer_engine_start(engine: Any, feature_config: Any) -> None:
    """The engine is built (model loaded, cache allocated) and about to serve. Called once."""


@hookspec
def deepinfer_engine_shutdown(engine: Any) -> None:
    """The engine is shutting down; release threads and buffers. Called once, also after errors."""


@hookspec
def deepinfer_request_added(request: Any) -> None:
    """A request was admitted to the waiting queue. Called once per request, in the engine thread."""


@hookspec
def deepinfer_request_finished(request: Any) -> None:
    """A request finished (any reason, errors included). Called once per request."""


@hookspec
def deepinfer_step_end(scheduler_output: Any, finished_request_ids: list[str]) -> None:
    """A step's results were applied. Called once per engine step; keep it cheap."""


@hookspec
def deepinfer_logits_processor(engine: Any, feature_config: Any) -> LogitsProcessor | None:
    """Contribute a batch-level logits processor (e.g. grammar bitmasks).

    Called once at start-up; every non-None result is called by the core each step, in plugin
    order (`before`/`after` of the FeatureSpec), before sampling.
    """


@hookspec(firstresult=True)
def deepinfer_draft_proposer(engine: Any, feature_config: Any) -> Any:
    """Contribute the speculative-decoding draft proposer (slot `draft_proposer`).

    Called once at start-up. firstresult: only one feature may own the slot, which the
    FeatureSpec's `slots` declares and start-up validation enforces.
    """
