"""Multi-process layouts on the CPU back end (gloo, 2 processes, fp32): expert parallelism and
data-parallel attention give the single-process tokens; failures end the launch; bad layouts are
refused before any process starts. (The EP exchange itself is also checked by the conformance
kit's collective level: core/testing/conformance_tests.py.)"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.parallel.launch import RankFailed, check_devices, launch, rank_environment
from deepinfer.parallel.layout import ParallelConfigError, ParallelLayout, check_runnable, resolve_layout
from example_modules import load_example
from node_helpers import run_nodes

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "offline_inference.py"


@pytest.fixture(scope="module")
def v4_checkpoint(tiny_v4) -> str:
    return str(tiny_v4)


@pytest.fixture(scope="module")
def v41_checkpoint(tiny_v41) -> str:
    return str(tiny_v41)


def _cpu():
    from deepinfer.plugins import load_accelerator_class
    return load_accelerator_class("cpu")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env.update(OMP_NUM_THREADS="1", DEEPINFER_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def sample_lines(checkpoint: str, *flags: str, env: dict[str, str] | None = None) -> list[str]:
    """The example's sample lines without their 'DP <rank>; ' prefix (which rank served a sample
    is the one thing a layout may change); `env`: variables to set for the run."""
    out = subprocess.run([sys.executable, str(EXAMPLE), "--model_name", checkpoint, "--dtype", "float32",
                          "--threads_per_rank", "1", *flags], capture_output=True, text=True,
                         env={**_env(), **(env or {})}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split("; ", 1)[1] for line in out.stdout.splitlines() if line.startswith("DP ")]
    assert lines, out.stdout
    return lines


# ----------------------------------------------------------------------- the example, end to end


@pytest.fixture(scope="module")
def v4_single_lines(v4_checkpoint) -> list[str]:
    return sample_lines(v4_checkpoint, "--ep", "1")


@pytest.mark.slow
def test_ep2_prints_the_single_process_samples(v4_checkpoint, v4_single_lines):
    """DeepSeek-V4 (hash and routed MoE layers, MTP drafting on): --ep 2 (dp 2 by default)."""
    assert sample_lines(v4_checkpoint, "--ep", "2") == v4_single_lines


@pytest.mark.slow
def test_two_ep_groups_print_the_single_process_samples(v4_checkpoint, v4_single_lines):
    """--ep 2 --dp 4 (the seeds' --ep 2 --dp 8, on 4 processes): EP groups [0, 1] and [2, 3], each
    exchanging over its own sub-group, four DP ranks with their own requests."""
    assert sample_lines(v4_checkpoint, "--ep", "2", "--dp", "4") == v4_single_lines


@pytest.mark.slow
def test_ep2_dp2_prints_the_single_process_samples_v41(v41_checkpoint):
    assert sample_lines(v41_checkpoint, "--ep", "2", "--dp", "2") == sample_lines(v41_checkpoint, "--ep", "1")


@pytest.mark.slow
def test_two_nodes_print_the_single_process_samples(v4_checkpoint, v4_single_lines):
    """Two node processes on one host over gloo (WORLD_SIZE=2, RANK=0/1): --ep 2 gives each node
    one DP rank; node 0 gathers and prints every sample, node 1 only its rank's summary."""
    node0, node1 = run_nodes([sys.executable, str(EXAMPLE), "--model_name", v4_checkpoint, "--dtype", "float32",
                              "--threads_per_rank", "1", "--ep", "2"], _env())
    assert node0.returncode == 0 and node1.returncode == 0, (node0.stderr[-3000:], node1.stderr[-3000:])
    lines = [line.split("; ", 1)[1] for line in node0.stdout.splitlines() if line.startswith("DP ")]
    assert lines == v4_single_lines
    assert {line.split(";")[0] for line in node0.stdout.splitlines() if line.startswith("DP ")} == {"DP 0", "DP 1"}
    assert not any(line.startswith("DP ") for line in node1.stdout.splitlines()), node1.stdout
    assert "node 1 of 2: node 0 prints the samples" in node1.stderr and "[rank 1]" in node1.stderr


@pytest.fixture(scope="module")
def v41_vision_checkpoint(tmp_path_factory) -> str:
    from deepinfer.models.deepseek_v41.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("par") / "v41-vision", "tiny", seed=0, with_vision=True))


