"""Weights kept quantised on the cpu back end vs dequantised at load: memory and accuracy.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/check_quant_accuracy.py --model /tmp/v4-160m [--tokens 64]

Memory: the bytes the checkpoint's weights take once loaded both ways (`DEEPINFER_CPU_QUANTIZED_WEIGHTS`
1 and 0), in all and for the routed experts alone, and the bytes per expert weight. Accuracy: a few
prompts decoded greedily for `--tokens` tokens both ways, in bf16 (or `--dtype float32`): the first position where the
tokens differ, the share of positions with the same token, and the largest difference of a
log-probability (the top 20 tokens of each position, while the two runs still agree on the tokens;
log-probabilities are the logits less one constant per position, so this is the logits' difference
up to that shift).
"""
from __future__ import annotations

import argparse
import os
import random

import torch

from deepinfer import LLM
from deepinfer.accelerator.quantized_weight import QuantizedWeight, weight_nbytes
from deepinfer.engine.builder import load_family_checkpoint
from deepinfer.models.registry import checkpoint_family
from deepinfer.sampling_params import SamplingParams
from deepinfer_plugins.cpu.accelerator import CpuAccelerator

TOP = 20


def memory(model: str) -> None:
    family, config_dict = checkpoint_family(model)
    for flag in ("0", "1"):
        os.environ["DEEPINFER_CPU_QUANTIZED_WEIGHTS"] = flag
        formats = CpuAccelerator().capabilities().weight_formats
        _, weights = load_family_checkpoint(family, model, torch.bfloat16, config_dict, formats)
        experts = {k: t for k, t in weights.items() if ".experts." in k or k.endswith((".w13", ".w2"))
                   and isinstance(t, QuantizedWeight) and t.dim() == 3}
        expert_bytes = sum(weight_nbytes(t) for t in experts.values())
        expert_count = sum(t.shape.numel() for t in experts.values())
        total = sum(weight_nbytes(t) for t in weights.values())
        print(f"quantised={flag}: weights {total / 2**20:.1f} MiB, routed experts {expert_bytes / 2**20:.1f} MiB "
              f"({expert_bytes / max(expert_count, 1):.4f} bytes per expert weight, {len(experts)} tensors), "
              f"formats kept {formats or 'none'}")
        del weights


def accuracy(model: str, tokens: int, prompts: int, dtype: str) -> None:
    rng = random.Random(0)
    batch = [{"prompt_token_ids": [rng.randrange(3, 20000) for _ in range(8 + 8 * i)]} for i in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=TOP)
    runs = {}
    for flag in ("0", "1"):
        os.environ["DEEPINFER_CPU_QUANTIZED_WEIGHTS"] = flag
        llm = LLM(model=model, accelerator="cpu", dtype=dtype, max_model_len=256)
        runs[flag] = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
        llm.shutdown()
    same = total = 0
    worst = 0.0
    for i, (ref, got) in enumerate(zip(runs["0"], runs["1"])):
        first = next((p for p, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), None)
        agree = sum(a == b for a, b in zip(ref.token_ids, got.token_ids))
        same, total = same + agree, total + len(ref.token_ids)
        for p in range(len(ref.token_ids) if first is None else first + 1):
            a, b = ref.logprobs[p], got.logprobs[p]
            worst = max([worst] + [abs(a[t].logprob - b[t].logprob) for t in a if t in b])
        print(f"prompt {i} ({len(batch[i]['prompt_token_ids'])} tokens): {agree}/{len(ref.token_ids)} tokens the "
              f"same, first difference at {'none' if first is None else first}")
    print(f"greedy agreement {same}/{total} ({same / total:.1%}); max |delta log-probability| over the top {TOP} "
          f"tokens of each position up to the first difference: {worst:.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = p.parse_args()
    memory(args.model)
    accuracy(args.model, args.tokens, args.prompts, args.dtype)


if __name__ == "__main__":
    main()
