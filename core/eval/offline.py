"""Generation through the offline engine in any parallel layout: one process per rank (as
`examples/offline_inference.py` launches them, `deepinfer.parallel.launch`), each with its own
engine and its share of the samples.

A sample belongs to data-parallel rank `crc32(request id) % dp`: the deal depends on the sample
alone, not on which samples are left, so the nodes of a run over several machines (each appending
to its own copy of the file) never disagree about who generates what. The ranks of a
context-parallel group serve the same samples; the first of them writes the rows.
"""
from __future__ import annotations

import hashlib
import zlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from deepinfer.eval.backends import OfflineBackend
from deepinfer.eval.generate import Job, Run, Stats, generate

#: engine settings that change what a sample's tokens are (the rest only change speed and memory)
FINGERPRINTED_SETTINGS = ("tokenizer", "seed", "sampler_force_topk", "model_options")


class EngineSpec(BaseModel):
    """The offline engine of a run: `LLM` arguments (None: the engine's default) and the layout."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = None
    config: str | None = None
    accelerator: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    ep: int | None = 1
    dp: int | None = None
    cp: int = 1
    threads_per_rank: int | None = None


def describe_engine(llm: Any) -> dict[str, Any]:
    """What identifies an offline engine's outputs: the checkpoint (path and a hash of its
    config.json), dtype, back end, the settings that change tokens, and the enabled features."""
    info, engine = llm.build_info, llm.engine
    config_file = Path(info.model_path) / "config.json"
    settings = llm.config.model_dump(mode="json")
    features = engine.features.configs if engine.features is not None else {}
    return {"backend": "offline", "model": str(info.model_path), "model_type": info.model_type,
            "config_sha256": hashlib.sha256(config_file.read_bytes()).hexdigest() if config_file.is_file() else None,
            "dtype": str(info.dtype).removeprefix("torch."), "accelerator": engine.accelerator.name,
            **{k: settings[k] for k in FINGERPRINTED_SETTINGS}, "max_model_len": engine.max_model_len,
            "features": {name: cfg.model_dump(mode="json") for name, cfg in features.items()}}


def owner(job: Job, dp: int) -> int:
    """The data-parallel rank that generates `job`."""
    return zlib.crc32(job.request_id.encode()) % dp


def run_offline(run: Run, jobs: list[Job], spec: EngineSpec) -> Stats:
    """Generate `jobs` on this node's ranks of the layout `spec` asks for; the ranks' stats merged.
    Refusals (a layout, back end or model the engine cannot run) raise before any rank starts
    where they can be found here, else as the rank's `RankFailed`."""
    from deepinfer.parallel.launch import launch
    from deepinfer.parallel.layout import check_runnable, resolve_layout
    from deepinfer.plugins import select_accelerator_class

    accelerator = select_accelerator_class(spec.accelerator)
    layout = resolve_layout(spec.ep, spec.dp, spec.cp, accelerator.name)
    check_runnable(layout)
    spec = spec.model_copy(update={"accelerator": accelerator.name})  # chosen once: the ranks do not ask again
    results = launch(_rank, (run, jobs, spec), layout, accelerator, spec.threads_per_rank)
    total = Stats()
    for stats in results:
        total = total.merge(stats)
    return total


def _rank(ctx: Any, run: Run, jobs: list[Job], spec: EngineSpec) -> Stats:
    from deepinfer.llm import LLM
    from deepinfer.parallel.expert_parallel import idle_until_peers_done

    layout = ctx.layout
    llm = LLM(model=spec.model, config=spec.config, accelerator=spec.accelerator, dtype=spec.dtype,
              max_model_len=spec.max_model_len, max_num_seqs=spec.max_num_seqs, ep=layout.ep, dp=layout.dp,
              cp=layout.cp)
    try:
        if llm.build_info.is_default_model:
            print(f"[using the embedded default model (the small demo model trained on Shakespeare) at {llm.build_info.model_path}; pass --model "
                  f"for a real checkpoint]", flush=True)
        backend = OfflineBackend(llm, Path(llm.build_info.model_path).name)
        mine = [job for job in jobs if owner(job, layout.dp) == ctx.dp_rank]
        stats = generate(run, backend, describe_engine(llm), mine, write=ctx.rank % layout.cp == 0,
                         progress=run.progress and ctx.is_first, layout=layout.describe())
        idle_until_peers_done()  # expert parallelism: serve the other ranks' experts until they are done
        return stats
    finally:
        llm.shutdown()
