"""The extension API of deepinfer: every hook a feature plugin can implement, and what it gets.

This one file is the contract for feature plugins (speculative decoding, structured outputs, ...).

A feature plugin is a class, named by an entry point in the group `deepinfer.features`:

- the class declares the feature: its `deepinfer_feature_spec` (a staticmethod) returns the
  `FeatureSpec`, read from every installed feature plugin, enabled or not;
- each engine that enables the feature makes one instance, `plugin_class(config)`, with the
  feature's validated config (an instance of `FeatureSpec.config_model`), and registers it with
  that engine's own pluggy plugin manager. The instance implements the other hooks, keeps its
  config and that engine's state: no hook passes a feature its config.

Hooks are control-plane only: declaration, configuration checks, lifecycle, per-request events,
and *contributing objects* (a logits processor, a draft proposer) that the core then calls
directly. Nothing per layer or per token goes through pluggy (a pluggy call costs ~1.7 µs).

Every hook is a real pluggy call (`pm.hook.<name>(...)`), with pluggy's meaning, as in pytest:
- hook names start with `deepinfer_`; implement them with `@deepinfer.hookimpl`; a plugin may
  implement any subset of the hooks, and take any subset of a hook's arguments;
- the features of an engine are called in feature order (their FeatureSpecs' `before`/`after`;
  pluggy calls the last registered plugin first, so the core registers them in reverse);
- a plain hook returns the list of its non-None results, in that order;
- a `firstresult` hook stops at the first non-None result and returns it (None if there is none);
- a `historic` hook is remembered: a plugin registered after the call is called at registration.

Arguments are typed: `engine` is an `EngineContext`, exactly what a feature may use of the engine.
A misspelled hook implementation is an error at start-up (`PluginManager.check_pending`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from deepinfer.accelerator.interface import Accelerator
    from deepinfer.config import EngineConfig
    from deepinfer.engine.cache_manager import CacheManager
    from deepinfer.engine.engine_core import EngineCore
    from deepinfer.engine.runner import ModelRunner
    from deepinfer.features import FeatureSpec
    from deepinfer.logits_processor import LogitsProcessor
    from deepinfer.models.protocol import Model
    from deepinfer.parallel.expert_placement import ExpertPlacement
    from deepinfer.tokenizer import NoTokenizer, Tokenizer

PROJECT = "deepinfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class EngineContext:
    """What a feature may use of the engine it is part of: the `engine` argument of the hooks.

    The objects are the engine's own (not copies); a feature that uses one, uses it as the engine
    does. The runner and the cache are here because speculative decoding times synthetic verify
    batches at start-up (`runner.dummy_run(cache, ...)`) and sizes its drafter by them.
    """

    config: EngineConfig | None  # the resolved engine configuration (None for engines built by hand)
    accelerator: Accelerator  # the back end
    model: Model  # the target model (forward, weights, cache binding)
    tokenizer: Tokenizer | NoTokenizer
    vocab_size: int  # width of the model's logits
    eos_token_ids: frozenset[int]  # tokens that end a request
    max_model_len: int  # prompt + output tokens per request
    max_num_seqs: int  # sequences per step
    max_num_batched_tokens: int  # tokens per step
    cache: CacheManager  # cache slots and blocks (`layout`, `block_size`, `allocate`, `free`)
    generator: torch.Generator  # the sampler's random stream (drafts sample from the same stream)
    runner: ModelRunner  # runs model batches; `dummy_run` times synthetic ones
    # the engine's hook relay (`pm.hook`): a feature that offers a hook to other features calls it
    # here (the eplb feature asks `deepinfer_expert_placement` for each re-placement); None when
    # the engine has no features
    hook: Any = None

    @classmethod
    def of(cls, engine: EngineCore) -> EngineContext:
        """The context of an `EngineCore`."""
        return cls(config=engine.config, accelerator=engine.accelerator, model=engine.model,
                   tokenizer=engine.tokenizer, vocab_size=engine.vocab_size,
                   eos_token_ids=frozenset(engine.eos_token_ids), max_model_len=engine.max_model_len,
                   max_num_seqs=engine.scheduler.max_num_seqs,
                   max_num_batched_tokens=engine.scheduler.max_num_batched_tokens, cache=engine.cache,
                   generator=engine.sampler.generator, runner=engine.runner,
                   hook=getattr(getattr(engine, "features", None), "hook", None))


@hookspec(historic=True)
def deepinfer_feature_spec() -> FeatureSpec:
    """Declare the feature: name, config model, hooks, environment variables, requirements, slots.

    Implemented by the plugin class itself (a staticmethod), not by its per-engine instances.
    Historic: deepinfer calls it once on a catalogue of the installed feature plugins
    (`deepinfer.plugins.FeatureCatalog`), and every plugin added to the catalogue afterwards is
    asked at that moment. Must return the plugin's `FeatureSpec`, named as its entry point; the
    core validates the whole combination of enabled features against it before the engine starts.
    """


@hookspec
def deepinfer_validate_config(config: EngineConfig) -> list[str] | None:
    """Check the engine configuration as a whole, from this feature's point of view.

    Return a list of problems or None; each problem is a sentence that names the feature and the
    fix. Called once at start-up, after every enabled feature's config has been parsed and its
    plugin made; all problems of all features are reported together.
    """


@hookspec
def deepinfer_engine_start(engine: EngineContext) -> None:
    """The engine is built and about to run: configure what the feature needs before the first
    forward (e.g. switch the back end into a mode through a generic `Accelerator` method, as the
    batch_invariant feature does with `set_batch_invariant`). Called once, before the other start-up
    hooks (`deepinfer_logits_processor`, `deepinfer_draft_proposer`), in feature order.

    A prefix cache attaches here: `engine.cache.attach_prefix_cache(store)` with an object of the
    `deepinfer.engine.cache_manager.PrefixCache` protocol (lookup, capture, record_admission,
    stats); the scheduler then consults it per admission and block boundary, and the executor runs
    its copies in step order (the prefix_cache feature; `engine.cache.tensors` is the pool)."""


@hookspec
def deepinfer_logits_processor(engine: EngineContext) -> LogitsProcessor | None:
    """Contribute a batch-level logits processor (e.g. grammar bitmasks).

    Called once at start-up; every non-None result is called by the core each step, in feature
    order, before sampling.
    """


@hookspec(firstresult=True)
def deepinfer_draft_proposer(engine: EngineContext) -> Any:
    """Contribute the speculative-decoding draft proposer (slot `draft_proposer`).

    Called once at start-up. firstresult: the first feature (in feature order) that returns one
    owns the slot; the others are not called. Start-up validation refuses two enabled features
    that both declare the slot in their FeatureSpec. Returns a `deepinfer.engine.speculative.Speculation` (a `Drafter`,
    `num_draft_tokens`, an optional `VerifyPolicy`); the core verifies, accepts, rolls back and
    keeps the statistics.
    """


@hookspec(firstresult=True)
def deepinfer_expert_placement(load: torch.Tensor, num_slots: int, ep_size: int, layer: int) -> ExpertPlacement | None:
    """Place one MoE layer's routed experts on the expert-parallel ranks (the eplb feature's policy).

    `load` `[E]` float64: rows routed to each logical expert since the last placement (all zeros
    for the first one); `num_slots`: physical expert slots of the whole group (E plus the
    redundant experts, a multiple of `ep_size`); `layer`: the MoE layer's key (construction
    order). Return a `deepinfer.parallel.expert_placement.ExpertPlacement` with `num_slots` slots
    (each rank holds `num_slots // ep_size` consecutive ones; every expert at least one), or None
    to leave the choice to the next implementation. Called by the eplb feature at engine start and
    at every rebalance, on every rank with the same counts: the result must depend on the
    arguments only (every rank must install the same placement; a mismatch is an error). The
    eplb feature's default is greedy bin-packing; a third-party feature ordered before it
    (`FeatureSpec.before=("eplb",)`) that returns a placement replaces it. firstresult.
    """


@hookspec
def deepinfer_engine_shutdown(engine: EngineContext) -> None:
    """The engine is shutting down; release threads and buffers. Called once, also after errors
    (even when start-up failed part way)."""
