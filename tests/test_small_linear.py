"""The small-batch linear kernel (workers/kernels/small_linear.py) against float64 references, every
weight type and scale granularity, ragged sizes (in not a multiple of 8, out not a multiple of a
thread's chunk, rows across the 4/2/1 row blocks, both block sets), under torch.compile as one graph, and where
the model's layers route products to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardlib.quantization import quantize
from tests.native_kernels import skip_unless_built
from workers.kernels import small_linear as small

pytestmark = skip_unless_built(small)

FORMATS = [None, "int8", "f8e4m3", "f8e5m2"]


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None):
    w = q.to(torch.float64) * (1.0 if scale is None else scale.to(torch.float64))
    y = x.to(torch.float64) @ w.T
    return y if bias is None else y + bias.to(torch.float64)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 16, 29, 32])
def test_products_equal_the_float64_reference(fmt, per_channel, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(37, 83, generator=g)  # 83 inputs: a tail after 10 vectors of 8; 37 outputs: ragged chunks
    q, scale = (w, None) if fmt is None else quantize(w, fmt, per_channel)
    x, bias = torch.randn(rows, 83, generator=g), torch.randn(37, generator=g)
    got = small.small_linear(x, q, scale, bias)
    want = reference(x, q, scale, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_the_16_register_blocks_also_equal_the_reference(fmt):
    """The kernel takes wider blocks where AVX-512 gives it 32 vector registers; this builds the
    source without AVX-512, so both block sets are checked on such a host (elsewhere it is the
    build the other tests already cover)."""
    narrow = small.build_and_load(small.NARROW_SPEC)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 83, generator=g)
    q, scale = (w, None) if fmt is None else quantize(w, fmt, True)
    assert narrow.cl_small_linear_wide() == 0
    for rows in (1, 2, 3, 5, 7, 16):
        x, bias = torch.randn(rows, 83, generator=g), torch.randn(37, generator=g)
        want = reference(x, q, scale, bias)
        got = small.run_kernel(narrow, x, q, scale, bias)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), rows


def test_fp8_widening_is_exact_for_every_byte():
    """All 256 codes of each fp8 format, subnormals and signed zeros included, read back as torch reads them."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.uint8).view(dtype)
        values = codes.to(torch.float32)
        finite = torch.isfinite(values)
        q = codes[finite].reshape(-1, 1)
        got = small.small_linear(torch.ones(1, 1), q).reshape(-1)
        assert torch.equal(got, values[finite]), dtype


def test_leading_dimensions_are_kept_and_inputs_may_be_views():
    w = torch.randn(24, 40)
    x = torch.randn(2, 3, 80)[..., ::2]  # (2, 3, 40), not contiguous
    got = small.small_linear(x, w)
    assert got.shape == (2, 3, 24)
    assert torch.allclose(got, F.linear(x, w), atol=1e-5)


def test_a_compiled_graph_keeps_the_kernel_as_one_call():
    import torch._dynamo

    w = torch.randn(64, 48)
    q, scale = quantize(w, "int8", True)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(lambda x: small.small_linear(x, q, scale) * 2)(torch.randn(4, 48))
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(lambda x: small.small_linear(x, q, scale) * 2, fullgraph=True, dynamic=False)
    x = torch.randn(4, 48)
    assert torch.equal(compiled(x), small.small_linear(x, q, scale) * 2)


def test_layers_route_small_batches_to_the_kernel(monkeypatch):
    """Eager: float32 products of 2 to max_rows() rows take the kernel, one row and larger products
    do not; 8-bit weights take it up to max_rows() rows. Counted through the operator."""
    from workers.layers import linear
    from workers.quantized_linear import QuantizedWeight

    most = small.max_rows()
    assert most == (small.WIDE_MAX_ROWS if small._library().cl_small_linear_wide() else small.MAX_ROWS)
    calls = []
    real = small.small_linear
    monkeypatch.setattr(small, "small_linear", lambda *a: (calls.append(a[0].shape), real(*a))[1])
    w = torch.randn(32, 16)
    for rows in (1, 2, most, most + 1):
        linear(torch.randn(rows, 16), w)
    assert calls == [(2, 16), (most, 16)]
    calls.clear()
    qw = QuantizedWeight(*quantize(w, "int8", True))
    for rows in (1, most, most + 1):
        y = linear(torch.randn(rows, 16), qw)
        assert y.shape == (rows, 32)
    assert calls == [(1, 16), (most, 16)]


def test_turned_off_by_the_environment(monkeypatch):
    small._library.cache_clear()
    monkeypatch.setenv("CORELAUNCH_SMALL_LINEAR", "0")
    try:
        assert small._library() is None and "CORELAUNCH_SMALL_LINEAR=0" in small.unavailable_reason
        with pytest.raises(RuntimeError, match="small-batch linear kernel is unavailable"):
            torch.ops.corelaunch.small_linear(torch.ones(2, 8), torch.ones(4, 8), None, None)
    finally:
        small._library.cache_clear()
        monkeypatch.delenv("CORELAUNCH_SMALL_LINEAR")
        assert small._library() is not None


def test_the_operator_refuses_what_its_c_code_would_misread():
    """The public operator passed raw pointers on unchecked: a bfloat16 x was read as float32 (twice
    its bytes: garbage, or a fault at a page's end), and a scale or bias of the wrong length read
    past its end."""
    weight = torch.randn(8, 16)
    with pytest.raises(ValueError, match="small_linear takes float32 x"):
        small.small_linear(torch.randn(2, 16, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="small_linear takes float32 x"):
        small.small_linear(torch.randn(2, 15), weight)
    with pytest.raises(ValueError, match=r"scale has 3 elements; it takes 1 or out \(8\)"):
        small.small_linear(torch.randn(2, 16), weight.to(torch.int8), torch.ones(3))
    with pytest.raises(ValueError, match=r"bias has 7 elements; it takes out \(8\)"):
        small.small_linear(torch.randn(2, 16), weight, None, torch.ones(7))


def test_two_threads_asking_first_build_the_library_once(monkeypatch):
    """lru_cache alone let two threads that asked first both build it (two compiles into an empty cache)."""
    import threading
    import time

    from workers.native_build import once_per_process

    calls = []

    def slow_build():
        calls.append(1)
        time.sleep(0.2)
        return "library"

    build = once_per_process(slow_build)
    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == [1] and build() == "library"
