"""The HTTP server's Prometheus metrics, in a registry of their own (GET /metrics serves exactly these).

A private CollectorRegistry, not prometheus_client's global one: each Serve replica (and each test)
gets a fresh set, and nothing else registered in the process (Ray's own metrics) leaks into
/metrics. Where a deployment may run several Serve replicas, /metrics shows every replica's series,
labelled `replica` (metrics_board.py).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the app's response

# Latency buckets (seconds): a CPU model's first token takes from milliseconds to tens of seconds
# (a long prompt's prefill behind a queue); a token after the first, milliseconds to a second.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
OUTCOMES = (("stop", 200), ("length", 200), ("abort", 499), ("error", 500), ("error", 504),
            ("unavailable", 503), *(("rejected", status) for status in (400, 404, 408, 413, 415, 503)))
"""corelaunch_requests_total's label pairs, each exported at 0 from the start: a series that first
appears at 1 hides its first increase from Prometheus' rate() and increase() (an alert on the first
504 of a replica never fired). A stream that fails after its headers carries its error's status
(500, 503 or 504), which these cover."""


class ServerMetrics:
    """Every metric the server exports. `load` returns the engine's {"running", "waiting"} sequences
    (one per choice of a request); it is read when /metrics is scraped, so the gauges are never stale."""

    def __init__(self, load: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self._load = load
        r = self.registry
        # ReplicaPool.load counts engine sequences, one per choice: a request with n=4 is 4 running
        self.running = Gauge("corelaunch_requests_running", "Sequences in the running batch, each holding one of "
                             "--max-num-seqs slots (one per choice: a request with n choices counts n)", registry=r)
        self.waiting = Gauge("corelaunch_requests_waiting", "Sequences (choices) queued for a slot: those beyond "
                             "--max-num-seqs", registry=r)
        self.time_to_first_token = Histogram(
            "corelaunch_time_to_first_token_seconds",
            "Seconds from a request's arrival at the server to a choice's first generated token: one "
            "observation per choice (a request with n choices, or several prompts, counts each)",
            buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "corelaunch_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of one choice (each choice of a request with n "
            "choices, or several prompts, counts its own gaps; a delta of several tokens counts "
            "its gap divided evenly among them; tokens arriving with the first count 0)", buckets=ITL_BUCKETS, registry=r)
        self.generated_tokens = Counter(
            "corelaunch_generated_tokens", "Generated tokens that reached the server, of every request (a "
            "cancelled or timed-out whole answer's tokens its group still held, up to 63, are not counted)",
            registry=r)
        self.prompt_tokens = Counter("corelaunch_prompt_tokens", "Prompt tokens of the requests admitted "
                                     "(counted at admission, however they end)",
                                     registry=r)
        self.cached_prompt_tokens = Counter(
            "corelaunch_prefix_cache_hit_tokens", "Prompt tokens not prefilled because the cache held them "
            "(prefix caching; each prompt counted once, as in corelaunch_prompt_tokens)",
            registry=r)
        self.requests = Counter(
            "corelaunch_requests", "Generation requests by outcome: finish_reason stop|length (completed), "
            "abort (client went away), error (failed while generating: 500, or 504 past the request timeout), rejected (refused with the "
            "HTTP status in `status` before generating: 400 bad input, 404, 408 body too slow, 413, 415 encoded body, 503 queue full or "
            "body budget full), "
            "unavailable (503: no TP group can take requests, at admission or while the request ran, or the shared "
            "response store did not answer a previous_response_id)",
            ["finish_reason", "status"], registry=r)
        for finish_reason, status in OUTCOMES:
            self.requests.labels(finish_reason=finish_reason, status=str(status))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, gauges refreshed from the engine now."""
        load = self._load()
        self.running.set(load.get("running", 0))
        self.waiting.set(load.get("waiting", 0))
        return generate_latest(_WithoutCreated(self.registry))

    def rejected(self, status: int, reason: str = "rejected") -> None:
        self.requests.labels(finish_reason=reason, status=str(status)).inc()

    def finished(self, finish_reason: str, status: int = 200) -> None:
        self.requests.labels(finish_reason=finish_reason, status=str(status)).inc()


class TokenTimer:
    """Times one choice's tokens into the metrics (one timer per choice, each started at its request's
    arrival): the first token's delay since `start`, then one inter-token gap for every later token
    (perf_counter seconds), so a choice of n tokens counts n - 1 gaps summing to the time from its
    first token to its last. A delta of several tokens shares the wait before it evenly among them;
    tokens arriving with the first waited for nothing after it (gap 0)."""

    def __init__(self, metrics: ServerMetrics, start: float):
        self.metrics, self.start, self.last = metrics, start, None

    def tokens(self, count: int, now: float) -> None:
        if count <= 0:
            return
        self.metrics.generated_tokens.inc(count)
        if self.last is None:
            self.metrics.time_to_first_token.observe(now - self.start)
            gap, count = 0.0, count - 1  # the first token has no gap before it; those with it none after it
        else:
            gap = (now - self.last) / count
        for _ in range(count):
            self.metrics.inter_token_latency.observe(gap)
        self.last = now


class _WithoutCreated:
    """The registry's families without prometheus_client's `<name>_created` samples (each counter's
    and histogram's creation time). In the text format Prometheus stores each as one more gauge per
    series, which only says when the replica started; prometheus_client's switch for them
    (disable_created_metrics) is process-wide, so they are left out here instead."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
