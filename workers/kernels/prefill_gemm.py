"""The GEMM behind prefill-sized products (x of UNPACK_MIN_ROWS rows or more, float32): oneDNN's.

torch's F.linear on CPU calls MKL's sgemm. oneDNN (also inside every torch CPU build) took 0.74-0.97
of its time per product at SmolLM2's prefill shapes on an AMD EPYC with AVX-512 (README, Measured,
machine L; benchmarks/prefill_gemm.py); on an Intel host the two have not been compared.
`CORELAUNCH_PREFILL_GEMM=mkl` goes back to F.linear; a torch built without oneDNN uses F.linear
anyway.

`corelaunch::prefill_linear` is a custom operator so that a compiled graph calls it as one opaque
step: inductor lowers oneDNN's own linear operator only for weights it has frozen and packed at
compile time, and these weights are unpacked from their panels during the call (packed_linear.py).
A Python-bodied operator costs tens of microseconds a call, against milliseconds for the product.
"""

from __future__ import annotations

import os

import torch

CHOICES = ("onednn", "mkl")


def chosen_gemm() -> str:
    """CORELAUNCH_PREFILL_GEMM (default onednn), or mkl where torch has no oneDNN; ValueError naming
    the value otherwise."""
    choice = os.environ.get("CORELAUNCH_PREFILL_GEMM", "onednn")
    if choice not in CHOICES:
        raise ValueError(f"CORELAUNCH_PREFILL_GEMM={choice!r} is not one of {', '.join(CHOICES)}")
    return choice if torch.backends.mkldnn.is_available() else "mkl"


@torch.library.custom_op("corelaunch::prefill_linear", mutates_args=())
def prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) for x (..., K) and W (N, K), through the chosen GEMM: oneDNN's only when all
    three are float32 (the packed weights' dtype; oneDNN's linear refuses others obscurely), else
    F.linear."""
    if chosen_gemm() == "onednn" and all(t is None or t.dtype == torch.float32 for t in (x, weight, bias)):
        # oneDNN reads x and the bias as if dense, whatever their strides: hand it dense copies
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.contiguous(),
                                                  None if bias is None else bias.contiguous(), "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


@prefill_linear.register_fake
def _prefill_linear_shape(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
