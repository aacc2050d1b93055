"""DeepSeek-V4's step plan: the decode shortcuts (host-side window bounds, every-row ring writes, the
window count before a compression plan) give what the general formulas give."""
from __future__ import annotations

import pytest
import torch

from deepinfer.models.batch import ForwardBatch
from deepinfer.models.deepseek_v4.make_model import model_config
from deepinfer.models.deepseek_v4.state import StepPlan, group_name, ring_sizes

CONFIG, _ = model_config("tiny")
RATE = CONFIG.csa_compress_rate
RINGS = ring_sizes(CONFIG, max_rollback=2)
BLOCK = 4


def plan(ctx: list[int], q_lens: list[int], slots: list[int]) -> StepPlan:
    T, blocks = sum(q_lens), 64
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, q_lens)])
    # every sequence owns its own blocks, in order
    table = torch.arange(len(ctx) * blocks).view(len(ctx), blocks)
    batch = ForwardBatch(input_ids=torch.zeros(T, dtype=torch.long), positions=positions, query_lens=q_lens,
                         context_lens=ctx, slots=torch.tensor(slots),
                         block_tables={group_name(r): table for r in (CONFIG.csa_compress_rate,
                                                                      CONFIG.hca_compress_rate)},
                         logits_indices=torch.tensor([T - 1]))
    return StepPlan(batch, CONFIG, RINGS, BLOCK, num_slots=8)


