"""Prometheus text exposition for `/metrics`: request and token counters, queue depth, cache usage,
a step-time histogram, and the per-request latency histograms vLLM's dashboards read (time to first
token, inter-token latency, end-to-end latency, queue time; vLLM's buckets). Written by hand: the
format is a few lines of text and needs no client library.

Counters and latency histograms are updated on the event loop; the step histogram by the engine
thread (single writer); the renderer copies lists before reading them, so a scrape never sees a
half-updated bucket list.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)

#: name -> (help, buckets) of the per-request latency histograms, in the order they are rendered
LATENCY_HISTOGRAMS = {
    "deepinfer_time_to_first_token_seconds": ("seconds from a request's arrival at the server to its first token",
                                              TTFT_BUCKETS),
    "deepinfer_inter_token_latency_seconds": ("seconds between a sample's successive tokens (one observation per "
                                              "token; tokens that arrive together share the interval)",
                                              ITL_BUCKETS),
    "deepinfer_e2e_request_latency_seconds": ("seconds from a request's arrival to its last token (requests that "
                                              "finished with stop or length)", REQUEST_BUCKETS),
    "deepinfer_request_queue_time_seconds": ("seconds a request waited in the engine's queue before it got a slot",
                                             REQUEST_BUCKETS),
}


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = STEP_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += count
        self.total += value * count
        self.count += count

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def render(self, name: str, help_text: str) -> list[str]:
        counts, total, count = list(self.counts), self.total, self.count
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, c in zip([*map(str, self.buckets), "+Inf"], counts):
            cumulative += c
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        return lines + [f"{name}_sum {total:.6f}", f"{name}_count {count}"]


class LatencyObserver:
    """Per-request latencies from the deltas a stream receives (on the event loop). The default
    observes nothing; `ServerMetrics.latency` records into /metrics' histograms."""

    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float, count: int) -> None: ...
    def end_to_end(self, seconds: float) -> None: ...
    def queue(self, seconds: float) -> None: ...

    def observe(self, stream: Any, delta: Any) -> None:
        """`stream`: a RequestStream (its `submitted` time and `last_token` by sample); `delta`: a Delta."""
        now = time.monotonic()
        if delta.queue_s is not None:
            self.queue(delta.queue_s)
        if delta.token_ids:
            last = stream.last_token.get(delta.index)
            if last is None:
                if not stream.last_token:
                    self.first_token(now - stream.submitted)
            else:  # one interval per token, as vLLM counts it
                self.inter_token((now - last) / len(delta.token_ids), len(delta.token_ids))
            stream.last_token[delta.index] = now
        if delta.done and delta.finish_reason in ("stop", "length"):
            self.end_to_end(now - stream.submitted)


class ServerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (route, HTTP status) -> count
        self.finished: Counter[str] = Counter()  # finish reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.step_time = Histogram()
        self.latencies = {name: Histogram(buckets) for name, (_, buckets) in LATENCY_HISTOGRAMS.items()}
        self.latency = _Latency(self.latencies)

    def request_done(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def tokens(self, prompt: int, generated: int, finish_reason: str | None) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated
            if finish_reason is not None:
                self.finished[finish_reason] += 1

    def render(self, gauges: dict[str, tuple[float, str]],
               labelled: dict[str, tuple[str, dict[str, float]]] | None = None) -> str:
        """The exposition text; `gauges` maps a metric name to (value, help), `labelled` a metric name
        to (help, {label text such as 'rank="0"': value}); a labelled name ending in `_total` is a
        counter."""
        with self._lock:
            requests, finished = dict(self.requests), dict(self.finished)
            prompt, generated = self.prompt_tokens, self.generation_tokens
        lines = ["# HELP deepinfer_requests_total HTTP requests answered, by route and status",
                 "# TYPE deepinfer_requests_total counter"]
        lines += [f'deepinfer_requests_total{{route="{r}",status="{s}"}} {n}'
                  for (r, s), n in sorted(requests.items())]
        lines += ["# HELP deepinfer_request_finish_total generation requests finished, by finish reason",
                  "# TYPE deepinfer_request_finish_total counter"]
        lines += [f'deepinfer_request_finish_total{{reason="{r}"}} {n}' for r, n in sorted(finished.items())]
        for name, value, help_text in (("deepinfer_prompt_tokens_total", prompt, "prompt tokens of admitted requests"),
                                       ("deepinfer_generation_tokens_total", generated, "tokens generated")):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        for name, (value, help_text) in gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value:g}"]
        for name, (help_text, values) in (labelled or {}).items():
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{labels}}} {value:g}" for labels, value in values.items()]
        lines += self.step_time.render("deepinfer_step_seconds", "engine step time (schedule, execute, update)")
        for name, (help_text, _) in LATENCY_HISTOGRAMS.items():
            lines += self.latencies[name].render(name, help_text)
        return "\n".join(lines) + "\n"


class _Latency(LatencyObserver):
    """Records a front end's per-request latencies into the /metrics histograms."""

    def __init__(self, histograms: dict[str, Histogram]):
        self.h = histograms

    def first_token(self, seconds: float) -> None:
        self.h["deepinfer_time_to_first_token_seconds"].observe(seconds)

    def inter_token(self, seconds: float, count: int) -> None:
        self.h["deepinfer_inter_token_latency_seconds"].observe(seconds, count)

    def end_to_end(self, seconds: float) -> None:
        self.h["deepinfer_e2e_request_latency_seconds"].observe(seconds)

    def queue(self, seconds: float) -> None:
        self.h["deepinfer_request_queue_time_seconds"].observe(seconds)
