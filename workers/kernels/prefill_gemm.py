"""The GEMM behind prefill-sized products (x of UNPACK_MIN_ROWS rows or more, float32): the
packed-panel kernel on the panels themselves, or oneDNN's or MKL's on the weight unpacked for the
call, chosen by the CPU.

torch's F.linear on CPU calls MKL's sgemm. At SmolLM2's prefill shapes (README, Measured;
benchmarks/prefill_gemm.py) oneDNN (also inside every torch CPU build) took 0.74-0.97 of MKL's time
per product on an AMD EPYC with AVX-512 (machine L), and the packed-panel kernel less still there
and on a Zen 5 EPYC (machine R: 0.94 of oneDNN's time a layer, without the unpacking), while on an
Intel Xeon with AVX-512 (machine M) MKL was the faster, oneDNN taking 0.99-1.16 of its time a layer
and the packed kernel 1.04-1.19. So the default is MKL's on Intel CPUs, the packed kernel on the
others with AVX-512, and oneDNN's on the rest (AVX2 AMD hosts: the packed kernel was not measured
against it there). `CORELAUNCH_PREFILL_GEMM=packed`, `=onednn` or `=mkl` overrides it; a torch
built without oneDNN uses F.linear for `onednn`.

`corelaunch::prefill_linear` is a custom operator so that a compiled graph calls it as one opaque
step: inductor lowers oneDNN's own linear operator only for weights it has frozen and packed at
compile time, and these weights are unpacked from their panels during the call (packed_linear.py).
A Python-bodied operator costs tens of microseconds a call, against milliseconds for the product.
"""

from __future__ import annotations

import functools

import torch

from shardlib import env_settings

CHOICES = env_settings.PREFILL_GEMMS


@functools.cache
def cpu_vendor() -> str | None:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD", ...), or None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.cache
def has_avx512() -> bool:
    """Whether /proc/cpuinfo's flags name avx512f."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def default_gemm() -> str:
    """mkl on Intel CPUs, packed on the others with AVX-512, onednn on the rest (see the module's
    docstring for the measurements)."""
    if cpu_vendor() == "GenuineIntel":
        return "mkl"
    return "packed" if has_avx512() else "onednn"


def chosen_gemm() -> str:
    """CORELAUNCH_PREFILL_GEMM (default: default_gemm()), mkl for onednn where torch has no oneDNN;
    ValueError naming the value otherwise."""
    choice = env_settings.choice(env_settings.PREFILL_GEMM, CHOICES) or default_gemm()
    return "mkl" if choice == "onednn" and not torch.backends.mkldnn.is_available() else choice


def keeps_packed() -> bool:
    """Whether prefill-sized products stay on the packed-panel kernel (chosen_gemm() is packed). A
    constant to torch.compile (mark_constants_for_tracing); a graph traced without that mark (a
    torch.compile other than workers/compiled.py's) takes the unpacked weight's GEMM, as tracing
    into the environment and /proc/cpuinfo would break it."""
    if torch.compiler.is_compiling() and not _marked_for_tracing:
        return False
    return chosen_gemm() == "packed"


_marked_for_tracing = False
"""Whether mark_constants_for_tracing ran in this process (keeps_packed() asks while traced)."""


def mark_constants_for_tracing() -> None:
    """Tells torch.compile to take keeps_packed() as a constant (every traced prefill-sized packed
    product asks it), as workers/kernels/small_linear.py does for its own."""
    import torch._dynamo

    global _marked_for_tracing
    torch._dynamo.assume_constant_result(keeps_packed)
    _marked_for_tracing = True


def prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) for x (..., K) and W (N, K), through the chosen GEMM (_prefill_linear). The
    operator only while torch.compile traces: run eagerly, torch wraps a Python operator's kernel so
    that its first call imports the whole of torch._dynamo (1.2 s measured on the first eager
    prefill of 1024 rows), which an eager rank never needs."""
    if torch.compiler.is_compiling():
        return torch.ops.corelaunch.prefill_linear(x, weight, bias)
    return _prefill_linear(x, weight, bias)


def _prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's GEMM only when all three are float32 (the packed weights' dtype; oneDNN's linear
    refuses others obscurely), else F.linear. With `packed` chosen a model never calls this (its
    products stay on the panels); a direct call takes oneDNN's where torch has it."""
    if (chosen_gemm() != "mkl" and torch.backends.mkldnn.is_available()
            and all(t is None or t.dtype == torch.float32 for t in (x, weight, bias))):
        # oneDNN reads x and the bias as if dense, whatever their strides: hand it dense copies
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.contiguous(),
                                                  None if bias is None else bias.contiguous(), "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


_prefill_linear_op = torch.library.custom_op("corelaunch::prefill_linear", _prefill_linear, mutates_args=())


@_prefill_linear_op.register_fake
def _prefill_linear_shape(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
