"""Model-family-independent building blocks.

- `errors`: CheckpointError, CheckpointTooLargeError, UnknownModelTypeError;
- `files`: what a checkpoint path is (a regular file, or the directory / FIFO / device it is instead);
- `finite`: the load-time check for NaN and infinite values;
- `config_values`: type and range checks of config.json values (`Range`);
- `safetensors_io`: config.json, the shard index and validated safetensors headers; writing files;
- `checkpoint`: the loading pipeline (scale pairing, shape validation, RAM check, dequantising load);
- `quant`: FP8 block and packed FP4 weight formats;
- `weights`: name canonicalisation helpers and load-time fused projections;
- `ragged`: `RaggedPlan`, the per-sequence index tensors of a ragged step.
"""
