"""DeepSeek-V4's registry entry: `model_type: deepseek_v4` (alias `v4`) -> parser, loader, model
class, op defaults, random checkpoints (`deepinfer make-model --family v4`).

Importing this module registers the family (the registry does so on the first look-up of
`deepseek_v4`).
"""
from __future__ import annotations

from deepinfer.models.deepseek_v4.checkpoint import load_checkpoint, parse_config
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.make_model import CHECKPOINT_MAKER
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops
from deepinfer.models.common.config_values import MAX_POSITIONS, MAX_QUERY_BLOCK, Range
from deepinfer.models.registry import ModelFamily, OpDefaults, activation_reserve_bytes, register_model_family

# every op the V4 model code calls: the generic accelerator kernels, then V4's own (DeepseekV4Ops)
REQUIRED_OPS = (
    "linear", "grouped_linear", "rms_norm", "rotary", "swiglu", "sink_attention",
    "sink_attention_rows", "moe_route", "moe_dispatch", "moe_experts", "moe_combine", "moe_sublayer",
    "hc_pre", "hc_pre_norm", "hc_post", "hc_post_pre_norm", "hc_head", "compress_store", "compress_pool",
    "indexer_topk", "attention_projections", "decode_attention_output",
)
# prefill runs in query blocks of this many tokens (bounded key ranges per block, see docs/model.md)
QUERY_BLOCK = 256
# under context parallelism, a step with a chunk of at least this many new tokens is split over the
# CP group (shorter steps - decode, speculative verification - run whole on every rank)
CP_MIN_TOKENS = 16

OPTION_RANGES = {"query_block": Range(int, 1, MAX_QUERY_BLOCK), "cp_min_tokens": Range(int, 1, MAX_POSITIONS)}


def activation_bytes(config: DeepseekV4Config, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The residual stream is `hc_mult` copies of the hidden state (mHC)."""
    return activation_reserve_bytes(config.hidden_size * config.hc_mult, config.vocab_size,
                                    max_num_batched_tokens, max_num_seqs)


FAMILY = register_model_family(ModelFamily(
    model_type="deepseek_v4",
    parse_config=parse_config,
    load_checkpoint=load_checkpoint,
    model_class=DeepseekV4ForCausalLM,
    op_defaults=OpDefaults(required_ops=REQUIRED_OPS, model_ops=DeepseekV4Ops,
                           model_options={"query_block": QUERY_BLOCK, "cp_min_tokens": CP_MIN_TOKENS},
                           option_ranges=OPTION_RANGES),
    activation_bytes=activation_bytes,
    make_checkpoint=CHECKPOINT_MAKER,
    aliases=("v4",),
    description="DeepSeek-V4 (V4-Flash / V4-Pro architecture): sliding, CSA and HCA attention, mHC, MoE, MTP",
))
