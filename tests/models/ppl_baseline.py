"""Perplexity baselines: the `decode_ppl` that `examples/offline_inference.py --greedy --dtype
float32` prints for each of its sample prompts, per model and parallel layout, kept in
`offline_decode_ppl.json` beside this file.

The models are the embedded random-weight checkpoints, built by make-model in a temporary folder:
deterministic in fp32, so a baseline is keyed by what builds its model (family, size, seed, the
family's make-model spec version, overrides) and catches numeric regressions even though the text
is gibberish. A measurement runs the example's own rank function through its launcher, so every
layout runs as the example runs it, one thread per rank.

Recording (`pytest tests/models --output PATH`): the measured values are merged into the baseline
and written to PATH, a candidate to review and copy over the file. On a single node only: on several
nodes (WORLD_SIZE > 1) give `--output` without a path, and each node updates, in the default file,
only the samples its own ranks served.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
BASELINE_FILE = HERE / "offline_decode_ppl.json"
#: a value is printed with 3 decimals; measured and baseline may each be off by half of the last one
PRINT_ROUNDING = 0.001
_PPL = re.compile(r"; decode_ppl=(n/a|[0-9.]+)$")


@dataclass(frozen=True)
class ModelBuild:
    """How make-model builds a baseline's model."""

    family: str  # "v4" or "v41"
    size: str = "tiny"
    seed: int = 0
    overrides: tuple[tuple[str, Any], ...] = ()

    def spec_version(self) -> int:
        from deepinfer.models.deepseek_v4 import make_model as v4
        from deepinfer.models.deepseek_v41 import make_model as v41

        return {"v4": v4, "v41": v41}[self.family].SPEC_VERSION

    @property
    def key(self) -> str:
        extra = "".join(f"-{k}={v}" for k, v in self.overrides)
        return f"{self.family}-{self.size}-seed{self.seed}-spec{self.spec_version()}{extra}"

    def build(self, folder: Path) -> Path:
        if self.family == "v4":
            from deepinfer.models.deepseek_v4.make_model import make_model
        else:
            from deepinfer.models.deepseek_v41.make_model import make_model
        return make_model(folder / self.key, self.size, seed=self.seed, progress=False, **dict(self.overrides))


@dataclass(frozen=True)
class Case:
    """What is measured on a model: a layout, and the prompts (the sample prompts, or `long_context`
    padded to `input_tokens` with `output_tokens` generated)."""

    ep: int = 1
    dp: int | None = None
    cp: int = 1
    long_context: tuple[int, int] | None = None

    @property
    def layout(self) -> str:
        return f"ep{self.ep}-dp{self.dp or max(self.ep // self.cp, 1)}-cp{self.cp}"

    @property
    def prompts(self) -> str:
        return "decode" if self.long_context is None else f"long-{self.long_context[0]}x{self.long_context[1]}"

    def argv(self, model: Path) -> list[str]:
        argv = ["--model_name", str(model), "--dtype", "float32", "--greedy", "--ep", str(self.ep), "--cp",
                str(self.cp), "--threads_per_rank", "1"]
        if self.dp is not None:
            argv += ["--dp", str(self.dp)]
        if self.long_context is not None:
            argv += ["--long_context", "--long_context_input_tokens", str(self.long_context[0]),
                     "--long_context_output_tokens", str(self.long_context[1])]
        return argv


def example():
    """examples/offline_inference.py, imported by its path (tests/example_modules.py)."""
    from example_modules import load_example

    return load_example("offline_inference.py")


def run_rank(*args: Any, **kwargs: Any) -> Any:
    """The example's rank function. The launcher's spawned ranks import it from this module (its folder
    is on the path pytest gives them) and load the example by its path, as the parent does."""
    return example().run_rank(*args, **kwargs)


