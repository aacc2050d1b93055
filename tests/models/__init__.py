"""Perplexity baselines of the embedded models (ppl_baseline.py)."""