def ring_write_reference(p: StepPlan, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last `ring` positions of each sequence: their rows and flat ring rows."""
    rows, ring_rows = [], []
    for i, (c, n) in enumerate(zip(p.ctx, p.q_lens)):
        for j in range(max(0, n - ring), n):
            rows.append(p.row_start[i] + j)
            ring_rows.append(p.slots[i] * ring + (c + j) % ring)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(ring_rows, dtype=torch.long)


def test_ring_writes_every_row_and_a_subset():
    p = plan([5, 0, 40], [1, 9, 3], [3, 0, 5])
    for ring in (4, 9, 16):  # 4: the 9-token chunk keeps its last 4 rows only
        write = p.ring_write(ring)
        rows, ring_rows = ring_write_reference(p, ring)
        assert write.all_rows == (ring >= 9)
        assert torch.equal(write.rows, rows) and torch.equal(write.ring_row, ring_rows)
        flat = torch.full((8 * ring, 2), -1.0)
        values = torch.arange(p.T * 2, dtype=torch.bfloat16).view(p.T, 2)
        write.store(flat, values)  # cast to the ring's dtype
        assert torch.equal(flat[ring_rows], values[rows].float())
        assert int((flat[:, 0] >= 0).sum()) == len(rows)


def test_decode_ring_rows_from_the_host_equal_the_tensor_formulas():
    p = plan([5, 0, 40, 129], [1, 1, 1, 1], [3, 0, 5, 7])
    assert p.decode_only
    for m in (RATE, CONFIG.hca_compress_rate, 9):
        want = p.positions % m
        got = p.position_mod(m)
        assert got.dtype == want.dtype and torch.equal(got, want)
        write = p.ring_write(m)
        assert write.all_rows and torch.equal(write.rows, torch.arange(p.T))
        assert torch.equal(write.ring_row, p.row_slot * m + want)


def test_windows_completed_matches_the_compression_plan():
    for ctx, q_lens in (([3, 7, 0], [1, 1, 1]), ([4, 11], [1, 13]), ([0], [3])):
        p = plan(ctx, q_lens, list(range(len(ctx))))
        for rate in (RATE, CONFIG.hca_compress_rate):
            assert p.windows_completed(rate) == p.compress_plan(rate, 2 * rate + 2, True).num_windows


def test_decode_group_equals_the_general_formulas():
    ctx = [0, 5, CONFIG.sliding_window + 3, 2 * RATE - 1]
    p = plan(ctx, [1] * len(ctx), [6, 1, 2, 0])
    items = [(i, 0, 1) for i in range(len(ctx))]
    decode, general = p._group(items, decode=True), p._group(items)
    assert_decode_group(p, decode, general)
    assert decode.in_row_order
    # every existing entry is visible to a decode query (its own position is the item's last)
    view = p.entry_view(0, RATE)
    count = torch.tensor([(c + 1) // RATE for c in ctx])
    E = int(count.max())
    assert torch.equal(view.visible[:, 0], torch.arange(E) < count.unsqueeze(1))


def assert_decode_group(p: StepPlan, decode, general) -> None:
    """`decode` (the decode construction) holds what the general formulas give for the same items,
    and its own ring rows: the query's key at slot * Rw + ctx % Rw, the older keys where they are."""
    for field in ("seq", "rows", "q_valid", "q_pos", "key_is_new", "key_new_row", "key_ring_row", "window_mask",
                  "end_pos"):
        want, got = getattr(general, field), getattr(decode, field)
        assert got.dtype == want.dtype and torch.equal(got, want), field
    assert decode.decode and not general.decode and decode.end_list == general.end_list
    seqs = general.seq.tolist()
    own = torch.tensor([p.slots[i] * RINGS.window + p.ctx[i] % RINGS.window for i in seqs])
    assert torch.equal(decode.new_key_ring_row, own)
    own_key = general.key_is_new & general.window_mask[:, 0]
    assert torch.equal(decode.key_ring_row_all, torch.where(own_key, own.unsqueeze(1), general.key_ring_row))


def test_decode_group_of_a_mixed_step():
    """Decode tokens beside prefill chunks: the decode group's items are not the step's rows in order."""
    ctx, q_lens = [7, 0, CONFIG.sliding_window + 9, 2, 1], [1, 5, 1, 3, 1]
    p = plan(ctx, q_lens, [4, 0, 7, 2, 3])
    decode = p.groups[0]
    items = [(i, 0, 1) for i in (0, 2, 4)]
    assert decode.decode and not decode.in_row_order and decode.seq.tolist() == [0, 2, 4]
    assert torch.equal(decode.rows[:, 0], torch.tensor([0, 6, 10]))
    assert_decode_group(p, decode, p._group(items))


@pytest.mark.parametrize("host_entry_rows", [0, 1024], ids=["tensors", "host"])
def test_first_entry_rows_equal_entry_rows(host_entry_rows):
    """Every existing entry's rows straight from the block table's first columns (by tensor arithmetic, or
    from host lists for a few rows) are `entry_rows` of entries 0..n-1; a missing block is refused as there."""
    p = plan([0, 5, 37, 64], [1, 1, 1, 1], [3, 1, 2, 0])
    p.host_entry_rows = host_entry_rows
    group, seq = group_name(RATE), torch.tensor([2, 0, 3])
    for counts in ([9, 0, 16], [0, 0, 0], [1, 4, 5], [1, BLOCK, 3]):  # the last: one block (E <= BLOCK)
        for s, seq_list in ((seq, None), (seq, seq.tolist()), (torch.arange(4), [0, 1, 2, 3])):
            counts_s = (counts + [2])[:len(seq_list)] if seq_list else counts
            rows, valid = p.first_entry_rows(group, s, counts_s, seq_list)  # 0..B-1 reads the table in place
            E = max(counts_s)
            want_valid = torch.arange(E) < torch.tensor(counts_s).unsqueeze(1)
            want = p.entry_rows(group, s, torch.arange(E).expand(len(counts_s), E), want_valid, max_entries=E)
            assert valid.dtype == want_valid.dtype and torch.equal(valid, want_valid)
            assert rows.dtype == want.dtype and torch.equal(rows, want) and rows.is_contiguous()
    p.block_tables[group] = p.block_tables[group].clone()
    p.block_tables[group][2, 1] = -1  # sequence 2's second block was never allocated
    with pytest.raises(ValueError, match="lacks blocks"):
        p.first_entry_rows(group, seq, [2 * BLOCK, 1, 1])
    p.first_entry_rows(group, seq, [BLOCK, 1, 1])  # its first block only: fine
    with pytest.raises(ValueError, match="too few"):
        p.first_entry_rows(group, seq, [64 * BLOCK + 1, 1, 1])


@pytest.mark.parametrize("q_lens", [[1, 1], [1, 3]])
def test_positions_other_than_context_plus_offsets_are_refused(q_lens):
    ctx = [5, 9]
    T = sum(q_lens)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, q_lens)])
    positions[-1] += 1
    table = torch.arange(2 * 8).view(2, 8)
    batch = ForwardBatch(input_ids=torch.zeros(T, dtype=torch.long), positions=positions, query_lens=q_lens,
                         context_lens=ctx, slots=torch.tensor([0, 1]),
                         block_tables={group_name(r): table for r in (RATE, CONFIG.hca_compress_rate)},
                         logits_indices=torch.tensor([T - 1]))
    with pytest.raises(ValueError, match="context_len \\+ 0..query_len-1"):
        StepPlan(batch, CONFIG, RINGS, BLOCK, num_slots=8)


