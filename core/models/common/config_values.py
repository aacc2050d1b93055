"""Type and range checks of config.json values, shared by every family's config parser.

A `Range` describes one numeric setting; `range_problems` checks a dict of them and `report` joins
the problems into one message prefixed with the file (one problem: one line; several: a list).
bool is never a number here, integers must be JSON integers and floats finite numbers. Every
setting that sets work or a shape has an upper bound too (the `MAX_*` limits below, far above any
released model's): a typo such as `hc_sinkhorn_iters: 1000000000` is an error naming the key, not
a hang or an allocation of terabytes.

Settings found in the wild that the loaders read only in part are checked here too, so that a
value deepinfer would ignore is refused rather than silently dropped: `token_ids_problem` (an
empty `eos_token_id` list), `tied_embeddings_problem` (`tie_word_embeddings`: DeepSeek models
keep a separate output head), `quantization_problems` and `fp8_block_size` (the one quantisation
method the loaders read: FP8 e4m3 blocks, optionally FP4 experts).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """The type and bounds of one numeric setting. Bounds are inclusive except a `low` with
    `open_low`; float settings must also be finite. bool is never a number here."""

    kind: type  # int or float
    low: float | None = None
    high: float | None = None
    open_low: bool = False

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a finite number"
        lo, hi = plain_number(self.low), plain_number(self.high)
        if self.low is not None and self.high is not None:
            return f"{what} in {'(' if self.open_low else '['}{lo}, {hi}]"
        if self.low is not None:
            return f"{what} {'>' if self.open_low else '>='} {lo}"
        return what if self.high is None else f"{what} <= {hi}"

    def problem(self, key: str, value: Any) -> str | None:
        """None when `value` is valid, else a sentence naming the key, the value and the range."""
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not number or (self.kind is int and not isinstance(value, numbers.Integral)):
            return f"{key} = {show_value(value)} has the wrong type ({type_name(value)}): must be {self.describe()}"
        below = self.low is not None and (value < self.low or (self.open_low and value == self.low))
        above = self.high is not None and value > self.high
        if below or above or (self.kind is float and not math.isfinite(value)):
            return f"{key} = {show_value(value)} is out of range: must be {self.describe()}"
        return None


# upper bounds of the settings that size work or memory (generous: 8-100x the released models')
MAX_VOCAB = 1 << 22  # token ids, vocabulary sizes
MAX_WIDTH = 1 << 16  # hidden sizes, ranks, intermediate sizes of one expert
MAX_HEAD_DIM = 4096
MAX_HEADS = 1024  # attention / indexer heads, o_groups, experts per token
MAX_LAYERS = 1024
MAX_EXPERTS = 1 << 16
MAX_POSITIONS = 1 << 24  # positions, windows, top-k widths, prompt lengths
MAX_COMPRESS_RATE = 4096
MAX_HC_MULT = 64
MAX_SINKHORN_ITERS = 1000  # per token and mHC site; the released models use 20
MAX_DRAFT_LAYERS = 16  # MTP / DSpark stages
MAX_FP8_BLOCK = 4096
MAX_QUERY_BLOCK = 8192  # prefill queries per attention block (model option query_block; default 256)


def plain_number(x: float | None) -> str:
    return "" if x is None else str(int(x)) if float(x).is_integer() else repr(x)


def show_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def type_name(value: Any) -> str:
    """How a JSON value is called in messages: "a list", "a string", "null", ..."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a bool"), (str, "a string"), (dict, "an object"), ((list, tuple), "a list"),
                       (numbers.Integral, "an integer"), (numbers.Real, "a float")):
        if isinstance(value, kind):
            return name
    return f"a {type(value).__name__}"


def range_problems(data: dict[str, Any], ranges: dict[str, Range]) -> list[str]:
    """One sentence per key of `ranges` present in `data` whose value is invalid."""
    return [p for k, r in ranges.items() if k in data and (p := r.problem(k, data[k])) is not None]


def report(source: str, problems: list[str]) -> str:
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return f"{source} has {len(problems)} invalid settings:\n" + "\n".join(f"  {p}" for p in problems)


