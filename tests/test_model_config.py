"""DeepseekV4Config parsing (official, hub and transformers spellings) and the weight naming maps."""
from __future__ import annotations

import pytest
import torch

from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer.models.deepseek_v4.weights import canonicalize, check_weights, expected_weight_shapes, to_hf_names

# V4-Flash's hub config.json, trimmed to the keys that matter
FLASH_HUB = dict(
    model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
    head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], num_hash_layers=3, n_routed_experts=256,
    num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2048, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, swiglu_limit=10.0, rope_theta=10000, compress_rope_theta=160000,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                  "beta_slow": 1},
    index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    rms_norm_eps=1e-6, num_nextn_predict_layers=1, expert_dtype="fp4", torch_dtype="bfloat16",
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
)

# the official reference inference/config.json spelling (ModelArgs field names)
OFFICIAL_ARGS = dict(
    vocab_size=512, dim=64, moe_inter_dim=32, n_layers=3, n_hash_layers=1, n_mtp_layers=1, n_heads=4,
    n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, score_func="sqrtsoftplus", route_scale=1.5,
    swiglu_limit=10.0, q_lora_rank=32, head_dim=32, rope_head_dim=8, norm_eps=1e-6, o_groups=2, o_lora_rank=16,
    window_size=8, compress_ratios=[0, 4, 16, 0], compress_rope_theta=160000.0, original_seq_len=32,
    rope_theta=10000.0, rope_factor=16, beta_fast=32, beta_slow=1, index_n_heads=16, index_head_dim=16,
    index_topk=4, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, dtype="fp8", scale_fmt="ue8m0",
)


def test_hub_config_gives_the_flash_schedule():
    c = DeepseekV4Config.from_dict(FLASH_HUB)
    assert c.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and c.layer_types[-1] == CSA
    assert c.layer_types.count(CSA) == 21 and c.layer_types.count(HCA) == 20
    assert c.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 40
    assert (c.csa_compress_rate, c.hca_compress_rate, c.qk_rope_head_dim) == (4, 128, 64)
    assert c.rope_scaling.factor == 16 and c.rope_scaling.original_max_position_embeddings == 65536
    assert c.expert_dtype == "fp4" and c.compress_ratios[-1] == 0


def test_official_inference_config():
    c = DeepseekV4Config.from_dict(OFFICIAL_ARGS)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.moe_intermediate_size) == (64, 3, 4, 32)
    assert c.layer_types == (SLIDING, CSA, HCA) and c.hca_compress_rate == 16
    assert c.mlp_layer_types == ("hash_moe", "moe", "moe") and c.num_experts_per_tok == 2
    assert c.sliding_window == 8 and c.qk_rope_head_dim == 8
    assert c.rope_scaling.original_max_position_embeddings == 32 and c.rope_scaling.factor == 16


def test_transformers_round_trip():
    from transformers import DeepseekV4Config as HFConfig
    ours = DeepseekV4Config.from_dict(OFFICIAL_ARGS)
    hf = HFConfig(**ours.to_hf_dict())
    assert hf.layer_types == list(ours.layer_types) and hf.qk_rope_head_dim == 8
    assert hf.rope_parameters["compress"]["rope_type"] == "yarn"
    assert DeepseekV4Config.from_dict(hf.to_dict()) == ours


def test_yarn_frequencies_match_transformers():
    from transformers import DeepseekV4Config as HFConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding
    from deepinfer.models.deepseek_v4.rope import RotaryTables
    ours = DeepseekV4Config.from_dict(FLASH_HUB)
    hf_rope = DeepseekV4RotaryEmbedding(HFConfig(**ours.to_hf_dict()))
    tables = RotaryTables(ours, torch.device("cpu"))
    for kind in ("main", "compress"):
        torch.testing.assert_close(tables.inv_freq[kind], getattr(hf_rope, f"{kind}_inv_freq"), rtol=1e-6, atol=0)


def test_cos_sin_of_host_positions_equal_those_of_a_tensor():
    """A decode step's host positions give the tables a position tensor gives, bit for bit (up to and past
    2^24, where fp32 rounds the position)."""
    from deepinfer.models.deepseek_v4.rope import RotaryTables
    tables = RotaryTables(DeepseekV4Config.from_dict(FLASH_HUB), torch.device("cpu"))
    for positions in ([0], [5, 130, 4095, 65535], [2 ** 24 + 1, 2 ** 25 + 3, 123456789]):
        want, got = tables.cos_sin_all(torch.tensor(positions)), tables.cos_sin_all(positions)
        for kind in ("main", "compress"):
            for w, g in zip(want[kind], got[kind]):
                assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


@pytest.mark.parametrize("bad, words", [
    (dict(model_type="deepseek_v41"), ["deepseek_v4"]),
    (dict(layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2), ["full_attention", CSA]),
    (dict(num_hidden_layers=2, layer_types=[SLIDING]), ["num_hidden_layers"]),
    (dict(scoring_func="relu"), ["sqrtsoftplus"]),
    (dict(rope_scaling={"type": "linear", "factor": 2}), ["yarn"]),
    (dict(dim=64, hidden_size=128), ["disagree"]),
])
def test_bad_values_name_the_choices(bad, words):
    with pytest.raises(ValueError) as e:
        DeepseekV4Config.from_dict(bad)
    for w in words:
        assert w in str(e.value)


def test_weight_names_round_trip_through_transformers():
    from model_harness import build_hf_model, our_config
    hf = build_hf_model(0, num_hidden_layers=3, layer_types=[SLIDING, CSA, HCA],
                        mlp_layer_types=["hash_moe", "moe", "moe"])
    cfg = our_config(hf)
    canonical = canonicalize(hf.state_dict())
    check_weights(canonical, cfg, include_mtp=False)
    assert {k: tuple(v.shape) for k, v in canonical.items()} == expected_weight_shapes(cfg, include_mtp=False)
    back = to_hf_names(canonical)
    hf.load_state_dict(back, strict=True)  # fused experts, HF-internal names
    assert canonicalize(back).keys() == canonical.keys()
    with pytest.raises(ValueError, match="missing: layers.0.attn.wq_a.weight"):
        check_weights({k: v for k, v in canonical.items() if k != "layers.0.attn.wq_a.weight"}, cfg,
                      include_mtp=False)
