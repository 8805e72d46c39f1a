"""The numbers of the serving benchmark, from per-request timestamps: pure functions, no I/O.

Definitions (the ones vLLM's serving benchmark uses, so figures compare):
- TTFT: from sending the request to the first streamed chunk that carries a choice.
- ITL (inter-token latency): the gaps between successive chunks. A server streams one chunk per
  token unless its detokenizer holds text back (half a character), when such a gap spans two tokens,
  or it gathers n tokens to a chunk (vLLM's and corelaunch's --stream-interval n), when most gaps span
  n tokens (n steps).
- E2E: from sending the request to the end of its stream.
- Aggregate output tokens/s: every completion token of the level over the level's wall time (first
  request sent to last stream ended).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """One streamed request, times in seconds on one monotonic clock (time.perf_counter)."""

    sent_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    """Arrival of each chunk that carried a choice (text, possibly empty), in order."""
    finished_s: float | None = None
    completion_tokens: int | None = None
    """From the stream's usage chunk; None when the server sent no usage (then chunks are counted)."""
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.sent_s if self.chunk_times_s else None

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.sent_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The stream's tokens after its first over the time from its first token's chunk to its last
        token's: not to the stream's end (e2e_s), which also holds the usage chunk and [DONE] after
        the last token and so read slower than the stream decoded. None without two chunks apart."""
        times = self.chunk_times_s
        if self.tokens < 2 or len(times) < 2 or times[-1] <= times[0]:
            return None
        return (self.tokens - 1) / (times[-1] - times[0])


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks (numpy's
    default method); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q ({q}) must be within 0..100")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _p50_p99(values: list[float]) -> dict:
    """samples: how many values the percentiles come from (a p99 of 16 is near the maximum, not a tail)."""
    return {"p50": _round(percentile(values, 50)), "p99": _round(percentile(values, 99)), "samples": len(values)}


def tokens_per_gap(done: list[RequestRecord]) -> float | None:
    """Tokens after each stream's first over its chunk gaps: 1 at one chunk a token; near n at
    --stream-interval n (the first token alone, then n at a time), so itl_s reads per token as
    itl_s / tokens_per_gap. None without any gap."""
    streams = [r for r in done if len(r.chunk_times_s) > 1]
    gaps = sum(len(r.chunk_times_s) - 1 for r in streams)
    return _round(sum(r.tokens - 1 for r in streams) / gaps, 3) if gaps else None


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def summarize_level(records: list[RequestRecord], wall_s: float, max_tokens: int) -> dict:
    """Per level: aggregate throughput, TTFT / ITL / E2E p50 and p99, and whether every request got
    exactly max_tokens tokens (with the failures listed when not)."""
    if wall_s <= 0:
        raise ValueError(f"wall_s ({wall_s}) must be positive")
    done = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in done)
    short = [{"tokens": r.tokens, "error": r.error} for r in records if r.error is not None or r.tokens != max_tokens]
    single_stream = [r.decode_tokens_per_s for r in done if r.decode_tokens_per_s is not None]
    return {
        "requests": len(records),
        "errors": sum(r.error is not None for r in records),
        "output_tokens": tokens,
        "wall_s": _round(wall_s),
        "output_tokens_per_s": _round(tokens / wall_s, 2),
        "ttft_s": _p50_p99([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl_s": _p50_p99([gap for r in done for gap in r.itls_s]),
        "tokens_per_gap": tokens_per_gap(done),
        "e2e_s": _p50_p99([r.e2e_s for r in done if r.e2e_s is not None]),
        "decode_tokens_per_s_per_stream_p50": _round(percentile(single_stream, 50), 2),
        "all_got_max_tokens": not short,
        "short_or_failed": short[:8],
        "tokens_counted_from": ("none" if not done else "usage" if all(r.completion_tokens is not None for r in done)
                                else "chunks"),
        "valid": bool(done) and not short,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator rounded, or None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 4)


def expected_ttft_s(static_batch_ttft_s: float, decode_step_latencies_s: list[float], steps: int = 2) -> float:
    """What a request arriving with 15 others should wait for its first token at best: the prefill
    of the whole batch (the static batch's TTFT) plus `steps` decode steps (a continuous batcher may
    be one step into the previous batch when the request arrives, and then emits the first token
    with the next step). The decode step is the median of the static batch's steps."""
    if not decode_step_latencies_s:
        raise ValueError("decode_step_latencies_s is empty: the static batch decoded no step "
                         "(max_new_tokens must be at least 2)")
    # statistics.median, as the report's decode_step_s_median beside it (the mean of the middle two)
    return static_batch_ttft_s + steps * statistics.median(decode_step_latencies_s)


BRACKETED = (("static_batch", "output_tokens_per_s"), ("static_batch", "expected_ttft_s_prefill_plus_2_steps"),
             ("one_at_a_time", "decode_tokens_per_s_median"))
"""The baseline figures measured again after the HTTP levels (benchmarks/serving.py --baselines-after)."""


def baseline_drift(before: dict, after: dict) -> dict:
    """after / before for each re-measured figure: how far the machine moved while the levels ran."""
    return {f"{part}.{key}": ratio(after[part][key], before[part][key]) for part, key in BRACKETED}


def bracketed_baselines(before: dict, after: dict) -> dict:
    """The baselines with each re-measured figure replaced by the mean of before and after (the other
    figures, measured once, as before): what the levels, run between the two, compare against."""
    out = {part: dict(values) if isinstance(values, dict) else values for part, values in before.items()}
    for part, key in BRACKETED:
        out[part][key] = round((before[part][key] + after[part][key]) / 2, 5)
    return out
