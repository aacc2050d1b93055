"""`deepinfer serve --dp 2`: one HTTP front end over two engine processes (cpu, gloo launcher, one
thread per rank), driven with the real `openai` client: greedy outputs equal the offline engine's,
a burst spreads over both ranks, follow-up turns stay on their conversation's rank and hit its
prefix cache, a disconnect frees the request on its rank, a killed rank fails its own requests with
503 while the other keeps serving, and layouts serve cannot run are refused before anything starts.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytestmark = pytest.mark.slow

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("deepseek_recipe")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

ENGINE = dict(accelerator="cpu", dtype="float32", max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=256)
BLOCK = 16
MODEL = "tiny-v4"


class DPServer:
    def __init__(self, path: str, **serve_flags: str):
        import uvicorn

        from deepinfer.entrypoints.serve import build_parser, build_server, data_parallel
        from deepinfer.server.protocol import ServerSettings

        flags = ["--dp", "2", "--threads-per-rank", "1", "--accelerator", "cpu"]
        for k, v in serve_flags.items():
            flags += [f"--{k.replace('_', '-')}", v]
        dp = data_parallel(build_parser().parse_args(flags))
        self.app, self.front = build_server(ServerSettings(default_thinking=False), dp, model=path,
                                            features={"prefix_cache": {"block_tokens": BLOCK}}, **ENGINE)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.srv = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.srv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.srv.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def rank_of(self, request_id: str) -> int:
        return self.front.recent_routes[request_id].rank

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def close(self) -> None:
        self.srv.should_exit = True
        self.thread.join(timeout=30)
        self.front.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from deepinfer.models.deepseek_v4.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("serve-dp") / MODEL, "tiny", seed=0, with_mtp=False,
                          max_position_embeddings=2048))


@pytest.fixture(scope="module")
def server(ckpt):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    s = DPServer(ckpt)
    yield s
    s.close()
    torch.set_num_threads(threads)


def _wait(condition, what: str, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _rank_idle(server: DPServer, rank: int) -> bool:
    m = server.metrics()
    return all(m[f'deepinfer_rank_{name}{{rank="{rank}"}}'] == 0
               for name in ("requests_pending", "requests_running", "cache_slots_used"))


def test_concurrent_greedy_requests_equal_the_offline_engine_and_spread_over_both_ranks(server, ckpt):
    from deepinfer import LLM, SamplingParams

    prompts = [f"Request number {i}: " + "abc " * (i % 7) for i in range(16)]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)

    async def one(p: str, i: int) -> tuple[str, str, int]:
        if i % 2:
            chunks = [c async for c in await client.completions.create(
                model=MODEL, prompt=p, max_tokens=6, temperature=0, stream=True,
                stream_options={"include_usage": True})]
            return chunks[0].id, "".join(c.choices[0].text for c in chunks if c.choices), \
                chunks[-1].usage.completion_tokens
        out = await client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
        return out.id, out.choices[0].text, out.usage.completion_tokens

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))
        finally:
            await client.close()

    served = asyncio.run(all_of_them())
    with LLM(model=ckpt, **ENGINE) as llm:
        offline = [(o.outputs[0].text, len(o.outputs[0].token_ids))
                   for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)]
    assert [(text, n) for _, text, n in served] == offline
    ranks = [server.rank_of(rid) for rid, _, _ in served]
    assert min(ranks.count(0), ranks.count(1)) >= 3, ranks  # a burst of unrelated prompts spreads
    m = server.metrics()
    assert m['deepinfer_rank_requests_total{rank="0"}'] + m['deepinfer_rank_requests_total{rank="1"}'] >= 16
    assert m["deepinfer_rank_up{rank=\"0\"}"] == 1 and m["deepinfer_rank_up{rank=\"1\"}"] == 1


def test_follow_up_turns_stay_on_their_conversations_rank_and_hit_its_prefix_cache(server):
    rng = random.Random(1)
    conversations = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(4)]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    hits_before = sum(server.metrics()[f'deepinfer_rank_prefix_cache_hits{{rank="{r}"}}'] for r in (0, 1))
    affinity_before = server.metrics().get('deepinfer_route_total{reason="affinity"}', 0)

    async def turn(i: int) -> str:
        out = await client.completions.create(model=MODEL, prompt=conversations[i], max_tokens=3, temperature=0)
        conversations[i] = conversations[i] + [rng.randrange(3, 500) for _ in range(6)]  # the next turn's prompt
        return out.id

    async def three_turns() -> list[list[int]]:
        try:
            return [[server.rank_of(rid) for rid in await asyncio.gather(*(turn(i) for i in range(4)))]
                    for _ in range(3)]
        finally:
            await client.close()

    first, second, third = asyncio.run(three_turns())
    assert second == first and third == first, (first, second, third)
    m = server.metrics()
    assert m['deepinfer_route_total{reason="affinity"}'] - affinity_before == 8
    # every follow-up restored its earlier turn's state (32 of 40, then 32 of 46 and 48 of 52 tokens)
    assert sum(m[f'deepinfer_rank_prefix_cache_hits{{rank="{r}"}}'] for r in (0, 1)) - hits_before >= 8


def test_a_disconnect_frees_the_request_on_its_rank(server):
    before = server.metrics().get('deepinfer_request_finish_total{reason="abort"}', 0)
    stream = server.client().completions.create(model=MODEL, prompt="Talk for a long time", max_tokens=1500,
                                                temperature=0, stream=True)
    for i, chunk in enumerate(stream):
        if i == 2:
            break
    rank = server.rank_of(chunk.id)
    m = server.metrics()
    assert m[f'deepinfer_rank_requests_pending{{rank="{rank}"}}'] == 1
    stream.close()
    _wait(lambda: _rank_idle(server, rank), f"rank {rank} to free the request", timeout=10)
    assert server.metrics()['deepinfer_request_finish_total{reason="abort"}'] == before + 1


def test_a_killed_rank_fails_its_requests_with_503_and_the_other_keeps_serving(ckpt, one_thread):
    server = DPServer(ckpt)
    try:
        body = {"model": MODEL, "prompt": "the victim request", "max_tokens": 1500, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            victim = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=120)
            _wait(lambda: server.front.ranks[0].status is not None and server.front.ranks[0].status.running == 1,
                  "the victim to run on rank 0")
            survivor = server.client().completions.create(model=MODEL, prompt="the survivor", max_tokens=1500,
                                                          temperature=0, stream=True)
            chunk = next(iter(survivor))
            assert server.rank_of(chunk.id) == 1
            os.kill(server.front.pids[0], signal.SIGKILL)
            answer = victim.result(timeout=60)
        assert answer.status_code == 503, answer.text
        assert "rank 0 went down" in answer.json()["error"]["message"]
        for i, _ in enumerate(survivor):  # the other rank is still generating
            if i == 5:
                break
        survivor.close()
        health = httpx.get(server.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "0" in health.json()["ranks_down"]
        m = server.metrics()
        assert m['deepinfer_rank_up{rank="0"}'] == 0 and m['deepinfer_rank_up{rank="1"}'] == 1
        out = server.client().completions.create(model=MODEL, prompt="after the failure", max_tokens=4,
                                                 temperature=0)
        assert out.usage.completion_tokens == 4 and server.rank_of(out.id) == 1

        os.kill(server.front.pids[1], signal.SIGKILL)
        _wait(lambda: httpx.get(server.url + "/health").status_code == 503, "/health to report the server down")
        with pytest.raises(openai.APIStatusError) as refused:
            server.client().completions.create(model=MODEL, prompt="nobody left", max_tokens=4)
        assert refused.value.status_code == 503 and "every data-parallel rank is down" in str(refused.value)
    finally:
        start = time.monotonic()
        server.close()
        assert time.monotonic() - start < 30


def test_layouts_serve_cannot_run_are_refused_before_anything_starts(ckpt, capsys, tmp_path):
    from deepinfer.entrypoints.serve import build_parser, data_parallel, main
    from deepinfer.server.dp_worker import rank_engine_args

    for flags, message in ((["--dp", "2", "--ep", "2"], "runs data parallelism with --ep 1 only"),
                           (["--dp", "3", "--ep", "2"], "must be divisible by --ep 2"),
                           (["--dp", "2", "--threads-per-rank", "0"], "--threads-per-rank 0 must be >= 1"),
                           (["--dp", "0"], "--dp 0 must be >= 1")):
        assert main(["--model", ckpt, "--accelerator", "cpu", *flags]) == 2
        assert message in capsys.readouterr().err
    assert data_parallel(build_parser().parse_args(["--accelerator", "cpu"])) is None
    # a rank that cannot build its engine stops the start with its error, not a hang
    assert main(["--model", str(tmp_path / "missing"), "--accelerator", "cpu", "--dp", "2",
                 "--threads-per-rank", "1"]) == 1
    err = capsys.readouterr().err
    assert "data-parallel rank 0 failed to start" in err and "missing" in err, err[-2000:]
    dp = data_parallel(build_parser().parse_args(["--accelerator", "cpu", "--dp", "2", "--threads_per_rank", "1",
                                                  "--dp-routing", "round_robin", "--dp-affinity-slack", "9"]))
    assert (dp.layout.dp, dp.layout.ep, dp.threads_per_rank, dp.routing.policy, dp.routing.slack) == \
        (2, 1, 1, "round_robin", 9)
    # each rank persists its prefix cache in its own folder
    config = rank_engine_args({"model": ckpt, "features": {"prefix_cache": {"dir": str(tmp_path)}}}, 1)["config"]
    assert config.features["prefix_cache"]["dir"] == str(tmp_path / "rank1")


def test_image_chats_over_two_ranks_equal_the_offline_engine(tmp_path, one_thread):
    """A tiny DeepSeek-V4.1 with a vision tower behind `serve --dp 2`: concurrent chats with different
    images reach both ranks (the images travel to the engine processes with their prompts) and each
    answer is the offline engine's for the same rendered prompt and image."""
    pytest.importorskip("PIL")
    import base64
    import io

    from PIL import Image

    from deepinfer import LLM, SamplingParams
    from deepinfer.models.deepseek_v41.make_model import make_model

    path = str(make_model(tmp_path / "v41-vision", "tiny", seed=3, with_vision=True, max_position_embeddings=2048))
    images = [Image.fromarray(torch.randint(0, 256, (20 + 4 * i, 28, 3), generator=torch.Generator().manual_seed(i),
                                            dtype=torch.uint8).numpy()) for i in range(4)]

    def chat(image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}},
            {"type": "text", "text": "what is this?"}]}]

    server = DPServer(path)
    try:
        client = server.client()
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda im: client.chat.completions.create(
                model="v41-vision", messages=chat(im), max_tokens=5, temperature=0), images))
        ranks = {server.rank_of(a.id) for a in answers}
        tokenized = [httpx.post(server.url + "/tokenize", json={"messages": chat(im)}).json()["tokens"] for im in images]
    finally:
        server.close()
    assert ranks == {0, 1}
    with LLM(model=path, **ENGINE) as llm:
        offline = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": im}}
                                for ids, im in zip(tokenized, images)],
                               SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [a.choices[0].message.content for a in answers] == [o.outputs[0].text for o in offline]
