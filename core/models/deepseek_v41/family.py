"""DeepSeek-V4.1's registry entry: `model_type: deepseek_v41` -> parser, loader, model class, op defaults.

Importing this module registers the family (the registry does so on the first look-up of
`deepseek_v41`).
"""
from __future__ import annotations

from deepinfer.models.deepseek_v41.checkpoint import load_checkpoint, parse_config
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.make_model import CHECKPOINT_MAKER
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.ops import DeepseekV41Ops
from deepinfer.models.common.config_values import MAX_POSITIONS, MAX_QUERY_BLOCK, Range
from deepinfer.models.registry import ModelFamily, OpDefaults, activation_reserve_bytes, register_model_family

# every op the V4.1 model code calls: the generic accelerator kernels, then V4.1's own (DeepseekV41Ops)
REQUIRED_OPS = (
    "linear", "grouped_linear", "rms_norm", "rotary", "swiglu", "sink_attention",
    "moe_route", "moe_dispatch", "moe_experts", "moe_combine", "moe_sublayer",
    "hc_mix", "hc_collapse", "hc_post", "compress_pool",
)
QUERY_BLOCK = 256
CP_MIN_TOKENS = 16  # a step with a chunk this long is split over the context-parallel group

OPTION_RANGES = {"query_block": Range(int, 1, MAX_QUERY_BLOCK), "cp_min_tokens": Range(int, 1, MAX_POSITIONS)}


def activation_bytes(config: DeepseekV41Config, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The residual stream is `hc_mult` copies of the hidden state (mHC)."""
    return activation_reserve_bytes(config.hidden_size * config.hc_mult, config.vocab_size,
                                    max_num_batched_tokens, max_num_seqs)


FAMILY = register_model_family(ModelFamily(
    model_type="deepseek_v41",
    parse_config=parse_config,
    load_checkpoint=load_checkpoint,
    model_class=DeepseekV41ForCausalLM,
    op_defaults=OpDefaults(required_ops=REQUIRED_OPS, model_ops=DeepseekV41Ops,
                           model_options={"query_block": QUERY_BLOCK, "cp_min_tokens": CP_MIN_TOKENS},
                           option_ranges=OPTION_RANGES),
    activation_bytes=activation_bytes,
    make_checkpoint=CHECKPOINT_MAKER,
    aliases=("v41",),
    description="DeepSeek-V4.1 (V4.1-Flash architecture): CSA2 shared compressed attention, single-pass mHC, "
                "Engram n-gram memory, MoE",
))
