"""Context parallelism (`--cp`): the zig-zag split, a CP prefill against a single-rank one (logits
and every cache tensor), and the offline example end to end (CPU, 2 gloo processes, fp32)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer.parallel.context_parallel import RowSplit, zigzag_bounds, zigzag_owner
from deepinfer.parallel.launch import launch
from deepinfer.parallel.layout import ParallelLayout
from model_harness import Runner, max_rel_diff
from test_parallel import _cpu, sample_lines

# a prompt longer than the tiny model's window (8) over many c4 and c8 blocks, in two chunks
PROMPT = [(7 * i + 3) % 500 + 2 for i in range(90)]
CHUNKS = [61, 29]
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def cp_checkpoint(tmp_path_factory) -> str:
    """The tiny V4 (window 8, c4 CSA with its indexer selecting top-4, HCA) with HCA at rate 8, so
    the example's short prompts span several blocks of both rates."""
    from deepinfer.models.deepseek_v4.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("cp") / "v4", "tiny", seed=0, hca_compress_rate=8))


# ---------------------------------------------------------------------------- the split itself


@pytest.mark.parametrize("q_lens, size", [([90], 2), ([13, 19, 26, 1, 24], 2), ([100, 3, 1], 4), ([7], 3)])
def test_zigzag_split_covers_every_row_once_and_reassembles_exactly(q_lens, size):
    T = sum(q_lens)
    splits = [RowSplit(q_lens, r, size) for r in range(size)]
    rows = sorted(r for s in splits for r in s.rows_of[s.rank])
    assert rows == list(range(T))
    for s in splits:  # each rank's chunks are runs of its own rows, in local order
        local = s.local_rows.tolist()
        starts = [0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))]
        flat = [starts[c.seq] + p for c in s.chunks for p in range(c.start, c.stop)]
        assert flat == local
        assert [c.local_row for c in s.chunks] == [sum(c2.stop - c2.start for c2 in s.chunks[:i])
                                                    for i in range(len(s.chunks))]
    # balanced: a sequence's rows split into 2N chunks; rank i holds chunks i and 2N-1-i
    for n in q_lens:
        b = zigzag_bounds(n, size)
        per_rank = [0] * size
        for k in range(2 * size):
            per_rank[zigzag_owner(k, size)] += b[k + 1] - b[k]
        assert max(per_rank) - min(per_rank) <= 2
    # reassembly: what an all-gather of every rank's padded rows returns, put back in row order
    full = torch.randn(T, 3)
    padded = []
    for s in splits:
        part = torch.zeros(s.width, 3)
        part[:len(s.rows_of[s.rank])] = full[s.local_rows]
        padded.append(part)
    for s in splits:
        assert torch.equal(torch.cat(padded).index_select(0, s.assemble), full)


def test_a_sequence_of_one_row_goes_to_the_first_rank():
    assert RowSplit([1], 0, 2).rows_of == [[0], []]
    assert RowSplit([4], 1, 2).rows_of == [[0, 3], [1, 2]]


# ---------------------------------------------------- CP prefill against a single-rank prefill


def prefill_and_decode(ctx, checkpoint: str, chunks: list[int]) -> dict:
    """Rank target: prefill PROMPT in `chunks`, then greedy decode; the logits of every step and
    every cache tensor afterwards (the model's own, unchanged by the test)."""
    from deepinfer.models.registry import load_model_checkpoint
    from deepinfer.parallel.context_parallel import current_context_parallel

    loaded = load_model_checkpoint(checkpoint, torch.float32)
    model = loaded.family.build_model(loaded.config, _cpu()(), torch.float32, "cpu", query_block=8)
    model.load_weights(loaded.weights)
    runner = Runner(model)
    tokens, logits = runner.generate("p", PROMPT, DECODE_STEPS, chunk_sizes=chunks)
    cache = runner.cache
    state = {f"slot.{k}": v.clone() for k, v in cache.slot.items()}
    state.update({f"{g}.{k}": v.clone() for g, group in cache.blocks.items() for k, v in group.items()})
    cp = current_context_parallel()
    return {"tokens": tokens, "logits": logits, "state": state, "gathers": cp.timing.calls if cp else 0}


