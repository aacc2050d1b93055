"""`deepinfer eval generate` and the judge on a tiny random DeepSeek-V4.1 (its cut-down real
tokenizer has the chat tokens), through the offline engine and through our own server on
127.0.0.1: resuming after an interruption, identical rows offline and over HTTP for greedy
decoding, the judge's structured output, and the command's stages end to end.

The text is gibberish; what is checked is the bookkeeping, the protocol and the equality."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepseek_recipe")

from deepinfer.eval import generate as gen  # noqa: E402
from deepinfer.eval.backends import Endpoint, EndpointBackend, SamplingSettings  # noqa: E402
from deepinfer.eval.offline import EngineSpec, run_offline  # noqa: E402
from deepinfer.eval.rows import GenerationFileError, RowWriter, read_rows  # noqa: E402
from deepinfer.eval.tasks import Task, gpqa_tasks  # noqa: E402

ENGINE = dict(accelerator="cpu", dtype="float32", max_model_len=2048, max_num_seqs=8)
GREEDY = SamplingSettings(temperature=0.0, top_p=1.0, max_tokens=12, thinking=False)
VOLATILE = ("fingerprint", "engine", "layout")  # what says which back end made a row


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from deepinfer.models.deepseek_v41.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("eval") / "tiny-v41", "tiny", seed=0, max_position_embeddings=2048))


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gpqa_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "gpqa_diamond.csv"
    lines = ["Record ID,Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3"]
    lines += [f"q{i},What is {i} plus {i}?,{2 * i},{2 * i + 1},{2 * i - 1},{i}" for i in range(1, 4)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _spec(model: str) -> EngineSpec:
    return EngineSpec(model=model, accelerator="cpu", dtype="float32", max_model_len=2048, max_num_seqs=8)


def _content(rows) -> list[dict]:
    return sorted((r.model_dump(exclude=set(VOLATILE)) for r in rows), key=lambda r: (r["task_id"], r["sample"]))


def test_an_interrupted_run_resumes_and_writes_each_row_once(model, gpqa_file, tmp_path, monkeypatch):
    out = tmp_path / "gen.jsonl"
    tasks = gpqa_tasks(gpqa_file)
    run, done = gen.open_run(out, "gpqa", GREEDY, progress=False)
    jobs = gen.plan(tasks, 2, seed=0, done=done)
    assert len(jobs) == 6

    calls = {"n": 0}
    append = RowWriter.append

    def interrupt_after_two(self, row):
        if calls["n"] == 2:
            raise KeyboardInterrupt
        calls["n"] += 1
        append(self, row)

    monkeypatch.setattr(RowWriter, "append", interrupt_after_two)
    with pytest.raises(KeyboardInterrupt):
        run_offline(run, jobs, _spec(model))
    monkeypatch.setattr(RowWriter, "append", append)
    first = out.read_text(encoding="utf-8")
    assert len(first.splitlines()) == 2

    # a write cut off by the interruption: the partial line is dropped and that sample made again
    with out.open("a", encoding="utf-8") as f:
        f.write(first.splitlines()[0][:40])
    run, done = gen.open_run(out, "gpqa", GREEDY, progress=False)
    assert out.read_text(encoding="utf-8") == first and len(done) == 2
    rest = gen.plan(tasks, 2, seed=0, done=done)
    assert len(rest) == 4 and not {j.key for j in rest} & done
    stats = run_offline(run, rest, _spec(model))
    assert (stats.written, stats.failed) == (4, 0)

    text = out.read_text(encoding="utf-8")
    assert text.startswith(first)  # the rows written before were not generated again
    keys = [(r["task_id"], r["sample"], r["seed"]) for r in map(json.loads, text.splitlines())]
    assert len(keys) == len(set(keys)) == 6
    assert gen.plan(tasks, 2, 0, gen.open_run(out, "gpqa", GREEDY)[1]) == []  # nothing left

    # the same file under other settings is refused, naming what differs
    run, _ = gen.open_run(out, "gpqa", GREEDY.model_copy(update={"max_tokens": 13}), progress=False)
    with pytest.raises(GenerationFileError, match="another engine or with other settings.*max_tokens.*12.*13"):
        run_offline(run, gen.plan(tasks, 3, 0, done), _spec(model))


def test_image_tasks_are_skipped_and_counted(model, tmp_path):
    tasks = [Task(id="img", question="What is shown?", answer="a cat", answer_type="exact", image="data:image/png;base64,AA"),
             Task(id="txt", question="Name a colour.", answer="red", answer_type="exact")]
    run, done = gen.open_run(tmp_path / "hle.jsonl", "hle", GREEDY, progress=False)
    stats = run_offline(run, gen.plan(tasks, 1, 0, done), _spec(model))
    assert (stats.skipped, stats.written) == (1, 1)
    rows = {r.task_id: r for r in read_rows(tmp_path / "hle.jsonl")}
    assert rows["img"].finish_reason == "skipped" and "image" in rows["img"].error
    assert rows["txt"].done and rows["txt"].messages[0]["role"] == "system"
    _, done = gen.open_run(tmp_path / "hle.jsonl", "hle", GREEDY)
    assert gen.plan(tasks, 1, 0, done) == []  # a resumed run does not write the skipped row again


# -- our own server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model):
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    from deepinfer.entrypoints.serve import build_server
    from deepinfer.server.protocol import ServerSettings
    from server_harness import running_server

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    settings = ServerSettings(api_key="k", max_pending=64)
    with running_server(*build_server(settings, model=model, **ENGINE)) as url:
        yield url + "/v1"
    torch.set_num_threads(threads)


def test_offline_and_server_generation_give_identical_rows_for_greedy(model, gpqa_file, server, tmp_path):
    tasks = gpqa_tasks(gpqa_file)
    offline_run, done = gen.open_run(tmp_path / "offline.jsonl", "gpqa", GREEDY, progress=False)
    run_offline(offline_run, gen.plan(tasks, 2, 0, done), _spec(model))
    served_run, done = gen.open_run(tmp_path / "served.jsonl", "gpqa", GREEDY, progress=False)
    endpoint = Endpoint(server, api_key="k", timeout=120)
    backend = EndpointBackend(endpoint, endpoint.default_model(), concurrency=3)
    stats = gen.generate(served_run, backend, backend.describe(), gen.plan(tasks, 2, 0, done))
    assert stats.failed == 0
    offline, served = read_rows(tmp_path / "offline.jsonl"), read_rows(tmp_path / "served.jsonl")
    assert len(offline) == 6 and all(r.done and r.completion_tokens > 0 and r.text for r in offline)
    assert _content(offline) == _content(served)
    assert served[0].engine["backend"] == "endpoint" and offline[0].engine["backend"] == "offline"


def test_thinking_rows_keep_the_reasoning_apart(server, tmp_path):
    """Thinking on (the default): the endpoint's reasoning_content lands in `reasoning`."""
    tasks = [Task(id="t", question="Say hi.", answer="hi", answer_type="exact")]
    settings = SamplingSettings(max_tokens=24)
    run, done = gen.open_run(tmp_path / "think.jsonl", "hle", settings, progress=False)
    endpoint = Endpoint(server, api_key="k", timeout=120)
    backend = EndpointBackend(endpoint, endpoint.default_model())
    gen.generate(run, backend, backend.describe(), gen.plan(tasks, 1, 0, done))
    (row,) = read_rows(tmp_path / "think.jsonl")
    assert row.done and row.reasoning and row.completion_tokens == 24 and row.finish_reason == "length"