def token_ids_problem(key: str, value: Any, vocab_size: int) -> str | None:
    """None when `value` (a token id, a tuple of them, or None) is valid for the vocabulary; an empty
    tuple is not (`eos_token_id: []` would silently mean "no EOS")."""
    if isinstance(value, tuple) and not value:
        return f"{key} = [] is empty: give at least one token id, or null for none"
    ids = value if isinstance(value, tuple) else () if value is None else (value,)
    if any(not 0 <= i < vocab_size for i in ids):
        return (f"{key} = {show_value(value)} is out of range: token ids must be in [0, {vocab_size}) "
                f"(vocab_size = {vocab_size})")
    return None


def tied_embeddings_problem(key: str, value: Any) -> str | None:
    """`tie_word_embeddings`: absent, null or false (the DeepSeek families keep a separate output head,
    `head.weight`); anything else is refused rather than ignored."""
    if value is None or value is False:
        return None
    if value is True:
        return (f"{key} = true is not supported: DeepSeek models have a separate output head (head.weight / "
                f"lm_head.weight); set it to false")
    return f"{key} = {show_value(value)} has the wrong type ({type_name(value)}): must be false (or absent)"


#: quantization_config keys and the values the loaders read (None: any value of the type checked below)
_QUANT_CHOICES: dict[str, tuple[str, ...] | None] = {
    "quant_method": ("fp8",), "fmt": ("e4m3",), "scale_fmt": ("ue8m0", "float", "fp32"),
    "activation_scheme": ("dynamic",), "expert_dtype": ("fp4", "fp8"), "weight_block_size": None,
    "modules_to_not_convert": None, "modules_to_convert": None, "dequantize": None,
}


def quantization_problems(q: Any, where: str = "quantization_config") -> list[str]:
    """The problems of a `quantization_config` block (None: no block). The loaders read one method,
    FP8 e4m3 weights with block scales (ue8m0 or float) and dynamic activation scaling, optionally FP4
    experts; which tensors are quantised they learn from the tensors' dtypes. A block that asks for
    anything else (another method, static activation scales, unknown keys) is refused instead of
    ignored, since weights written that way would be read wrongly."""
    if q is None:
        return []
    if not isinstance(q, dict):
        return [f"{where} = {show_value(q)} has the wrong type ({type_name(q)}): must be an object or null"]
    problems = []
    unknown = sorted(set(q) - set(_QUANT_CHOICES))
    if unknown:
        problems.append(f"{where} has keys deepinfer does not read: {unknown}; known keys: {sorted(_QUANT_CHOICES)}. "
                        f"Remove them if the weights do not depend on them")
    for key, allowed in _QUANT_CHOICES.items():
        value = q.get(key)
        if value is None or allowed is None:
            continue
        if value not in allowed:
            problems.append(f"{where}.{key} = {show_value(value)} is not supported: deepinfer loads "
                            f"{' or '.join(repr(a) for a in allowed)}")
    for key in ("modules_to_not_convert", "modules_to_convert"):
        value = q.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            problems.append(f"{where}.{key} = {show_value(value)} has the wrong type ({type_name(value)}): must be a "
                            f"list of module names or null")
    if q.get("dequantize") not in (None, False, True):
        problems.append(f"{where}.dequantize = {show_value(q['dequantize'])} has the wrong type: must be a bool")
    if "weight_block_size" in q and fp8_block_size(q, 0) is None:
        problems.append(f"{where}.weight_block_size = {show_value(q['weight_block_size'])} is not supported: it "
                        f"must be two equal integers in [1, {MAX_FP8_BLOCK}] (square FP8 blocks), e.g. [128, 128]")
    return problems


def fp8_block_size(q: dict | None, default: int) -> int | None:
    """Rows and columns per FP8 scale block: `weight_block_size` ([b, b]) of a quantization_config,
    `default` when absent, None when it is given in another form (`quantization_problems` says so)."""
    value = (q or {}).get("weight_block_size")
    if value is None:
        return default
    if (isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]
            and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_FP8_BLOCK for v in value)):
        return value[0]
    return None