@pytest.fixture(scope="module")
def single(cp_checkpoint) -> dict:
    return launch(prefill_and_decode, (cp_checkpoint, CHUNKS), ParallelLayout(), _cpu())[0]


@pytest.mark.parametrize("layout", [
    ParallelLayout(dp=1, cp=2),
    ParallelLayout(ep=2, dp=2, cp=2),  # two CP groups, each also an EP group: every group its own sub-group
], ids=["cp2", "ep2-cp2-dp2"])
@pytest.mark.slow
def test_cp_prefill_matches_a_single_rank_prefill(cp_checkpoint, single, layout):
    ranks = launch(prefill_and_decode, (cp_checkpoint, CHUNKS), layout, _cpu(), threads_per_rank=1)
    layers = 6
    # decode is not split; under expert parallelism its MoE layers (every layer) share the rows and
    # gather their outputs (moe.py)
    decode_gathers = DECODE_STEPS * layers if layout.ep > 1 else 0
    for r in ranks:
        # two split prefill chunks: one gather per layer and one of the final streams each
        assert r["gathers"] == 2 * (layers + 1) + decode_gathers
        assert r["tokens"] == single["tokens"]
        assert max_rel_diff(r["logits"], single["logits"]) < 1e-5
        assert r["state"].keys() == single["state"].keys()
        for name, tensor in single["state"].items():  # the cache a single-rank prefill leaves, on every rank
            assert torch.allclose(r["state"][name], tensor, atol=1e-5, rtol=1e-5), name


@pytest.mark.slow
def test_cp_with_expert_parallelism_matches_a_single_rank_prefill(cp_checkpoint, single):
    """--ep 2 --cp 2: the CP ranks' MoE layers exchange their own rows' experts."""
    ranks = launch(prefill_and_decode, (cp_checkpoint, [90]), ParallelLayout(ep=2, dp=1, cp=2), _cpu(),
                   threads_per_rank=1)
    whole = launch(prefill_and_decode, (cp_checkpoint, [90]), ParallelLayout(), _cpu())[0]
    for r in ranks:
        assert r["tokens"] == whole["tokens"]
        assert max_rel_diff(r["logits"], whole["logits"]) < 1e-5


# ------------------------------------------------------- DeepSeek-V4.1: CP prefill against one rank


@pytest.fixture(scope="module")
def v41_checkpoint(tmp_path_factory) -> str:
    """The tiny V4.1 (window 8; layers: 2 sliding, a ratio-2 KV source and its Reuse layer, a ratio-1
    KV source that is the candidate source, Reuse, a Reindex layer scoring inside the candidate
    pool, Reuse; Engram before layers 1 and 4; index top-4) with its DSpark drafter."""
    from deepinfer.models.deepseek_v41.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("cp41") / "v41", "tiny", seed=0, with_dspark=True))


@pytest.fixture(scope="module")
def v41_single(v41_checkpoint) -> dict:
    return launch(prefill_and_decode, (v41_checkpoint, CHUNKS), ParallelLayout(), _cpu())[0]


@pytest.mark.slow
def test_v41_cp_prefill_matches_a_single_rank_prefill(v41_checkpoint, v41_single):
    """90 tokens (45 c2 and 90 c1 entries, window 8, Engram n-grams across the chunk boundary) in two
    split chunks: the logits, tokens and every cache tensor (window rings, compressor rows,
    compressed KV, index keys, Engram history) of one rank, on both ranks."""
    ranks = launch(prefill_and_decode, (v41_checkpoint, CHUNKS), ParallelLayout(dp=1, cp=2), _cpu(),
                   threads_per_rank=1)
    layers = 8
    for r in ranks:
        assert r["gathers"] == 2 * (layers + 1)  # per split chunk: one per layer and the final streams
        assert r["tokens"] == v41_single["tokens"]
        assert max_rel_diff(r["logits"], v41_single["logits"]) < 1e-5
        assert r["state"].keys() == v41_single["state"].keys()
        for name, tensor in v41_single["state"].items():
            assert torch.allclose(r["state"][name].float(), tensor.float(), atol=1e-5, rtol=1e-5), name


