"""Decode attention under a torch.compile that did not set workers/compiled.py's tracing marks."""

from __future__ import annotations

from tests.native_kernels import last_line_of_a_fresh_process


def test_a_graph_traced_without_the_marks_keeps_the_traced_decode_attention():
    """A fresh process that never ran mark_constants_for_tracing (workers/compiled.py runs it):
    usable() traced into available(), whose lock Dynamo cannot trace, so a fullgraph compile failed
    and any other broke its graph at every decode attention. Now such a graph keeps the traced path,
    as the prefill kernel's usable() does."""
    script = ("import torch\nfrom workers.kernels import decode_attention\n"
              "q, cache = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 16, 64)\n"
              "step = lambda q, k: q * 2 if decode_attention.usable(q, k) else q - 1\n"
              "got = torch.compile(step, fullgraph=True, backend='eager')(q, cache)\n"
              "print(torch.equal(got, q - 1))")
    assert last_line_of_a_fresh_process(script) == "True"
