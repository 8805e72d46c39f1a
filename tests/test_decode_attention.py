"""The decode attention kernel (workers/kernels/decode_attention.py): one query per row over a
float32 cache against a float64 reference (GQA groups, holes in the mask, rows of a serving cache,
fewer slots read than the cache holds), a row's result independent of its batch, the operator kept
as one call in a compiled graph that agrees with the eager model, and the paths that stay on the
traced products and sums."""

from __future__ import annotations

import os

import pytest
import torch

from tests.native_kernels import last_line_of_a_fresh_process, skip_unless_built
from workers.kernels import decode_attention as kernel

pytestmark = skip_unless_built(kernel)


def reference(q, k_cache, v_cache, rows, mask, read_slots, scale):
    """softmax over the allowed slots in float64, each batch row against its own cache row."""
    batch, q_heads, _, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    rows = torch.arange(batch) if rows is None else rows
    keys = k_cache[rows, :, :read_slots].double().repeat_interleave(q_heads // kv_heads, dim=1)
    values = v_cache[rows, :, :read_slots].double().repeat_interleave(q_heads // kv_heads, dim=1)
    scores = (q.double() @ keys.transpose(-1, -2)) * scale  # (batch, q_heads, 1, read_slots)
    scores = scores.masked_fill(~mask.reshape(batch, 1, 1, read_slots), float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 80)])
@pytest.mark.parametrize("serving", [False, True])
def test_matches_the_float64_reference(q_heads, kv_heads, head_dim, serving):
    g = torch.Generator().manual_seed(q_heads * head_dim)
    batch, slots, read_slots = 5, 40, 40 if not serving else 24
    cache_rows = batch if not serving else 7
    q = torch.randn(batch, q_heads, 1, head_dim, generator=g)
    k_cache = torch.randn(cache_rows, kv_heads, slots, head_dim, generator=g)
    v_cache = torch.randn(cache_rows, kv_heads, slots, head_dim, generator=g)
    rows = torch.tensor([6, 0, 3, 2, 5]) if serving else None
    mask = torch.rand(batch, 1, 1, read_slots, generator=g) > 0.3  # holes, as left padding leaves
    mask[:, ..., 0] = True
    scale = head_dim ** -0.5
    got = kernel.decode_attention(q, k_cache, v_cache, rows, mask, read_slots, scale)
    want = reference(q, k_cache, v_cache, rows, mask, read_slots, scale)
    assert got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=["host", "portable"])
def kernel_build(request):
    """The kernel alone (C) as this host builds it (the vector path where AVX2 and FMA are there) and
    its portable path, called through ctypes."""
    return kernel.build_kernel(kernel.kernel_spec(portable=request.param == "portable"))


def test_the_host_build_takes_the_vector_path_where_the_cpu_has_avx2_and_fma():
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        flags = {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split()}
    if not {"avx2", "fma"} <= flags:
        pytest.skip("no AVX2 and FMA here: the host build is the portable path")
    assert kernel.build_kernel(kernel.kernel_spec()).cl_decode_attention_vector_path() == 1
    assert kernel.build_kernel(kernel.kernel_spec(portable=True)).cl_decode_attention_vector_path() == 0


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,read_slots", [
    (9, 3, 64, 300),    # SmolLM2's heads; several value tiles (64 slots each at 64 lanes), a short last block of keys
    (8, 2, 80, 150),    # a group of 4 (passes of 3 and 1 query heads), lanes in passes of 32, 32 and 16
    (16, 2, 128, 70),   # a group of 8
    (4, 2, 40, 96),     # lanes in passes of 32 and 8
    (6, 3, 24, 200),    # one pass of 24 lanes
    (6, 6, 12, 40),     # 12 lanes: the portable path in every build
])
def test_each_build_matches_the_float64_reference(kernel_build, q_heads, kv_heads, head_dim, read_slots):
    g = torch.Generator().manual_seed(read_slots + head_dim)
    batch, cache_rows, slots = 5, 7, read_slots + 20
    q = torch.randn(batch, q_heads, 1, head_dim, generator=g) * 2  # peaked softmaxes as well as flat ones
    k_cache = torch.randn(cache_rows, kv_heads, slots, head_dim, generator=g)
    v_cache = torch.randn(cache_rows, kv_heads, slots, head_dim, generator=g)
    rows = torch.tensor([5, 0, 3, 1, 6])
    mask = torch.rand(batch, 1, 1, read_slots, generator=g) > 0.2
    mask[0] = torch.arange(read_slots) < read_slots - 3  # a prefix, as a running sequence has
    mask[1, ..., 0], mask[1, ..., 1:] = True, False  # a single slot
    mask[2] = torch.arange(read_slots) < 64  # exactly a tile at 64 lanes, a whole number of blocks of 8
    mask[3] = torch.arange(read_slots) < 16
    want = reference(q, k_cache, v_cache, rows, mask, read_slots, head_dim ** -0.5)
    for b, row in enumerate(rows.tolist()):  # what the mask excludes, and what lies past read_slots, is never read
        k_cache[row, :, :read_slots][..., ~mask[b, 0, 0], :] = float("nan")
        v_cache[row, :, :read_slots][..., ~mask[b, 0, 0], :] = float("nan")
    k_cache[:, :, read_slots:], v_cache[:, :, read_slots:] = float("nan"), float("nan")
    got = kernel.run_kernel(kernel_build, q, k_cache, v_cache, rows, mask, read_slots, head_dim ** -0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)