@pytest.mark.slow  # 400 tokens per judged row
def test_the_judge_answers_in_its_schema_through_our_server(server):
    from deepinfer.eval.judge import Judge
    from deepinfer.eval.scoring import judge_row

    endpoint = Endpoint(server, api_key="k", timeout=120)
    # short strings: a random model's judge fills them to the bound
    judge = Judge(endpoint, endpoint.default_model(), max_tokens=400, extra_body={"thinking": {"type": "disabled"}},
                  answer_chars=30, reasoning_chars=60)
    row = gen.make_row(gen.Run(Path("x"), "hle", GREEDY, {}), gen.Job(
        Task(id="h", question="What is 3/4 as a decimal?", answer="0.75", answer_type="exact"), 0, 0,
        [{"role": "user", "content": "What is 3/4 as a decimal?"}], None),
        gen.Completion(text="Explanation: easy.\nExact Answer: 0.75\nConfidence: 90%", finish_reason="stop"), "f", {})
    score = judge_row(row, judge)
    assert score.status == "scored" and score.method == "judge", score.note
    assert score.judge["model"] == endpoint.default_model() and 0 <= score.judge["confidence"] <= 100
    assert isinstance(score.correct, bool)


def test_a_judge_that_leaves_its_schema_leaves_the_row_unjudged(monkeypatch):
    from deepinfer.eval.judge import Judge
    from deepinfer.eval.scoring import judge_row

    endpoint = Endpoint("http://127.0.0.1:9/v1")
    monkeypatch.setattr(endpoint, "chat", lambda body: {"choices": [{"message": {"content": "yes, correct"}}]})
    row = gen.make_row(gen.Run(Path("x"), "hle", GREEDY, {}), gen.Job(
        Task(id="h", question="q", answer="1", answer_type="exact"), 0, 0, [], None),
        gen.Completion(text="Exact Answer: 1", finish_reason="stop"), "f", {})
    score = judge_row(row, Judge(endpoint, "judge"))
    assert score.status == "unjudged" and "verdict schema" in score.note and score.answer == "1"
    with pytest.raises(ValueError, match="placeholder {correct_answer}"):
        Judge(endpoint, "judge", prompt="{question} {response}")


