"""Whole batch-1 decode steps of the offline engine under two settings of one environment variable, one
process per side and round, the order flipping every round (what `bench_huge_pages.py --engine` and
`bench_decode_blocks.py` run).

Each process builds an offline engine on the model (batch 1), generates a few tokens (the packed weight
copies are made), then times two greedy generations of `tokens` tokens from a 128-token prompt: the
step, the model's forward and its LM head (`_logits`: hc_head, the final norm and the head's product).
The LM head streams its 132 MB (the 161 M checkpoint) from memory at a speed this shared machine's
neighbours move, so the figure to read is often the rest of the forward (the layers).

    python scripts/engine_ab.py --child MODEL --tokens N    # one side: prints its JSON line
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def anon_huge_mb() -> float:
    """Megabytes of this process's anonymous memory on huge pages (/proc/self/smaps_rollup)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def engine_child(model: str, tokens: int) -> None:
    """One side: JSON of ms per decode step (the prompts' forwards included), per decode forward and per LM
    head in it, and AnonHugePages in MB."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    llm = LLM(model=model, max_num_seqs=1, max_model_len=tokens + 256, async_pipeline=False)
    spent = {"forward": 0.0, "head": 0.0, "forwards": 0}
    forward, logits, decoding = llm.engine.model.forward, DeepseekV4ForCausalLM._logits, [False]

    def timed_forward(batch):  # decode forwards only (one new token): the prompt's forward is left out
        decoding[0] = batch.input_ids.numel() == 1
        t = time.perf_counter()
        out = forward(batch)
        if decoding[0]:
            spent["forward"] += time.perf_counter() - t
            spent["forwards"] += 1
        return out

    def timed_logits(*args):
        t = time.perf_counter()
        out = logits(*args)
        spent["head"] += (time.perf_counter() - t) if decoding[0] else 0.0
        return out

    llm.engine.model.forward = timed_forward
    DeepseekV4ForCausalLM._logits = timed_logits
    ids = torch.randint(0, 100_000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, **greedy), use_tqdm=False)  # packs
    spent.update(forward=0.0, head=0.0, forwards=0)
    t = time.perf_counter()
    for _ in range(2):
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=tokens, **greedy), use_tqdm=False)
    n = spent["forwards"]
    print(json.dumps({"step": (time.perf_counter() - t) / n * 1e3, "forward": spent["forward"] / n * 1e3,
                      "head": spent["head"] / n * 1e3, "anon_huge_mb": anon_huge_mb()}))


def engine_rounds(model: str, rounds: int, tokens: int, variable: str, sides: dict[str, str]) -> None:
    """`rounds` rounds of one process per side (`sides`: two names -> the variable's value), printing each
    round and the median of the per-round ratios second side / first side (above 1: the first is faster)."""
    (first, _), (second, _) = sides.items()
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            env = dict(os.environ, DEEPINFER_USE_NEXTN_DECODE="0", **{variable: sides[name]})
            out = subprocess.run([sys.executable, __file__, "--child", model, "--tokens", str(tokens)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
        print(f"round {r + 1}: " + "; ".join(
            f"{name} step {x['step']:.2f} ms (LM head {x['head']:.2f}, rest of the forward "
            f"{x['forward'] - x['head']:.2f}; AnonHugePages {x['anon_huge_mb']:.0f} MB)"
            for name, x in ((n, runs[n][-1]) for n in sides)), flush=True)
    for what, key in (("step", lambda x: x["step"]), ("rest of the forward", lambda x: x["forward"] - x["head"])):
        ratios = [key(b) / key(a) for a, b in zip(runs[first], runs[second])]
        print(f"{what}: {second} / {first} median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", metavar="MODEL", required=True, help="time one side on this checkpoint")
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()
    engine_child(args.child, args.tokens)


if __name__ == "__main__":
    main()