def test_each_build_takes_scores_far_below_zero_and_keeps_a_nan(kernel_build):
    """Every score of a row near -128, where exp underflows unless the maximum is taken off first,
    and a NaN query head: NaN comes out where the reference has it, on both paths, instead of a
    plausible-looking average."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 1, 64, generator=g)
    k_cache, v_cache = torch.randn(2, 2, 50, 64, generator=g), torch.randn(2, 2, 50, 64, generator=g)
    # row 0's scores exactly -128 + slot / 32: every product and sum is exact in float32
    q[0] = 0.0
    q[0, :, :, 0], q[0, :, :, 1] = -1024.0, 1.0
    k_cache[0, :, :, 0], k_cache[0, :, :, 1] = 1.0, torch.arange(50) * 0.25
    q[1, 3] = float("nan")
    mask = torch.ones(2, 1, 1, 50, dtype=torch.bool)
    got = kernel.run_kernel(kernel_build, q, k_cache, v_cache, None, mask, 50, 0.125)
    want = reference(q, k_cache, v_cache, None, mask, 50, 0.125)
    assert torch.isnan(got[1, 3]).all() and not torch.isnan(got[1, :3]).any()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6, equal_nan=True)


def test_the_host_build_and_the_operator_agree():
    """run_kernel (what tests and the benchmark time) computes what the registered operator does."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, 9, 1, 64, generator=g)
    k_cache, v_cache = torch.randn(3, 3, 100, 64, generator=g), torch.randn(3, 3, 100, 64, generator=g)
    mask = torch.rand(3, 1, 1, 90, generator=g) > 0.1
    lib = kernel.build_kernel(kernel.kernel_spec())
    assert torch.equal(kernel.run_kernel(lib, q, k_cache, v_cache, None, mask, 90, 0.125),
                       kernel.decode_attention(q, k_cache, v_cache, None, mask, 90, 0.125))


def test_a_rows_result_does_not_depend_on_its_batch_and_masked_slots_are_never_read():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 9, 1, 64, generator=g)
    k_cache, v_cache = torch.randn(6, 3, 32, 64, generator=g), torch.randn(6, 3, 32, 64, generator=g)
    mask = torch.ones(6, 1, 1, 32, dtype=torch.bool)
    mask[:, ..., 20:] = False
    together = kernel.decode_attention(q, k_cache, v_cache, None, mask, 32, 0.125)
    rows = torch.tensor([4])
    alone = kernel.decode_attention(q[4:5], k_cache, v_cache, rows, mask[4:5], 32, 0.125)
    assert torch.equal(alone, together[4:5])
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    poisoned_k[:, :, 20:], poisoned_v[:, :, 20:] = float("nan"), float("nan")
    assert torch.equal(kernel.decode_attention(q, poisoned_k, poisoned_v, None, mask, 32, 0.125), together)