def replay_prefill(ctx, checkpoint: str, keep: int, chunks: list[int]) -> dict:
    """Rank target: bounded replay keeping `keep` prompt rows, PROMPT prefilled in `chunks`, greedy
    decode; the logits, every cache tensor, and which steps gathered."""
    from deepinfer.models.deepseek_v41.checkpoint import load_checkpoint
    from deepinfer.parallel.context_parallel import current_context_parallel
    from test_swa_replay import ReplayRunner

    runner = ReplayRunner(load_checkpoint(checkpoint, torch.float32), keep)
    cp = current_context_parallel()
    gathers = []
    forward = runner.model.forward

    def counted(batch):
        before = cp.timing.calls if cp else 0
        out = forward(batch)
        gathers.append((cp.timing.calls if cp else 0) - before)
        return out

    runner.model.forward = counted
    logits = runner.run(PROMPT, chunks)
    cache = runner.cache
    state = {f"slot.{k}": v.clone() for k, v in cache.slot.items()}
    state.update({f"{g}.{k}": v.clone() for g, group in cache.blocks.items() for k, v in group.items()})
    return {"logits": logits, "state": state, "gathers": gathers}


@pytest.mark.slow
def test_v41_bounded_replay_splits_the_encoder_and_the_kept_rows(v41_checkpoint):
    """SWA bounded replay keeping 40 of 90 rows (floor 50; decoder = layers 4-7), chunks 30 + 60:
    the first chunk has no kept row (4 encoder layers, the prepass and the step's rows gathered:
    6 all-gathers), the second splits the encoder, then its 40 kept rows anew (4 + 1 + 1, then 4
    decoder layers and the final streams: 11); decode is not split. Both ranks end with the
    single rank's logits and every cache tensor."""
    args = (v41_checkpoint, 40, [30, 60])
    single = launch(replay_prefill, args, ParallelLayout(), _cpu())[0]
    ranks = launch(replay_prefill, args, ParallelLayout(dp=1, cp=2), _cpu(), threads_per_rank=1)
    for r in ranks:
        assert r["gathers"] == [6, 11] + [0] * 4
        assert max_rel_diff(r["logits"], single["logits"]) < 1e-5
        assert r["logits"].argmax(-1).tolist() == single["logits"].argmax(-1).tolist()
        for name, tensor in single["state"].items():
            assert torch.allclose(r["state"][name].float(), tensor.float(), atol=1e-5, rtol=1e-5), name


# ------------------------------------- steps the CP group does not split, under expert parallelism

# 4 prompts of 14-27 tokens (prefilled in one split step), as the example's
PROMPTS = [[(7 * i + 3 * k) % 500 + 2 for i in range(n)] for k, n in enumerate([14, 19, 23, 27])]


def position_sensitive(accel):
    """`accel` with expert products whose bits depend on where a row sits in the expert's batch, as
    a CPU GEMM's do where the tail rows of a tile take another kernel (an AVX2 CPU's: a row alone,
    and the same row among others, differ in the last bits). Makes the test machine-independent."""
    experts = accel.moe_experts

    def moe_experts(rows, plan, w13, w2, swiglu_limit):
        out = experts(rows, plan, w13, w2, swiglu_limit)
        return out * (1 + torch.arange(rows.shape[0], dtype=out.dtype).unsqueeze(1) * 2 ** -20)

    accel.moe_experts = moe_experts
    return accel


