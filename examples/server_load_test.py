"""A bounded load test of `deepinfer serve` on loopback: requests/s, latency percentiles, tokens/s.

    # start a server on a free port with this checkpoint, load it, stop it
    python examples/server_load_test.py --model /tmp/ckpt --requests 64 --concurrency 16 --max-tokens 16
    # or load a server that is already running
    python examples/server_load_test.py --url http://127.0.0.1:8000 --api-key KEY --requests 64

Each of `--concurrency` clients sends streaming requests one after another (greedy, `max_tokens`
fixed; a request may stop earlier on EOS, so tokens are the server's usage counts). Latency is
request start to the last chunk, time to first token start to the first chunk with a choice. The
server runs in its own process, so the client's event loop does not share its GIL; one warm-up
request is not counted.
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


async def run_load(url: str, args: argparse.Namespace) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    latencies, ttfts, tokens = [], [], []

    async def one(i: int) -> None:
        start = time.perf_counter()
        first = None
        usage = None
        if args.endpoint == "chat":
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Request {i}: tell me about {i % 17}"}],
                max_tokens=args.max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
        else:
            stream = await client.completions.create(
                model=model, prompt=f"Request {i}: once upon a time {i % 17}", max_tokens=args.max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if first is None and chunk.choices:
                first = time.perf_counter()
            usage = chunk.usage or usage
        latencies.append(time.perf_counter() - start)
        ttfts.append((first or time.perf_counter()) - start)
        tokens.append(usage.completion_tokens if usage else 0)

    async def worker() -> None:
        while not queue.empty():
            await one(queue.get_nowait())

    await one(-1)  # warm-up (first compile of anything lazy), not counted
    latencies.clear(), ttfts.clear(), tokens.clear()
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - start
    await client.close()

    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]

    return {"endpoint": args.endpoint, "requests": args.requests, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "wall_s": round(wall, 2),
            "requests_per_s": round(args.requests / wall, 2),
            "latency_p50_s": round(pct(latencies, 50), 3), "latency_p99_s": round(pct(latencies, 99), 3),
            "ttft_p50_s": round(pct(ttfts, 50), 3), "ttft_p99_s": round(pct(ttfts, 99), 3),
            "output_tokens": sum(tokens), "output_tokens_per_s": round(sum(tokens) / wall, 1)}


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
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra argument for `deepinfer serve` (repeat), e.g. --serve-arg=--max-num-seqs=16")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--requests, --concurrency and --max-tokens must be at least 1")
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