def compress_plan_reference(p: StepPlan, rate: int, ring: int, overlap: bool) -> dict[str, torch.Tensor]:
    """A step's compression windows by the direct formulas, on [Nw, slots] tensors."""
    seqs, ws = [], []
    for i, (c, n) in enumerate(zip(p.ctx, p.q_lens)):
        seqs += [i] * ((c + n) // rate - c // rate)
        ws += range(c // rate, (c + n) // rate)
    seq, w = torch.tensor(seqs, dtype=torch.long), torch.tensor(ws, dtype=torch.long)
    offs = torch.arange(2 * rate if overlap else rate) - (rate if overlap else 0)
    pos = (rate * w).unsqueeze(1) + offs
    ctx = torch.tensor(p.ctx)[seq].unsqueeze(1)
    start = torch.tensor(p.row_start)[seq].unsqueeze(1)
    slot = torch.tensor(p.slots)[seq].unsqueeze(1)
    empty, is_new = pos < 0, pos >= ctx
    ring_pos = slot * ring + pos % ring
    entry_row = p.entry_rows(group_name(rate), seq, w.unsqueeze(1), torch.ones(len(ws), 1, dtype=torch.bool),
                             max_entries=max(ws, default=-1) + 1).squeeze(1)
    return dict(is_new=is_new, new_row=torch.where(is_new, start + pos - ctx, 0),
                ring_row=torch.where(~is_new & ~empty, ring_pos, 0), ring_row_all=torch.where(empty, 0, ring_pos),
                empty=empty, entry_row=entry_row, rope_pos=rate * w)


@pytest.mark.parametrize("ctx,q_lens", [([3, 7, 0, 11], [1, 1, 1, 1]), ([4, 11, 0], [1, 13, 9]), ([0], [3]),
                                        ([0, 5], [1, 1])])
def test_compress_plan_equals_the_direct_formulas(ctx, q_lens):
    """The plan built from per-window host columns (and the block rows read in one gather) holds what the
    direct tensor formulas give, first windows (empty CSA slots) and windows with new rows included."""
    p = plan(ctx, q_lens, [5, 0, 3, 7][:len(ctx)])
    for rate, overlap in ((RATE, True), (RATE, False), (CONFIG.hca_compress_rate, False)):
        ring = (2 if overlap else 1) * rate + 2
        cp, want = p.compress_plan(rate, ring, overlap), compress_plan_reference(p, rate, ring, overlap)
        assert cp.num_windows == p.windows_completed(rate) == len(want["rope_pos"])
        for field, value in want.items():
            got = getattr(cp, field)
            assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), field
        assert cp.has_empty == bool(cp.empty.any())


def test_entry_row_list_refuses_missing_blocks_and_short_tables():
    p = plan([3, 37], [1, 1], [0, 1])
    group = group_name(RATE)
    assert p.entry_row_list(group, [], []) == []
    p.block_tables[group] = p.block_tables[group].clone()
    p.block_tables[group][1, 2] = -1  # sequence 1's third block was never allocated
    assert p.entry_row_list(group, [0, 1], [0, BLOCK + 1]) == [0, 65 * BLOCK + 1]
    with pytest.raises(ValueError, match="lacks blocks"):
        p.entry_row_list(group, [0, 1], [0, 2 * BLOCK])
    with pytest.raises(ValueError, match="too few"):
        p.entry_row_list(group, [0], [64 * BLOCK])