def unsplit_steps(ctx, checkpoint: str, sensitive: bool) -> dict:
    """Rank target: PROMPTS prefilled in one step (split), then steps the CP group runs whole on every
    rank: 3 verification-sized steps (6 rows per sequence, 5 rolled back as rejected drafts), 3
    decode steps, and one of a single sequence (one row: the other rank's share is empty). Every
    step's logits and every cache tensor afterwards."""
    from deepinfer.models.registry import load_model_checkpoint

    loaded = load_model_checkpoint(checkpoint, torch.float32)
    accel = _cpu()()
    model = loaded.family.build_model(loaded.config, position_sensitive(accel) if sensitive else accel,
                                      torch.float32, "cpu", query_block=8)
    model.load_weights(loaded.weights)
    runner = Runner(model, max_rollback=6)
    for key in range(len(PROMPTS)):
        runner.add(key)
    out = runner.step(dict(enumerate(PROMPTS)))
    logits = [torch.cat(list(out.values()))]
    last = {key: int(v[-1].argmax()) for key, v in out.items()}
    for rows in [6] * 3 + [1] * 3:
        out = runner.step({key: [t] + [(3 * t + j) % 500 for j in range(1, rows)] for key, t in last.items()})
        for key in last:
            runner.truncate(key, rows - 1)
        logits.append(torch.cat(list(out.values())))
        last = {key: int(v[0].argmax()) for key, v in out.items()}
    logits.append(runner.step({0: [last[0]]})[0])
    cache = runner.cache
    state = {f"slot.{k}": v.clone() for k, v in cache.slot.items()}
    state.update({f"{g}.{k}": v.clone() for g, group in cache.blocks.items() for k, v in group.items()})
    return {"logits": logits, "state": state}


@pytest.mark.parametrize("sensitive", [False, True], ids=["cpu-kernels", "position-sensitive-experts"])
@pytest.mark.slow
def test_ranks_hold_the_same_bits_after_steps_not_split_under_expert_parallelism(v41_checkpoint, sensitive):
    """--ep 2 --cp 2: a step the CP group does not split holds the same rows on both ranks. Each
    rank used to send its copy of every row to the experts, where the two copies were computed in
    different expert batches (position, row count, EPLB replica), so the ranks' logits and caches
    drifted apart in the last bits (on an AVX2 CPU with the plain kernels, everywhere with
    position-sensitive ones); now every row is computed once and the outputs all-gathered."""
    ranks = launch(unsplit_steps, (v41_checkpoint, sensitive), ParallelLayout(ep=2, dp=1, cp=2), _cpu(),
                   threads_per_rank=1)
    first, second = ranks
    assert len(first["logits"]) == 8
    for step, (a, b) in enumerate(zip(first["logits"], second["logits"])):
        assert torch.equal(a, b), f"step {step}: the ranks' logits differ"
    assert first["state"].keys() == second["state"].keys()
    for name, tensor in first["state"].items():
        assert torch.equal(tensor, second["state"][name]), name


# ----------------------------------------------------------------------------- the layouts


def test_a_model_that_cannot_split_its_prefill_is_refused_with_its_reason():
    from deepinfer.engine.builder import check_context_parallel

    class Unsplittable:
        context_parallel_unsupported = "its layers read rows no gather provides"

    family = SimpleNamespace(model_type="toy", model_class=Unsplittable)
    with pytest.raises(ValueError, match=r"context parallelism \(--cp 2\) is not available for toy: its layers read "
                                         r"rows no gather provides; use --cp 1"):
        check_context_parallel(family, 2)
    check_context_parallel(family, 1)


# ------------------------------------------------------------------------- the example, end to end


@pytest.fixture(scope="module")
def cp_single_lines(cp_checkpoint) -> list[str]:
    return sample_lines(cp_checkpoint, "--cp", "1")


@pytest.mark.slow
def test_cp2_prints_the_single_process_samples(cp_checkpoint, cp_single_lines):
    """Greedy and seeded samples, prompts of 13-26 tokens (window 8, c4 and c8 blocks), MTP
    speculation on: prefill split over 2 ranks, decode in lockstep on both."""
    assert sample_lines(cp_checkpoint, "--cp", "2") == cp_single_lines


@pytest.mark.parametrize("flags", [
    # one EP group of two CP groups [0, 1] and [2, 3], which step their own requests: the EP idle
    # lockstep runs between the CP groups
    ("--ep", "4", "--cp", "2", "--dp", "2"),
    # the seeds' --ep 2 --cp 8 on 4 processes: EP groups [0, 1] and [2, 3] inside one CP group
    ("--ep", "2", "--cp", "4"),
], ids=["ep4-cp2-dp2", "ep2-cp4"])
@pytest.mark.slow
def test_several_groups_print_the_single_process_samples(cp_checkpoint, cp_single_lines, flags):
    assert sample_lines(cp_checkpoint, *flags) == cp_single_lines