def measure(model: Path, case: Case) -> dict[int, float]:
    """sample index -> decode_ppl printed for it, for the samples this node's ranks served."""
    ex = example()
    from deepinfer.plugins import select_accelerator_class

    args = ex.parse_args(case.argv(model))
    sizes = ex.resolve_parallel(args.ep, args.dp, args.cp, "cpu")
    saved = {k: v for k, v in os.environ.items() if k.startswith("DEEPINFER_")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank in this process: the same threads as each spawned rank
    try:
        for k in saved:  # the example applies the seeds' defaults itself, as for a user
            del os.environ[k]
        results = ex.launch_dp(run_rank, sizes, select_accelerator_class("cpu"), (args, "cpu"),
                               threads_per_rank=1)
    finally:
        torch.set_num_threads(threads)
        for k in [k for k in os.environ if k.startswith("DEEPINFER_")]:
            del os.environ[k]
        os.environ.update(saved)
    problems = [e for r in results for e in r["errors"] if e.startswith("error") or "FAILED" in e]
    assert all(r["status"] == 0 for r in results) and not problems, problems
    values = {}
    for r in results:
        for i, line in r["lines"].items():
            m = _PPL.search(line)
            assert m is not None and m.group(1) != "n/a", f"no decode_ppl in {line!r}"
            values[i] = float(m.group(1))
    import _prompts

    own = own_samples(sizes, len(_prompts.SAMPLES))
    return {i: v for i, v in values.items() if i in own}


def own_samples(layout: Any, n_samples: int) -> set[int]:
    """The samples this node's ranks serve: the example deals sample i to data-parallel rank i % dp."""
    local_dp = {rank // layout.cp for rank in layout.local_ranks()}
    return {i for i in range(n_samples) if i % layout.dp in local_dp}


@dataclass
class Baselines:
    """The baseline file's contents and the values measured in this session."""

    path: Path = BASELINE_FILE
    data: dict[str, Any] = field(default_factory=dict)
    measured: dict[tuple[str, str, str], dict[int, float]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path = BASELINE_FILE) -> Baselines:
        return cls(path, json.loads(path.read_text(encoding="utf-8")))

    @property
    def relative_tolerance(self) -> float:
        return float(self.data["relative_tolerance"])

    def expected(self, build: ModelBuild, case: Case) -> list[float] | None:
        return self.data["baselines"].get(build.key, {}).get(case.layout, {}).get(case.prompts)

    def mismatches(self, build: ModelBuild, case: Case, values: dict[int, float]) -> list[str]:
        """What differs from the baseline beyond the tolerance (an empty list: it matches)."""
        expected = self.expected(build, case)
        if expected is None:
            return [f"no baseline for model {build.key}, layout {case.layout}, prompts {case.prompts}; record one "
                    f"with `pytest {HERE.relative_to(HERE.parents[1])} --output PATH` and review it"]
        out = []
        for i, value in sorted(values.items()):
            want = expected[i]
            if not math.isclose(value, want, rel_tol=self.relative_tolerance, abs_tol=PRINT_ROUNDING):
                out.append(f"sample {i}: decode_ppl {value} != baseline {want} (relative difference "
                           f"{abs(value - want) / want:.2e}, tolerance {self.relative_tolerance:.0e})")
        return out

    def record(self, build: ModelBuild, case: Case, values: dict[int, float]) -> None:
        self.measured[(build.key, case.layout, case.prompts)] = values

    def check(self, model: Path, build: ModelBuild, case: Case) -> None:
        """Measure `case` on `model` (built by `build`), record it for --output, and fail on a
        value outside the tolerance."""
        values = measure(model, case)
        self.record(build, case, values)
        assert values, "no sample was measured"
        problems = self.mismatches(build, case, values)
        assert not problems, "\n".join(problems)

    def candidate(self, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """`base` (default: the baseline read at start) with this session's measurements merged in,
        only the samples measured."""
        data = json.loads(json.dumps(self.data if base is None else base))
        for (model, layout, prompts), values in sorted(self.measured.items()):
            row = data["baselines"].setdefault(model, {}).setdefault(layout, {})
            old = row.get(prompts) or []
            merged = [old[i] if i < len(old) else None for i in range(max(len(old), max(values) + 1))]
            for i, v in values.items():
                merged[i] = v
            row[prompts] = merged
        return data

    def write(self, path: Path) -> None:
        """Merge the measurements into the file at `path` (the baseline read at start if there is
        none yet) under a lock: the nodes of a run over several machines may share the file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            base = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self.candidate(base), indent=2) + "\n", encoding="utf-8")
            tmp.replace(path)


def output_path(option: str | None, nodes: int) -> Path | None:
    """Where `--output` writes (None: not asked). A path is a single-node candidate; `--output`
    alone (the default file) is what several nodes use, each updating only its own ranks."""
    if option is None:
        return None
    if option == "default":
        return BASELINE_FILE
    if nodes > 1:
        raise ValueError(f"--output {option}: a candidate baseline is written on a single node only; with "
                         f"WORLD_SIZE={nodes} nodes give --output without a path, so that each node updates the "
                         f"entries of its own ranks in {BASELINE_FILE.name}")
    return Path(option)
