import pytest
import torch

from deepinfer.engine.cache_manager import GiB, CacheManager, bytes_for_request, size_pool
from deepinfer.engine.request import Request
from deepinfer.models.interface import BlockGroup, CacheLayout, StateTensor
from deepinfer.sampling_params import SamplingParams

# Two growing groups (m = 4 and m = 128) plus per-sequence slot state, fp32.
LAYOUT = CacheLayout(
    slot_tensors=(StateTensor("window", (16, 8), torch.float32, (0, 1, 2)),),  # 1536 B per slot
    block_groups=(
        BlockGroup("c4", 4, (StateTensor("kv", (8,), torch.float32, (1,)),
                             StateTensor("idx", (4,), torch.float32, (1,)))),  # 48 B per entry
        BlockGroup("c128", 128, (StateTensor("kv", (8,), torch.float32, (2,)),)),  # 32 B per entry
    ),
    max_rollback=0)


def _req(i: int = 0) -> Request:
    return Request(request_id=str(i), prompt=None, prompt_token_ids=[5], params=SamplingParams(), arrival_index=i)


def test_bytes_for_request():
    # 1000 tokens: 250 c4 entries -> 16 blocks of 16; 7 c128 entries -> 1 block
    assert bytes_for_request(LAYOUT, 1000, 16) == 1536 + 16 * 16 * 48 + 1 * 16 * 32


def test_pool_is_capped_at_what_max_num_seqs_times_max_model_len_needs():
    pool = size_pool(LAYOUT, budget_bytes=20 * GiB, max_model_len=1000, max_num_seqs=3, block_size=16)
    assert pool.num_slots == 3
    assert pool.num_blocks == {"c4": 48, "c128": 3}
    assert pool.total_bytes == 3 * bytes_for_request(LAYOUT, 1000, 16)


def test_small_budget_is_split_by_tokens_and_still_fits_one_full_request():
    one = bytes_for_request(LAYOUT, 1000, 16)
    pool = size_pool(LAYOUT, budget_bytes=int(2.5 * one), max_model_len=1000, max_num_seqs=8, block_size=16)
    assert pool.num_slots == 8  # slots are cheap here; the blocks are what runs short
    assert 16 <= pool.num_blocks["c4"] < 8 * 16 and pool.num_blocks["c128"] >= 1
    assert pool.total_bytes <= int(2.5 * one) * 1.05
    tight = size_pool(LAYOUT, budget_bytes=one + 1000, max_model_len=1000, max_num_seqs=8, block_size=16)
    assert tight.num_slots == 1 and tight.num_blocks["c4"] >= 16 and tight.num_blocks["c128"] == 1
    assert tight.total_bytes <= one + 1000


def test_budget_too_small_for_one_request_says_how_much_is_needed():
    one = bytes_for_request(LAYOUT, 100_000, 16)
    with pytest.raises(ValueError) as err:
        size_pool(LAYOUT, budget_bytes=one - 1, max_model_len=100_000, max_num_seqs=4, block_size=16)
    msg = str(err.value)
    assert "max_model_len=100000" in msg and "cache_memory_gb" in msg and "gpu_memory_utilization" in msg
    assert f"{one / GiB:.3f} GiB" in msg


def test_allocate_grows_block_tables_and_free_returns_everything():
    cache = CacheManager(LAYOUT, num_slots=2, num_blocks={"c4": 4, "c128": 1}, block_size=4)
    a = _req(0)
    assert cache.allocate(a, 3)  # 0 entries yet: slot only
    assert a.slot is not None and a.block_ids == {"c4": [], "c128": []}
    assert cache.allocate(a, 17)  # 4 c4 entries -> 1 block
    assert len(a.block_ids["c4"]) == 1 and a.block_ids["c128"] == []
    assert cache.allocate(a, 64)  # 16 entries -> 4 blocks
    stats = cache.stats()
    assert stats.slots_used == 1 and stats.blocks_used == {"c4": 4, "c128": 0} and stats.usage == 1.0
    b = _req(1)
    assert not cache.allocate(b, 4)  # no c4 block left: all-or-nothing, b gets no slot either
    assert b.slot is None and cache.num_free_slots == 1
    cache.free(a)
    assert a.slot is None and a.block_ids == {}
    stats = cache.stats()
    assert stats.slots_used == 0 and stats.blocks_used == {"c4": 0, "c128": 0} and stats.peak_usage == 1.0
    assert cache.allocate(b, 64)
    assert sorted(b.block_ids["c4"]) == [0, 1, 2, 3]


