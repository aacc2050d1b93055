"""Parallel sizes and the per-rank launcher of the examples: a thin layer over `deepinfer.parallel`.

- `--dp` defaults to `ep // cp` (at least 1);
- the world size is `dp x cp`, and it must be divisible by `ep`;
- one process per data-parallel rank, each with `cp` consecutive devices from DEVICE_OFFSET;
- multi-node: RANK (node index) and WORLD_SIZE (number of nodes), defaults 0 and 1; each node runs
  an equal share of the DP ranks, so dp must be divisible by the number of nodes;
  MASTER_ADDR/MASTER_PORT name node 0 (on one node: 127.0.0.1 and a free port).

Every valid layout runs whose ep and cp divide one another (several EP groups of `ep` consecutive
ranks, several CP groups of `cp`; --cp needs a DeepSeek-V4 model); other layouts are refused before
any process starts. See docs/parallelism.md.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from deepinfer.parallel.launch import RankContext, RankFailed, launch
from deepinfer.parallel.layout import (ACCELERATOR_DEFAULT_EP, DEFAULT_EP, ParallelConfigError, ParallelLayout,
                                       check_runnable, env_int, resolve_layout)
from deepinfer.plugins import PluginError

ParallelSizes = ParallelLayout  # the examples' older name
__all__ = ["ACCELERATOR_DEFAULT_EP", "DEFAULT_EP", "REFUSALS", "ParallelConfigError", "ParallelSizes", "RankContext",
           "RankFailed", "check_context_parallel_model", "env_int", "error_line", "launch_dp", "resolve_parallel"]

#: What deepinfer raises on purpose, each with the reason and the fix in its message: a back end
#: that is absent or unusable here (PluginError), a setting, layout or model the engine refuses
#: (ValueError, ParallelConfigError), a missing file. The examples print these as one `error:` line.
REFUSALS: tuple[type[BaseException], ...] = (PluginError, ValueError, FileNotFoundError)


def error_line(exc: BaseException) -> str:
    """What an example prints for `exc` on stderr: `error: <message>` for a refusal, raised here or
    in a rank of the launch (RankFailed carries the rank's exception); anything else is a crash and
    keeps its traceback (a rank's text, or the caller lets it propagate)."""
    cause = exc.exception if isinstance(exc, RankFailed) else exc
    if isinstance(cause, REFUSALS):
        return f"error: {cause}"
    return f"error: {exc}"


def resolve_parallel(ep: int | None, dp: int | None, cp: int, accelerator: str,
                     env: Mapping[str, str] | None = None) -> ParallelLayout:
    """The layout for --ep/--dp/--cp, refused (ParallelConfigError with the fix) when invalid or
    not runnable here."""
    layout = resolve_layout(ep, dp, cp, accelerator, env)
    check_runnable(layout)
    return layout


def check_context_parallel_model(model_name: str | None, cp: int) -> None:
    """Refuse --cp > 1 before any process starts when the model's family cannot split its prefill
    (the engine would refuse it in every rank); ValueError with the reason and the fix. A model
    that cannot be resolved here is left to the engine, which reports that in its own words."""
    if cp == 1:
        return
    from deepinfer.engine.builder import check_context_parallel
    from deepinfer.models.registry import checkpoint_family
    from deepinfer.models.resolve import resolve_model

    try:
        family, _ = checkpoint_family(resolve_model(model_name).path)
    except (OSError, ValueError, RuntimeError):
        return
    check_context_parallel(family, cp)


def launch_dp(main: Callable[..., Any], sizes: int | ParallelLayout, accelerator_class: type | None = None,
              args: tuple = (), threads_per_rank: int | None = None) -> list[Any]:
    """Run `main(RankContext, *args)` once per rank of this node (one process per rank when the
    world is larger than 1); returns the ranks' values in rank order, or raises RankFailed.

    `sizes` is the layout (`resolve_parallel`), or just the number of data-parallel ranks, as in the
    seeds' `launch_dp(main, dp_size)`: dp_size independent ranks (ep = cp = 1; several nodes from
    WORLD_SIZE/RANK), each with its own engine. `accelerator_class` defaults to the back end
    DEEPINFER_ACCELERATOR selects."""
    if accelerator_class is None:
        from deepinfer.plugins import select_accelerator_class

        accelerator_class = select_accelerator_class(None)
    if not isinstance(sizes, ParallelLayout):
        sizes = resolve_parallel(1, sizes, 1, accelerator_class.name)
    return launch(main, args, sizes, accelerator_class, threads_per_rank)
