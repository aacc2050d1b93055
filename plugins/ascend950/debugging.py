"""CANN's two switches for readable NPU errors, as the seeds' examples README suggests them:

- ASCEND_LAUNCH_BLOCKING=1: every operator runs synchronously, so an error is raised by the
  operator that failed instead of a later one;
- ASCEND_SLOG_PRINT_TO_STDOUT=1: CANN's own logs (the error codes and the operator's detail) go
  to stdout instead of only the log files under ~/ascend/log.

The NPU runtime reads both itself, when torch_npu initialises it. The back end honours them as
follows: with ASCEND_LAUNCH_BLOCKING=1 it does not declare `host_overlap`, so the engine runs each
step to completion before preparing the next (no async pipeline: the error surfaces in the step
that caused it, on the engine's own thread); the probe (`deepinfer doctor`) shows the switches that
are on; and an NPU start-up failure names the switches that are off. Read here and nowhere else.
"""
from __future__ import annotations

import os
from typing import Mapping

LAUNCH_BLOCKING_VAR = "ASCEND_LAUNCH_BLOCKING"
SLOG_TO_STDOUT_VAR = "ASCEND_SLOG_PRINT_TO_STDOUT"
SWITCHES = {
    LAUNCH_BLOCKING_VAR: "operators run synchronously, so an error names the operator that failed",
    SLOG_TO_STDOUT_VAR: "CANN's logs go to stdout",
}


def _on(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip() == "1"


def launch_blocking(env: Mapping[str, str] | None = None) -> bool:
    """ASCEND_LAUNCH_BLOCKING=1 is set."""
    return _on(os.environ if env is None else env, LAUNCH_BLOCKING_VAR)


def switches_on(env: Mapping[str, str] | None = None) -> str:
    """'ASCEND_LAUNCH_BLOCKING=1 (operators run ...)' for each switch that is on; '' when none is."""
    env = os.environ if env is None else env
    return "; ".join(f"{name}=1 ({meaning})" for name, meaning in SWITCHES.items() if _on(env, name))


def readable_errors_hint(env: Mapping[str, str] | None = None) -> str:
    """What to set for a readable error, naming only the switches that are off ('' when both are on)."""
    env = os.environ if env is None else env
    off = [name for name in SWITCHES if not _on(env, name)]
    if not off:
        return ""
    return ("for a readable NPU error, rerun with " + " ".join(f"{name}=1" for name in off) + " ("
            + "; ".join(SWITCHES[name] for name in off) + ")")