def test_blocks_are_never_shared():
    cache = CacheManager(LAYOUT, num_slots=4, num_blocks={"c4": 12, "c128": 4}, block_size=2)
    reqs = [_req(i) for i in range(4)]
    for step in range(1, 5):
        for r in reqs[:3]:
            assert cache.allocate(r, 8 * step)
    owned = [b for r in reqs for b in r.block_ids.get("c4", [])]
    assert len(owned) == len(set(owned)) == 12
    assert len({r.slot for r in reqs[:3]}) == 3


# --- owners and readers ------------------------------------------------------------------------------
# Layers 0 and 2 keep their own per-token KV; layer 1 and layer 3 read layer 0's (no memory of their own).
SHARED = CacheLayout(
    slot_tensors=(StateTensor("window", (16, 8), torch.float32, (0, 1, 2, 3)),),  # 2048 B per slot
    block_groups=(BlockGroup("kv", 1, (StateTensor("k", (8,), torch.float32, (0, 2), {1: 0, 3: 0}),
                                       StateTensor("v", (8,), torch.float32, (0, 2), {3: 0, 1: 0}))),),  # 128 B
    max_rollback=0)
# the same state if every layer kept its own copy
OWNED = CacheLayout(
    slot_tensors=SHARED.slot_tensors,
    block_groups=(BlockGroup("kv", 1, (StateTensor("k", (8,), torch.float32, (0, 1, 2, 3)),
                                       StateTensor("v", (8,), torch.float32, (0, 1, 2, 3)))),),  # 256 B
    max_rollback=0)


def test_a_reader_allocates_nothing_and_reads_its_owners_copy():
    from deepinfer.models.interface import allocate_cache_tensors

    k = SHARED.group("kv").tensor("k")
    assert k.owners == (0, 2) and k.reader_map == {1: 0, 3: 0} and k.layers == (0, 2, 1, 3)
    assert k == StateTensor("k", (8,), torch.float32, (0, 2), ((3, 0), (1, 0)))  # pairs or a mapping, same tensor
    tensors = allocate_cache_tensors(SHARED, num_slots=2, num_blocks={"kv": 3}, block_size=4, device="cpu")
    assert tensors.blocks["kv"]["k"].shape == (2, 12, 8)  # one copy per owner, none for the readers
    assert tensors.slot["window"].shape == (4, 2, 16, 8)
    owner, reader, other = (tensors.block_view("kv", "k", i) for i in (0, 1, 2))
    assert reader.data_ptr() == owner.data_ptr() and other.data_ptr() != owner.data_ptr()
    owner[5] = torch.arange(8.0)  # the owner writes an entry ...
    assert torch.equal(tensors.block_view("kv", "k", 3)[5], torch.arange(8.0))  # ... every reader sees it
    assert not other[5].any()  # the other owner's copy does not
    with pytest.raises(ValueError, match=r"layer 4 neither owns nor reads state tensor 'k'"):
        tensors.block_view("kv", "k", 4)


