"""The toy family's registry entry: folder + this entry + its op defaults is all a family needs."""
from __future__ import annotations

import contextlib

import torch

from deepinfer.models.registry import (
    CheckpointMaker, ModelFamily, OpDefaults, register_model_family, unregister_model_family,
)
from toy_family.checkpoint import SIZES, add_arguments, load_checkpoint, make_checkpoint
from toy_family.config import MODEL_TYPE, parse_config
from toy_family.model import ToyDenseForCausalLM

TOY_FAMILY = ModelFamily(
    model_type=MODEL_TYPE,
    parse_config=parse_config,
    load_checkpoint=load_checkpoint,
    model_class=ToyDenseForCausalLM,
    # the accelerator kernels the toy model calls; attention scores in fp32 whatever the model dtype
    op_defaults=OpDefaults(required_ops=("linear", "rms_norm", "swiglu"),
                           model_options={"attention_dtype": torch.float32}),
    make_checkpoint=CheckpointMaker(make=make_checkpoint, sizes=tuple(SIZES), add_arguments=add_arguments),
    aliases=("toy",),
    description="test-only dense transformer: full, sliding-window and KV-sharing attention layers",
)


@contextlib.contextmanager
def registered(family: ModelFamily = TOY_FAMILY):
    """The family registered for the duration of a `with` block (tests leave the registry as found)."""
    register_model_family(family)
    try:
        yield family
    finally:
        unregister_model_family(family.model_type)
