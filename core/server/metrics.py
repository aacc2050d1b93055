"""Prometheus text exposition for `/metrics`: request and token counters, queue depth, cache usage,
and a step-time histogram. Written by hand: the format is a few lines of text and needs no
client library.

Counters are updated on the event loop; the step histogram by the engine thread (single writer);
the renderer copies lists before reading them, so a scrape never sees a half-updated bucket list.
"""
from __future__ import annotations

import threading
from collections import Counter

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = STEP_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += value
        self.count += 1

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


class ServerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (route, HTTP status) -> count
        self.finished: Counter[str] = Counter()  # finish reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.step_time = Histogram()

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
        return "\n".join(lines) + "\n"
