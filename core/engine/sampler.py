"""Logits -> tokens: masks, penalties and logit bias, greedy / temperature / top-k / top-p / min-p,
per-request seeds, logprobs.

Policy lives here; the two device operations (applying a token bitmask, drawing from a
distribution) are the accelerator's `apply_token_bitmask` and `sample` kernels.

Non-finite logits: a row whose raw logits hold a NaN or +inf, or are all -inf, has no distribution
to sample from. Its log-normaliser (the log-sum-exp the log-probabilities need anyway) is then not
finite, which flags the row at no extra pass over the logits: the row gets token -1 and
`nonfinite`, and the request fails alone (`nonfinite_problem` says what was wrong). Logits that
are -inf for some tokens only (a model that bans tokens itself) are valid; the -inf that masks
write are applied after this check, to a copy.

Penalties and logit bias (`LogitAdjustment`, vLLM's definitions, in vLLM's order): the bias is
added, then the repetition penalty divides the positive logits (multiplies the negative ones) of
every token of the prompt or the output so far, then the frequency penalty is subtracted once per
occurrence of a token in the output and the presence penalty once per token that occurs. They
change what is sampled, not the log-probabilities reported, which stay those of the raw
distribution (as with temperature and masks). Rows without them keep the unchanged logits (and the
all-greedy fast path when no row has any).

Batch invariance: every decision is made per row from that row's own parameters, so a row is
processed the same way whatever else is in the batch; with a per-request `seq_seed` the draw uses
a generator seeded from (seq_seed, output position), so a request samples the same tokens alone
or in any batch, and after a preemption (the position is unchanged by recompute), given the same
logits: the batch_invariant feature makes those the same bits (docs/batch_invariance.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from deepinfer.sampling_params import GREEDY_TEMPERATURE

_MASK64 = (1 << 64) - 1


def position_seed(seq_seed: int, output_index: int) -> int:
    """A well-mixed 64-bit seed for one request's `output_index`-th draw (splitmix64)."""
    z = (seq_seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class LogitAdjustment:
    """One row's penalties and logit bias, and the tokens they count: `output_ids` the generated
    tokens before the row's position, `prompt_ids` the prompt's (read by the repetition penalty
    only; None when it is off)."""

    row: int
    output_ids: torch.Tensor  # [n] int64
    prompt_ids: torch.Tensor | None = None
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: dict[int, float] | None = None

    def apply(self, row: torch.Tensor) -> None:
        """Adjust one row of fp32 logits `[V]` in place."""
        vocab = row.shape[0]
        if self.bias:
            ids = torch.tensor(list(self.bias), dtype=torch.int64, device=row.device)
            row.index_add_(0, ids, torch.tensor(list(self.bias.values()), dtype=row.dtype, device=row.device))
        if self.repetition != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
            seen[self.output_ids.to(row.device)] = True
            if self.prompt_ids is not None:
                seen[self.prompt_ids.to(row.device)] = True
            penalised = torch.where(row > 0, row / self.repetition, row * self.repetition)
            row.copy_(torch.where(seen, penalised, row))
        if (self.frequency or self.presence) and self.output_ids.numel():
            counts = torch.bincount(self.output_ids.to(row.device), minlength=vocab).to(row.dtype)
            row.sub_(counts * self.frequency + (counts > 0).to(row.dtype) * self.presence)


@dataclass
class SamplingMetadata:
    """Per sampled row (in the order of the batch's logits rows)."""

    temperature: list[float]
    top_k: list[int]  # 0 = off
    top_p: list[float]
    min_p: list[float]
    seeds: list[int | None]  # per-position seed, or None for the engine's shared generator
    num_logprobs: list[int | None]
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, token ids) masked (min_tokens)
    adjustments: list[LogitAdjustment] = field(default_factory=list)  # rows with penalties or a logit bias

    @property
    def num_rows(self) -> int:
        return len(self.temperature)

    @property
    def all_greedy(self) -> bool:
        """Every row takes the argmax (the sampler's greedy rule)."""
        return all(t < GREEDY_TEMPERATURE or k == 1 for t, k in zip(self.temperature, self.top_k))

    @property
    def wants_logprobs(self) -> bool:
        """Some row asks for ranks / top-k log-probabilities."""
        return any(n is not None for n in self.num_logprobs)

    def subset(self, rows: list[int]) -> SamplingMetadata:
        """The metadata of `rows`, renumbered 0..len(rows)-1 (speculative verification)."""
        index = {r: i for i, r in enumerate(rows)}
        return SamplingMetadata(
            temperature=[self.temperature[r] for r in rows], top_k=[self.top_k[r] for r in rows],
            top_p=[self.top_p[r] for r in rows], min_p=[self.min_p[r] for r in rows],
            seeds=[self.seeds[r] for r in rows], num_logprobs=[self.num_logprobs[r] for r in rows],
            banned=[(index[r], ids) for r, ids in self.banned if r in index],
            adjustments=[replace(a, row=index[a.row]) for a in self.adjustments if a.row in index])


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [L] int64; -1 for a dead row
    logprobs: torch.Tensor  # [L] fp32, raw log-probability of the sampled token (0 for dead rows)
    # [L] int64, rank of the sampled token in the raw distribution (1 = top); None when no row asks
    # for logprobs
    ranks: torch.Tensor | None
    dead: torch.Tensor  # [L] bool: every token was masked
    # [L] bool: the raw logits were not finite (a NaN or +inf, or every logit -inf): nothing was sampled
    nonfinite: torch.Tensor
    top_ids: torch.Tensor | None = None  # [L, K] the K most likely tokens (raw distribution)
    top_logprobs: torch.Tensor | None = None  # [L, K]


