"""Measure what SWA bounded replay (the swa_replay feature) costs in agreement and saves in prefill.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_swa_replay.py [--lengths 256 512 1024 2048]
        [--keep 140] [--new-tokens 32] [--repeats 3] [--size default] [--model DIR]

On a V4.1 checkpoint (by default the embedded `default` size, made in a temporary folder with
random weights), per prompt length, one model and one cache slot:
- greedy agreement length: tokens that bounded and exact prefill generate identically, from the
  first generated token, before the first difference (decode itself is the same in both modes);
- teacher-forced top-1 agreement: exact mode's greedy continuation is fed to both modes and the
  share of positions whose argmax agrees is counted; and the largest logit difference at the
  prompt's last row;
- prefill FLOPs from the config (linear layers + attention, per token and layer) in both modes,
  and the decoder share saved;
- measured prefill time of the whole prompt in one chunk, exact and bounded in turn `--repeats`
  times in the same process, the mode that goes first alternating (`deepinfer.benchmarks.timing`;
  the median of each, and their speed-up).
Random weights make the agreement figures indicative only: a trained model's decoder states are
smoother than a random one's. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

import torch

from deepinfer.benchmarks.timing import alternating_rounds, timed
from deepinfer.models.deepseek_v41.checkpoint import load_checkpoint
from deepinfer.models.deepseek_v41.config import FULL, REINDEX, DeepseekV41Config
from deepinfer.models.deepseek_v41.make_model import make_model
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.replay import decoder_start
from deepinfer.models.interface import ForwardBatch, allocate_cache_tensors

BLOCK = 64


class OneSlot:
    """One sequence in one cache slot: prefill, then decode token by token."""

    def __init__(self, model: DeepseekV41ForCausalLM, max_len: int):
        self.model = model
        layout = model.cache_layout(0)
        blocks = {g.name: -(-g.entries_for(max_len) // BLOCK) for g in layout.block_groups}
        model.bind_cache(allocate_cache_tensors(layout, 1, blocks, BLOCK, "cpu"))
        self.tables = {name: torch.arange(n).unsqueeze(0) for name, n in blocks.items()}
        self.length = self.prompt_len = 0

    def step(self, tokens: list[int]) -> torch.Tensor:
        n = len(tokens)
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens), positions=torch.arange(self.length, self.length + n), query_lens=[n],
            context_lens=[self.length], slots=torch.tensor([0]), block_tables=self.tables,
            logits_indices=torch.tensor([n - 1]), prompt_lens=[self.prompt_len])
        logits = self.model.forward(batch).logits[0]
        self.length += n
        return logits

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        self.length, self.prompt_len = 0, len(prompt)
        return self.step(prompt)


def layer_flops(c: DeepseekV41Config, layer: int, keys: int, entries: int) -> dict[str, float]:
    """Multiply-add FLOPs per token of one layer: 'linear' (attention projections, compressor,
    indexer, MoE), 'prepass' (the compressor and index-key projection alone), 'attention' (scores
    and values over `keys` window keys and `entries` selected entries; the indexer's scoring of
    every visible entry is added by the caller)."""
    D, H, d = c.hidden_size, c.num_attention_heads, c.head_dim
    role, r = c.layer_roles[layer], c.compress_ratio(layer)
    lin = D * c.q_lora_rank + D * d + c.q_lora_rank * H * d + H * d * c.o_lora_rank + c.o_groups * c.o_lora_rank * D
    prepass = 0.0
    if role in (FULL, REINDEX):
        lin += c.q_lora_rank * c.index_n_heads * c.index_head_dim + D * c.index_n_heads
    if role == FULL:
        prepass = D * d * (2 if r > 1 else 1) + d * c.index_head_dim  # wkv (+ wgate), indexer.wk
        lin += prepass
    lin += D * c.n_routed_experts + 3 * D * c.moe_intermediate_size * (c.num_experts_per_tok + c.n_shared_experts)
    att = 2 * H * d * (keys + (entries if r else 0))
    return {"linear": 2 * lin, "prepass": 2 * prepass, "attention": 2 * att}


def prefill_flops(c: DeepseekV41Config, prompt_len: int, keep: int | None) -> float:
    """FLOPs of a one-chunk prefill (the head at the last row only, in both modes)."""
    cut = decoder_start(c)
    floor = 0 if keep is None else max(0, prompt_len - keep)
    total = 0.0
    for t in range(prompt_len):
        keys = min(t + 1, c.sliding_window)
        for layer in range(c.num_hidden_layers):
            r = c.compress_ratio(layer)
            visible = (t + 1) // r if r else 0
            f = layer_flops(c, layer, keys, min(visible, c.index_topk))
            if c.layer_roles[layer] in (FULL, REINDEX):  # indexer scores over every visible entry
                f["attention"] += 2 * c.index_n_heads * c.index_head_dim * visible
            if layer >= cut and t < floor:
                total += f["prepass"]  # a dropped row: the prepass only
            else:
                total += f["linear"] + f["attention"]
    return total + 2 * c.hidden_size * c.vocab_size


def measure(model: DeepseekV41ForCausalLM, prompt: list[int], keep: int, new_tokens: int, repeats: int) -> dict:
    slot = OneSlot(model, len(prompt) + new_tokens + 1)
    # exact greedy continuation, and the exact logits along it
    model.set_bounded_replay(None)
    exact = [slot.prefill(prompt)]
    cont = []
    for _ in range(new_tokens):
        cont.append(int(exact[-1].argmax()))
        exact.append(slot.step(cont[-1:]))
    model.set_bounded_replay(keep)
    bounded = [slot.prefill(prompt)]  # teacher-forced on exact's continuation
    for t in cont:
        bounded.append(slot.step([t]))
    delta = float((exact[0] - bounded[0]).abs().max())  # the prompt's last row
    tf_agree = sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(exact, bounded)) / len(exact)
    logits, free = slot.prefill(prompt), []  # free-running greedy under bounded replay
    for _ in range(new_tokens):
        free.append(int(logits.argmax()))
        logits = slot.step(free[-1:])
    agree = next((i for i, (a, b) in enumerate(zip(cont, free)) if a != b), new_tokens)

    def prefill_seconds(mode: int | None):
        def run(_case) -> float:
            model.set_bounded_replay(mode)
            return timed(lambda: slot.prefill(prompt))[1]
        return run

    times = alternating_rounds({"exact": prefill_seconds(None), "bounded": prefill_seconds(keep)}, repeats)[None]
    model.set_bounded_replay(None)
    return {"greedy_agree": agree, "tf_agree": tf_agree, "delta": delta, "t_exact": statistics.median(times["exact"]),
            "t_bounded": statistics.median(times["bounded"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--keep", type=int, default=140)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", default="default", help="make-model size when --model is not given")
    p.add_argument("--model", help="a V4.1 checkpoint folder (default: make one of --size)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else make_model(Path(tmp) / args.size, args.size, seed=args.seed,
                                                              dtype="float32")
        config, weights = load_checkpoint(path, torch.float32)
    from deepinfer.plugins import select_accelerator_class

    model = DeepseekV41ForCausalLM(config, select_accelerator_class()(), dtype=torch.float32)
    model.load_weights(weights)
    rng = random.Random(args.seed)
    print(f"model: {args.model or args.size} (random weights, fp32), window {config.sliding_window}, decoder layers "
          f"{decoder_start(config)}-{config.num_hidden_layers - 1} of {config.num_hidden_layers}, keep {args.keep}, "
          f"{args.new_tokens} generated tokens, {torch.get_num_threads()} thread(s)")
    print("| prompt | greedy agreement (tokens) | teacher-forced top-1 | last-row max abs logit diff "
          "| prefill GFLOP exact / bounded (saved) | prefill s exact / bounded (speed-up) |")
    print("|---|---|---|---|---|---|")
    for n in args.lengths:
        prompt = [rng.randrange(3, config.vocab_size) for _ in range(n)]
        m = measure(model, prompt, args.keep, args.new_tokens, args.repeats)
        fe, fb = prefill_flops(config, n, None), prefill_flops(config, n, args.keep)
        print(f"| {n} | {m['greedy_agree']}/{args.new_tokens} | {m['tf_agree']:.1%} | {m['delta']:.2e} "
              f"| {fe / 1e9:.3f} / {fb / 1e9:.3f} ({1 - fb / fe:.0%}) "
              f"| {m['t_exact']:.3f} / {m['t_bounded']:.3f} ({m['t_exact'] / m['t_bounded']:.2f}x) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
