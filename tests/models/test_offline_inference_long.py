"""Long-context decode perplexity: the example's --long_context prompts (filler text, then the
sample question), sized to run in seconds on the tiny models yet reach far past their sliding
window and fill several blocks of compressed entries, against tests/models/offline_decode_ppl.json.

    python -m pytest -v -s tests/models/test_offline_inference_long.py
"""
from __future__ import annotations

import pytest

from .ppl_baseline import Case, ModelBuild

INPUT_TOKENS, OUTPUT_TOKENS = 2048, 32
CONTEXT = (("max_position_embeddings", 4096),)
V4 = ModelBuild("v4", overrides=CONTEXT)
V41 = ModelBuild("v41", overrides=CONTEXT)
LONG = Case(long_context=(INPUT_TOKENS, OUTPUT_TOKENS))
BLOCK_SIZE = 64  # compressed entries per cache block (the engine's default block_size)


def test_the_prompts_reach_past_the_window_into_several_compressed_blocks(built):
    import json

    for build in (V4, V41):
        config = json.loads((built(build) / "config.json").read_text())
        config = config.get("text_config", config)
        assert INPUT_TOKENS > 100 * config["sliding_window"]
        # V4 (transformers format) names its two rates; V4.1 (release format) gives one per layer
        ratios = [r for r in (config.get("compress_ratios") or list(config["compress_rates"].values())) if r > 0]
        assert ratios and all(INPUT_TOKENS // r >= 2 * BLOCK_SIZE for r in ratios), ratios


@pytest.mark.parametrize("build, case", [
    pytest.param(V4, LONG, id="v4-tiny-single"),
    pytest.param(V41, LONG, id="v41-tiny-single", marks=pytest.mark.slow),  # the fast lane runs V4's
    pytest.param(V4, Case(cp=2, long_context=LONG.long_context), id="v4-tiny-cp2", marks=pytest.mark.slow),
    pytest.param(V41, Case(cp=2, long_context=LONG.long_context), id="v41-tiny-cp2", marks=pytest.mark.slow),
])
def test_long_context_decode_ppl_matches_the_baseline(build, case, built, baselines):
    baselines.check(built(build), build, case)
