"""An fp8 KV cache (`--kv-cache-dtype f8e4m3`): keys and values stored as float8 e4m3, dequantized
when attention reads them.

Stored value: fp8(clamp(x / KV_FP8_SCALE, -240, 240)), and NaN for an infinite x; read back as
stored * KV_FP8_SCALE in the compute dtype. The scale is one static number (1.0: a direct cast, as
NxD Inference's fp8 KV cache does without calibration); 240 is the largest e4m3 value on Neuron, so
the stored bytes mean the same there. Keys and values of the Llama-family models stay well inside
+-240 (their magnitudes are set by RMSNorm-ed activations times projection weights), so the clamp
only guards outliers. An infinite key or value (an overflowed activation) is no outlier: clamped to
a finite 240, its request went on giving tokens, where a float cache spreads it to NaN logits, which
fail that request alone; stored as NaN, it fails it with an fp8 cache too. The relative rounding
error is at most 2^-4 (3 mantissa bits) for magnitudes of 2^-6 and more; below that e4m3's
subnormals keep less (the smallest stored value is 2^-9, and magnitudes under half of it are stored
as 0). The check command's logit-matching mode measures what that costs a model.

Which steps read quantized values: every step that attends over the cache (decode, a serving
step, an eager prefill, which writes the prompt into the cache first) reads the dequantized bytes,
its own new keys included. A compiled prefill from slot 0 attends over the prompt's own keys and
values in full precision and stores them afterwards (workers/compiled.py), as context encoding does
in NxD Inference; so an eager and a compiled prefill with an fp8 cache can differ by the rounding
of the prompt's keys (on a model that nearly ties, a different first token).

torch's CPU kernels cannot index_copy_ or index_put into float8 tensors, so writes go through a
uint8 view of the same bytes (a bit-exact copy).
"""

from __future__ import annotations

import torch

KV_FP8 = torch.float8_e4m3fn
KV_FP8_SCALE = 1.0
KV_FP8_MAX = 240.0
KV_CACHE_DTYPES = {"f8e4m3": KV_FP8}
"""--kv-cache-dtype names -> the cache's storage dtype."""


def is_quantized_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == KV_FP8


def to_cache(values: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """`values` as `cache` stores them: unchanged for a float cache; for fp8 the stored bytes as
    uint8 (write them into cache.view(torch.uint8))."""
    if not is_quantized_cache(cache):
        return values
    # an infinite value clamped would be a finite 240 (module docstring): NaN fails its request
    # in place on the scaled copy, which nothing else holds (each write is on the decode path)
    scaled = values.float() / KV_FP8_SCALE
    scaled.nan_to_num_(nan=float("nan"), posinf=float("nan"), neginf=float("nan")).clamp_(-KV_FP8_MAX, KV_FP8_MAX)
    return scaled.to(KV_FP8).view(torch.uint8)


def writable(cache: torch.Tensor) -> torch.Tensor:
    """The tensor to write to_cache's result into: the cache, or its uint8 view for fp8."""
    return cache.view(torch.uint8) if is_quantized_cache(cache) else cache


def from_cache(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What attention reads: a float cache as it is, an fp8 one dequantized to `dtype`."""
    if not is_quantized_cache(stored):
        return stored
    return (stored.to(torch.float32) * KV_FP8_SCALE).to(dtype)


def kv_storage_dtype(name: str | None, compute: torch.dtype) -> torch.dtype:
    """The cache dtype for a --kv-cache-dtype (None: the compute dtype); ValueError naming the choices."""
    if name is None:
        return compute
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv cache dtype {name!r}; use f8e4m3, or omit it for the compute dtype")
    return KV_CACHE_DTYPES[name]