def test_the_command_runs_generate_score_and_report(model, gpqa_file, tmp_path, capsys):
    from deepinfer.cli import main

    out = tmp_path / "gpqa" / "generations.jsonl"
    args = ["eval", "generate", "gpqa", "--data", str(gpqa_file), "--samples", "2", "--output", str(out), "--model",
            model, "--accelerator", "cpu", "--dtype", "float32", "--max-tokens", "8", "--no-progress"]
    assert main(args) == 0
    assert main(args) == 0  # resumed: nothing left to do
    assert "6 done" in capsys.readouterr().out
    assert main(["eval", "score", str(out)]) == 0
    assert main(["eval", "report", str(tmp_path / "gpqa" / "scores.jsonl")]) == 0
    summary = json.loads((tmp_path / "gpqa" / "scores_report.json").read_text())
    assert summary["benchmark"] == "gpqa" and summary["tasks"] == 3 and summary["counted"] == 6
    assert set(summary["pass@k"]) == {"1", "2"} and 0 <= summary["pass@1"] <= 1
    assert main(["eval", "generate", "gpqa", "--output", str(out)]) == 2
    assert "gpqa_diamond.csv" in capsys.readouterr().err


def test_endpoint_flags_and_offline_flags_do_not_mix(capsys):
    from deepinfer.cli import main

    assert main(["eval", "generate", "aime26", "--endpoint", "http://127.0.0.1:9/v1", "--ep", "2", "--dtype",
                 "float32"]) == 2
    assert "--dtype, --ep configure the offline engine, which --endpoint replaces" in capsys.readouterr().err
    assert main(["eval", "generate", "aime26", "--limit", "0"]) == 2
    assert "--limit 0 must be >= 1" in capsys.readouterr().err


def test_the_endpoint_client_retries_busy_answers_and_reports_refusals():
    """A 503 is tried again; a 400 is a failed sample carrying the server's message."""
    import http.server

    answers = [(503, {"error": {"message": "busy"}}),
               (200, {"choices": [{"message": {"content": "Answer: B", "reasoning_content": "hmm"},
                                   "finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}),
               (400, {"error": {"message": "max_tokens is too large"}})]
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server interface
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            status, body = answers.pop(0)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        backend = EndpointBackend(Endpoint(f"http://127.0.0.1:{httpd.server_port}/v1", retries=2), "m", 1)
        (rid, ok), = backend.run([("a", {"model": "m"})])
        assert (rid, ok.text, ok.reasoning, ok.completion_tokens, ok.error) == ("a", "Answer: B", "hmm", 3, None)
        (_, refused), = backend.run([("b", {"model": "m"})])
        assert refused.error.endswith("HTTP 400: max_tokens is too large") and refused.finish_reason == "error"
        assert len(seen) == 3
    finally:
        httpd.shutdown()


@pytest.mark.slow
def test_an_expert_parallel_run_deals_each_sample_to_one_rank(model, gpqa_file, tmp_path):
    """--ep 2 (two data-parallel ranks in one expert-parallel group, spawned processes, shares of
    unequal size): every sample is written once, with the rows a single engine writes."""
    tasks = gpqa_tasks(gpqa_file)
    single, done = gen.open_run(tmp_path / "single.jsonl", "gpqa", GREEDY, progress=False)
    run_offline(single, gen.plan(tasks, 2, 0, done), _spec(model))
    run, done = gen.open_run(tmp_path / "ep2.jsonl", "gpqa", GREEDY, progress=False)
    jobs = gen.plan(tasks, 2, 0, done)
    from deepinfer.eval.offline import owner

    assert {owner(j, 2) for j in jobs} == {0, 1}
    stats = run_offline(run, jobs, _spec(model).model_copy(update={"ep": 2, "threads_per_rank": 1}))
    assert (stats.written, stats.failed) == (6, 0)
    rows = read_rows(tmp_path / "ep2.jsonl")
    assert len(rows) == 6 and {r.layout for r in rows} == {"ep=2 dp=2 cp=1 (world size 2)"}
    assert _content(rows) == _content(read_rows(tmp_path / "single.jsonl"))


@pytest.mark.slow
def test_ctrl_c_keeps_the_rows_and_the_same_command_finishes_the_run(model, gpqa_file, tmp_path):
    """The real command, interrupted with SIGINT once rows are coming in, exits 130 at once; run
    again, it makes only what is missing."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "gen.jsonl"
    command = [sys.executable, "-c", "import sys; from deepinfer.cli import main; sys.exit(main())", "eval", "generate",
               "gpqa", "--data", str(gpqa_file), "--samples", "4", "--output", str(out), "--model", model,
               "--accelerator", "cpu", "--dtype", "float32", "--max-tokens", "48", "--max-num-seqs", "1",
               "--no-thinking", "--no-progress"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.is_file() and out.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "run the same command again to resume" in err, err
    kept = len(read_rows(out))
    assert 2 <= kept < 12
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{kept} done" in done.stdout and f"{12 - kept} to generate" in done.stdout
    keys = [(r["task_id"], r["sample"]) for r in map(json.loads, out.read_text().splitlines())]
    assert len(keys) == len(set(keys)) == 12