def test_each_build_combines_the_parts_of_long_rows(kernel_build):
    """Rows longer than PART_SLOTS are cut into parts at fixed slots, each part a task, and the parts'
    results combined: rows over three parts, one whose middle part the mask leaves empty, one wholly
    inside the last part, one where a slot of the last part dominates, one whose scores are NaN in
    one part only (NaN comes out, not an average of the other parts), one whose scores are -inf over
    a whole part (the other parts decide, as over the row) and one whose scores are all -inf (NaN,
    as the softmax of nothing finite)."""
    part = kernel.PART_SLOTS
    read_slots, head_dim = 2 * part + 100, 64
    g = torch.Generator().manual_seed(21)
    q = torch.randn(7, 9, 1, head_dim, generator=g) * 2
    k_cache = torch.randn(8, 3, read_slots + 8, head_dim, generator=g)
    v_cache = torch.randn(8, 3, read_slots + 8, head_dim, generator=g)
    rows = torch.tensor([5, 1, 0, 3, 2, 6, 7])
    mask = torch.rand(7, 1, 1, read_slots, generator=g) > 0.1
    mask[1, ..., part:2 * part] = False  # an empty middle part
    mask[2, ..., :2 * part] = False  # only the last part
    mask[3, ..., 2 * part + 5] = mask[4, ..., part + 7] = True
    k_cache[rows[3], :, 2 * part + 5] = q[3, ::3, 0] * 8  # row 3: one slot of the last part dominates
    k_cache[rows[4], 1, part + 7] = float("nan")  # row 4, KV head 1: a NaN score in its second part
    q[5:, :, :, 0] = q[5:, :, :, 0].abs() + 0.5  # rows 5 and 6: a key of -inf in lane 0 scores -inf
    k_cache[rows[5], 0, part:2 * part, 0] = float("-inf")  # row 5, KV head 0: its whole second part
    k_cache[rows[6], 2, :, 0] = float("-inf")  # row 6, KV head 2: every slot
    want = reference(q, k_cache, v_cache, rows, mask, read_slots, head_dim ** -0.5)
    got = kernel.run_kernel(kernel_build, q, k_cache, v_cache, rows, mask, read_slots, head_dim ** -0.5)
    nan = torch.zeros(7, 9, dtype=torch.bool)
    nan[4, 3:6] = nan[6, 6:9] = True
    nan_lanes = torch.isnan(got).squeeze(2)  # (rows, query heads, lanes)
    assert torch.equal(nan_lanes.all(-1), nan) and torch.equal(nan_lanes.any(-1), nan)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6, equal_nan=True)