class Sampler:
    def __init__(self, accelerator, force_topk: int | None = None, generator: torch.Generator | None = None):
        self.accelerator = accelerator
        self.force_topk = force_topk
        self.generator = generator  # shared generator for rows without a seq_seed

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, bitmask: torch.Tensor | None = None) -> SamplerOutput:
        logits = logits.float()
        if bitmask is None and not meta.banned and not meta.adjustments and meta.all_greedy:
            return self._greedy(logits, meta)
        num_rows, vocab = logits.shape
        log_norm = torch.logsumexp(logits, dim=-1)  # the logprobs' normaliser; not finite for a broken row
        nonfinite = ~torch.isfinite(log_norm)
        if bool(nonfinite.any()):  # one host sync per step, not per row
            logits = logits.masked_fill(nonfinite.unsqueeze(1), 0.0)  # a harmless draw, discarded below
        masked, dead, alive, greedy, plain, needs_sort = self._prepare(logits, meta, bitmask)
        device = logits.device
        # greedy: the first maximal index, as argmax; max(dim) returns the same index 2.6x faster
        # on the CPU (0.98 vs 2.6 ms for 32 x 129,280 logits)
        if len(greedy) == num_rows:  # no gathered copy of the logits
            tokens = masked.max(dim=-1).indices
        else:
            tokens = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
            if greedy:
                tokens[greedy] = masked[greedy].max(dim=-1).indices
        if plain:
            probs = torch.softmax(masked[plain] / self._col(meta.temperature, plain, device), dim=-1)
            tokens[plain] = self.accelerator.sample(probs, self._generators(meta, plain, device))
        if needs_sort:
            probs, indices = self._sorted_probs(masked[needs_sort], meta, needs_sort, vocab)
            choice = self.accelerator.sample(probs, self._generators(meta, needs_sort, device))
            tokens[needs_sort] = indices.gather(1, choice.unsqueeze(1)).squeeze(1)
        logprobs, ranks, top_ids, top_logprobs = self.score(logits, tokens, meta, log_norm)
        tokens = tokens.masked_fill(nonfinite, -1)
        dead = dead & ~nonfinite  # a broken row fails the request, whatever the masks allowed
        logprobs = logprobs.masked_fill(dead | nonfinite, 0.0)  # dead rows (only under masks) score 0
        return SamplerOutput(token_ids=tokens, logprobs=logprobs, ranks=ranks, dead=dead, nonfinite=nonfinite,
                             top_ids=top_ids, top_logprobs=top_logprobs)

    def _greedy(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Every row greedy and unconstrained (batch-1 and benchmark decode): the tokens and their
        log-normaliser in one kernel, no row lists (the same tokens and figures as the general path).
        The non-finite check costs a few ops over `[L]`, no pass over the logits and no host sync."""
        tokens, log_norm = self.accelerator.argmax_logsumexp(logits)
        nonfinite = ~torch.isfinite(log_norm)
        dead = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        if meta.wants_logprobs:
            logprobs, ranks, top_ids, top_logprobs = self.score(logits, tokens, meta, log_norm)
            return SamplerOutput(token_ids=tokens.masked_fill(nonfinite, -1),
                                 logprobs=logprobs.masked_fill(nonfinite, 0.0), ranks=ranks, dead=dead,
                                 nonfinite=nonfinite, top_ids=top_ids, top_logprobs=top_logprobs)
        # what `score` computes without the clamp (no -1 token yet) and with one subtraction in place
        logprobs = logits.gather(1, tokens.view(-1, 1)).view(-1).sub_(log_norm).masked_fill_(nonfinite, 0.0)
        return SamplerOutput(token_ids=tokens.masked_fill(nonfinite, -1), logprobs=logprobs, ranks=None, dead=dead,
                             nonfinite=nonfinite)

    def probabilities(self, logits: torch.Tensor, meta: SamplingMetadata,
                      bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """`[L, V]` fp32: the distribution `__call__` draws each row's token from (one-hot at the
        masked argmax for greedy rows, all zeros for dead rows). Speculative rejection sampling
        needs it whole. The logits must be finite rows (`verify` replaces the others first)."""
        logits = logits.float()
        num_rows, vocab = logits.shape
        masked, _, _, greedy, plain, needs_sort = self._prepare(logits, meta, bitmask)
        device = logits.device
        out = torch.zeros((num_rows, vocab), dtype=torch.float32, device=device)
        if greedy:
            out[greedy, masked[greedy].argmax(dim=-1)] = 1.0
        if plain:
            out[plain] = torch.softmax(masked[plain] / self._col(meta.temperature, plain, device), dim=-1)
        if needs_sort:
            probs, indices = self._sorted_probs(masked[needs_sort], meta, needs_sort, vocab)
            out[needs_sort] = torch.zeros((len(needs_sort), vocab), device=device).scatter_(1, indices, probs)
        return out

    def score(self, logits: torch.Tensor, tokens: torch.Tensor, meta: SamplingMetadata,
              log_norm: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Raw-distribution statistics of chosen `tokens` `[L]` (-1 = none): (log-probability,
        rank (1 = most likely), and the top-k ids and log-probabilities when a row asks for them).
        `log_norm`: the rows' log-sum-exp when already known."""
        # Passes over [L, V] are what this costs at large batches (the vocabulary is 129k): the
        # chosen token's log-probability needs only the log-normaliser; ranks and top-k are
        # computed when some row asks for logprobs.
        k = max((n for n in meta.num_logprobs if n), default=0) if meta.wants_logprobs else None
        logprobs, ranks, top_ids, top_logprobs, _ = self._score(logits, tokens, k, log_norm)
        return logprobs, ranks, top_ids, top_logprobs

    def score_tokens(self, logits: torch.Tensor, tokens: torch.Tensor, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Raw-distribution log-probability and rank of given `tokens` `[L]` (prompt tokens), the
        top `k` ids and log-probabilities (None when k is 0), and the rows' log-normalisers (not
        finite for a row whose logits are not)."""
        return self._score(logits, tokens, k, None)

    @staticmethod
    def _score(logits: torch.Tensor, tokens: torch.Tensor, k: int | None, log_norm: torch.Tensor | None):
        """(logprobs, ranks or None when k is None, top ids, top logprobs (None unless k), log_norm)."""
        logits = logits.float()
        token_logits = logits.gather(1, tokens.clamp(min=0).unsqueeze(1)).squeeze(1)
        if log_norm is None:
            log_norm = torch.logsumexp(logits, dim=-1)
        token_logprobs = token_logits - log_norm
        if k is None:
            return token_logprobs, None, None, None, log_norm
        ranks = (logits > token_logits.unsqueeze(1)).sum(dim=1) + 1
        if not k:
            return token_logprobs, ranks, None, None, log_norm
        top_logits, top_ids = logits.topk(min(k, logits.shape[1]), dim=-1)
        return token_logprobs, ranks, top_ids, top_logits - log_norm.unsqueeze(1), log_norm

    def _prepare(self, logits: torch.Tensor, meta: SamplingMetadata, bitmask: torch.Tensor | None):
        """Masked logits, dead rows, the alive rows, and those split by how they are drawn."""
        num_rows = logits.shape[0]
        constrained = bitmask is not None or bool(meta.banned)
        # unconstrained rows are never all -inf; the raw logits stay untouched for the logprobs
        masked = logits.clone() if constrained or meta.adjustments else logits
        for adjustment in meta.adjustments:
            adjustment.apply(masked[adjustment.row])
        for row, ids in meta.banned:
            masked[row, ids] = float("-inf")
        if bitmask is not None:
            self.accelerator.apply_token_bitmask(masked, bitmask)
        dead = torch.isneginf(masked.max(dim=-1).values) if constrained and num_rows else \
            torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
        alive = [i for i, d in enumerate(dead.tolist()) if not d] if constrained else list(range(num_rows))
        greedy = [i for i in alive if meta.temperature[i] < GREEDY_TEMPERATURE or meta.top_k[i] == 1]
        # Rows that need a sorted candidate list are drawn separately from those that do not, so a
        # row's path never depends on its neighbours.
        greedy_set = set(greedy)
        random_rows = [i for i in alive if i not in greedy_set]
        needs_sort = [i for i in random_rows if self._needs_sort(meta, i, logits.shape[1])]
        sorted_set = set(needs_sort)
        plain = [i for i in random_rows if i not in sorted_set]
        return masked, dead, alive, greedy, plain, needs_sort

    # -- helpers ----------------------------------------------------------------------------------

    def _needs_sort(self, meta: SamplingMetadata, i: int, vocab: int) -> bool:
        # a top_k of the vocabulary's size or more keeps every token: the same as no top-k
        return bool(self.force_topk or 0 < meta.top_k[i] < vocab or meta.top_p[i] < 1.0 or meta.min_p[i] > 0.0)

    @staticmethod
    def _col(values: list[float], rows: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor([values[i] for i in rows], dtype=torch.float32, device=device).unsqueeze(1)

    def _generators(self, meta: SamplingMetadata, rows: list[int], device: torch.device) -> list[torch.Generator | None]:
        gens: list[torch.Generator | None] = []
        for i in rows:
            seed = meta.seeds[i]
            if seed is None:
                gens.append(self.generator)
            else:
                g = torch.Generator(device=device)
                g.manual_seed(seed)
                gens.append(g)
        return gens

    def _sorted_probs(self, logits: torch.Tensor, meta: SamplingMetadata, rows: list[int], vocab: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, then top-k / top-p / min-p over candidates sorted by probability:
        (probabilities `[R, W]`, their token ids `[R, W]`)."""
        device = logits.device
        scaled = logits / self._col(meta.temperature, rows, device)
        width = min(self.force_topk, vocab) if self.force_topk else vocab
        values, indices = scaled.topk(width, dim=-1)  # sorted, descending
        ranks = torch.arange(width, device=device).unsqueeze(0)
        top_k = torch.tensor([min(meta.top_k[i], width) or width for i in rows], device=device).unsqueeze(1)
        values = values.masked_fill(ranks >= top_k, float("-inf"))
        probs = torch.softmax(values, dim=-1)
        top_p = self._col(meta.top_p, rows, device)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely candidates
        drop = before >= top_p
        min_p = self._col(meta.min_p, rows, device)
        drop |= probs < min_p * probs[:, :1]
        drop[:, 0] = False  # the most likely candidate always stays
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs, indices


def nonfinite_problem(row: torch.Tensor, output_index: int, at: str | None = None) -> str:
    """Why one row of raw logits (flagged `nonfinite`) could not be sampled (or scored: `at` names
    the position, e.g. "prompt position 3"): the request's error."""
    row = row.float()
    nan, pos_inf = int(row.isnan().sum()), int(row.isposinf().sum())
    found = [f"{n} NaN" for n in (nan,) if n] + [f"{n} +inf" for n in (pos_inf,) if n]
    what = ", ".join(found) + f" among {row.numel()} logits" if found else f"all {row.numel()} logits are -inf"
    at = at or f"output token {output_index}"
    return (f"the model's logits for {at} are not finite ({what}), so no token could be "
            f"sampled; the tokens before it are kept. This is a numerical fault in the model or the back end "
            f"(e.g. corrupt weights, or an overflow in half precision), not a problem of this request")
