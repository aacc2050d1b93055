"""NVIDIA NeMo AutoModel's DeepSeek-V4.1 as the tests' independent oracle (`deepinfer.testing.nemo_v41`).

Tests that use it skip when nemo_automodel is not installed:

    nemo = pytest.importorskip("nemo_automodel", reason=...)
    from v41_oracle import build_nemo_model
"""
from deepinfer.testing.nemo_v41 import (  # noqa: F401
    build_nemo_model, fast_tokenizer, nemo_config, nemo_tokenizer, nemo_vision, read_release_tensors,
)
