"""The measuring scripts in scripts/ run on tiny checkpoints and print what they promise (their
figures' format and the checks they make, never a timing): the prefix cache on and off, SWA bounded
replay against exact prefill, the cpu back end's linear paths, and on gloo ranks context parallelism and
EPLB."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from deepinfer_plugins.cpu import packed_weights
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels
from example_modules import REPO, load_script


def _run(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """A script as its users run it (ranks are spawned processes, which import the script as __main__)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env.update(OMP_NUM_THREADS="1", DEEPINFER_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, str(REPO / "scripts" / f"{script}.py"), *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_prefix_cache_bench_reuses_prefixes_and_agrees_under_batch_invariant_kernels(tiny_v4, capsys, clean_env):
    model = tiny_v4
    script = load_script("bench_prefix_cache")
    argv = ["--model", str(model), "--dtype", "float32", "--conversations", "2", "--turns", "2", "--system_tokens",
            "48", "--user_tokens", "8", "--answer_tokens", "2", "--rounds", "2", "--block_tokens", "16",
            "--threads", "1", "--batch_invariant"]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    rounds = [m.groups() for m in map(re.compile(r"^round (\d): (off|on) [\d.]+ s$").match, out.splitlines()) if m]
    assert rounds == [("0", "off"), ("0", "on"), ("1", "on"), ("1", "off")]  # the first mode alternates
    hits = int(out.split("hit rate ")[1].split("/")[0])
    assert hits > 0  # the system prompt and the first turn come back from the cache
    assert "answers identical in both modes: 8/8" in out
    assert "speed-up " in out and "(per round; min-max)" in out


def test_linear_paths_bench_prints_a_row_per_shape_and_row_count(capsys):
    """Every path this build has (the register tiles where the tier has them, AMX where usable, oneDNN where
    torch has its bf16 kernel) gets a time in each row, and the fastest is one of them."""
    script = load_script("bench_linear_paths")
    kernels = NativeCpuKernels()
    if kernels.native_library is None:
        pytest.fail("the native library did not build")
    assert script.main(["--shapes", "128x64", "--rows", "1,9", "--rounds", "2", "--cold_mb", "1"]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 128 x 64")]
    assert [r[1] for r in rows] == ["1", "9"]
    has = {"tiles": True, "amx": kernels.native_amx, "onednn": packed_weights.onednn_bf16()}
    for r in rows:
        timed = {name for name, cell in zip(("tiles", "amx", "onednn"), r[2:5]) if cell != "-"}
        assert timed == {name for name, present in has.items() if present} and r[5] in timed


@pytest.mark.slow  # the fast lane runs the prefix-cache script
def test_swa_replay_bench_prints_one_row_per_prompt_length(capsys):
    script = load_script("bench_swa_replay")
    assert script.main(["--size", "tiny", "--lengths", "48", "80", "--keep", "16", "--new-tokens", "3",
                        "--repeats", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| prompt | greedy agreement")
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| 48", "| 80"]
    for row in rows[1:]:
        cells = row.strip("| ").split(" | ")
        agree, total = map(int, cells[1].split("/"))
        assert total == 3 and 0 <= agree <= 3
        exact, bounded = (float(x) for x in cells[4].split(" (")[0].split(" / "))
        assert bounded < exact  # rows before the kept suffix skip the decoder


@pytest.mark.slow
def test_context_parallel_bench_agrees_with_one_rank():
    out = _run("bench_context_parallel", "--tokens", "96", "--rounds", "2", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["round"], r["cp"]) for r in rows] == [(0, 1), (0, 2), (1, 2), (1, 1)]  # the first side alternates
    assert all(len(r["gather_seconds"]) == 2 and r["gather_mib"] > 0 for r in rows if r["cp"] == 2)
    assert "cp2/cp1 time ratio" in out.stdout and "greedy first tokens identical: True" in out.stdout


@pytest.mark.slow
def test_eplb_bench_balances_the_skewed_load_without_changing_tokens():
    out = _run("bench_eplb", "--ep", "2", "--layers", "2", "--max_tokens", "6", "--interval", "2", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["same_tokens"] is True
    off, on = report["off"], report["on"]
    assert len(off["rows"]) == len(on["rows"]) == 2 and sum(off["rows"]) == sum(on["rows"]) > 0
    # the hot experts all sit on rank 0 without EPLB; its replicas spread them (counts, not timings)
    assert off["imbalance"] > on["imbalance"] >= 1.0
