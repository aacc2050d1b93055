"""Race deepinfer against llama.cpp on the same DeepSeek-V4 weights, on this CPU.

Two sub-commands:

    # 1. a GGUF of the checkpoint (llama.cpp's converter, run from its source tree)
    python examples/compare_llamacpp.py prepare --model DIR --llama-cpp SRC --out WORK [--experts bf16]
    # 2. alternate the two engines round by round and print median ratios
    python examples/compare_llamacpp.py race --model DIR --gguf WORK/model-bf16.gguf --llama-bin SRC/build/bin

`prepare` needs a V4 checkpoint in the official quantised layout with FP4 routed experts
(`deepinfer make-model DIR --quantize fp4-experts ...`; llama.cpp's converter accepts nothing else).
It writes the released `config.json` keys beside links to the weights, runs `convert_hf_to_gguf.py
--outtype bf16` (the experts become MXFP4, losslessly) and, with `--experts bf16`, rewrites the MXFP4
expert tensors as BF16 so both engines compute in bf16 on identical values.

`race` times, in each round and in alternating order: prefill of one prompt (`--prompt-tokens`,
default 512), batch-1 decode (`--decode-tokens`, default 64) and aggregate decode of every batch in
`--batches` (default 16,64), every decode after a context of `--context` tokens (default 128; llama-bench
`-d`). deepinfer runs through
`examples/benchmark.py` (speculation off, `OMP_NUM_THREADS=--threads`), llama.cpp through
`llama-bench` and `llama-batched-bench` (`-t --threads`). Within a round each side measures every
figure `--repeats` times in one process where the tool allows it (deepinfer's `--repeats`, llama-bench's
`-r`; llama-batched-bench has no repetitions and runs that many times) and the round keeps the median:
one sample of a 64-token decode lasts well under a second, shorter than the busy machine's slow and fast
phases. It prints medians and the median of the per-round ratios (deepinfer / llama.cpp; above 1 means
deepinfer is faster). Differences under ~20 % are noise on a busy machine. llama.cpp is a benchmark-time
tool: nothing in deepinfer depends on it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from deepinfer.benchmarks import ab, results, timing

HERE = Path(__file__).resolve().parent
SUPPORTED_RATIOS = {0, 4, 128}  # what llama.cpp's converter (through transformers' config) maps to layer types


class CompareError(RuntimeError):
    """A problem with the inputs of the comparison, with the fix."""


# ----------------------------------------------------------------------------------------- prepare
def write_hub_checkpoint(model: Path, out: Path) -> Path:
    """`out/hub`: the released config.json keys plus links to `model`'s weights and tokenizer."""
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config

    config_path = model / "config.json"
    if not config_path.is_file():
        raise CompareError(f"{config_path} is missing: --model must be a checkpoint directory")
    raw = json.loads(config_path.read_text())
    if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise CompareError(f"{config_path}: model_type {raw.get('model_type')!r}; llama.cpp runs DeepSeek-V4 "
                           f"(deepseek_v4) only")
    config = DeepseekV4Config.from_dict(raw, source=str(config_path))
    if config.expert_dtype != "fp4":
        raise CompareError(f"{model} does not hold FP4 routed experts in the official layout, the only expert "
                           f"format llama.cpp's converter reads; write one with `deepinfer make-model OUT "
                           f"--family v4 --quantize fp4-experts --dtype bfloat16 --set hca_compress_rate=128` (docs/performance.md "
                           f"gives the sizes llama.cpp's graph accepts)")
    if bad := sorted(set(config.compress_ratios) - SUPPORTED_RATIOS):
        raise CompareError(f"{model}: compress ratios {bad} cannot be converted (llama.cpp accepts "
                           f"{sorted(SUPPORTED_RATIOS)}); make the checkpoint with --set hca_compress_rate=128")
    hub = out / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    for item in model.iterdir():
        if item.name != "config.json" and item.is_file():
            link = hub / item.name
            link.unlink(missing_ok=True)
            link.symlink_to(item.resolve())
    (hub / "config.json").write_text(json.dumps(config.to_hub_dict(), indent=2))
    return hub


