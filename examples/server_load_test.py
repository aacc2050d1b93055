"""A bounded load test of `deepinfer serve` on loopback: requests/s, latency percentiles, tokens/s.

    # start a server on a free port with this checkpoint, load it, stop it
    python examples/server_load_test.py --model /tmp/ckpt --requests 64 --concurrency 16 --max-tokens 16
    # the same over two data-parallel ranks of one thread each
    python examples/server_load_test.py --model /tmp/ckpt --dp 2 --threads-per-rank 1
    # multi-turn chats with the prefix cache: hit rate with affinity routing vs round robin
    python examples/server_load_test.py --model /tmp/ckpt --dp 2 --threads-per-rank 1 --workload multi_turn \
        --serve-arg=--prefix-cache --dp-routing round_robin
    # or load a server that is already running
    python examples/server_load_test.py --url http://127.0.0.1:8000 --api-key KEY --requests 64

Workload `single` (default): each of `--concurrency` clients sends streaming requests one after
another (greedy, `max_tokens` fixed; a request may stop earlier on EOS, so tokens are the server's
usage counts). Workload `multi_turn`: `--conversations` chats of `--turns` turns, at most
`--concurrency` at a time; each opens with its own long user message (`--opening-words`) and
every turn re-sends the whole conversation with the previous answer and a new question, as chat
clients do; the prefix-cache counters and routing counts it caused are read from /metrics.
Latency is request start to the last chunk, time to first token start to the first chunk with a
choice. The server runs in its own process, so the client's event loop does not share its GIL; one
warm-up request is not counted. The server's own time-to-first-token and inter-token latency histograms
(/metrics) give `server_ttft_*` and `server_itl_*` (mean, and p50 / p99 interpolated in their buckets).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--model", args.model, "--port", str(port),
           "--max-pending", str(max(args.concurrency * 2, 16)), "--no-thinking", *args.serve_arg]
    for flag, value in (("--dp", args.dp), ("--threads-per-rank", args.threads_per_rank),
                        ("--dp-routing", args.dp_routing)):
        if value is not None:
            cmd += [flag, str(value)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    import httpx2 as httpx

    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not answer /health within {args.start_timeout} s")


WORDS = ("river stone lantern orchard signal harbor meadow copper winter garden violin thunder marble "
         "compass feather canyon ribbon glacier harvest beacon spiral willow ember quartz saddle tide").split()


def opening(conversation: int, words: int) -> str:
    """A long first message of its own for each conversation (so no two share a prefix block)."""
    return f"Conversation {conversation}. " + " ".join(WORDS[(conversation * 7 + i * 13 + i // 5) % len(WORDS)]
                                                        for i in range(words))


async def stream_one(client, model: str, args: argparse.Namespace, i: int,
                     messages: list[dict] | None = None) -> tuple[float, float, int, str]:
    """One streaming request: (latency, time to first token, output tokens, text)."""
    start = time.perf_counter()
    first, usage, text = None, None, []
    if messages is not None or args.endpoint == "chat":
        messages = messages or [{"role": "user", "content": f"Request {i}: tell me about {i % 17}"}]
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
    else:
        stream = await client.completions.create(
            model=model, prompt=f"Request {i}: once upon a time {i % 17}", max_tokens=args.max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices:
            first = first or time.perf_counter()
            piece = chunk.choices[0]
            text.append(getattr(piece, "text", None) or getattr(getattr(piece, "delta", None), "content", None) or "")
        usage = chunk.usage or usage
    return (time.perf_counter() - start, (first or time.perf_counter()) - start,
            usage.completion_tokens if usage else 0, "".join(text))


def scrape(url: str, api_key: str | None) -> dict[str, float]:
    import httpx2 as httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = {}
    for line in httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def histogram_quantile(before: dict[str, float], after: dict[str, float], name: str, q: float) -> float:
    """The q-quantile of a /metrics histogram's observations between two scrapes, interpolated
    linearly inside its bucket (Prometheus' histogram_quantile)."""
    prefix = f'{name}_bucket{{le="'
    bounds = sorted((float(k[len(prefix):-2]), after[k] - before.get(k, 0)) for k in after if k.startswith(prefix))
    total = bounds[-1][1]
    rank, lower, below = q * total, 0.0, 0.0
    for upper, cumulative in bounds:
        if cumulative >= rank:
            if upper == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = upper, cumulative
    return lower


async def run_load(url: str, args: argparse.Namespace) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    jobs: asyncio.Queue = asyncio.Queue()
    results: list[tuple[float, float, int, str]] = []

    async def conversation(c: int) -> None:
        messages = [{"role": "user", "content": opening(c, args.opening_words)}]
        for t in range(args.turns):
            result = await stream_one(client, model, args, c, messages)
            results.append(result)
            messages += [{"role": "assistant", "content": result[3]},
                         {"role": "user", "content": f"Question {t + 2}: what about {WORDS[(c + t) % len(WORDS)]}?"}]

    async def single(i: int) -> None:
        results.append(await stream_one(client, model, args, i))

    if args.workload == "multi_turn":
        for c in range(args.conversations):
            jobs.put_nowait((conversation, c))
    else:
        for i in range(args.requests):
            jobs.put_nowait((single, i))

    async def worker() -> None:
        while not jobs.empty():
            fn, i = jobs.get_nowait()
            await fn(i)

    await stream_one(client, model, args, -1)  # warm-up (first compile of anything lazy), not counted
    before = scrape(url, args.api_key)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - start
    after = scrape(url, args.api_key)
    await client.close()
    latencies, ttfts, tokens = ([r[k] for r in results] for k in range(3))

    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    out = {"workload": args.workload, "endpoint": "chat" if args.workload == "multi_turn" else args.endpoint,
           "requests": len(results), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
           "dp": args.dp or 1, "dp_routing": args.dp_routing, "wall_s": round(wall, 2),
           "requests_per_s": round(len(results) / wall, 2),
           "latency_p50_s": round(pct(latencies, 50), 3), "latency_p99_s": round(pct(latencies, 99), 3),
           "ttft_p50_s": round(pct(ttfts, 50), 3), "ttft_p99_s": round(pct(ttfts, 99), 3),
           "output_tokens": sum(tokens), "output_tokens_per_s": round(sum(tokens) / wall, 1)}
    # the server's own latency histograms (what a vLLM dashboard reads): means and Prometheus-style
    # quantiles over this run's observations
    for short, name in (("server_ttft", "deepinfer_time_to_first_token_seconds"),
                        ("server_itl", "deepinfer_inter_token_latency_seconds")):
        count = delta(f"{name}_count")
        if count:
            out[f"{short}_mean_s"] = round(delta(f"{name}_sum") / count, 4)
            out[f"{short}_p50_s"] = round(histogram_quantile(before, after, name, 0.5), 4)
            out[f"{short}_p99_s"] = round(histogram_quantile(before, after, name, 0.99), 4)
    if "deepinfer_prefix_cache_hits" in after:
        hits, misses = delta("deepinfer_prefix_cache_hits"), delta("deepinfer_prefix_cache_misses")
        out["prefix_cache_hit_rate"] = round(hits / max(hits + misses, 1), 3)
        out["prefill_tokens_saved"] = int(delta("deepinfer_prefix_cache_prefill_tokens_saved"))
        out["prefill_tokens"] = int(delta("deepinfer_prefix_cache_prefill_tokens"))
    routes = {k.split('"')[1]: int(delta(k)) for k in after if k.startswith("deepinfer_route_total")}
    if routes:
        out["routes"] = {k: v for k, v in routes.items() if v}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="start `deepinfer serve --model MODEL` on a free loopback port")
    where.add_argument("--url", help="load a running server instead")
    p.add_argument("--api-key", default=os.environ.get("DEEPINFER_API_KEY"))
    p.add_argument("--endpoint", choices=["chat", "completions"], default="completions")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--workload", choices=["single", "multi_turn"], default="single")
    p.add_argument("--conversations", type=int, default=16, help="multi_turn: chats in all")
    p.add_argument("--turns", type=int, default=4, help="multi_turn: requests per chat")
    p.add_argument("--opening-words", type=int, default=300, help="multi_turn: words of each chat's first message")
    p.add_argument("--dp", type=int, default=None, help="serve --dp: data-parallel ranks (started server only)")
    p.add_argument("--threads-per-rank", type=int, default=None, help="serve --threads-per-rank")
    p.add_argument("--dp-routing", choices=["affinity", "round_robin"], default=None, help="serve --dp-routing")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra argument for `deepinfer serve` (repeat), e.g. --serve-arg=--max-num-seqs=16")
    args = p.parse_args(argv)
    if min(args.requests, args.concurrency, args.max_tokens, args.conversations, args.turns) < 1:
        p.error("--requests, --concurrency, --max-tokens, --conversations and --turns must be at least 1")
    proc = None
    url = args.url
    if args.model is not None:
        proc, url = start_server(args)
    try:
        result = asyncio.run(run_load(url, args))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
