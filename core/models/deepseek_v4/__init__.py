"""DeepSeek-V4 (docs/model.md, "DeepSeek-V4"): config, weight naming, and the model."""
from deepinfer.models.deepseek_v4.config import DeepseekV4Config

__all__ = ["DeepseekV4Config"]
