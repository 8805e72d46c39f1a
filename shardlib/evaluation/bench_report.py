"""The benchmark report in NxD Inference's format: percentiles of measured latencies, and throughput.

Pure arithmetic on timings; no Ray, no torch. `corelaunch bench` measures, this module summarizes.

One section per model part, each with latency_ms_p50, latency_ms_p90, latency_ms_p95,
latency_ms_p99, latency_ms_p100, latency_ms_avg and throughput (NxD Inference's fields), plus
`count` (the number of latency samples) and `throughput_unit`:

- e2e_model: one sample per measured generate call, the driver-side wall time of the call.
  throughput = generated tokens (all rows, all calls) / sum of the call times, in tokens/s.
- context_encoding_model: one sample per call, its time to first token (prefill of the whole
  batch plus choosing the first token). throughput = prompt tokens x batch x calls / sum of those
  times, in prompt tokens/s.
- token_generation_model: one sample per decode step of every call (the steps after the first
  token, timed inside rank 0). throughput = batch x steps / sum of the step times, in tokens/s
  (= batch / mean step latency).

A section whose latencies sum to 0 (all below the clock's resolution) has throughput None (JSON null).

Percentiles interpolate linearly between the two nearest ranks (numpy's default method), so p100 is
the maximum. NxD Inference computes every section's throughput as max_length x batch x runs / total
time; corelaunch uses the definitions above, which count only the tokens each part produces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

PERCENTILES = (50, 90, 95, 99, 100)
SECTIONS = ("e2e_model", "context_encoding_model", "token_generation_model")
FIELDS = tuple(f"latency_ms_p{p}" for p in PERCENTILES) + ("latency_ms_avg", "throughput")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values; measure at least one run")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q ({q}) must be within [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(latencies_s: Sequence[float], work: float, unit: str = "tokens/s") -> dict:
    """One report section: latency percentiles in ms, and throughput = work / total latency."""
    if not latencies_s:
        raise ValueError("no latencies to summarize; measure at least one run")
    bad = [x for x in latencies_s if not math.isfinite(x) or x < 0]
    if bad:
        raise ValueError(f"latencies must be finite and >= 0; got {bad[:3]}")
    total = sum(latencies_s)
    section = {f"latency_ms_p{p}": percentile(latencies_s, p) * 1000 for p in PERCENTILES}
    section["latency_ms_avg"] = total / len(latencies_s) * 1000
    # None where no time was measured (every latency 0, below the clock's resolution): JSON has no
    # infinity, and json.dumps wrote `Infinity`, which JSON readers refuse
    section["throughput"] = work / total if total > 0 else None
    section["throughput_unit"] = unit
    section["count"] = len(latencies_s)
    return section


@dataclass
class RunTiming:
    """What one measured generate call reported."""

    e2e_s: float
    """Driver-side wall time of the whole call."""
    time_to_first_token_s: float
    decode_step_latencies_s: list[float]
    generated_tokens: int
    """Tokens generated over all rows of the batch."""


def build_report(runs: Sequence[RunTiming], batch_size: int, prompt_len: int) -> dict:
    """The three NxD Inference sections from the measured (post-warm-up) runs."""
    if not runs:
        raise ValueError("no measured runs; --runs must be at least 1")
    steps = [s for r in runs for s in r.decode_step_latencies_s]
    if not steps:
        raise ValueError("no decode step of the whole batch was measured; generate more new tokens per run (at "
                         "least 2; more where the batch's prompts exceed the prefill budget and take several "
                         "steps to prefill)")
    return {
        "e2e_model": summarize([r.e2e_s for r in runs], sum(r.generated_tokens for r in runs)),
        "context_encoding_model": summarize([r.time_to_first_token_s for r in runs],
                                            prompt_len * batch_size * len(runs), "prompt tokens/s"),
        "token_generation_model": summarize(steps, batch_size * len(steps)),
    }