def load_gguf(gguf_py: Path) -> ModuleType:
    """llama.cpp's `gguf` package from the tree's `gguf-py` folder (a benchmark-time tool, never
    installed here), imported by path under its own name so that its submodules (`gguf.quants`)
    import too."""
    init = gguf_py / "gguf" / "__init__.py"
    if not init.is_file():
        raise CompareError(f"{init} is missing: --llama-cpp must be a llama.cpp source tree (with gguf-py/)")
    spec = importlib.util.spec_from_file_location("gguf", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["gguf"] = module
    spec.loader.exec_module(module)
    return module


def experts_to_bf16(src: Path, dst: Path, gguf_py: Path) -> int:
    """Copy the GGUF `src` to `dst` with every MXFP4 tensor (the routed experts) stored as BF16;
    metadata and all other tensors byte for byte. Returns the number of tensors rewritten."""
    gguf = load_gguf(gguf_py)
    from gguf import quants  # noqa: PLC0415  (the tree's package, loaded above)

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    bf16 = gguf.GGMLQuantizationType.BF16
    new_data, rewritten = [], 0
    for t in reader.tensors:
        data, qtype = t.data, t.tensor_type
        if qtype == mxfp4:
            data, qtype = quants.quantize(quants.dequantize(t.data, mxfp4), bf16), bf16
            rewritten += 1
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qtype)
        new_data.append(data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in new_data:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return rewritten


def prepare(args: argparse.Namespace) -> int:
    src, out = Path(args.llama_cpp), Path(args.out)
    converter = src / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise CompareError(f"{converter} is missing: --llama-cpp must be a llama.cpp source tree "
                           f"(docs/performance.md says where to get one)")
    hub = write_hub_checkpoint(Path(args.model), out)
    mxfp4_file = out / "model-mxfp4.gguf"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    print(f"converting {hub} -> {mxfp4_file}", flush=True)
    subprocess.run([args.python, str(converter), str(hub), "--outtype", "bf16", "--outfile", str(mxfp4_file)],
                   check=True, env=env)
    if args.experts == "bf16":
        bf16_file = out / "model-bf16.gguf"
        n = experts_to_bf16(mxfp4_file, bf16_file, src / "gguf-py")
        print(f"wrote {bf16_file} ({n} MXFP4 expert tensors stored as BF16)")
    print(f"wrote {mxfp4_file}")
    return 0


# -------------------------------------------------------------------------------------------- race
@dataclass(frozen=True)
class Figure:
    name: str  # e.g. "decode, 16 sequences (aggregate)"
    kind: str  # "prefill" | "decode"
    batch: int


def figures_of(batches: list[int]) -> list[Figure]:
    return ([Figure("prefill, one prompt", "prefill", 1), Figure("decode, batch 1", "decode", 1)]
            + [Figure(f"decode, {b} sequences (aggregate)", "decode", b) for b in batches if b > 1])


def _run_json(cmd: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise CompareError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def deepinfer_rate(fig: Figure, args: argparse.Namespace) -> float:
    """tokens/s of `fig` measured by examples/benchmark.py in a fresh process (the median of its repeats)."""
    cmd = [sys.executable, str(HERE / "benchmark.py"), "--preset", "cpu", "--model_name", args.model,
           "--seed", "0", "--repeats", str(args.repeats)]
    if fig.kind == "prefill":
        cmd += ["--phase", "prefill", "--non_cached_tokens", str(args.prompt_tokens), "--prefill_batch_size",
                str(args.prompt_tokens), "--prefill_batches", "1", "--decode_num_requests", "1"]
    else:
        cmd += ["--phase", "decode", "--decode_num_requests", str(fig.batch), "--context_length",
                str(args.context), "--decode_tokens", str(args.decode_tokens)]
    record = ab.run_recorded(cmd, dict(os.environ, OMP_NUM_THREADS=str(args.threads), DEEPINFER_USE_NEXTN_DECODE="0"))
    f = results.figures(record)
    key = "prefill_tokens_per_s_per_device" if fig.kind == "prefill" else "decode_accepted_tokens_per_s_per_device"
    return f[key]["median"]


def llamacpp_rate(fig: Figure, args: argparse.Namespace) -> float:
    """tokens/s of `fig` measured by llama-bench (prefill, batch 1: the median of its `-r` samples) or
    llama-batched-bench (the median of `--repeats` runs)."""
    bin_dir, t = Path(args.llama_bin), str(args.threads)
    if fig.batch == 1:
        # decode after a context of --context tokens (`-d`, as deepinfer's side and the batched figures do)
        p, n, d = (args.prompt_tokens, 0, 0) if fig.kind == "prefill" else (0, args.decode_tokens, args.context)
        rows = json.loads(_run_json([str(bin_dir / "llama-bench"), "-m", args.gguf, "-t", t, "-p", str(p),
                                     "-n", str(n), "-d", str(d), "-r", str(args.repeats), "-o", "json"]))
        samples = rows[0].get("samples_ts") or [rows[0]["avg_ts"]]
        return float(statistics.median(samples))
    ctx = fig.batch * (args.context + args.decode_tokens) + 256
    speeds = []
    for _ in range(args.repeats):
        text = _run_json([str(bin_dir / "llama-batched-bench"), "-m", args.gguf, "-t", t, "-c", str(ctx),
                          "-b", "2048", "-ub", "512", "-npp", str(args.context), "-ntg", str(args.decode_tokens),
                          "-npl", str(fig.batch), "--output-format", "jsonl"])
        rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        if not rows:
            raise CompareError(f"llama-batched-bench printed no JSON line:\n{text[-1000:]}")
        speeds.append(float(rows[-1]["speed_tg"]))
    return statistics.median(speeds)


Rates = dict[str, dict[str, list[float]]]


def race_rounds(figs: list[Figure], rounds: int, sides: dict[str, Callable[[Figure], float]],
                progress: Callable[[str], None] = print) -> Rates:
    """Per figure and side, one rate per round (`timing.alternating_rounds`: each round measures
    every figure, the side measured first alternating every round, so that a machine warming up or
    throttling does not favour one engine)."""
    samples = timing.alternating_rounds(
        sides, rounds, cases=figs,
        on_sample=lambda r, fig, side, rate: progress(f"round {r + 1}/{rounds}  {fig.name:<36} {side:<10} "
                                                      f"{rate:10.1f} tok/s"))
    return {fig.name: by_side for fig, by_side in samples.items()}


def summarise(rates: Rates, a: str = "deepinfer", b: str = "llama.cpp") -> list[dict[str, float | str]]:
    """Median rate of each side and the median (min-max) of the per-round ratios a / b."""
    rows = []
    for name, by_side in rates.items():
        ratios = timing.ratios(by_side[a], by_side[b])
        spread = timing.Spread.of(ratios) if ratios else timing.Spread(float("nan"), float("nan"), float("nan"), 0)
        rows.append({"figure": name, a: statistics.median(by_side[a]), b: statistics.median(by_side[b]),
                     "ratio": spread.median, "ratio_min": spread.low, "ratio_max": spread.high})
    return rows


def format_table(rows: list[dict[str, float | str]]) -> str:
    lines = ["| figure | deepinfer tok/s | llama.cpp tok/s | ratio (median of rounds; min-max) |",
             "|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['figure']} | {row['deepinfer']:,.1f} | {row['llama.cpp']:,.1f} | "
                     f"{row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) |")
    return "\n".join(lines)


def race(args: argparse.Namespace) -> int:
    bin_dir = Path(args.llama_bin)
    for tool in ("llama-bench", "llama-batched-bench"):
        if not (bin_dir / tool).is_file():
            raise CompareError(f"{bin_dir / tool} is missing: build it with `cmake --build build --target "
                               f"llama-bench llama-batched-bench` in the llama.cpp tree (docs/performance.md)")
    if not Path(args.gguf).is_file():
        raise CompareError(f"{args.gguf} is missing: make it with `compare_llamacpp.py prepare`")
    if not (Path(args.model) / "config.json").is_file():
        raise CompareError(f"{args.model}/config.json is missing: --model is the deepinfer checkpoint the GGUF was "
                           f"made from")
    if args.rounds < 1 or args.threads < 1 or args.repeats < 1:
        raise CompareError("--rounds, --repeats and --threads must be at least 1")
    figs = figures_of(args.batches)
    rates = race_rounds(figs, args.rounds, {"deepinfer": lambda f: deepinfer_rate(f, args),
                                            "llama.cpp": lambda f: llamacpp_rate(f, args)})
    rows = summarise(rates)
    print(f"\n{args.threads} threads, {args.rounds} rounds of {args.repeats} repeats, prompt {args.prompt_tokens}, "
          f"decode {args.decode_tokens} tokens at context {args.context}\n")
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "func"},
                                               "rates": rates, "summary": rows}, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _batches(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batches {text!r}: give comma-separated integers, e.g. 16,64") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--batches {text!r}: every batch must be at least 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="convert a deepinfer V4 checkpoint to GGUF with llama.cpp's converter")
    p.add_argument("--model", required=True, help="deepinfer checkpoint (official layout, FP4 experts)")
    p.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (with convert_hf_to_gguf.py)")
    p.add_argument("--out", required=True, help="work directory for the hub copy and the GGUF files")
    p.add_argument("--experts", choices=("mxfp4", "bf16"), default="bf16",
                   help="expert storage in the GGUF: bf16 (default) for a bf16-vs-bf16 race, or the converter's MXFP4")
    p.add_argument("--python", default=sys.executable, help="interpreter for the converter (needs torch)")
    p.set_defaults(func=prepare)
    r = sub.add_parser("race", help="alternate both engines and print median ratios")
    r.add_argument("--model", required=True, help="deepinfer checkpoint")
    r.add_argument("--gguf", required=True, help="GGUF of the same weights")
    r.add_argument("--llama-bin", required=True, help="directory with llama-bench and llama-batched-bench")
    r.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--repeats", type=int, default=3,
                   help="samples of each figure per side and round, the round keeping their median (default 3)")
    r.add_argument("--prompt-tokens", type=int, default=512)
    r.add_argument("--decode-tokens", type=int, default=64)
    r.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding sequence")
    r.add_argument("--batches", type=_batches, default=[16, 64], help="aggregate decode batch sizes (default 16,64)")
    r.add_argument("--json", help="also write every round's rates and the summary here")
    r.set_defaults(func=race)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CompareError, ab.RunFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
