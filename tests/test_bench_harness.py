"""deepinfer.benchmarks' timing loop (`timing`) and A/B runs (`ab`, `examples/benchmark.py --ab`):
which side goes first in each round, per-round ratios, the command and environment each side's
process gets, and the summary. Fake sides and clocks throughout; the end-to-end run checks what
the processes did, never how fast."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from deepinfer.benchmarks import ab, model_cost, results, timing
from example_modules import load_example

# --- timing ----------------------------------------------------------------------------------------


def test_every_round_measures_every_case_the_first_side_alternating():
    calls = []

    def side(name):
        def measure(case):
            calls.append((case, name))
            return f"{name}{case}#{len(calls)}"
        return measure

    samples = timing.alternating_rounds({"A": side("A"), "B": side("B")}, rounds=3, cases=["x", "y"])
    assert calls == [("x", "A"), ("x", "B"), ("y", "A"), ("y", "B"),   # round 1: A first
                     ("x", "B"), ("x", "A"), ("y", "B"), ("y", "A"),   # round 2: B first
                     ("x", "A"), ("x", "B"), ("y", "A"), ("y", "B")]   # round 3: A first again
    assert samples["x"]["A"] == ["Ax#1", "Ax#6", "Ax#9"] and samples["y"]["B"] == ["By#4", "By#7", "By#12"]
    assert [timing.side_order(["A", "B", "C"], r) for r in (0, 1)] == [["A", "B", "C"], ["C", "B", "A"]]


def test_on_sample_sees_every_measurement_in_order():
    seen = []
    out = timing.alternating_rounds({"A": lambda _: 1.0, "B": lambda _: 2.0}, rounds=2,
                                    on_sample=lambda r, case, side, value: seen.append((r, case, side, value)))
    assert seen == [(0, None, "A", 1.0), (0, None, "B", 2.0), (1, None, "B", 2.0), (1, None, "A", 1.0)]
    assert out == {None: {"A": [1.0, 1.0], "B": [2.0, 2.0]}}


@pytest.mark.parametrize("rounds, sides", [(0, {"A": lambda _: 1}), (2, {})])
def test_a_loop_that_would_measure_nothing_is_refused(rounds, sides):
    with pytest.raises(ValueError, match="rounds must be at least 1|no sides"):
        timing.alternating_rounds(sides, rounds)


def test_ratios_are_per_round_and_skip_rounds_that_measured_nothing():
    assert timing.ratios([10.0, 30.0, 12.0], [20.0, 20.0, 0.0]) == [0.5, 1.5]
    spread = timing.Spread.of(timing.ratios([10.0, 20.0, 30.0], [20.0, 20.0, 20.0]))
    assert (spread.median, spread.low, spread.high, spread.n) == (1.0, 0.5, 1.5, 3)
    assert spread.text() == "1.00x (0.50-1.50)" and timing.Spread.of([2.0]).text(".1f", " s") == "2.0 s"
    with pytest.raises(ValueError, match="as many rounds"):
        timing.ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="no values"):
        timing.Spread.of([])


def test_timed_reads_the_clock_before_and_after_the_call():
    ticks = iter([100.0, 102.5])
    calls = []
    value, seconds = timing.timed(lambda: calls.append("ran") or "value", clock=lambda: next(ticks))
    assert (value, seconds, calls) == ("value", 2.5, ["ran"])


# --- A/B: options, commands, environments ------------------------------------------------------------


def test_ab_options_come_off_the_command_line_each_side_runs():
    options, rest = ab.split_argv(["--preset", "cpu", "--ab", "X=1", "--phase", "decode", "--ab=Y=", "--ab_rounds",
                                   "4", "--ab_model", "/m2", "--repeats", "2"])
    assert rest == ["--preset", "cpu", "--phase", "decode", "--repeats", "2"]
    assert (options.ab, options.ab_model, options.ab_rounds) == (["X=1", "Y="], "/m2", 4)
    assert ab.parse_assignments(options.ab) == {"X": "1", "Y": ""}
    a, b = ab.sides_of(options)
    assert (a.env, a.model, a.describe()) == ({}, None, "as given")
    assert (b.env, b.model, b.describe()) == ({"X": "1", "Y": ""}, "/m2", "X=1 Y= --model_name /m2")


@pytest.mark.parametrize("argv, message", [
    (["--ab", "NOEQUALS"], "give an environment variable as NAME=VALUE"),
    (["--ab", "1X=2"], "give an environment variable as NAME=VALUE"),
    (["--ab_rounds", "2"], "needs side B's changes"),
    (["--ab", "X=1", "--ab_rounds", "0"], "--ab_rounds 0 must be >= 1"),
])
def test_bad_ab_options_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        ab.sides_of(ab.split_argv(argv)[0])


def _record(path: str, prefill_tps: float | None, decode_tps: float) -> dict:
    """A minimal result record: one prefill run (if any) and one decode run of 4 sequences x 10 steps."""
    return {"schema": results.SCHEMA, "nextn": 0, "settings": {"decode_num_requests": 4},
            "layout": {"scale": 1, "cp": 1}, "model": {"path": path},
            "prefill": [] if prefill_tps is None else [{"tokens": 100, "seconds": 100 / prefill_tps, "batches": 1,
                                                        "mean_ttft_s": 0.1}],
            "decode": [{"requests": 4, "steps": 10, "sequence_steps": 40, "seconds": 40 / decode_tps,
                        "accepted_tokens": 40, "speculation": None}]}


def test_each_side_runs_its_command_and_environment_in_alternating_order():
    calls = []

    def fake_run(cmd, env):
        calls.append((list(cmd), {k: env[k] for k in ("X", "KEEP") if k in env}))
        return {"n": len(calls)}

    sides = [ab.Side("A"), ab.Side("B", {"X": "1"}, "/m2")]
    seen = []
    records = ab.run_sides(["py", "benchmark.py", "--phase", "decode"], sides, rounds=2, env={"KEEP": "k", "X": "0"},
                           run=fake_run, on_record=lambda r, side, rec: seen.append((r, side, rec["n"])))
    a_cmd = ["py", "benchmark.py", "--phase", "decode"]
    b_cmd = a_cmd + ["--model_name", "/m2"]
    assert calls == [(a_cmd, {"KEEP": "k", "X": "0"}), (b_cmd, {"KEEP": "k", "X": "1"}),
                     (b_cmd, {"KEEP": "k", "X": "1"}), (a_cmd, {"KEEP": "k", "X": "0"})]
    assert records == {"A": [{"n": 1}, {"n": 4}], "B": [{"n": 2}, {"n": 3}]}
    assert seen == [(0, "A", 1), (0, "B", 2), (1, "B", 3), (1, "A", 4)]


def test_summary_gives_medians_per_side_and_per_round_ratios():
    records = {"A": [_record("/m", 100.0, 10.0), _record("/m", 200.0, 20.0), _record("/m", 300.0, 30.0)],
               "B": [_record("/m", 150.0, 10.0), _record("/m", 200.0, 40.0), _record("/m", 600.0, 15.0)]}
    rows = {r.label: r for r in ab.summarise(records)}
    prefill = rows["prefill throughput (tokens/s/device)"]
    assert (prefill.a, prefill.b) == pytest.approx((200.0, 200.0))
    assert (prefill.ratio.median, prefill.ratio.low, prefill.ratio.high) == pytest.approx((1.5, 1.0, 2.0))
    decode = rows["decode throughput, accepted tokens (tokens/s/device)"]
    assert (decode.ratio.median, decode.ratio.low, decode.ratio.high) == pytest.approx((1.0, 0.5, 2.0))
    assert rows["decode avg_SPS (steps/s)"].a == pytest.approx(20.0 / 4)
    assert ab.WORK_LABEL not in rows  # the same checkpoint on both sides
    table = ab.format_summary(list(rows.values()), [ab.Side("A"), ab.Side("B", {"X": "1"})], 3)
    assert "A: as given; B: X=1" in table
    assert "| prefill throughput (tokens/s/device) | 200.00 | 200.00 | 1.50x (1.00-2.00) |" in table


def test_a_figure_one_side_did_not_measure_is_left_out_and_the_work_row_scales_by_active_parameters():
    records = {"A": [_record("/v4", None, 10.0)], "B": [_record("/v41", 100.0, 5.0)]}
    rows = {r.label: r for r in ab.summarise(records, {"A": 4_000_000_000, "B": 6_000_000_000})}
    assert "prefill throughput (tokens/s/device)" not in rows
    work = rows[ab.WORK_LABEL]
    assert (work.a, work.b) == pytest.approx((40.0, 30.0)) and work.ratio.median == pytest.approx(0.75)
    assert ab.WORK_LABEL not in {r.label for r in ab.summarise(records, {"A": 4, "B": None})}


def test_active_parameters_only_when_the_sides_ran_different_checkpoints(tmp_path):
    from deepinfer.models.deepseek_v4.make_model import make_model as make_v4
    from deepinfer.models.deepseek_v41.make_model import make_model as make_v41

    v4, v41 = make_v4(tmp_path / "v4", size="tiny"), make_v41(tmp_path / "v41", size="tiny")
    same = {"A": [_record(str(v4), None, 1.0)], "B": [_record(str(v4), None, 1.0)]}
    assert ab.active_params_if_models_differ(same) is None
    params = ab.active_params_if_models_differ({"A": [_record(str(v4), None, 1.0)], "B": [_record(str(v41), None, 1.0)]})
    for side, path in (("A", v4), ("B", v41)):
        config, _, _ = model_cost.checkpoint_config(path)
        assert params[side] == model_cost.token_cost(config).active_params > 0


WRITES_A_RECORD = textwrap.dedent("""
    import json, sys
    flags = [i for i, a in enumerate(sys.argv) if a == "--result_jsonl"]
    out = sys.argv[flags[-1] + 1]  # the last one wins, as in argparse: the one run_recorded adds
    if sys.argv[1] == "fail":
        sys.exit("the side failed loudly")
    with open(out, "a") as f:
        f.write(json.dumps({"schema": "deepinfer.benchmark/1", "argv": sys.argv[1:]}) + "\\n")