def test_dp2_with_images_prints_the_single_process_samples(v41_vision_checkpoint):
    """DeepSeek-V4.1 with a vision tower, --dp 2 (fp32, greedy image samples): the text and image
    samples dealt over two processes, each rank running the tower for its own images."""
    pytest.importorskip("PIL")
    single = sample_lines(v41_vision_checkpoint, "--ep", "1")
    assert sum("[image " in line for line in single) == 2, single
    assert sample_lines(v41_vision_checkpoint, "--ep", "1", "--dp", "2") == single


@pytest.mark.slow
def test_ep2_with_images_prints_the_single_process_samples(v41_vision_checkpoint):
    """--ep 2 (two DP ranks sharing the experts): an image span's rows choose their experts with
    gate.bias_vl and travel the expert-parallel exchange with those choices (fp32, greedy)."""
    pytest.importorskip("PIL")
    single = sample_lines(v41_vision_checkpoint, "--ep", "1")
    assert sample_lines(v41_vision_checkpoint, "--ep", "2") == single


# --------------------------------------------------------------- lockstep: a rank with no requests


def generate_tokens(ctx, checkpoint: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Rank target: DP rank 0 (its CP group) serves every prompt, the others none (they only serve
    their experts)."""
    from deepinfer import LLM
    from deepinfer.parallel.expert_parallel import idle_until_peers_done
    from deepinfer.sampling_params import SamplingParams

    layout = ctx.layout
    llm = LLM(model=checkpoint, accelerator="cpu", dtype="float32", max_num_seqs=4, cache_memory_gb=0.05,
              ep=layout.ep, dp=layout.dp, cp=layout.cp)
    mine = prompts if ctx.dp_rank == 0 else []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate(mine, [params] * len(mine), use_tqdm=False) if mine else []
    idle_until_peers_done()
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def single_tokens(v4_checkpoint) -> list[list[int]]:
    tokens = launch(generate_tokens, (v4_checkpoint, IDLE_PROMPTS, 8), ParallelLayout(), _cpu())[0]
    assert all(len(t) == 8 for t in tokens)
    return tokens


IDLE_PROMPTS = ["The capital of France is", "1 2 3 4 5 6 7 8"]


@pytest.mark.parametrize("layout", [
    ParallelLayout(ep=2, dp=2),
    # EP group [2, 3] has no requests at all (it leaves its lockstep at once) while rank 1 serves
    # rank 0 in EP group [0, 1]
    ParallelLayout(ep=2, dp=4),
], ids=["ep2-dp2", "ep2-dp4"])
@pytest.mark.slow
def test_a_rank_without_requests_keeps_serving_its_experts(v4_checkpoint, single_tokens, layout):
    results = launch(generate_tokens, (v4_checkpoint, IDLE_PROMPTS, 8), layout, _cpu(), threads_per_rank=1)
    assert results[0] == single_tokens and all(r == [] for r in results[1:])


# --------------------------------------------------------------------------------- failures


def fail_on_rank_one(ctx) -> int:
    """Rank 1 raises; rank 0 meanwhile waits in a collective that rank 1 never joins."""
    from deepinfer.parallel.expert_parallel import current_expert_parallel

    if ctx.rank == 1:
        raise ValueError("rank one cannot load its shard")
    current_expert_parallel().idle_until_peers_done()
    return 0


def die_on_rank_one(ctx) -> int:
    if ctx.rank == 1:
        os._exit(3)
    time.sleep(60)
    return 0


@pytest.mark.slow
def test_a_failing_rank_ends_the_launch_with_its_error():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 failed") as failed:
        launch(fail_on_rank_one, (), ParallelLayout(ep=2, dp=2), _cpu(), threads_per_rank=1)
    assert failed.value.rank == 1 and "ValueError: rank one cannot load its shard" in failed.value.error
    # the exception itself comes back too: callers print a refusal as one line (examples/_launch.error_line)
    assert isinstance(failed.value.exception, ValueError) and str(failed.value.exception) == "rank one cannot load its shard"
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_a_rank_that_dies_silently_is_reported():
    with pytest.raises(RankFailed, match=r"exited with code 3"):
        launch(die_on_rank_one, (), ParallelLayout(ep=1, dp=2), _cpu(), threads_per_rank=1)


def where_am_i(ctx, tag: str) -> tuple[int, int, int, str]:
    return ctx.dp_rank, ctx.layout.dp, os.getpid(), tag


@pytest.mark.slow
def test_launch_dp_with_the_number_of_data_parallel_ranks(monkeypatch):
    """The seeds' entry point `launch_dp(main, dp_size)`: one process per data-parallel rank on the
    back end DEEPINFER_ACCELERATOR selects."""
    launch_dp = load_example("_launch.py").launch_dp

    for name, value in _env().items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    ranks = launch_dp(where_am_i, 2, args=("hello",))
    assert [(r[0], r[1], r[3]) for r in ranks] == [(0, 2, "hello"), (1, 2, "hello")]
    pids = {r[2] for r in ranks}
    assert len(pids) == 2 and os.getpid() not in pids
    assert launch_dp(where_am_i, 1, args=("one",))[0][:2] == (0, 1)  # one rank runs in this process
    with pytest.raises(ParallelConfigError, match="--dp 0 must be >= 1"):
        launch_dp(where_am_i, 0)


# ------------------------------------------------------------------------------ layout rules


def record_start(ctx, marker: str) -> None:
    Path(marker).write_text("started")


def test_a_cp_group_straddling_two_ep_groups_is_refused_before_any_process_starts(tmp_path):
    # ep 4, cp 6: CP group [6..11] would hold ranks of EP groups [4..7] and [8..11]
    marker = tmp_path / "started"
    with pytest.raises(ParallelConfigError, match=r"ep 4 and cp 6 a CP group would straddle two EP groups.*one "
                                                  r"divides the other"):
        launch(record_start, (str(marker),), ParallelLayout(ep=4, dp=2, cp=6), _cpu())
    assert not marker.exists()


def test_groups_of_the_seeds_layouts():
    """EP groups are blocks of ep consecutive ranks, CP groups blocks of cp (one DP rank each)."""
    ep2_dp8 = resolve_layout(2, 8, 1, "nvidia", env={})  # several EP groups, no CP
    assert ep2_dp8.ep_groups() == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert ep2_dp8.ep_group(5) == range(4, 6) and ep2_dp8.cp == 1
    ep2_cp8 = resolve_layout(2, None, 8, "nvidia", env={})  # dp 1: four EP groups inside one CP group
    assert ep2_cp8.dp == 1 and ep2_cp8.cp_groups() == [range(8)]
    assert [ep2_cp8.ep_group(r) for r in (0, 3, 7)] == [range(0, 2), range(2, 4), range(6, 8)]
    ep4_cp2 = ParallelLayout(ep=4, dp=2, cp=2)  # one EP group of two CP groups
    assert ep4_cp2.ep_groups() == [range(4)] and ep4_cp2.cp_groups() == [range(0, 2), range(2, 4)]
    assert ep4_cp2.cp_group(3) == range(2, 4)
    for layout in (ep2_dp8, ep2_cp8, ep4_cp2, ParallelLayout(ep=2, dp=2, cp=2), ParallelLayout(ep=1, dp=2, cp=2)):
        check_runnable(layout)
        ranks = range(layout.world_size)
        assert sorted(r for g in layout.ep_groups() for r in g) == list(ranks)
        assert all(layout.ep_group(r) == g for g in layout.ep_groups() for r in g)
    with pytest.raises(ValueError, match="rank 8 is outside a world of 8"):
        ep2_cp8.cp_group(8)


class RecordingCollectives:
    """Stands in for a back end: records the `new_group` calls a rank makes."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def new_group(self, ranks):
        self.calls.append(ranks)
        return f"handle{ranks}"

    def all_gather(self, tensor, group=None):
        return (tensor, group)


@pytest.mark.parametrize("layout, ep_ranks, cp_ranks, calls", [
    (ParallelLayout(ep=2, dp=4), [2, 3], None, [[0, 1], [2, 3]]),
    (ParallelLayout(ep=2, dp=1, cp=4), [2, 3], [0, 1, 2, 3], [[0, 1], [2, 3]]),
    (ParallelLayout(ep=4, dp=2, cp=2), [0, 1, 2, 3], [2, 3], [[0, 1], [2, 3]]),
    (ParallelLayout(ep=2, dp=2, cp=2), [2, 3], [2, 3], [[0, 1], [2, 3], [0, 1], [2, 3]]),
    (ParallelLayout(ep=4, dp=4), [0, 1, 2, 3], None, []),
], ids=["ep2-dp4", "ep2-cp4", "ep4-cp2-dp2", "ep2-cp2-dp2", "ep4-dp4"])
def test_every_rank_makes_every_group_in_the_same_order(layout, ep_ranks, cp_ranks, calls):
    """torch.distributed needs every rank to create every sub-group, in one order; a group that
    spans the world is the default group (collectives called without `group`)."""
    from deepinfer.parallel.groups import make_groups

    per_rank = []
    for rank in range(layout.world_size):
        back_end = RecordingCollectives()
        groups = make_groups(back_end, layout, rank)
        per_rank.append(back_end.calls)
        if rank == 2:
            assert list(groups.ep.ranks) == ep_ranks and groups.ep.rank == ep_ranks.index(2)
            assert (groups.cp is None) if cp_ranks is None else list(groups.cp.ranks) == cp_ranks
            _, handle = groups.ep.all_gather(1)
            assert handle == (None if len(ep_ranks) == layout.world_size else f"handle{ep_ranks}")
    assert all(c == calls for c in per_rank)


def test_layout_rules():
    assert resolve_layout(2, None, 1, "cpu", env={}) == ParallelLayout(ep=2, dp=2, cp=1)
    assert resolve_layout(None, None, 1, "nvidia", env={}).world_size == 8
    with pytest.raises(ParallelConfigError, match=r"3 x 1 = 3 must be divisible by --ep 2"):
        resolve_layout(2, 3, 1, "cpu", env={})
    two_nodes = resolve_layout(4, None, 1, "nvidia", env={"WORLD_SIZE": "2", "RANK": "1"})
    assert list(two_nodes.local_ranks()) == [2, 3]
    check_runnable(two_nodes)
    with pytest.raises(ParallelConfigError, match="threads_per_rank 0 must be >= 1"):
        launch(record_start, ("unused",), ParallelLayout(ep=2, dp=2), _cpu(), threads_per_rank=0)


def test_each_rank_sees_its_own_devices():
    layout = ParallelLayout(ep=4, dp=4)
    assert rank_environment("nvidia", layout, 1, env={"DEVICE_OFFSET": "2"}) == {"CUDA_VISIBLE_DEVICES": "3"}
    # one process per CP rank: DP rank 1 of cp 2 is local ranks 2 and 3, devices 2 and 3
    assert [rank_environment("ascend", ParallelLayout(ep=2, dp=2, cp=2), r, env={}) for r in (2, 3)] == \
        [{"ASCEND_RT_VISIBLE_DEVICES": "2"}, {"ASCEND_RT_VISIBLE_DEVICES": "3"}]
    assert rank_environment("cpu", layout, 1, env={}) == {}
    # devices the parent already narrowed down: the index counts in its list
    assert rank_environment("nvidia", layout, 1, env={"CUDA_VISIBLE_DEVICES": "4,5,6,7", "DEVICE_OFFSET": "2"}) \
        == {"CUDA_VISIBLE_DEVICES": "7"}


def test_a_layout_needing_more_devices_than_the_node_has_is_refused():
    # the seeds' default --ep 8 on a one-GPU machine: refused with the fix, before any process starts
    with pytest.raises(ParallelConfigError, match=r"need devices 0\.\.7.*sees 1.*--ep 1"):
        check_devices(ParallelLayout(ep=8, dp=8), "nvidia", 1, env={})
    with pytest.raises(ParallelConfigError, match=r"devices 4\.\.11 \(DEVICE_OFFSET=4\)"):
        check_devices(ParallelLayout(ep=8, dp=8), "ascend", 8, env={"DEVICE_OFFSET": "4"})
    check_devices(ParallelLayout(ep=8, dp=8), "nvidia", 8, env={})
    check_devices(ParallelLayout(ep=4, dp=4), "nvidia", 8, env={"DEVICE_OFFSET": "4"})
    check_devices(ParallelLayout(ep=1, dp=1), "nvidia", 1, env={"DEVICE_OFFSET": "3"})  # one process: no launch
    check_devices(ParallelLayout(ep=2, dp=2), "cpu", None, env={})  # the host has no device count
    check_devices(ParallelLayout(ep=2, dp=2), "nvidia", None, env={})  # the probe did not say


def test_the_engine_refuses_a_layout_outside_a_launch():
    from deepinfer.config import EngineConfig
    from deepinfer.engine.builder import check_parallel_layout

    with pytest.raises(ValueError, match=r"outside a parallel launch.*deepinfer.parallel.launch"):
        check_parallel_layout(EngineConfig(ep=2, dp=2))
    check_parallel_layout(EngineConfig())
