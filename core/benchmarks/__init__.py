"""The reusable parts of deepinfer's benchmarks (`examples/benchmark.py`, the races in
`examples/compare_llamacpp.py` and `examples/compare_transformers.py`, `examples/sweep/`, and the
measuring scripts in `scripts/`); docs/performance.md describes the tools and their methods.

- `timing`: the one paired timing loop (sides in turn, the first side alternating every round) and
  per-round ratios;
- `ab`: `benchmark.py --ab` / `--ab_model`, one benchmark under two settings in fresh processes;
- `workloads`: prompts and the timed prefill / decode phases run through the engine;
- `accounting`: the printed figures (prefill tokens/s/device, decode avg_SPS, full-acceptance and
  accepted-token throughput);
- `results`: one JSON record per run (`--result_jsonl`) and the figures recomputed from it;
- `layout`: parallel scale (`WORLD_SIZE` x devices per node) and the `--cp` check;
- `progress`: the plan, the time estimates and the progress bars `benchmark.py` shows while it runs;
- `model_cost`: active-weight bytes per decode token and FLOPs per prefill token from a parsed config,
  counted by the family's module (`cost_v4`: DeepSeek-V4, `cost_v41`: DeepSeek-V4.1);
- `roofline`: measured memory bandwidth and bf16 matmul throughput, and the bounds they imply;
- `transformers_baseline`: transformers' `generate` in a child process of its own.
"""