def test_memory_accounting_counts_owners_only():
    assert SHARED.group("kv").bytes_per_entry() == 128 and OWNED.group("kv").bytes_per_entry() == 256
    assert bytes_for_request(SHARED, 100, 16) == 2048 + 7 * 16 * 128
    assert bytes_for_request(OWNED, 100, 16) == 2048 + 7 * 16 * 256
    budget = 20 * bytes_for_request(OWNED, 100, 16)
    shared = size_pool(SHARED, budget_bytes=budget, max_model_len=1000, max_num_seqs=8, block_size=16)
    owned = size_pool(OWNED, budget_bytes=budget, max_model_len=1000, max_num_seqs=8, block_size=16)
    assert shared.num_slots == owned.num_slots == 8
    # the block pool holds twice the tokens when half the layers read instead of owning
    assert shared.num_blocks["kv"] == pytest.approx(2 * owned.num_blocks["kv"], abs=1)
    assert shared.total_bytes <= budget and owned.total_bytes <= budget


def test_owner_reader_mistakes_are_refused():
    with pytest.raises(ValueError, match=r"reader layer 1 reads layer 5, which owns no copy"):
        StateTensor("k", (8,), torch.float32, (0,), {1: 5})
    with pytest.raises(ValueError, match=r"layer 0 is both an owner and a reader"):
        StateTensor("k", (8,), torch.float32, (0, 1), {0: 1})
    with pytest.raises(ValueError, match=r"no owner layer"):
        StateTensor("k", (8,), torch.float32, ())
    with pytest.raises(ValueError, match=r"slot tensor names must be unique; repeated: \['w'\]"):
        CacheLayout(slot_tensors=(StateTensor("w", (1,), torch.float32, (0,)),) * 2, block_groups=(), max_rollback=0)


def test_v4_layout_memory_is_every_layer_owning_its_state():
    """DeepSeek-V4 shares nothing between layers: every tensor has owners only, and the per-slot and
    per-entry bytes are the documented per-layer figures (docs/model.md, State design)."""
    from deepinfer.models.deepseek_v4.make_model import model_config
    from deepinfer.models.deepseek_v4.state import build_cache_layout

    config, _ = model_config("tiny")  # [S, CSA, HCA, CSA, HCA, S] + 1 MTP, d 32, window 8, rates 4/16, di 16
    R = 3
    layout = build_cache_layout(config, torch.float32, max_rollback=R)
    assert all(not t.readers for t in layout.slot_tensors)
    assert all(not t.readers for g in layout.block_groups for t in g.tensors)
    window = (8 + R) * 32 * 4 * 7  # every layer and the MTP block
    csa = 2 * (2 * 4 + R) * (2 * 32) * 4 * 2 + 2 * (2 * 4 + R) * (2 * 16) * 4 * 2  # main + indexer rows, 2 layers
    hca = 2 * (16 + R) * 32 * 4 * 2
    assert layout.bytes_per_slot() == window + csa + hca
    assert {g.name: g.bytes_per_entry() for g in layout.block_groups} == {"c4": (32 + 16) * 4 * 2, "c16": 32 * 4 * 2}


def test_bind_cache_refuses_tensors_that_do_not_match_the_layout():
    from deepinfer.models.interface import allocate_cache_tensors
    from model_harness import build_hf_model, build_our_model

    model = build_our_model(build_hf_model())
    layout = model.cache_layout(0)
    groups = {g.name: 8 for g in layout.block_groups}
    model.bind_cache(allocate_cache_tensors(layout, 2, groups, 4, "cpu"))  # the matching one binds
    name = next(t.name for t in layout.slot_tensors if t.dtype == torch.float32)
    bad = allocate_cache_tensors(layout, 2, groups, 4, "cpu")
    bad.slot[name] = bad.slot[name].to(torch.float64)
    with pytest.raises(ValueError, match=rf"cache slot tensor '{name}' does not match the layout.*model\.cache_layout\(0\)"):
        model.bind_cache(bad)
    bad = allocate_cache_tensors(layout, 2, groups, 4, "cpu")
    group = layout.block_groups[0]
    tensor = group.tensors[0].name
    bad.blocks[group.name][tensor] = bad.blocks[group.name][tensor][:, :, :1]
    with pytest.raises(ValueError, match=rf"cache block tensor {group.name}/{tensor} does not match the layout"):
        model.bind_cache(bad)
