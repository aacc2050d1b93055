"""Plot a benchmark sweep as a Pareto chart (needs matplotlib).

    python examples/sweep/plot_pareto.py decode sweeps/TAG/results.jsonl sweeps/TAG/decode_pareto.png
    python examples/sweep/plot_pareto.py prefill sweeps/TAG/results.jsonl sweeps/TAG/prefill_pareto.png

decode:  throughput (accepted tokens/s/device) against per-user speed (tokens/s per sequence), one
         point per --decode_num_requests; both axes are better higher. When the runs were made with
         --accept_rate A (the sweep's ACCEPT), both axes are the projections at that acceptance.
prefill: throughput (tokens/s/device) against the time of one prefill step of
         --prefill_batch_size tokens; throughput is better higher, latency lower.
The Pareto front (points no other point beats on both axes) is drawn as a line.
Figures are recomputed from the raw quantities of each record (`deepinfer.benchmarks.results.figures`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from deepinfer.benchmarks import results

MODES = ("decode", "prefill")


def assumed_acceptance(records: list[dict[str, Any]]) -> float | None:
    """The --accept_rate every decode record was made with, or None when none was; mixing is an error
    (projected and measured points are not comparable)."""
    rates = {r["settings"].get("accept_rate") for r in records if r.get("decode")}
    if len(rates) > 1:
        raise ValueError(f"the records were made with different --accept_rate values {sorted(rates, key=str)}; "
                         f"plot one sweep (one results.jsonl per TAG) at a time")
    return rates.pop() if rates else None


def points(records: list[dict[str, Any]], mode: str) -> list[tuple[float, float, str]]:
    """(x, y, label) per record that measured `mode`."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    projected = mode == "decode" and assumed_acceptance(records) is not None
    out = []
    for r in records:
        if not r.get(mode):
            continue
        f = results.figures(r)
        s = r["settings"]
        if projected:
            out.append((f["decode_assumed_acceptance_per_user_tokens_per_s"]["median"],
                        f["decode_assumed_acceptance_tokens_per_s_per_device"]["median"],
                        f"{s['decode_num_requests']} req"))
        elif mode == "decode":
            out.append((f["decode_per_user_tokens_per_s"]["median"],
                        f["decode_accepted_tokens_per_s_per_device"]["median"], f"{s['decode_num_requests']} req"))
        else:
            out.append((f["prefill_batch_latency_s"]["median"], f["prefill_tokens_per_s_per_device"]["median"],
                        f"{s['prefill_batch_size']} tok"))
    if not out:
        raise ValueError(f"no record measured the {mode} phase; run the benchmark with --phase {mode} or both")
    return out


def pareto_front(pts: list[tuple[float, float, str]], higher_x_better: bool) -> list[tuple[float, float, str]]:
    """Points not dominated by another (y always higher-is-better), sorted by x."""
    def beats(a, b) -> bool:
        x_ok = a[0] >= b[0] if higher_x_better else a[0] <= b[0]
        x_strict = a[0] > b[0] if higher_x_better else a[0] < b[0]
        return x_ok and a[1] >= b[1] and (x_strict or a[1] > b[1])

    front = [p for p in pts if not any(beats(q, p) for q in pts if q is not p)]
    return sorted(front, key=lambda p: p[0])


def _title(records: list[dict[str, Any]], mode: str) -> str:
    r = records[-1]
    model = r["model"].get("name") or "default model"
    ctx = (f"context {r['settings']['context_length']}" if mode == "decode"
           else f"{r['settings']['non_cached_tokens']}-token prompts")
    tag = f"{r['tag']}: " if r.get("tag") else ""
    return (f"{tag}{mode} Pareto, {Path(str(model)).name}, {ctx}\n{r['layout']['scale']} device(s) "
            f"({r['layout']['accelerator']}), cp {r['layout']['cp']}, nextn {r['nextn']}, {r['model']['dtype']}")


def plot(records: list[dict[str, Any]], mode: str, out_png: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(records, mode)
    front = pareto_front(pts, higher_x_better=(mode == "decode"))
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=36, color="#9aa7b8", label="measured runs", zorder=2)
    ax.plot([p[0] for p in front], [p[1] for p in front], "-o", color="#c0392b", lw=2, ms=7,
            label="Pareto front", zorder=3)
    for x, y, label in pts:
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8, color="#333333")
    accept = assumed_acceptance(records) if mode == "decode" else None
    if accept is not None:
        what = f"tokens/s at draft acceptance {accept:g}"
        ax.set_xlabel(f"per-user speed ({what} per sequence)  \u2192 better")
        ax.set_ylabel(f"decode throughput ({what}/device)  \u2192 better")
    elif mode == "decode":
        ax.set_xlabel("per-user speed (accepted tokens/s per sequence)  \u2192 better")
        ax.set_ylabel("decode throughput (accepted tokens/s/device)  \u2192 better")
    else:
        ax.set_xlabel("prefill step latency (s per step of --prefill_batch_size tokens)  \u2190 better")
        ax.set_ylabel("prefill throughput (tokens/s/device)  \u2192 better")
    ax.set_title(_title(records, mode), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0, right=max(p[0] for p in pts) * 1.12)  # room for the labels
    ax.set_ylim(bottom=0, top=max(p[1] for p in pts) * 1.15)
    ax.legend(loc="best", fontsize=9)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=MODES)
    p.add_argument("results_jsonl")
    p.add_argument("out_png")
    args = p.parse_args(argv)
    try:
        out = plot(results.read_jsonl(args.results_jsonl), args.mode, args.out_png)
    except ImportError:
        print("error: plotting needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
