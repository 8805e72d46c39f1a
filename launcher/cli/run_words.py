"""How a measured or checked run ran, in the words its report's title gives: `bench`'s table and
`check`'s verdict line both name the weights' quantization, the KV cache's dtype and eager steps
(an int8, fp8-cache or eager run's title read like a float32 compiled one's)."""

from __future__ import annotations


def run_choices(report: dict) -> list[str]:
    """The run's quantized weights, KV-cache dtype and eager steps, each where it had them, from
    the JSON report's fields (quantization, kv_cache_dtype, compile)."""
    words = []
    if report.get("quantization"):
        words.append(f"{report['quantization']['quantization_dtype']} weights")
    if report.get("kv_cache_dtype"):
        words.append(f"{report['kv_cache_dtype']} KV cache")
    if not report.get("compile", True):
        words.append("eager")
    return words
