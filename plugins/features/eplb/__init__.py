"""EPLB: expert-parallel load balancing with redundant experts (docs/parallelism.md, "EPLB").

Enable it with DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS=<n> (the offline example sets the seeds'
default, 32, unless `--disable_eplb`) or a `[features.eplb]` table. Under expert parallelism
(`--ep` > 1) it:

- gives every MoE layer `physical_slots(E, n, ep)` expert slots (E routed experts plus at least n
  redundant ones, rounded up to a multiple of ep), S per rank;
- places the experts on them at engine start and again every `rebalance_interval` forward passes,
  from the rows each expert was routed since the last placement (counted by the EP group from the
  headers it already exchanges: `ExpertParallel.track_load`), through the hook
  `deepinfer_expert_placement` (default here: greedy bin-packing; another feature may supply its
  own), and moves the expert weights between ranks with the back end's all-to-all
  (`ExpertParallel.install`);
- routes each token's choice of an expert to one of its replicas (`(token + rank) mod replicas`):
  every replica holds the same weights, so outputs do not depend on the placement.

With ep = 1 there is nothing to balance: the feature logs that and does nothing.

This module stays import-light: the entry point imports it to read the FeatureSpec.
"""
from __future__ import annotations

import logging

import torch

from deepinfer.envs import EnvVar
from deepinfer.features import FeatureSpec
from deepinfer.hookspecs import EngineContext, hookimpl
from deepinfer.parallel.expert_placement import ExpertLoad, ExpertPlacement

from .config import EXTRA_VAR, EplbConfig
from .policy import greedy_placement, physical_slots

NAME = "eplb"
logger = logging.getLogger("deepinfer")


class EplbPlugin:
    """The feature plugin (entry point `deepinfer.features:eplb`): one instance per engine that
    enables it; it places and re-places that engine's experts over the EP group."""

    def __init__(self, config: EplbConfig) -> None:
        self.config = config
        self.active = False
        self.rebalances = 0  # re-placements after the first one (statistics, tests)
        self._hook = None
        self._slots: dict[int, int] = {}  # layer key -> physical slots
        self._seen: dict[int, torch.Tensor] = {}  # layer key -> expert rows counted at its last placement

    @staticmethod
    @hookimpl
    def deepinfer_feature_spec() -> FeatureSpec:
        return FeatureSpec(
            name=NAME,
            config_model=EplbConfig,
            hooks=("deepinfer_feature_spec", "deepinfer_engine_start", "deepinfer_expert_placement"),
            env_vars=(EnvVar(EXTRA_VAR, "Redundant expert slots per MoE layer (a lower bound, rounded up so "
                                        "routed experts + extra is divisible by ep); setting it turns EPLB on.",
                             field="num_extra_experts", kind=int),),
            description="expert-parallel load balancing: redundant hot experts, periodic re-placement "
                        "(nothing to do with --ep 1)",
        )

    @hookimpl(trylast=True)
    def deepinfer_expert_placement(self, load: torch.Tensor, num_slots: int, ep_size: int) -> ExpertPlacement:
        """The default policy (trylast: any other feature's implementation is asked first)."""
        return greedy_placement(load.tolist(), num_slots, ep_size)

    @hookimpl
    def deepinfer_engine_start(self, engine: EngineContext) -> None:
        from deepinfer.parallel.expert_parallel import current_expert_parallel

        ep = current_expert_parallel()
        if ep is None or ep.num_layers == 0:
            why = "expert parallelism is off (ep=1)" if ep is None else "the model has no MoE layers"
            logger.info("eplb: %s, so there is nothing to balance; the feature does nothing", why)
            return
        self.active, self._hook = True, engine.hook
        load = ep.track_load()
        for key in range(ep.num_layers):  # every rank makes the same calls in the same order (collective)
            E = ep.placement(key).num_experts
            self._slots[key] = physical_slots(E, self.config.num_extra_experts, ep.size)
            ep.install(key, self._place(torch.zeros(E, dtype=torch.float64), key, ep.size))
            self._seen[key] = load.expert_rows.get(key, torch.zeros(E, dtype=torch.long)).clone()
        slots = sorted(set(self._slots.values()))
        logger.info("eplb: %d MoE layers over ep=%d, %s expert slots per layer (%s per rank), re-placed every %s",
                    ep.num_layers, ep.size, slots, [s // ep.size for s in slots],
                    f"{self.config.rebalance_interval} forward passes" if self.config.rebalance_interval else "never")
        if self.config.rebalance_interval:
            # the lockstep counts MoE exchanges; a forward pass makes one per MoE layer
            ep.set_rebalancer(self._rebalance, self.config.rebalance_interval * ep.num_layers)

    def _place(self, load: torch.Tensor, key: int, ep_size: int) -> ExpertPlacement:
        placement = self._hook.deepinfer_expert_placement(load=load, num_slots=self._slots[key], ep_size=ep_size,
                                                          layer=key) if self._hook is not None else None
        if placement is None:  # engines built without a feature set have no relay: the default policy
            placement = greedy_placement(load.tolist(), self._slots[key], ep_size)
        if not isinstance(placement, ExpertPlacement) or placement.num_slots != self._slots[key] \
                or placement.ep_size != ep_size or placement.num_experts != load.numel():
            raise TypeError(f"feature '{NAME}': the deepinfer_expert_placement hook returned {placement!r} for MoE "
                            f"layer {key}; it must return an ExpertPlacement of {load.numel()} experts in "
                            f"{self._slots[key]} slots over {ep_size} ranks")
        return placement

    def _rebalance(self, load: ExpertLoad) -> dict[int, ExpertPlacement]:
        """Called by the EP group at the same exchange on every rank: new placements of the layers
        that saw rows since their last placement."""
        out = {}
        for key, rows in sorted(load.expert_rows.items()):
            recent = rows - self._seen.get(key, torch.zeros_like(rows))
            if not int(recent.sum()):
                continue
            self._seen[key] = rows.clone()
            out[key] = self._place(recent.double(), key, load.ep_size)
        self.rebalances += 1
        return out


plugin = EplbPlugin  # the entry point: the class, instantiated by each engine with its config

__all__ = ["EXTRA_VAR", "NAME", "EplbConfig", "EplbPlugin", "greedy_placement", "physical_slots", "plugin"]
