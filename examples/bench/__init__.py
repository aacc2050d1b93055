"""Helpers of `examples/benchmark.py`, `examples/sweep/` and `examples/compare_transformers.py`.

Importable as `bench` once `examples/` is on `sys.path` (the scripts put it there themselves):

- `layout`: parallel scale (`WORLD_SIZE` x devices per node) and the `--cp` check;
- `accounting`: the printed figures (prefill tokens/s/device, decode avg_SPS, full-acceptance and
  accepted-token throughput);
- `model_cost`: active-weight bytes per decode token and FLOPs per prefill token from a parsed config,
  counted by the family's module (`cost_v4`: DeepSeek-V4, `cost_v41`: DeepSeek-V4.1);
- `roofline`: measured memory bandwidth and bf16 matmul throughput, and the bounds they imply;
- `workloads`: prompts and the timed prefill / decode phases run through the engine;
- `progress`: the plan, the time estimates and the progress bars `benchmark.py` shows while it runs;
- `results`: one JSON object per run (`--result_jsonl`).
"""
