"""Settings of the eplb feature: the `[features.eplb]` table.

DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS (declared on the FeatureSpec, in `__init__.py`) sets
`num_extra_experts`; setting it, or writing the table, turns the feature on; `enabled = false`
(what `--disable_eplb` in the offline example writes) leaves it off.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

EXTRA_VAR = "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"


def _whole_number(name: str, value: object, minimum: int, fix: str) -> int:
    # bool is an int to Python, and pydantic would round 2.0: a setting that is not a whole number
    # of experts or steps is a mistake to report, not to guess
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, got {value!r}; {fix}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; {fix}")
    return value


class EplbConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="false leaves expert-parallel load balancing off (--disable_eplb)")
    num_extra_experts: int = Field(
        32, description=f"redundant expert slots per MoE layer ({EXTRA_VAR}): a lower bound, rounded up so that "
                        "routed experts + extra is divisible by ep")
    rebalance_interval: int = Field(
        100, description="re-place the experts from the load counts every this many forward passes (counted as "
                         "this many x MoE layers expert exchanges of the EP group); 0: place once at start only")

    @field_validator("num_extra_experts", mode="before")
    @classmethod
    def _extra(cls, value: object) -> int:
        return _whole_number("num_extra_experts", value, 0,
                             f"set {EXTRA_VAR} (or features.eplb.num_extra_experts) to 0 or a positive integer")

    @field_validator("rebalance_interval", mode="before")
    @classmethod
    def _interval(cls, value: object) -> int:
        return _whole_number("rebalance_interval", value, 0,
                             "set features.eplb.rebalance_interval to a step count, or 0 to never rebalance")
