"""Default logit-matching tolerances of `corelaunch check` for quantized weights and an fp8 KV cache.

Quantization changes logits by design, so NxD Inference's float defaults (top 5: rtol 0.01 ...)
would fail every quantized model. The values below are the largest relative errors measured on
SmolLM2-135M-Instruct (2 prompts x 16 tokens, eager, TP 1, against transformers float32, with
teacher forcing at divergences) with about 1.5x headroom, rounded to two figures: the relative errors all, the
divergence differences of int8 per tensor and of every fp8 format and granularity. An fp8 entry covers
the larger of its errors with and without `quantize --embedding` (on every fp8 row below, the
--embedding case's). Two divergence tolerances have more: int8
per channel 0.1 (no divergence measured: chosen, 100x the float default of 0.001), and the fp8 KV
cache 1.0 against 0.20 alone (5x), sized so that int8 weights plus the KV
cache (0.1 + 1.0) cover the 0.76 measured for both. So with an fp8 KV cache alone, a wrong token
within 1 logit of the expected one passes. They state what each format costs that model, not a
guarantee for others: pass --tol-map and --divergence-difference-tol to hold a model to other bounds.

Measured max relative error per group (top5 / top50 / top1000 / all) and largest divergence
difference (logit units; "-" where the greedy tokens never diverged):
  int8 per channel     0.026 / 0.034 / 0.040 / 0.056   -      (16 of 16 tokens equal on both prompts)
  int8 per tensor      0.169 / 0.172 / 0.216 / 0.254   0.86
  f8e4m3 per channel   0.097 / 0.126 / 0.143 / 0.161   0.06
    with --embedding   0.110 / 0.130 / 0.158 / 0.199   0.67
  f8e4m3 per tensor    0.073 / 0.114 / 0.126 / 0.129   0.37
    with --embedding   0.086 / 0.142 / 0.167 / 0.178   0.65
  f8e5m2 per channel   0.192 / 0.192 / 0.253 / 0.315   0.47
    with --embedding   0.205 / 0.205 / 0.276 / 0.400   1.26
  f8e5m2 per tensor    0.114 / 0.163 / 0.167 / 0.203   0.44
    with --embedding   0.146 / 0.180 / 0.214 / 0.271   0.62
  float32 + fp8 KV     0.055 / 0.059 / 0.078 / 0.090   0.20
  int8 + fp8 KV        0.061 / 0.069 / 0.089 / 0.106   0.76
Divergence differences move far more than relative errors: quantizing the embedding too takes
f8e4m3 per channel's from 0.06 to 0.67 while its relative errors grow by at most a quarter. A
divergence difference depends on how near the reference's top two logits lie where the errors land,
so each format, granularity and --embedding case is measured, not copied from another.
The weight and the KV-cache tolerances add up when both are quantized (errors of the two roughly add).
"""

from __future__ import annotations

from shardlib.quantization import Quantization

DEFAULT_TOL_SPEC = "5:0.01,50:0.02,1000:0.03,all:0.05"
"""NxD Inference's float defaults (unquantized models), as --tol-map text."""

GROUPS = ("5", "50", "1000", "all")
# (format, per channel) -> (rtol per group in GROUPS order, divergence difference tolerance)
WEIGHT_TOLERANCES = {
    ("int8", True): ((0.04, 0.05, 0.06, 0.08), 0.1),
    ("int8", False): ((0.25, 0.26, 0.32, 0.38), 1.3),
    ("f8e4m3", True): ((0.17, 0.19, 0.24, 0.3), 1.0),
    ("f8e4m3", False): ((0.13, 0.21, 0.25, 0.27), 0.98),
    ("f8e5m2", True): ((0.31, 0.31, 0.41, 0.6), 1.9),
    ("f8e5m2", False): ((0.22, 0.27, 0.32, 0.41), 0.93),
}
KV_TOLERANCES = {"f8e4m3": ((0.08, 0.09, 0.12, 0.14), 1.0)}


def default_tolerances(quant: Quantization | None, kv_cache_dtype: str | None) -> tuple[str, float]:
    """(--tol-map spec, divergence difference tolerance) for a model's weights and KV cache."""
    from shardlib.evaluation.accuracy import DEFAULT_DIVERGENCE_DIFFERENCE_TOL  # torch: not at import time

    parts = []
    if quant is not None:
        parts.append(WEIGHT_TOLERANCES[(quant.dtype, quant.per_channel)])
    if kv_cache_dtype is not None:
        parts.append(KV_TOLERANCES[kv_cache_dtype])
    if not parts:
        return DEFAULT_TOL_SPEC, DEFAULT_DIVERGENCE_DIFFERENCE_TOL
    rtols = [round(sum(p[0][i] for p in parts), 4) for i in range(len(GROUPS))]
    spec = ",".join(f"{group}:{rtol:g}" for group, rtol in zip(GROUPS, rtols))
    return spec, round(sum(p[1] for p in parts), 4)  # 0.93 + 1.0 would print as 1.9300000000000002
