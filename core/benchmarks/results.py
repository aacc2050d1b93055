"""The benchmark's result file: one JSON object per run, one line each (`--result_jsonl`).

A record keeps the raw quantities (tokens, seconds, steps, accepted tokens per repeat, the layout,
nextn, the model and engine settings); `figures()` derives the printed numbers from them, so the
plots and any later analysis recompute rather than trust a stored figure.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from deepinfer.benchmarks import accounting

SCHEMA = "deepinfer.benchmark/1"


def _median(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def figures(record: dict[str, Any]) -> dict[str, dict[str, float] | None]:
    """Median (and min/max over repeats) of every figure `benchmark.py` prints."""
    layout = record["layout"]
    devices, cp = layout["scale"], layout["cp"]
    nextn = record["nextn"]
    per_group = record["settings"]["decode_num_requests"]
    prefill = record.get("prefill") or []
    decode = record.get("decode") or []
    # steps per second as one sequence sees them (see workloads.py)
    sps = [accounting.decode_avg_sps(d["sequence_steps"] / d["requests"], d["seconds"]) for d in decode]
    out = {
        "prefill_tokens_per_s_per_device": _median(
            [accounting.prefill_throughput(p["tokens"], p["seconds"], devices) for p in prefill]),
        "prefill_batch_latency_s": _median([p["seconds"] / p["batches"] for p in prefill]),
        "prefill_mean_ttft_s": _median([p["mean_ttft_s"] for p in prefill]),
        "decode_avg_sps": _median(sps),
        "decode_full_acceptance_tokens_per_s_per_device": _median(
            [accounting.full_acceptance_throughput(s, per_group, nextn, cp) for s in sps]),
        "decode_accepted_tokens_per_s_per_device": _median(
            [accounting.accepted_throughput(d["accepted_tokens"], d["seconds"], devices) for d in decode]),
        "decode_per_user_tokens_per_s": _median(
            [accounting.per_user_speed(d["accepted_tokens"], d["seconds"], d["requests"]) for d in decode]),
        "decode_acceptance_length": _median(
            [accounting.acceptance_length(d["accepted_tokens"], d["sequence_steps"]) for d in decode]),
        "decode_draft_accept_rate": _median(
            [d["speculation"]["num_drafts_accepted"] / d["speculation"]["num_drafts_verified"]
             for d in decode if d.get("speculation") and d["speculation"]["num_drafts_verified"]]),
    }
    accept = record["settings"].get("accept_rate")
    if accept is not None:  # projections from the measured step rate at an assumed acceptance
        verified = [verified_drafts_per_step(d) for d in decode]
        out["decode_assumed_acceptance_tokens_per_s_per_device"] = _median(
            [accounting.assumed_acceptance_throughput(s, per_group, v, accept, cp) for s, v in zip(sps, verified)])
        out["decode_assumed_acceptance_per_user_tokens_per_s"] = _median(
            [s * accounting.tokens_per_step(v, accept) for s, v in zip(sps, verified)])
        out["decode_verified_drafts_per_step"] = _median(verified)
    if record.get("roofline"):  # each phase against the machine measured right before it
        from deepinfer.benchmarks import roofline

        cost = roofline.WorkloadCost(**record["roofline"]["cost"])
        out["prefill_fraction_of_matmul_bound"] = _median(
            [accounting.prefill_throughput(p["tokens"], p["seconds"], devices)
             / roofline.prefill_bound(cost, roofline.Machine.from_json(p["machine"])) for p in prefill])
        out["decode_fraction_of_bound"] = _median(
            [s / roofline.decode_bound(cost, roofline.Machine.from_json(d["machine"]))[0]
             for s, d in zip(sps, decode)])
    return out


def verified_drafts_per_step(decode_run: dict[str, Any]) -> float:
    """Drafts one sequence verified per decode step in a run (0 without speculation)."""
    spec = decode_run.get("speculation")
    if not spec or not spec["num_verifications"]:
        return 0.0
    return spec["num_drafts_verified"] / spec["num_verifications"]


#: How one repeat's runs of several DP ranks combine into the run of the whole layout: counts add
#: up, times are the slowest rank's (the ranks start each phase together, so that is the phase's
#: wall time), ttft is averaged, a size every rank shares is kept.
COMBINE = {"requests": "sum", "tokens": "sum", "sequence_steps": "sum", "accepted_tokens": "sum",
           "seconds": "max", "total_seconds": "max", "steps": "max", "total_steps": "max", "batches": "max",
           "mean_ttft_s": "mean", "prompt_len": "same", "context_len": "same", "max_tokens": "same",
           "machine": "first", "speculation": "sum"}


def combine_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase run of the whole layout from one run per DP rank (a single run is returned as is)."""
    if len(runs) == 1:
        return dict(runs[0])
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        rule = COMBINE.get(key)
        if rule is None:
            raise ValueError(f"no rule to combine {key!r} over data-parallel ranks; add it to results.COMBINE")
        if rule == "sum" and isinstance(values[0], dict):
            out[key] = {k: sum(v[k] for v in values) for k in values[0]}
        elif rule == "sum":
            out[key] = None if values[0] is None else sum(values)
        elif rule == "max":
            out[key] = max(values)
        elif rule == "mean":
            out[key] = statistics.fmean(values)
        elif rule == "same":
            if len(set(values)) != 1:
                raise ValueError(f"data-parallel ranks ran different {key} {sorted(set(values))}")
            out[key] = values[0]
        else:
            out[key] = values[0]
    return out


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every benchmark record of a result file (blank lines skipped; anything else is an error)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"result file {path} does not exist; run examples/benchmark.py with "
                                f"--result_jsonl {path} first")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not valid JSON ({e}); remove or fix that line") from None
        if not isinstance(record, dict) or record.get("schema") != SCHEMA:
            raise ValueError(f"{path}:{number} is not a benchmark record (expected \"schema\": \"{SCHEMA}\")")
        records.append(record)
    return records