@pytest.mark.slow
def test_v41_cp2_and_ep2_cp2_print_the_single_process_samples(v41_checkpoint):
    """DeepSeek-V4.1 with DSpark drafting on (the seeds' default; the checkpoint has the drafter):
    the 4 prompts (14-27 tokens: over window 8, several c2 and c1 entries, Engram n-grams) are
    prefilled in one step split over 2 ranks, decode and drafting run in lockstep on both. With
    bounded replay keeping 20 rows (the minimum with 5 drafts), --ep 2 --cp 2 also splits the
    encoder and then the kept rows (the drafter's features come from those)."""
    single = sample_lines(v41_checkpoint, "--cp", "1")
    assert not any("accept_rate=n/a" in line for line in single)  # drafting is on
    assert sample_lines(v41_checkpoint, "--cp", "2") == single
    replay = {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "20"}
    replayed = sample_lines(v41_checkpoint, "--cp", "1", env=replay)
    assert replayed != single  # bounded replay is on
    # --ep 2 also deals the prompts to 2 attention (DP) ranks: each decodes beside other sequences than in
    # the single process, which moves the last bits of the fp32 logits (outside batch-invariant mode), so
    # the decode perplexity is compared to 1e-4; the text and the acceptance exactly
    split_lines = sample_lines(v41_checkpoint, "--ep", "2", "--cp", "2", env=replay)
    assert [_without_ppl(line) for line in split_lines] == [_without_ppl(line) for line in replayed]
    assert [_ppl(line) for line in split_lines] == pytest.approx([_ppl(line) for line in replayed], rel=1e-4)


def _without_ppl(line: str) -> str:
    return line.rsplit("; decode_ppl=", 1)[0]


def _ppl(line: str) -> float:
    return float(line.rsplit("; decode_ppl=", 1)[1])


@pytest.fixture(scope="module")
def v41_vision_checkpoint(tmp_path_factory) -> str:
    from deepinfer.models.deepseek_v41.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("cp") / "v41-vision", "tiny", seed=0, with_vision=True))


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--cp", "2"), ("--ep", "2", "--cp", "2")], ids=["cp2", "ep2-cp2"])
def test_v41_image_samples_under_context_parallelism(v41_vision_checkpoint, flags):
    """The image samples' prefill split over a CP group (each rank embeds its own rows of the span,
    the tower's rows for them; with --ep 2 the rows every rank holds choose their experts with
    gate.bias_vl and share the exchange) print the single process's lines (fp32)."""
    pytest.importorskip("PIL")
    single = sample_lines(v41_vision_checkpoint, "--cp", "1")
    assert sum("[image " in line for line in single) == 2, single
    assert sample_lines(v41_vision_checkpoint, *flags) == single


@pytest.mark.slow
def test_v41_image_samples_with_bounded_replay_in_every_layout(v41_vision_checkpoint):
    """SWA bounded replay keeping 20 rows on the image samples (spans longer than that: their first
    rows only reach the encoder): the decoder's kept rows carry their span marks (bias_vl routing, no
    Engram contribution), alone, split over --cp 2 and with --ep 2 --cp 2 alike."""
    pytest.importorskip("PIL")
    replay = {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "20"}
    replayed = sample_lines(v41_vision_checkpoint, "--cp", "1", env=replay)
    assert sum("[image " in line for line in replayed) == 2, replayed
    assert replayed != sample_lines(v41_vision_checkpoint, "--cp", "1")  # bounded replay is on
    assert sample_lines(v41_vision_checkpoint, "--cp", "2", env=replay) == replayed
    split_lines = sample_lines(v41_vision_checkpoint, "--ep", "2", "--cp", "2", env=replay)
    assert [_without_ppl(line) for line in split_lines] == [_without_ppl(line) for line in replayed]