def test_a_long_rows_result_does_not_depend_on_its_batch_or_the_slots_read():
    """Parts are cut at fixed slots: a row gives the same bits alone, in a batch, and when the step
    reads more slots (a longer neighbour's read bucket), whether it spans one part or several."""
    part = kernel.PART_SLOTS
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 9, 1, 64, generator=g)
    k_cache, v_cache = torch.randn(3, 3, 3 * part, 64, generator=g), torch.randn(3, 3, 3 * part, 64, generator=g)
    mask = torch.zeros(3, 1, 1, 3 * part, dtype=torch.bool)
    lengths = (part - 10, part + 300, 3 * part - 1)  # one part, two, three
    for b, length in enumerate(lengths):
        mask[b, ..., :length] = True
    together = kernel.decode_attention(q, k_cache, v_cache, None, mask, 3 * part, 0.125)
    for b, length in enumerate(lengths):
        rows = torch.tensor([b])
        for read_slots in {length, -(-length // part) * part, 3 * part}:
            alone = kernel.decode_attention(q[b:b + 1], k_cache, v_cache, rows,
                                            mask[b:b + 1, ..., :read_slots].contiguous(), read_slots, 0.125)
            assert torch.equal(alone, together[b:b + 1]), (length, read_slots)


def test_a_row_with_no_allowed_slot_gets_zeros_not_nan():
    q, cache = torch.randn(2, 2, 1, 16), torch.randn(2, 1, 8, 16)
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    mask[1] = False
    out = kernel.decode_attention(q, cache, cache, None, mask, 8, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and not out[0].eq(0).all()


def test_the_operator_refuses_what_it_cannot_hold():
    q, cache = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16)
    mask = torch.ones(2, 8, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="read_slots within"):
        kernel.decode_attention(q, cache, cache, None, mask, 9, 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.decode_attention(q.double(), cache, cache, None, mask, 8, 0.25)
    with pytest.raises(RuntimeError, match="outside the cache's 2 rows"):
        kernel.decode_attention(q, cache, cache, torch.tensor([0, 2]), mask, 8, 0.25)


def test_only_float32_caches_on_the_cpu_take_it():
    q = torch.randn(1, 4, 1, 16)
    assert kernel.usable(q, torch.randn(1, 2, 8, 16))
    assert not kernel.usable(q, torch.zeros(1, 2, 8, 16, dtype=torch.float8_e4m3fn))  # fp8: dequantized in the graph
    assert not kernel.usable(torch.randn(1, 4, 2, 16), torch.randn(1, 2, 8, 16))  # two queries: a prefill


def test_what_the_operator_refuses_keeps_the_traced_path():
    """The operator's own checks fail a step (RuntimeError); usable() sends such inputs to the
    traced attention instead."""
    assert not kernel.usable(torch.randn(1, 6, 1, 16), torch.randn(1, 4, 8, 16))  # 6 query heads over 4 KV heads
    assert not kernel.usable(torch.randn(1, 4, 1, 16), torch.randn(1, 8, 2, 16).transpose(1, 2))  # not contiguous


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("CORELAUNCH_DECODE_ATTENTION", "0")
    assert not kernel.available() and "CORELAUNCH_DECODE_ATTENTION=0" in kernel.unavailable_reason
    monkeypatch.delenv("CORELAUNCH_DECODE_ATTENTION")
    assert kernel.available()


def tiny_attention():
    """An Attention of 4 query heads over 2 KV heads of 16 lanes (hidden 64), random weights."""
    from workers.collectives import SingleRank
    from workers.layers import Attention

    g = torch.Generator().manual_seed(7)
    weights = {"q_proj.weight": torch.randn(64, 64, generator=g) * 0.1,
               "k_proj.weight": torch.randn(32, 64, generator=g) * 0.1,
               "v_proj.weight": torch.randn(32, 64, generator=g) * 0.1,
               "o_proj.weight": torch.randn(64, 64, generator=g) * 0.1}
    return Attention(weights, 4, 2, 16, torch.float32, SingleRank())


def test_a_compiled_decode_step_calls_the_operator_once_and_agrees_with_eager():
    """Attention over a cache, traced for one token per row: the attention is one operator call in
    the graph, and the output matches the eager module (SDPA), for a static batch's cache (rows
    None) and a serving cache (each batch row its own cache row, fewer slots read than held)."""
    import torch._dynamo

    from workers.compiled import _compile
    from workers.layers import KVSlots

    from workers.kernels import small_linear

    kernel.mark_constants_for_tracing()  # as _compile does, for explain's own trace
    small_linear.mark_constants_for_tracing()
    attention = tiny_attention()
    g = torch.Generator().manual_seed(3)
    cos, sin = torch.ones(2, 1, 16), torch.zeros(2, 1, 16)  # rotary at angle 0: the identity

    def step(x, mask, k_cache, v_cache, positions, rows):
        return attention(x, cos, sin, mask, KVSlots(k_cache, v_cache, positions, rows))[0]

    for rows, cache_rows, read_slots in ((None, 2, 16), (torch.tensor([[2], [0]]), 3, 12)):
        k_cache, v_cache = (torch.randn(cache_rows, 2, 16, 16, generator=g) for _ in range(2))
        x = torch.randn(2, 1, 64, generator=g)
        positions = torch.tensor([5]) if rows is None else torch.tensor([[5], [9]])
        mask = torch.arange(read_slots).view(1, 1, 1, read_slots) <= positions.view(-1, 1, 1, 1)
        eager_caches, compiled_caches = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
        with torch.inference_mode():
            eager = step(x, mask, *eager_caches, positions, rows)
            torch._dynamo.reset()
            explained = torch._dynamo.explain(step)(x, mask, *compiled_caches, positions, rows)
            compiled = _compile(step)(x, mask, *compiled_caches, positions, rows)
        targets = [str(n.target) for gm in explained.graphs for n in gm.graph.nodes if n.op == "call_function"]
        assert explained.graph_break_count == 0
        assert sum("decode_attention" in t for t in targets) == 1, targets
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
        assert torch.equal(compiled_caches[0], eager_caches[0]) and torch.equal(compiled_caches[1], eager_caches[1])


def test_zero_kv_heads_or_head_dim_are_refused_not_a_process_crash():
    """The check divided by the KV head count before anything had checked it, and a head_dim of 0
    passed every check and divided by zero later: the process died of SIGFPE."""
    q = torch.zeros(1, 2, 1, 8)
    for kv_heads, head_dim in ((0, 8), (2, 0)):
        cache = torch.zeros(1, kv_heads, 4, head_dim)
        query = q if head_dim else torch.zeros(1, 2, 1, 0)
        with pytest.raises(RuntimeError, match="decode_attention takes"):
            kernel.decode_attention(query, cache, cache.clone(), None, torch.ones(1, 4, dtype=torch.bool), 4, 1.0)


def test_a_direct_call_loads_the_kernel_first():
    """The operator's CPU kernel is registered when its library loads: a direct call in a process
    that had not asked available() raised NotImplementedError."""
    script = ("import torch\nfrom workers.kernels import decode_attention as k\n"
              "q, cache = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 4, 8)\n"
              "print(tuple(k.decode_attention(q, cache, cache, None, torch.ones(1, 4, dtype=torch.bool), 4, 1.0).shape))")
    assert last_line_of_a_fresh_process(script) == "(1, 2, 1, 8)"
