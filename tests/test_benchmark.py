"""The benchmark tools (examples/benchmark.py, deepinfer.benchmarks, examples/sweep/): formulas, argument
checks, cost counting, plotting, and one tiny end-to-end run. Nothing here asserts a timing."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from deepinfer.benchmarks import accounting, cost_v41, model_cost, progress, results, roofline
from deepinfer.benchmarks.layout import devices_per_node, resolve_layout, validate_cp
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from example_modules import EXAMPLES, load_example

benchmark = load_example("benchmark.py")
plot_pareto = load_example("sweep/plot_pareto.py")


# --- accounting ----------------------------------------------------------------------------------

def test_full_acceptance_accounting_matches_the_seeds_formula():
    # avg_SPS x decode_num_requests x (1 + nextn) / cp
    assert accounting.full_acceptance_throughput(10.0, 64, 5, 8) == pytest.approx(10 * 64 * 6 / 8)
    assert accounting.full_acceptance_throughput(2.5, 1, 0, 1) == pytest.approx(2.5)


def test_accepted_throughput_equals_full_acceptance_without_speculation():
    steps, seconds, requests, devices = 40, 4.0, 16, 1
    sps = accounting.decode_avg_sps(steps, seconds)
    accepted = steps * requests  # one token per sequence per step
    assert accounting.accepted_throughput(accepted, seconds, devices) == pytest.approx(
        accounting.full_acceptance_throughput(sps, requests, 0, 1))
    assert accounting.acceptance_length(accepted, steps * requests) == 1.0
    assert accounting.per_user_speed(accepted, seconds, requests) == pytest.approx(10.0)


def test_full_acceptance_overstates_rejected_drafts():
    # 10 steps, 4 sequences, nextn 3, but only 2 tokens per sequence per step accepted
    sps = accounting.decode_avg_sps(10, 1.0)
    assert accounting.full_acceptance_throughput(sps, 4, 3, 1) == 160
    assert accounting.accepted_throughput(10 * 4 * 2, 1.0, 1) == 80


def test_assumed_acceptance_accounting():
    # 3 drafts verified per step, 0.75 of them accepted: 1 + 2.25 tokens per sequence per step
    assert accounting.tokens_per_step(3.0, 0.75) == 3.25
    assert accounting.assumed_acceptance_throughput(10.0, 8, 3.0, 0.75, 2) == pytest.approx(10 * 8 * 3.25 / 2)
    # every draft verified and accepted: the seeds' full-acceptance accounting
    assert accounting.assumed_acceptance_throughput(10.0, 64, 5, 1.0, 8) == pytest.approx(
        accounting.full_acceptance_throughput(10.0, 64, 5, 8))
    assert accounting.tokens_per_step(0.0, 0.75) == 1.0  # no speculation: the measured figure
    with pytest.raises(ValueError, match="between 0 and 1"):
        accounting.tokens_per_step(3.0, 1.5)


def test_prefill_throughput_is_per_device():
    assert accounting.prefill_throughput(8192, 2.0, 4) == 1024


@pytest.mark.parametrize("call", [
    lambda: accounting.prefill_throughput(10, 0.0, 1),
    lambda: accounting.decode_avg_sps(10, -1.0),
    lambda: accounting.full_acceptance_throughput(1.0, 1, -1, 1),
    lambda: accounting.accepted_throughput(10, 1.0, 0),
])
def test_accounting_rejects_impossible_inputs(call):
    with pytest.raises(ValueError):
        call()


# --- parallel layout and argument checks ---------------------------------------------------------

def test_parallel_scale_is_world_size_times_visible_devices():
    env = {"WORLD_SIZE": "2", "RANK": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    layout = resolve_layout(4, "nvidia", env)
    assert (layout.scale, layout.cp, layout.dp, layout.ep, layout.rank) == (8, 4, 2, 8, 1)


def test_cpu_counts_one_device_per_node():
    assert devices_per_node("cpu", {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 1
    assert resolve_layout(1, "cpu", {}).scale == 1
    assert resolve_layout(2, "cpu", {"WORLD_SIZE": "2"}).dp == 1


def test_cp_must_divide_the_parallel_scale():
    with pytest.raises(ValueError, match=r"--cp 3 must divide the parallel scale 8 .*choose --cp from \[1, 2, 4, 8\]"):
        resolve_layout(3, "nvidia", {"WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    with pytest.raises(ValueError, match="must divide the parallel scale 1"):
        validate_cp(2, 1)
    with pytest.raises(ValueError, match=">= 1"):
        validate_cp(0, 4)


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 must be smaller than WORLD_SIZE=2"),
])
def test_bad_launch_variables_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        resolve_layout(1, "cpu", env)


def test_accelerator_without_visible_devices_is_an_error():
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES is unset"):
        devices_per_node("nvidia", {})


def test_benchmark_cli_rejects_cp_on_one_cpu(capsys, clean_env):
    assert benchmark.main(["--cp", "2", "--phase", "none"]) == 2
    assert "--cp 2 must divide the parallel scale 1" in capsys.readouterr().err


def test_preset_fills_only_flags_that_were_not_given():
    args = benchmark.build_parser().parse_args(["--preset", "cpu", "--context_length", "128"])
    s = benchmark.resolve_settings(args)
    assert s.context_length == 128
    assert s.decode_num_requests == benchmark.PRESETS["cpu"]["decode_num_requests"]
    seeds = benchmark.resolve_settings(benchmark.build_parser().parse_args([]))
    assert (seeds.decode_num_requests, seeds.context_length, seeds.non_cached_tokens, seeds.prefill_batch_size) \
        == (64, 32768, 4096, 32768)
    with pytest.raises(ValueError, match="--decode_num_requests 0 must be >= 1"):
        benchmark.resolve_settings(benchmark.build_parser().parse_args(["--decode_num_requests", "0"]))


# --- telling the user what runs: the plan, estimates, progress bars ------------------------------

def test_the_plan_of_the_seeds_defaults_on_a_cpu_names_the_work_and_how_to_shrink_it():
    settings = benchmark.resolve_settings(benchmark.build_parser().parse_args([]))
    work = benchmark.planned_work(settings)
    assert (work.prefill_prompts, work.prefill_tokens, work.decode_prompt_tokens) == (16, 65536, 2097152)
    text = progress.plan_text(work, "both", 1, settings.prefill_batch_size, "seeds", "cpu", 1, warmup=True)
    assert "16 prompts x 4,096 tokens = 65,536 tokens, 32,768 per step" in text
    assert "64 sequences, first prefilled to 32,768 tokens each (2,097,152 prompt tokens), then 64 steps" in text
    assert "--preset cpu" in text and "--decode_num_requests" in text and "--phase prefill|decode" in text
    on_gpu = progress.plan_text(work, "decode", 3, settings.prefill_batch_size, "seeds", "nvidia", 8, warmup=False)
    assert "--preset cpu" not in on_gpu and "prefill:" not in on_gpu and "x 3" in on_gpu


def test_estimates_count_every_prompt_token_and_decode_step():
    work = progress.Work(prefill_prompts=2, prompt_len=100, decode_sequences=4, context_len=50, decode_steps=10)
    speed = progress.Speed(prefill_tokens_per_s=100.0, decode_step_s=0.5, measured_on="a test")
    # (200 + 4 x 50) tokens / 100 per s + 10 steps x 0.5 s, twice
    assert progress.estimate_seconds(work, "both", 2, speed) == pytest.approx(2 * (4.0 + 5.0))
    assert progress.estimate_seconds(work, "prefill", 1, speed, extra_prefill_tokens=300) == pytest.approx(5.0)
    assert progress.estimate_seconds(work, "decode", 1, progress.Speed(100.0, None, "x")) is None
    assert "at least 2.5 h" in progress.estimate_text(9000.0, speed, "it takes")


def test_progress_bars_follow_prefilled_tokens_then_decode_steps():
    import io
    from types import SimpleNamespace as NS

    out = io.StringIO()
    bars = progress.PhaseProgress("decode phase", decode_steps=4, stream=out, enabled=True)
    requests = [NS(num_prompt_tokens=30, num_computed_tokens=20), NS(num_prompt_tokens=30, num_computed_tokens=0)]
    bars.update(requests, NS(all_started=[False], advances=[0]))
    assert bars._prefill.n == 20 and bars._decode is None
    requests[1].num_computed_tokens = 30
    requests[0].num_computed_tokens = 31  # prompt plus a decoded token: counted up to the prompt
    bars.update(requests, NS(all_started=[False, True], advances=[1, 2]))
    bars.update(requests, NS(all_started=[False, True, True], advances=[1, 2, 8]))  # 3 steps each
    assert bars._prefill.n == 60 and bars._decode.n == 3
    bars.close()
    text = out.getvalue()
    assert "decode phase: prefill: 100%" in text and "60.0/60.0" in text and "decode phase: decode:  75%" in text
    quiet = progress.PhaseProgress("x", stream=io.StringIO())  # not a terminal: no bars
    quiet.update(requests, NS(all_started=[True], advances=[0]))
    assert quiet._prefill is None


# --- model cost: a small config counted by hand --------------------------------------------------

def _small_config() -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=100, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, head_dim=8, qk_rope_head_dim=4,
        q_lora_rank=6, o_groups=2, o_lora_rank=5, sliding_window=4, layer_types=(SLIDING, CSA, HCA),
        csa_compress_rate=4, hca_compress_rate=8, index_n_heads=2, index_head_dim=4, index_topk=2,
        mlp_layer_types=("hash_moe", "moe", "moe"), n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=3, hc_mult=2)


def test_active_parameters_of_a_small_config_counted_by_hand():
    # D=16, n=2 streams (nD=32, mix=(2+n)n=8), H=2, d=8, q_lora=6, g=2, o_lora=5, E=4, k=2, I=3
    mhc = 2 * (8 * 32 + 8 + 3)  # hc_attn and hc_ffn: fn, base, scale
    norms = 16 + 16  # attn_norm, ffn_norm
    attention = 2 + 6 * 16 + 6 + 16 * 6 + 8 * 16 + 8 + 10 * 8 + 16 * 10  # sink, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b
    router = 4 * 16
    shared = 3 * 3 * 16
    routed = 2 * 3 * 3 * 16  # top-2 experts
    common = mhc + norms + attention + router + shared + routed
    csa = (4 * 16 + 2 * 16 * 16 + 8) + (8 * 6 + 2 * 16 + 4 * 8 + 2 * 8 * 16 + 4)  # compressor; indexer
    hca = 8 * 8 + 2 * 8 * 16 + 8  # compressor (no overlap: width d)
    bias = 4  # learned-routing layers only
    head = 100 * 16 + 16 + 2 * 32 + 2 + 1  # head, final norm, hc_head fn/base/scale
    total = 3 * common + csa + hca + 2 * bias + head + 16  # + one embedding row
    assert total == 7905

    cost = model_cost.token_cost(_small_config(), float_bytes=4)
    assert cost.active_params == total
    assert cost.active_bytes == 4 * total  # fp32 model: every tensor 4 bytes
    assert cost.params_by_group["routed_experts"] == 3 * routed
    assert cost.params_by_group["embedding_row"] == 16
    # matrices multiplied per token (2 FLOPs each); position biases and vectors are not matrices
    per_layer = 2 * 8 * 32 + (6 * 16 + 16 * 6 + 8 * 16 + 10 * 8 + 16 * 10) + 4 * 16 + 3 * 3 * 16 + routed
    assert cost.matmul_params == 3 * per_layer + (2 * 16 * 16 + 8 * 6 + 2 * 16 + 2 * 8 * 16) + 2 * 8 * 16
    assert cost.head_matmul_params == 100 * 16 + 2 * 32


def test_bf16_bytes_keep_fp32_tensors_at_four_bytes():
    cost = model_cost.token_cost(_small_config(), float_bytes=2)
    assert cost.bytes_by_group["mhc"] == 4 * 3 * 2 * (8 * 32 + 8 + 3)
    assert cost.bytes_by_group["routed_experts"] == 2 * 3 * 2 * 3 * 3 * 16


def test_cache_bytes_and_attention_flops_counted_by_hand():
    cfg = _small_config()
    # context 16, window 4, d=8: sliding 4*8; CSA 4*8 + min(2, 4 entries)*8 + 4 indexer keys*4; HCA 4*8 + 2*8
    assert model_cost.cache_bytes_per_token(cfg, 16, float_bytes=2) == 2 * (32 + (32 + 16 + 16) + (32 + 16))
    # query at position 15: 4*H*d = 64 FLOPs per key; indexer 2*Hi*(di+1) = 20 per scored entry
    assert model_cost.attention_flops(cfg, 15) == 64 * 4 + (64 * 6 + 20 * 4) + 64 * 6
    # one-token prompt: trunk matmuls + head + 3 layers x 1 key
    cost = model_cost.token_cost(cfg)
    assert model_cost.prefill_flops_per_token(cfg, 1) == 2 * cost.matmul_params + 2 * cost.head_matmul_params + 3 * 64


def test_decode_step_bytes_share_weights_across_the_batch():
    cfg = _small_config()
    assert model_cost.expected_distinct_experts(4, 2, 1) == pytest.approx(2.0)
    assert model_cost.expected_distinct_experts(4, 2, 2) == pytest.approx(3.0)
    one = model_cost.decode_step_bytes(cfg, 1, 16, float_bytes=4)
    assert one == pytest.approx(7905 * 4 + 576)  # batch 1: active weights + its cache (model dtype, 4 bytes)
    two = model_cost.decode_step_bytes(cfg, 2, 16, float_bytes=4)
    expert = 3 * 3 * 16 * 4
    assert two - one == pytest.approx(1 * expert * 3 + 16 * 4 + 576)  # one more expert per layer + one sequence


def test_real_v4_flash_config_has_13b_active_parameters():
    cost = model_cost.token_cost(DeepseekV4Config.from_dict({}))
    assert 12.5e9 < cost.active_params < 14e9  # V4-Flash: 13 B active per token


def test_roofline_bounds_from_a_given_machine():
    machine = roofline.Machine(10.0, [10.0], 100.0, [100.0], 1, 1, (1, 1, 1))
    cfg = _small_config()
    cost = roofline.workload_cost(cfg, prefill_len=1, decode_batch=1, decode_context=16, float_bytes=4)
    sps, bound_by = roofline.decode_bound(cost, machine)
    assert bound_by == "memory"
    assert sps == pytest.approx(10e9 / (7905 * 4 + 576))
    tps = roofline.prefill_bound(cost, machine)
    assert tps == pytest.approx(100e9 / model_cost.prefill_flops_per_token(cfg, 1))
    text = roofline.report(cost, [machine], prefill=[(tps / 2, machine)], decode=[(sps / 4, machine)])
    assert "50.0 % of the matmul bound" in text and "25.0 % of the memory bound" in text


# --- model cost of DeepSeek-V4.1: a small config counted by hand ---------------------------------

def _small_v41_config() -> DeepseekV41Config:
    # roles: 0 sliding, 1 Full r=2 (Engram before it), 2 Reuse r=2, 3 Full r=1 (candidate source),
    # 4 Reindex inside the candidate pool, 5 Reuse of 4's top-k
    return DeepseekV41Config(
        vocab_size=100, hidden_size=16, num_hidden_layers=6, num_attention_heads=2, head_dim=32, qk_rope_head_dim=8,
        q_lora_rank=6, o_groups=2, o_lora_rank=5, sliding_window=4, compress_ratios=(0, 2, 2, 1, 1, 1),
        kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 4), candidate_source_layer_id=3,
        candidate_block_size=2, candidate_topk_blocks=2, index_n_heads=2, index_head_dim=32, index_topk=2,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=3, hc_mult=2,
        engram_layer_ids=(1,), engram_num_embeddings=(1000,), engram_max_ngram_size=3, engram_n_heads=2,
        engram_head_dim=32, num_nextn_predict_layers=0, dspark_target_layer_ids=(), image_token_id=None)


def test_v41_active_parameters_of_a_small_config_counted_by_hand():
    # D=16, n=2 streams (nD=32, mix=8), H=2, d=32, q_lora=6, g=2, o_lora=5, Hi=2, di=32, E=4, k=2, I=3
    attention = 16 + 96 + 6 + 384 + 512 + 32 + 320 + 160 + 2  # attn_norm wq_a q_norm wq_b wkv kv_norm wo_a wo_b sink
    mhc = 2 * (8 * 32 + 8 + 3)  # hc_attn and hc_ffn: fn, base, scale (single-pass: no hc_head)
    router = 4 * 16 + 4  # gate weight and bias (bias_vl: image tokens only)
    shared = 3 * 3 * 16 + 16  # w1 w2 w3 + ffn_norm
    routed = 2 * 3 * 3 * 16  # top-2 experts
    common = attention + mhc + router + shared + routed
    full_r2 = 512 + 512 + 32 + 1024 + 32 + 384 + 32  # compressor wkv wgate norm, indexer wk k_norm wq_b weights_proj
    full_r1 = 512 + 32 + 1024 + 32 + 384 + 32  # ratio 1: no wgate
    reindex = 384 + 32  # indexer query side only; Reuse and sliding layers own none
    engram = 48 * 128 + 32 + 32  # wkv [D(n+1), 4 hash heads x 32], q_weight, k_weight
    engram_rows = 4 * 32  # (3 - 1) x 2 hash heads gather one 32-wide row each
    head = 100 * 16 + 16  # head + final norm
    total = 6 * common + full_r2 + full_r1 + reindex + engram + head + 16 + engram_rows  # + one embedding row
    assert total == 28396

    cost = model_cost.token_cost(_small_v41_config(), float_bytes=2)
    assert cost.active_params == total
    assert cost.params_by_group["compressor_indexer"] == full_r2 + full_r1 + reindex
    assert cost.params_by_group["engram"] == engram and cost.params_by_group["engram_rows"] == engram_rows
    # bytes at bf16: fp32 for mHC, sinks, router weight + bias and the compressor's wkv / wgate
    assert cost.bytes_by_group["mhc"] == 4 * 6 * mhc
    assert cost.bytes_by_group["router"] == 4 * 6 * router
    assert cost.bytes_by_group["attention"] == 6 * (2 * (attention - 2) + 4 * 2)
    assert cost.bytes_by_group["compressor_indexer"] == 4 * (512 + 512 + 512) + 2 * (2 * (32 + 1024 + 32 + 384 + 32)
                                                                                      + reindex)
    assert cost.bytes_by_group["engram_rows"] == 4 * (32 + 1)  # FP8 codes + one ue8m0 scale per 32, a byte each
    assert cost.sequence_bytes == 4 * 33 + 2 * 16  # Engram rows + embedding row: read by every sequence
    # matrices per token: indexer.wk of the ratio-2 KV source runs once per 2 tokens; the Engram
    # gate's q_weight / k_weight are element-wise
    per_layer = 2 * 8 * 32 + (96 + 384 + 512 + 320 + 160) + 4 * 16 + 3 * 3 * 16 + routed
    compressed = (512 + 512 + 1024 / 2 + 384 + 32) + (512 + 1024 + 384 + 32) + 416
    assert cost.matmul_params == 6 * per_layer + compressed + 48 * 128
    assert cost.head_matmul_params == 100 * 16


def test_v41_cache_reads_and_attention_flops_counted_by_hand():
    cfg = _small_v41_config()
    # context 12, window 4; FP8 window key 32 + 1 bytes, NVFP4 entry 16 + 2, MXFP4 index key 16 + 1.
    # Ratio 2: 6 entries, ratio 1: 12; layer 4 scores only the candidate pool of 2 blocks of 2,
    # the newest kept: 2 + 2 = 4 entries. Top-2 everywhere.
    window = 4 * 33
    reads = [window, window + 2 * 18 + 6 * 17, window + 2 * 18, window + 2 * 18 + 12 * 17,
             window + 2 * 18 + 4 * 17, window + 2 * 18]
    assert model_cost.cache_bytes_per_token(cfg, 12) == sum(reads) == 1346
    # 13 ratio-1 entries: 7 blocks, the newest holding one entry -> layer 4 scores 2 + 1; the
    # candidate source itself scores all 13
    assert [cost_v41.scored_entries(cfg, layer, 13) for layer in (3, 4)] == [13, 3]
    assert model_cost.cache_bytes_per_token(cfg, 13) == sum(reads) + 17 - 17  # layer 3 reads one more key, 4 one less
    # stored per token of context: the ratio-2 source (18 + 17) / 2, the ratio-1 source 18 + 17
    assert model_cost.context_bytes_per_token(cfg) == 35 / 2 + 35
    # query at position 11: 4*H*d = 256 FLOPs per key (window + selected), 2*Hi*(di+1) = 132 per scored entry
    assert model_cost.attention_flops(cfg, 11) == (256 * 4 + (256 * 6 + 132 * 6) + 256 * 6 + (256 * 6 + 132 * 12)
                                                    + (256 * 6 + 132 * 4) + 256 * 6)
    # position 0: one window key per layer, no complete ratio-2 entry yet, one ratio-1 entry
    assert model_cost.attention_flops(cfg, 0) == 6 * 256 + 3 * 256 + 2 * 132


def test_v41_decode_step_bytes_read_engram_rows_per_sequence():
    cfg = _small_v41_config()
    cost = model_cost.token_cost(cfg, float_bytes=2)
    one = model_cost.decode_step_bytes(cfg, 1, 12, float_bytes=2)
    assert one == pytest.approx(cost.active_bytes + 1346)
    two = model_cost.decode_step_bytes(cfg, 2, 12, float_bytes=2)
    expert = 3 * 3 * 16 * 2
    assert two - one == pytest.approx(1 * expert * 6 + (4 * 33 + 2 * 16) + 1346)


def test_real_v41_flash_config_active_parameters_and_cache():
    cfg = DeepseekV41Config()
    cost = model_cost.token_cost(cfg)
    assert 15.5e9 < cost.active_params < 16.5e9  # V4.1-Flash: about 16 B active per decode token
    assert cost.bytes_by_group["engram_rows"] == 2 * 24 * 264  # 24 rows of 264 B per Engram layer
    assert model_cost.context_bytes_per_token(cfg) == 890  # the release's 890 B per token of context


def test_cost_model_refuses_a_family_it_does_not_count():
    with pytest.raises(ValueError, match=r"does not know dict configs; it counts deepseek_v4 .*deepseek_v41"):
        model_cost.token_cost({"hidden_size": 16})


def test_measured_machine_figures_are_positive():
    m = roofline.measure_machine(trials=1, copy_mib=8, shape=(16, 64, 64))
    assert m.bandwidth_gbs > 0 and m.matmul_gflops > 0


# --- results and plots ---------------------------------------------------------------------------

def _record(mode: str, value: int, speed: float) -> dict:
    rec = {"schema": results.SCHEMA, "tag": "t", "nextn": 0,
           "settings": {"decode_num_requests": value, "prefill_batch_size": value, "context_length": 64,
                        "non_cached_tokens": 64},
           "layout": {"scale": 1, "cp": 1, "accelerator": "cpu"}, "model": {"name": "tiny", "dtype": "float32"},
           "prefill": [], "decode": []}
    if mode == "decode":
        rec["decode"] = [{"requests": value, "steps": 10, "sequence_steps": 10 * value, "seconds": 10 / speed,
                          "accepted_tokens": 10 * value, "speculation": None}]
    else:
        rec["prefill"] = [{"requests": 1, "prompt_len": 64, "tokens": value * 4, "seconds": value * 4 / speed,
                           "batches": 4, "mean_ttft_s": 0.1}]
    return rec


def test_pareto_front():
    pts = [(1, 10, "a"), (2, 9, "b"), (1.5, 5, "dominated"), (3, 3, "c")]
    assert [p[2] for p in plot_pareto.pareto_front(pts, higher_x_better=True)] == ["a", "b", "c"]
    # lower x (latency) is better: (1, 10) beats everything with x >= 1 and y <= 10
    assert [p[2] for p in plot_pareto.pareto_front(pts, higher_x_better=False)] == ["a"]


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_sweep_plot_from_a_small_jsonl(tmp_path, mode):
    path = tmp_path / "results.jsonl"
    for value, speed in [(1, 20.0), (4, 15.0), (16, 8.0)]:
        results.append_jsonl(path, _record(mode, value, speed))
    out = tmp_path / f"{mode}_pareto.png"
    assert plot_pareto.main([mode, str(path), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_plot_at_an_assumed_acceptance(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    for value, speed in [(1, 20.0), (4, 15.0)]:
        rec = _record("decode", value, speed)
        rec["settings"]["accept_rate"] = 0.5
        rec["decode"][0]["speculation"] = {"num_verifications": 10 * value, "num_drafts_verified": 40 * value,
                                           "num_drafts_accepted": 0, "num_tokens_emitted": 10 * value}
        results.append_jsonl(path, rec)
    records = results.read_jsonl(path)
    # 4 drafts verified per step, half assumed accepted: 3 tokens per step instead of the measured 1
    assert [p[:2] for p in plot_pareto.points(records, "decode")] == [
        (pytest.approx(60.0), pytest.approx(60.0)), (pytest.approx(45.0), pytest.approx(180.0))]
    assert plot_pareto.main(["decode", str(path), str(tmp_path / "d.png")]) == 0
    results.append_jsonl(path, _record("decode", 16, 8.0))  # a run without --accept_rate
    assert plot_pareto.main(["decode", str(path), str(tmp_path / "d.png")]) == 2
    assert "different --accept_rate values" in capsys.readouterr().err


def test_plot_reports_bad_input(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text("not json\n")
    assert plot_pareto.main(["decode", str(path), str(tmp_path / "x.png")]) == 2
    assert "r.jsonl:1 is not valid JSON" in capsys.readouterr().err
    results.append_jsonl(tmp_path / "p.jsonl", _record("prefill", 4, 1.0))
    assert plot_pareto.main(["decode", str(tmp_path / "p.jsonl"), str(tmp_path / "x.png")]) == 2
    assert "no record measured the decode phase" in capsys.readouterr().err


def test_run_sweep_checks_its_arguments():
    script = EXAMPLES / "sweep" / "run_sweep.sh"
    bad_mode = subprocess.run(["bash", str(script), "train", "t", "64"], capture_output=True, text=True)
    assert bad_mode.returncode == 2 and "mode must be decode or prefill" in bad_mode.stderr
    bad_ctx = subprocess.run(["bash", str(script), "decode", "t", "lots"], capture_output=True, text=True)
    assert bad_ctx.returncode == 2 and "CONTEXT must be a token count" in bad_ctx.stderr
    for args, message in [(["decode", "t", "64", "1,2,4"], "a list of batch sizes goes in --points 1,2,4"),
                          (["decode", "t", "64", "3", "1.5"], "ACCEPT must be a share between 0 and 1, got '1.5'"),
                          (["decode", "t", "64", "3", "0.75", "9"], "unexpected argument '9'"),
                          (["prefill", "t", "64", "512,1024"], "a list of points goes in --points"),
                          (["prefill", "t", "64", "--points", "1,x"], "--points must be comma-separated")]:
        out = subprocess.run(["bash", str(script), *args], capture_output=True, text=True)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


# --- end to end on the tiny model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tiny_v4):
    return tiny_v4


TINY_ARGS = ["--decode_num_requests", "3", "--context_length", "20", "--non_cached_tokens", "24",
             "--prefill_batch_size", "48", "--decode_tokens", "5", "--prefill_batches", "2"]


@pytest.mark.slow
def test_the_seeds_decode_sweep_with_draft_length_and_acceptance(tiny_model, tmp_path):
    """`run_sweep.sh decode TAG CONTEXT 3 0.75` (the seeds' command, at tiny sizes): every run drafts 3
    tokens (DEEPINFER_USE_NEXTN_DECODE=3) and the chart is the throughput at 0.75 of the verified
    drafts accepted: avg_SPS x requests x (1 + 0.75 x 3) / cp, 3.25 tokens per step."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env.update(PYTHON=sys.executable, SWEEP_DIR=str(tmp_path), OMP_NUM_THREADS="1", DEEPINFER_ACCELERATOR="cpu")
    out = subprocess.run(["bash", str(EXAMPLES / "sweep" / "run_sweep.sh"), "decode", "tiny-decode", "20", "3", "0.75",
                          "--points", "1,2", "--model_name", str(tiny_model), "--prefill_batch_size", "48",
                          "--decode_tokens", "4", "--no_warmup"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decode, 1 requests at context 20, nextn 3, accept_rate 0.75" in out.stdout
    assert "decode throughput at accept_rate 0.75 (avg_SPS x 2 x (1 + 0.75 x 3.00 verified drafts per step)" \
        in out.stdout
    records = results.read_jsonl(tmp_path / "tiny-decode" / "results.jsonl")
    assert [r["settings"]["decode_num_requests"] for r in records] == [1, 2]
    for r in records:
        assert r["nextn"] == 3 and r["settings"]["accept_rate"] == 0.75 and r["settings"]["context_length"] == 20
        f = results.figures(r)
        assert f["decode_verified_drafts_per_step"]["median"] == 3.0  # fixed-length verification
        sps = f["decode_avg_sps"]["median"]
        assert f["decode_assumed_acceptance_tokens_per_s_per_device"]["median"] == pytest.approx(
            sps * r["settings"]["decode_num_requests"] * 3.25)
        assert f["decode_assumed_acceptance_per_user_tokens_per_s"]["median"] == pytest.approx(sps * 3.25)
    assert (tmp_path / "tiny-decode" / "decode_pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_benchmark_end_to_end_writes_a_valid_record(tiny_model, tmp_path, capsys, clean_env):
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")  # no speculation, whether or not it is installed
    out = tmp_path / "results.jsonl"
    argv = ["--model_name", str(tiny_model), *TINY_ARGS, "--repeats", "2", "--result_jsonl", str(out), "--tag", "e2e"]
    assert benchmark.main(argv) == 0
    captured = capsys.readouterr()
    printed = captured.out
    for label in ("prefill throughput:", "decode avg_SPS:", "full-acceptance accounting",
                  "accepted tokens (measured)"):
        assert label in printed
    # what runs and how long, on stderr before and after the warm-up
    assert "benchmark plan (seeds sizes, 1 device(s), cpu back end), per repeat x 2:" in captured.err
    assert "estimate: the warm-up and the timed phases take at least" in captured.err
    assert "estimate: the timed phases take at least" in captured.err
    [record] = results.read_jsonl(out)
    assert record["tag"] == "e2e" and record["nextn"] == 0 and record["layout"]["scale"] == 1
    assert len(record["prefill"]) == 2 and len(record["decode"]) == 2
    p = record["prefill"][0]
    assert (p["requests"], p["prompt_len"], p["tokens"], p["batches"]) == (4, 24, 96, 2)
    for d in record["decode"]:
        assert d["requests"] == 3 and d["context_len"] == 20 and d["steps"] >= 5
        # no speculation: every sequence emits one token in every step of the window
        assert d["sequence_steps"] == d["steps"] * d["requests"] == d["accepted_tokens"]
        assert d["speculation"] is None
    f = results.figures(record)
    assert f["decode_full_acceptance_tokens_per_s_per_device"]["median"] == pytest.approx(
        f["decode_accepted_tokens_per_s_per_device"]["median"])
    json.dumps(record)  # plain JSON all the way down


@pytest.mark.slow
def test_roofline_without_the_engine_on_a_v4_checkpoint(tiny_model, capsys, clean_env):
    argv = ["--model_name", str(tiny_model), *TINY_ARGS, "--phase", "none", "--roofline"]
    assert benchmark.main(argv) == 0
    assert "roofline (one device, deepseek_v4;" in capsys.readouterr().out


@pytest.mark.slow
def test_roofline_without_the_engine_on_a_v41_checkpoint(tiny_v41, tmp_path, capsys, clean_env):
    from deepinfer.models.deepseek_v41.checkpoint import parse_config
    from deepinfer.models.deepseek_v41.state import build_cache_layout, context_bytes_per_token

    out = tmp_path / "none.jsonl"
    argv = ["--model_name", str(tiny_v41), *TINY_ARGS, "--phase", "none", "--roofline", "--dtype", "float32",
            "--result_jsonl", str(out)]
    assert benchmark.main(argv) == 0
    printed = capsys.readouterr().out
    assert "roofline (one device, deepseek_v41;" in printed and "steps/s" in printed and "measured" not in printed
    [record] = results.read_jsonl(out)
    assert record["model"]["model_type"] == "deepseek_v41" and record["model"]["dtype"] == "float32"
    assert record["prefill"] == [] and record["decode"] == []
    cost = record["roofline"]["cost"]
    config = parse_config(json.loads((tiny_v41 / "config.json").read_text()))
    expected = roofline.workload_cost(config, prefill_len=24, decode_batch=3, decode_context=20, float_bytes=4)
    assert cost == expected.to_json()
    assert cost["model_type"] == "deepseek_v41" and "engram_rows" in cost["bytes_by_group"]
    assert cost["cache_bytes_per_context_token"] == context_bytes_per_token(build_cache_layout(config, 0))


@pytest.mark.slow
def test_benchmark_on_two_nodes_runs_its_layout(tiny_model, tmp_path):
    """WORLD_SIZE=2 on the CPU back end (two node processes on this host, gloo): scale 2, ep 2, dp 2;
    each node runs one rank, node 0 prints and records the figures of both DP ranks combined."""
    import os

    from node_helpers import run_nodes

    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(DEEPINFER_ACCELERATOR="cpu", DEEPINFER_USE_NEXTN_DECODE="0", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    out = tmp_path / "results.jsonl"
    argv = [sys.executable, str(EXAMPLES / "benchmark.py"), "--model_name", str(tiny_model), "--preset", "cpu",
            "--decode_num_requests", "2", "--context_length", "16", "--non_cached_tokens", "16",
            "--prefill_batch_size", "32", "--decode_tokens", "3", "--prefill_batches", "1", "--threads_per_rank", "1"]
    node0, node1 = run_nodes(argv + ["--result_jsonl", str(out)], env)
    assert node0.returncode == 0 and node1.returncode == 0, (node0.stderr[-3000:], node1.stderr[-3000:])
    assert "prefill throughput:" in node0.stdout and "decode avg_SPS:" in node0.stdout
    assert "prefill throughput" not in node1.stdout and "node 1 of 2: node 0 prints the figures" in node1.stderr
    [record] = results.read_jsonl(out)
    layout = record["layout"]
    assert (layout["world_size"], layout["scale"], layout["ep"], layout["dp"], layout["cp"]) == (2, 2, 2, 2, 1)
    ranks = record["ranks"]
    assert [(r["rank"], r["dp_rank"]) for r in ranks] == [(0, 0), (1, 1)]
    # each DP rank prefilled and decoded its own requests; the record sums them, seconds the slowest rank's
    [p], [d] = record["prefill"], record["decode"]
    assert p["tokens"] == sum(r["prefill"][0]["tokens"] for r in ranks) == 2 * 2 * 16
    assert p["seconds"] == max(r["prefill"][0]["seconds"] for r in ranks)
    assert d["requests"] == 2 * 2 and all(r["decode"][0]["requests"] == 2 for r in ranks)
    assert d["accepted_tokens"] == sum(r["decode"][0]["accepted_tokens"] for r in ranks)
    f = results.figures(record)
    assert f["prefill_tokens_per_s_per_device"]["median"] == pytest.approx(p["tokens"] / p["seconds"] / 2)
    # --cp 2 on two one-device nodes would put one CP group (dp 1) across both: refused before any rank starts
    refused = run_nodes(argv + ["--cp", "2"], env)
    assert all(n.returncode == 2 and "dp=1 must be divisible by the number of nodes WORLD_SIZE=2" in n.stderr
               for n in refused), [n.stderr[-2000:] for n in refused]


def test_combining_runs_of_data_parallel_ranks():
    a = {"requests": 2, "tokens": 32, "seconds": 1.0, "batches": 1, "mean_ttft_s": 0.2, "prompt_len": 16,
         "machine": None}
    b = dict(a, seconds=2.0, mean_ttft_s=0.4)
    assert results.combine_runs([a]) == a
    assert results.combine_runs([a, b]) == dict(a, requests=4, tokens=64, seconds=2.0, mean_ttft_s=pytest.approx(0.3))
    with pytest.raises(ValueError, match="different prompt_len"):
        results.combine_runs([a, dict(b, prompt_len=8)])


@pytest.mark.slow
def test_benchmark_roofline_on_a_timed_v41_run(tiny_v41, tmp_path, capsys, clean_env):
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    out = tmp_path / "v41.jsonl"
    argv = ["--model_name", str(tiny_v41), *TINY_ARGS, "--roofline", "--dtype", "float32", "--no_warmup",
            "--result_jsonl", str(out)]
    assert benchmark.main(argv) == 0
    printed = capsys.readouterr().out
    # the decode bound is the memory or the compute one, whichever the machine measured lower (a tiny model
    # on a slow emulated-AVX2 matmul can be compute-bound)
    assert "% of the matmul bound" in printed and re.search(r"% of the (memory|compute) bound", printed), printed
    [record] = results.read_jsonl(out)
    assert record["roofline"]["cost"]["model_type"] == "deepseek_v41" == record["model"]["model_type"]
    assert all(r["machine"] is not None for r in record["prefill"] + record["decode"])
    f = results.figures(record)
    assert 0 < f["prefill_fraction_of_matmul_bound"]["median"] and 0 < f["decode_fraction_of_bound"]["median"]


def _dspark_installed() -> bool:
    from deepinfer.plugins import FEATURE_GROUP, discover
    return "dspark" in discover(FEATURE_GROUP)


@pytest.mark.skipif(not _dspark_installed(), reason="speculative decoding (dspark) is not installed")
def test_benchmark_with_speculation_reports_both_throughputs(tiny_model, tmp_path, capsys, clean_env):
    # the self drafter (the target drafts for itself) accepts every greedy draft
    config = tmp_path / "spec.toml"
    config.write_text('[features.dspark]\ndrafter = "self"\nnum_draft_tokens = 2\n')
    clean_env.setenv("DEEPINFER_CONFIG", str(config))
    out = tmp_path / "spec.jsonl"
    argv = ["--model_name", str(tiny_model), *TINY_ARGS, "--phase", "decode", "--no_warmup", "--result_jsonl", str(out)]
    assert benchmark.main(argv) == 0
    printed = capsys.readouterr().out
    assert "speculation on, nextn 2" in printed
    [record] = results.read_jsonl(out)
    assert record["nextn"] == 2
    [d] = record["decode"]
    assert d["sequence_steps"] >= 5 * d["requests"]
    assert d["sequence_steps"] < d["accepted_tokens"] <= 3 * d["sequence_steps"]  # 1 + accepted drafts each
    assert d["speculation"]["num_drafts_verified"] > 0
    f = results.figures(record)
    assert f["decode_draft_accept_rate"]["median"] > 0.5
    assert f["decode_accepted_tokens_per_s_per_device"]["median"] <= \
        f["decode_full_acceptance_tokens_per_s_per_device"]["median"] * (1 + 1e-9)


@pytest.mark.skipif(not _dspark_installed(), reason="speculative decoding (dspark) is not installed")
def test_benchmark_leaves_speculation_off_for_a_model_that_cannot_draft(tiny_model, tiny_v41, clean_env):
    import os

    from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM

    v41 = tiny_v41
    assert benchmark._speculation_model_note(str(tiny_model)) is None  # V4 with MTP: the seeds' default stays
    assert "DEEPINFER_USE_NEXTN_DECODE" not in os.environ
    note = benchmark._speculation_model_note(str(v41))
    assert note.startswith("note: speculative decoding is off for this model")
    assert note.endswith(DeepseekV41ForCausalLM.drafter_unsupported)
    assert os.environ["DEEPINFER_USE_NEXTN_DECODE"] == "0" and benchmark.planned_nextn() == 0
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")  # the user's own value is kept
    assert benchmark._speculation_model_note(str(v41)) is None and benchmark.planned_nextn() == 3


def test_yoco_clip_without_the_feature_is_a_clear_error(capsys, clean_env):
    from deepinfer.plugins import FEATURE_GROUP, discover

    if "swa_replay" in discover(FEATURE_GROUP):
        pytest.skip("the swa_replay feature is installed")
    assert benchmark.main(["--yoco_clip", "--phase", "none"]) == 2
    assert "--yoco_clip needs SWA bounded replay" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_transformers_runs_alternately_on_the_tiny_model(tiny_model, capsys, clean_env):
    compare = load_example("compare_transformers.py")
    argv = ["--model_name", str(tiny_model), "--dtype", "float32", "--pairs", "2", "--num_prompts", "2",
            "--input_len", "8", "--output_len", "4"]
    assert compare.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("pair ") == 2 and "ratio deepinfer / transformers over 2 pairs: median" in out
    assert "greedy agreement" in out


def test_compare_transformers_rejects_empty_sizes(capsys):
    compare = load_example("compare_transformers.py")
    assert compare.main(["--output_len", "0"]) == 2
    assert "--output_len 0 must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_transformers_baseline_child_reports_failures_instead_of_hanging(tmp_path):
    from deepinfer.benchmarks.transformers_baseline import ChildProcessSide, TransformersSide

    with pytest.raises(RuntimeError, match="the child process failed"):
        ChildProcessSide(TransformersSide, str(tmp_path / "no-such-checkpoint"), "float32")


# --- --prompt_mode image ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_v41_vision(tmp_path_factory):
    from deepinfer.models.deepseek_v41.make_model import make_model

    out = tmp_path_factory.mktemp("bench") / "tiny-v41-vision"
    make_model(out, size="tiny", with_vision=True)
    return out


def test_image_prompts_are_refused_on_a_model_without_a_tower(tiny_model, tiny_v41, capsys, clean_env):
    for model in (tiny_model, tiny_v41):
        assert benchmark.main(["--model_name", str(model), *TINY_ARGS, "--prompt_mode", "image"]) == 2
        err = capsys.readouterr().err
        assert "--prompt_mode image needs a model with a vision tower" in err and str(model) in err, err
        assert "Traceback" not in err


def test_image_size_flag_is_checked(capsys):
    with pytest.raises(SystemExit):
        benchmark.build_parser().parse_args(["--image_size", "544"])
    assert "give WIDTHxHEIGHT" in capsys.readouterr().err
    assert benchmark.build_parser().parse_args(["--image_size", "800X600"]).image_size == (800, 600)


def test_image_prefill_reports_the_tower_and_the_text_model_apart(tiny_v41_vision, tmp_path, capsys, clean_env):
    """A tiny tower: image prompts through the engine (spans split by 48-token chunks), the tower run
    once per image inside the engine and alone on other images, the text model's share the rest."""
    pytest.importorskip("PIL")
    from deepinfer.benchmarks.model_cost import checkpoint_config
    from deepinfer.models.deepseek_v41.image_processing import plan_image

    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    out = tmp_path / "image.jsonl"
    argv = ["--model_name", str(tiny_v41_vision), *TINY_ARGS, "--non_cached_tokens", "80", "--prompt_mode", "image",
            "--image_size", "40x28", "--phase", "prefill", "--dtype", "float32", "--result_jsonl", str(out)]
    assert benchmark.main(argv) == 0
    printed = capsys.readouterr().out
    for label in ("image prefill throughput (tower in line):", "image tower alone:", "ms per image",
                  "span tokens/s", "text model prefill on image prompts (tower and admission taken out):"):
        assert label in printed, printed
    [record] = results.read_jsonl(out)
    assert record["settings"]["prompt_mode"] == "image" and record["settings"]["image_size"] == [40, 28]
    assert record["decode"] == []
    [p] = record["prefill"]
    vision = checkpoint_config(tiny_v41_vision)[0].vision
    span = plan_image(40, 28, vision).num_tokens
    assert p["span_tokens"] == span and p["prompt_len"] == max(80, span + 1)
    requests = -(-2 * 48 // 80)
    assert p["requests"] == requests and p["tokens"] == requests * p["prompt_len"]
    assert p["tower_runs"] == requests  # once per image, though the 48-token chunks split each span
    assert len(p["tower_alone_seconds"]) == min(requests, benchmark.IMAGES_TIMED_ALONE)
    assert 0 < p["tower_seconds"] < p["seconds"] and 0 < p["admission_seconds"] < p["seconds"]
    assert p["text_model_seconds"] == pytest.approx(p["seconds"] - p["admission_seconds"] - p["tower_seconds"])
    f = results.figures(record)
    assert f["image_text_model_prefill_tokens_per_s_per_device"]["median"] > f["prefill_tokens_per_s_per_device"]["median"]
    assert f["image_tower_tokens_per_s"]["median"] == pytest.approx(span / (f["image_tower_ms_per_image"]["median"] / 1000))


def test_image_prompts_hold_one_placeholder_each():
    pytest.importorskip("PIL")
    from deepinfer.benchmarks import workloads

    images = workloads.random_images(3, 10, 6, seed=1)
    assert len({im.tobytes() for im in images}) == 3 and images[0].size == (10, 6)
    prompts = workloads.image_prompts(images, 7, span_tokens=5, prompt_len=400, vocab_size=9, seed=0)
    for p, image in zip(prompts, images):
        ids = p["prompt_token_ids"]
        assert ids[0] == 7 and ids.count(7) == 1 and len(ids) == 1 + 395  # random ids in [3, 9) hit 7 often
        assert p["multi_modal_data"]["image"] is image