""")


def test_run_recorded_returns_the_record_its_process_appended_or_names_the_failure(tmp_path):
    script = tmp_path / "fake_benchmark.py"
    script.write_text(WRITES_A_RECORD)
    record = ab.run_recorded([sys.executable, str(script), "ok", "--result_jsonl", "/elsewhere.jsonl"], {})
    assert record["argv"][0] == "ok" and record["argv"][-2] == "--result_jsonl"
    assert record["argv"][-1] != "/elsewhere.jsonl"
    with pytest.raises(ab.RunFailed, match="(?s)failed \\(exit 1\\).*the side failed loudly"):
        ab.run_recorded([sys.executable, str(script), "fail"], {})


# --- examples/benchmark.py --ab, end to end on tiny checkpoints ---------------------------------------


@pytest.mark.slow  # two benchmark processes
def test_benchmark_ab_runs_both_sides_and_records_them(tiny_v4, tiny_v41, tmp_path, capsys, clean_env):
    """Side A: tiny V4 with the seeds' speculation default; side B: tiny V4.1 with
    DEEPINFER_USE_NEXTN_DECODE=0 (what the records say each process ran, not how fast)."""
    benchmark = load_example("benchmark.py")
    v4, v41 = tiny_v4, tiny_v41
    clean_env.setenv("DEEPINFER_ACCELERATOR", "cpu")
    clean_env.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "ab.jsonl"
    argv = ["--model_name", str(v4), "--phase", "decode", "--decode_num_requests", "2", "--context_length", "16",
            "--decode_tokens", "3", "--prefill_batch_size", "48", "--no_warmup", "--dtype", "float32",
            "--ab", "DEEPINFER_USE_NEXTN_DECODE=0", "--ab_model", str(v41), "--ab_rounds", "1",
            "--result_jsonl", str(out)]
    assert benchmark.main(argv) == 0
    captured = capsys.readouterr()
    assert f"A: as given; B: DEEPINFER_USE_NEXTN_DECODE=0 --model_name {v41}" in captured.out
    for label in ("decode avg_SPS (steps/s)", "decode throughput, accepted tokens", ab.WORK_LABEL):
        assert f"| {label}" in captured.out
    assert "prefill throughput" not in captured.out  # --phase decode: nothing to compare
    assert "A/B round 1/1, side A:" in captured.err and "A/B round 1/1, side B:" in captured.err
    by_side = {r["ab"]["side"]: r for r in results.read_jsonl(out)}
    assert by_side["A"]["model"]["model_type"] == "deepseek_v4" and by_side["B"]["model"]["model_type"] == "deepseek_v41"
    assert by_side["B"]["ab"]["env"] == {"DEEPINFER_USE_NEXTN_DECODE": "0"} and by_side["B"]["nextn"] == 0
    assert by_side["A"]["ab"] == {"side": "A", "round": 0, "env": {}, "model": None}
    for record in by_side.values():
        assert record["settings"]["decode_num_requests"] == 2 and len(record["decode"]) == 1
    json.dumps(by_side)


def test_benchmark_ab_refuses_bad_options_before_running_anything(capsys):
    benchmark = load_example("benchmark.py")
    assert benchmark.main(["--ab", "oops"]) == 2
    assert "error: --ab 'oops': give an environment variable as NAME=VALUE" in capsys.readouterr().err
