"""The prefill attention kernel (workers/kernels/prefill_attention.py): many queries per row over
float32 keys and values against a float64 reference, for the masks the model builds (a prefill
from slot 0, chunks continuing a history, sliding windows, padded batch rows) and any other (holes,
rows that read nothing), GQA groups, both block sets (AVX-512's and the 8-float one); a query's
result independent of the other queries and batch rows of its call, bit for bit; the operator
kept as one call in a compiled graph; whole models through it equal to transformers; and the calls
that stay on torch's attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.model_factory import build_random_model
from tests.native_kernels import last_line_of_a_fresh_process, skip_unless_built
from tests.test_attention_blocks import logits_counting_calls
from workers.kernels import prefill_attention as kernel
from workers.layers import attention
from workers.step import attention_bias_mask

pytestmark = skip_unless_built(kernel)


def reference(q, keys, values, mask, scale):
    """softmax over the readable slots in float64; a query that reads none gets zeros."""
    group = q.shape[1] // keys.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (keys, values))
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def model_mask(starts: list[int], seq: int, slots: int, window: int | None = None, pad: list[int] | None = None):
    """The model's mask (workers/step.py) for batch rows whose queries start at `starts`; row b's
    first pad[b] slots hold no token (a left-padded batch row)."""
    positions = torch.tensor(starts)[:, None] + torch.arange(seq)[None]
    real = torch.ones(len(starts), slots, dtype=torch.bool)
    for b, p in enumerate(pad or []):
        real[b, :p] = False
    return attention_bias_mask(slots, positions, real, window)


def tensors(batch, q_heads, kv_heads, seq, slots, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, q_heads, seq, head_dim, generator=g),
            torch.randn(batch, kv_heads, slots, head_dim, generator=g),
            torch.randn(batch, kv_heads, slots, head_dim, generator=g))


CASES = {
    "prefill from slot 0": dict(batch=1, seq=200, slots=200, starts=[0]),
    "chunk after a history": dict(batch=2, seq=70, slots=330, starts=[260, 100]),
    "sliding window": dict(batch=1, seq=300, slots=300, starts=[0], window=90),
    "padded batch rows": dict(batch=3, seq=130, slots=130, starts=[0, 0, 0], pad=[0, 17, 129]),
    "one query block": dict(batch=2, seq=5, slots=9, starts=[4, 0]),
}


def case_mask(case):
    return model_mask(case["starts"], case["seq"], case["slots"], case.get("window"), case.get("pad"))


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa3", "mha", "mqa8"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_operator_matches_the_float64_reference(name, heads):
    case = CASES[name]
    q, keys, values = tensors(case["batch"], *heads, case["seq"], case["slots"], 64, seed=len(name))
    mask = case_mask(case)
    got = kernel.prefill_attention(q, keys, values, mask, 0.125)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert torch.allclose(got.double(), reference(q, keys, values, mask, 0.125), atol=2e-6)


@pytest.mark.parametrize("build", ["host", "narrow"])
def test_both_block_sets_match_the_reference_with_holes_and_empty_rows(build):
    """Any mask: holes in a row (slot by slot), a row that reads nothing (zeros), one mask shared by
    the batch, head_dim 128, keys and values as strided views (a transposed projection)."""
    lib = kernel._library() if build == "host" else kernel.build_kernel(kernel.NARROW_SPEC)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 130, 6, 128, generator=g).transpose(1, 2)  # (2, 6, 130, 128), not contiguous
    keys = torch.randn(2, 257, 2, 128, generator=g).transpose(1, 2)
    values = torch.randn(2, 257, 2, 128, generator=g).transpose(1, 2)
    mask = torch.rand(1, 1, 130, 257, generator=g) < 0.3
    mask[0, 0, 7] = False
    got = kernel.run_kernel(lib, q, keys, values, mask, 0.09)
    expected = reference(q, keys, values, mask, 0.09)
    assert torch.allclose(got.double(), expected, atol=2e-6)
    assert torch.equal(got[:, :, 7], torch.zeros(2, 6, 128))


def test_a_querys_result_does_not_depend_on_the_rest_of_its_call():
    """The same queries prefilled in one call, in chunks of other sizes, and beside another batch
    row give the same bits: tiles of slots start at fixed multiples whatever the call holds."""
    q, keys, values = tensors(2, 9, 3, 600, 600, 64, seed=3)
    whole = kernel.prefill_attention(q, keys, values, model_mask([0, 0], 600, 600), 0.125)
    for start, end in ((0, 100), (100, 357), (357, 600), (517, 518)):
        chunk = kernel.prefill_attention(q[:1, :, start:end].contiguous(), keys[:1], values[:1],
                                         model_mask([start], end - start, 600), 0.125)
        assert torch.equal(chunk, whole[:1, :, start:end])
    windowed = kernel.prefill_attention(q, keys, values, model_mask([0, 0], 600, 600, 150), 0.125)
    alone = kernel.prefill_attention(q[1:, :, 300:].contiguous(), keys[1:], values[1:],
                                     model_mask([300], 300, 600, 150), 0.125)
    assert torch.equal(alone, windowed[1:, :, 300:])


def test_a_compiled_graph_keeps_the_operator_as_one_call_and_agrees_with_eager():
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return compile_fx(gm, inputs)

    q, keys, values = tensors(2, 4, 2, 96, 160, 32, seed=9)
    mask = model_mask([64, 10], 96, 160)
    eager = attention(q, keys, values, mask)
    torch._dynamo.reset()
    kernel.mark_constants_for_tracing()
    got = torch.compile(attention, backend=backend, fullgraph=True, dynamic=False)(q, keys, values, mask)
    assert torch.allclose(got, eager, atol=1e-6)
    assert len(graphs) == 1
    calls = [n for n in graphs[0].graph.nodes if str(n.target).startswith("corelaunch.prefill_attention")]
    assert len(calls) == 1


def test_a_graph_traced_without_the_marks_keeps_torchs_attention():
    """torch.compile of the model's attention in a fresh process that never ran
    mark_constants_for_tracing (workers/compiled.py runs it): tracing into available() broke the
    graph (an unsupported lock) and a fullgraph compile failed; now such a graph keeps torch's."""
    script = ("import torch, torch.nn.functional as F\nfrom workers.layers import attention\n"
              "q, k, v = torch.randn(1, 4, 40, 32), torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32)\n"
              "mask = torch.ones(40, 40, dtype=torch.bool).tril()[None, None]\n"
              "got = torch.compile(attention, fullgraph=True, dynamic=False)(q, k, v, mask)\n"
              "print(torch.allclose(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), "
              "atol=1e-6))")
    assert last_line_of_a_fresh_process(script) == "True"


