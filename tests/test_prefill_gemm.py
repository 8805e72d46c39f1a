"""The GEMM behind prefill-sized products (workers/kernels/prefill_gemm.py): by default MKL's
(F.linear) on Intel CPUs, the packed-panel kernel on the others with AVX-512 and oneDNN's on the
rest, CORELAUNCH_PREFILL_GEMM choosing any, MKL's for oneDNN where torch has no oneDNN; one opaque
call in a compiled graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.native_kernels import skip_unless_built
from workers.kernels import packed_linear as kernel
from workers.kernels import prefill_gemm
from workers.kernels.prefill_gemm import CHOICES, chosen_gemm, prefill_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def operands(rows: int = 1024, k: int = 192, n: int = 80):
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, rows // 2, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("vendor, avx512, default", [("GenuineIntel", True, "mkl"), ("AuthenticAMD", True, "packed"),
                                                     ("AuthenticAMD", False, "onednn"), (None, False, "onednn")],
                         ids=["intel", "amd-avx512", "amd-avx2", "unknown"])
def test_the_default_follows_the_cpu(monkeypatch, vendor, avx512, default):
    monkeypatch.setattr(prefill_gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(prefill_gemm, "has_avx512", lambda: avx512)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    for unset in (None, ""):
        if unset is None:
            monkeypatch.delenv("CORELAUNCH_PREFILL_GEMM", raising=False)
        else:
            monkeypatch.setenv("CORELAUNCH_PREFILL_GEMM", unset)
        assert chosen_gemm() == default
    assert prefill_gemm.keeps_packed() == (default == "packed")
    for choice in CHOICES:  # the variable overrides the default either way
        monkeypatch.setenv("CORELAUNCH_PREFILL_GEMM", choice)
        assert chosen_gemm() == choice


def test_this_hosts_maker_and_flags_are_read():
    with open("/proc/cpuinfo") as f:
        lines = f.readlines()
    vendors = {line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")}
    assert prefill_gemm.cpu_vendor() in (vendors or {None})
    flags = {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    assert prefill_gemm.has_avx512() == ("avx512f" in flags)


@needs_onednn
def test_onednn_agrees_with_f_linear(monkeypatch):
    monkeypatch.setenv("CORELAUNCH_PREFILL_GEMM", "onednn")
    assert chosen_gemm() == "onednn"
    x, w, b = operands()
    got = prefill_linear(x, w, b)
    assert got.shape == (2, 512, 80)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # strided operands (a slice of the hidden states, every other bias element) are read by their strides
    wide, b2 = torch.cat([x, x], dim=-1)[..., :192], torch.stack([b, b], dim=-1).reshape(-1)[::2]
    torch.testing.assert_close(prefill_linear(wide, w, b2), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # other dtypes take F.linear (oneDNN's linear takes float32 here)
    assert torch.equal(prefill_linear(x.double(), w.double(), None), F.linear(x.double(), w.double()))


def test_mkl_is_f_linear_exactly(monkeypatch):
    monkeypatch.setenv("CORELAUNCH_PREFILL_GEMM", "mkl")
    assert chosen_gemm() == "mkl"
    x, w, b = operands()
    assert torch.equal(prefill_linear(x, w, b), F.linear(x, w, b))


def test_a_torch_without_onednn_takes_f_linear(monkeypatch):
    monkeypatch.setenv("CORELAUNCH_PREFILL_GEMM", "onednn")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert chosen_gemm() == "mkl"
    monkeypatch.setenv("CORELAUNCH_PREFILL_GEMM", "packed")  # needs no oneDNN
    assert chosen_gemm() == "packed"
    x, w, b = operands()
    assert torch.equal(prefill_linear(x, w, b), F.linear(x, w, b))


def test_an_unknown_choice_is_named(monkeypatch):
    monkeypatch.setenv("CORELAUNCH_PREFILL_GEMM", "blas")
    with pytest.raises(ValueError, match="CORELAUNCH_PREFILL_GEMM='blas' is not one of packed, onednn, mkl"):
        chosen_gemm()


@skip_unless_built(kernel, "the packed-panel kernel")
def test_an_unknown_choice_is_named_when_a_model_is_packed(monkeypatch):
    from tests.model_factory import build_random_model
    from workers.packed_weight import pack_linear_weights

    monkeypatch.setenv("CORELAUNCH_PREFILL_GEMM", "blas")
    with pytest.raises(ValueError, match="CORELAUNCH_PREFILL_GEMM='blas'"):  # at load, not at the first prefill
        pack_linear_weights(build_random_model("llama"))


def test_a_compiled_graph_calls_it_once_and_agrees_with_eager():
    import torch._dynamo

    x, w, b = operands()
    fn = lambda x: prefill_linear(x, w * 1.0, b).relu()  # noqa: E731 - the weight an intermediate, as unpacked
    torch._dynamo.reset()
    explain = torch._dynamo.explain(fn)(x)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    calls = [n for n in explain.graphs[0].graph.nodes if n.op == "call_function" and "prefill_linear" in str(n.target)]
    assert len(calls) == 1, [str(n.target) for n in explain.graphs[0].graph.nodes]
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), fn(x))
