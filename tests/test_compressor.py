"""V4's compressor at decode: the ring writes come first and a completed window is pooled from the
ring rows alone; the entries are the ones the general path (new rows read from the step's tensors,
used by steps with prefill chunks) pools from the same rows, bit for bit."""
from __future__ import annotations

import pytest
import torch

from deepinfer.models.batch import ForwardBatch
from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.make_model import model_config
from deepinfer.models.deepseek_v4.rope import RotaryTables
from deepinfer.models.deepseek_v4.state import StepPlan, group_name, ring_sizes
from deepinfer_plugins.cpu.kernels import CpuKernels
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels

CONFIG, _ = model_config("tiny")
RINGS = ring_sizes(CONFIG, max_rollback=2)
BLOCK, SLOTS, BLOCKS = 4, 4, 16


def step(ctx: list[int], q_lens: list[int], slots: list[int]) -> StepPlan:
    T = sum(q_lens)
    table = torch.arange(SLOTS * BLOCKS).view(SLOTS, BLOCKS)[slots]  # every slot owns its own blocks
    batch = ForwardBatch(input_ids=torch.zeros(T, dtype=torch.long),
                         positions=torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, q_lens)]),
                         query_lens=q_lens, context_lens=ctx, slots=torch.tensor(slots),
                         block_tables={group_name(r): table for r in (CONFIG.csa_compress_rate,
                                                                      CONFIG.hca_compress_rate)},
                         logits_indices=torch.tensor([T - 1]))
    return StepPlan(batch, CONFIG, RINGS, BLOCK, num_slots=SLOTS)


@pytest.mark.parametrize("kernels", [CpuKernels, NativeCpuKernels])
@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_pools_from_the_ring_as_the_general_path_does(kernels, overlap, dtype):
    accel, g = kernels(), torch.Generator().manual_seed(3)
    rate = CONFIG.csa_compress_rate if overlap else CONFIG.hca_compress_rate
    width = (2 if overlap else 1) * CONFIG.head_dim
    weights = {"ape": torch.randn(rate, width, generator=g), "norm.weight": torch.rand(CONFIG.head_dim, generator=g)}
    comp = Compressor(accel, weights, rate, overlap, CONFIG.head_dim, CONFIG.rms_norm_eps)
    ring = RINGS.csa_rows if overlap else RINGS.hca_rows
    rope = RotaryTables(CONFIG, torch.device("cpu"))
    rows = [torch.randn(SLOTS, ring, width, generator=g) for _ in range(2)]
    entries = torch.zeros(SLOTS * BLOCKS * BLOCK, CONFIG.head_dim, dtype=dtype)
    # slot 0 completes window 2 (CSA: with window 1's Ca half), slot 2 its first window (CSA: the
    # previous half empty), slot 3 completes nothing; the mixed step adds a prefill chunk in slot 1
    ctx = [3 * rate - 1, rate - 1, rate + 1]
    kv, score = (torch.randn(4, width, generator=g).to(dtype) for _ in range(2))
    results = []
    for plan, rows_of in ((step(ctx, [1, 1, 1], [0, 2, 3]), [0, 1, 2]),
                          (step(ctx[:1] + [0] + ctx[1:], [1, 2, 1, 1], [0, 1, 2, 3]), [0, 3, 4])):
        assert plan.decode_only == (len(plan.q_lens) == 3)
        state = [r.clone() for r in rows] + [entries.clone()]
        T = plan.T
        step_kv = torch.randn(T, width, generator=g).to(dtype)  # rows of the prefill chunk: any values
        step_score = torch.randn(T, width, generator=g).to(dtype)
        step_kv[rows_of], step_score[rows_of] = kv[:3], score[:3]
        comp.update(step_kv, step_score, plan, rope, *state)
        results.append(state)
    decode, mixed = results
    for s in (0, 2, 3):  # the decode sequences' ring rows and entries
        assert torch.equal(decode[0][s], mixed[0][s]) and torch.equal(decode[1][s], mixed[1][s])
    first = entries.shape[0] // SLOTS
    assert torch.equal(decode[2][:first], mixed[2][:first])  # slot 0's blocks
    assert torch.equal(decode[2][2 * first:], mixed[2][2 * first:])  # slots 2 and 3
    written = (decode[2] != 0).any(dim=1)
    assert int(written[:first].sum()) == 1 and int(written[2 * first:3 * first].sum()) == 1
    assert not written[3 * first:].any()