def test_the_model_attention_takes_the_kernel_for_prefills_only(monkeypatch):
    """layers.attention gives the kernel's own bits for a float32 prefill on the CPU; one query per
    row, float64, a head_dim that is no multiple of the panel width, or the switch turned off keep
    torch's attention."""
    q, keys, values = tensors(1, 4, 2, 40, 40, 64, seed=1)
    mask = model_mask([0], 40, 40)
    assert torch.equal(attention(q, keys, values, mask), kernel.prefill_attention(q, keys, values, mask, 0.125))
    assert kernel.usable(q, keys, values, mask)
    assert not kernel.usable(q[:, :, :1], keys, values, mask[:, :, :1])
    assert not kernel.usable(q.double(), keys.double(), values.double(), mask)
    odd = tensors(1, 4, 2, 40, 40, 24)
    assert not kernel.usable(odd[0], odd[1], odd[2], mask)
    assert torch.allclose(attention(*odd, mask), F.scaled_dot_product_attention(*odd, attn_mask=mask,
                                                                                enable_gqa=True), atol=1e-6)
    monkeypatch.setenv("CORELAUNCH_PREFILL_ATTENTION", "0")
    assert not kernel.available() and "CORELAUNCH_PREFILL_ATTENTION=0" in kernel.unavailable_reason
    assert not kernel.usable(q, keys, values, mask)
    monkeypatch.delenv("CORELAUNCH_PREFILL_ATTENTION")
    assert kernel.available()


def test_shapes_the_kernel_does_not_take_stay_on_torchs_attention():
    """A mask broadcast over the queries, values of another head_dim, a mask per head: torch's
    attention takes them, so the model's attention must not send them to the kernel."""
    q, keys, values = tensors(2, 4, 2, 16, 24, 32, seed=2)
    full = model_mask([8, 0], 16, 24)
    for mask, v in ((full[:, :, -1:], values), (full, torch.randn(2, 2, 24, 64)), (full.expand(2, 4, 16, 24), values)):
        assert not kernel.usable(q, keys, v, mask)
        expected = F.scaled_dot_product_attention(q, keys, v, attn_mask=mask, enable_gqa=True)
        assert torch.allclose(attention(q, keys, v, mask), expected, atol=1e-6)


def test_a_nan_query_gives_nan_as_torchs_attention_does():
    q, keys, values = tensors(1, 4, 2, 8, 8, 32, seed=6)
    q[0, 1, 3] = float("nan")
    mask = model_mask([0], 8, 8)
    got = kernel.prefill_attention(q, keys, values, mask, 0.2)
    assert got[0, 1, 3].isnan().all()
    others = torch.ones(4, 8, dtype=torch.bool)
    others[1, 3] = False
    assert not got[0][others].isnan().any()


def test_bad_shapes_are_refused_with_what_it_takes():
    q, keys, values = tensors(1, 4, 2, 8, 8, 64)
    with pytest.raises(RuntimeError, match="q_heads a multiple of kv_heads"):
        kernel.prefill_attention(q[:, :3], keys, values, model_mask([0], 8, 8), 0.1)
    with pytest.raises(RuntimeError, match="bool mask"):
        kernel.prefill_attention(q, keys, values, model_mask([0], 8, 8).float(), 0.1)


@pytest.mark.parametrize("window", [None, 120], ids=["causal", "window"])
def test_a_long_prompt_through_the_kernel_equals_transformers(monkeypatch, window):
    """A 500-token prompt through a random Mistral of head_dim 32: every layer's attention takes the
    kernel (counted), and the last logits equal transformers'."""
    hf = build_random_model(model_type="mistral", hidden_size=128, num_heads=4, num_kv_heads=2, sliding_window=window,
                            max_position_embeddings=1024, vocab_size=256, initializer_range=0.05, seed=4)
    prompt = [(11 * i + 5) % 250 + 3 for i in range(500)]
    expected, got, calls = logits_counting_calls(monkeypatch, kernel, "prefill_attention", hf, prompt)
    assert calls == hf.config.num_hidden_layers
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
