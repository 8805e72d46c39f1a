"""The packed-panel linear kernel (workers/kernels/packed_linear.py) and packed model weights
(workers/packed_weight.py): products against float64 references for ragged shapes in both builds
(AVX-512 blocks and the 8-float ones), a row's result independent of its batch, the prefill path
through F.linear, one operator call in a compiled graph, and models whose weights are packed giving
transformers' greedy tokens at TP 1, 2 and 3 (tied embeddings, biases, fused projections)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.native_kernels import last_line_of_a_fresh_process, skip_unless_built
from workers.kernels import packed_linear as kernel

pytestmark = skip_unless_built(kernel)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("build", ["host", "narrow"])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 29, 300])
def test_products_equal_the_float64_reference(build, rows):
    """37 outputs: a partial last panel in both widths (32 and 16); 83 inputs (a chunk of K and a
    part of one, where a few blocks of rows take K in chunks); rows across the block sizes (12 and
    6) and past one row chunk (256)."""
    lib = kernel._library() if build == "host" else kernel.build_and_load(kernel.NARROW_SPEC)
    g = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(37, 83, generator=g), torch.randn(37, generator=g)
    x = torch.randn(rows, 83, generator=g)
    panels = kernel.pack(w, lib)
    assert panels.shape == (-(-37 // lib.cl_packed_panel_width()), 83, lib.cl_packed_panel_width())
    for b in (None, bias):
        got = kernel.run_kernel(lib, x, panels, 37, b)
        assert got.shape == (rows, 37) and close(got, reference(x, w, b)), (build, rows, b is None)


def test_pack_and_unpack_round_trip_and_padding_is_zero():
    w = torch.randn(37, 20)
    panels = kernel.pack(w)
    assert torch.equal(kernel.unpack(panels, 37), w)
    width = panels.shape[2]
    assert torch.count_nonzero(panels.permute(0, 2, 1).reshape(-1, 20)[37:]) == 0
    assert width * panels.shape[0] >= 37 > width * (panels.shape[0] - 1)


@pytest.mark.parametrize("build", ["host", "narrow"])
def test_a_rows_result_does_not_depend_on_its_batch(build):
    """Every output is summed in the same order whatever the number of rows: a request's logits are
    bit-identical alone and batched (below the prefill size that goes to F.linear). 200 inputs span
    several chunks of K; a few blocks of rows take K in chunks and a full row chunk (256) takes it
    whole, and the two agree to the bit."""
    lib = kernel._library() if build == "host" else kernel.build_and_load(kernel.NARROW_SPEC)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(100, 200, generator=g), torch.randn(300, 200, generator=g)
    panels = kernel.pack(w, lib)
    together = kernel.run_kernel(lib, x, panels, 100, None)
    for i in (0, 13, 299):
        assert torch.equal(kernel.run_kernel(lib, x[i:i + 1], panels, 100, None)[0], together[i])
    for start, stop in ((5, 17), (5, 53), (250, 262), (256, 300)):
        assert torch.equal(kernel.run_kernel(lib, x[start:stop], panels, 100, None), together[start:stop]), (start, stop)
    assert torch.equal(kernel.packed_linear(x[5:17], kernel.pack(w), 100, None),
                       kernel.packed_linear(x, kernel.pack(w), 100, None)[5:17])


def test_prefill_sized_products_go_through_the_prefill_gemm_on_the_unpacked_weight(monkeypatch):
    from workers.kernels.prefill_gemm import prefill_linear

    g = torch.Generator().manual_seed(4)
    w, bias = torch.randn(50, 96, generator=g), torch.randn(50, generator=g)
    x = torch.randn(kernel.UNPACK_MIN_ROWS, 96, generator=g)
    monkeypatch.setenv("CORELAUNCH_PREFILL_GEMM", "onednn")
    got = kernel.packed_linear(x, kernel.pack(w), 50, bias)
    assert torch.equal(got, prefill_linear(x, w, bias))
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("CORELAUNCH_PREFILL_GEMM", "mkl")
    assert torch.equal(kernel.packed_linear(x, kernel.pack(w), 50, bias), F.linear(x, w, bias))


def test_a_graph_traced_without_the_marks_takes_a_prefill_sized_product():
    """torch.compile of a prefill-sized packed product in a fresh process that never ran the marks
    workers/compiled.py sets: tracing into the prefill GEMM's choice (the environment,
    /proc/cpuinfo) failed a fullgraph compile; now such a graph takes the unpacked weight's GEMM."""
    script = ("import torch\nfrom workers.kernels import packed_linear as k\n"
              "w = torch.randn(64, 48); panels = k.pack(w); x = torch.randn(1100, 48)\n"
              "fn = lambda x: k.packed_linear(x, panels, 64, None) * 2\n"
              "print(torch.allclose(torch.compile(fn, fullgraph=True, dynamic=False)(x), fn(x), atol=1e-5))")
    assert last_line_of_a_fresh_process(script) == "True"


def test_with_the_packed_prefill_gemm_prefill_sized_products_stay_on_the_panels(monkeypatch):
    """Every row count through the kernel: a row's bits are the same in a prefill-sized product as
    alone."""
    monkeypatch.setenv("CORELAUNCH_PREFILL_GEMM", "packed")
    g = torch.Generator().manual_seed(5)
    w, bias = torch.randn(50, 96, generator=g), torch.randn(50, generator=g)
    x = torch.randn(kernel.UNPACK_MIN_ROWS + 3, 96, generator=g)
    panels = kernel.pack(w)
    got = kernel.packed_linear(x, panels, 50, bias)
    assert torch.equal(got, kernel.run_kernel(kernel._library(), x, panels, 50, bias))
    assert torch.equal(got[7:19], kernel.packed_linear(x[7:19], panels, 50, bias))
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_pack_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="2-D float32 CPU weight.*torch.float16"):
        kernel.pack(torch.ones(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\(2, 2, 2\)"):
        kernel.pack(torch.ones(2, 2, 2))


def test_a_compiled_graph_keeps_the_kernel_as_one_call_and_agrees_with_eager():
    import torch._dynamo

    w = torch.randn(64, 48)
    panels = kernel.pack(w)
    fn = lambda x: kernel.packed_linear(x, panels, 64, None) * 2  # noqa: E731
    torch._dynamo.reset()
    explain = torch._dynamo.explain(fn)(torch.randn(4, 48))
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    x = torch.randn(4, 1, 48)
    assert torch.equal(compiled(x), fn(x)) and compiled(x).shape == (4, 1, 64)


def test_turned_off_by_the_environment(monkeypatch):
    from workers.packed_weight import pack_linear_weights

    monkeypatch.setenv("CORELAUNCH_PACKED_WEIGHTS", "0")
    try:
        assert kernel._library() is None and "CORELAUNCH_PACKED_WEIGHTS=0" in kernel.unavailable_reason
        layer = torch.nn.Linear(4, 4)
        assert pack_linear_weights(layer) == 0 and isinstance(layer.weight, torch.nn.Parameter)
    finally:
        monkeypatch.delenv("CORELAUNCH_PACKED_WEIGHTS")
        assert kernel._library() is not None


# ---- packed models ---------------------------------------------------------------------------------
def test_packing_a_model_replaces_its_linear_weights_and_keeps_a_tied_table_single():
    from tests.test_model_tp import reference as model_reference
    from tests.tp_harness import build_rank_model
    from workers.collectives import SingleRank
    from workers.layers import RMSNorm
    from workers.packed_weight import PackedWeight, pack_linear_weights

    config, state_dict, _ = model_reference("uneven_tied_tp3")
    model = build_rank_model(config, state_dict, 0, 1, SingleRank())
    table = model.embed.weight.detach().clone()
    layers = len(model.layers)
    assert pack_linear_weights(model) == 7 * layers + 1  # q k v o gate up down per layer, the tied head
    assert isinstance(model.lm_head_weight, PackedWeight) and model.embed.weight is model.lm_head_weight
    assert torch.equal(model.lm_head_weight.unpacked(), table)
    ids = torch.tensor([[0, 5, 129], [64, 3, 7]])
    assert torch.equal(model.embed.weight.rows(ids), F.embedding(ids, table))
    assert not any(isinstance(getattr(m, "weight", None), PackedWeight) for m in model.modules() if isinstance(m, RMSNorm))
    assert model.device.type == "cpu"


def test_a_packed_tp1_model_matches_transformers():
    """Qwen2's q/k/v biases at TP 1, prompts alone and together."""
    from tests.test_model_tp import PROMPTS, reference as model_reference
    from tests.tp_harness import build_rank_model
    from workers.collectives import SingleRank
    from workers.engine import generate
    from workers.packed_weight import pack_linear_weights
    from workers.sampling import SamplingParams

    config, state_dict, refs = model_reference("qwen2_tp1")
    model = build_rank_model(config, state_dict, 0, 1, SingleRank())
    assert pack_linear_weights(model) > 0
    with torch.inference_mode():
        alone = [generate(model, [p], [SamplingParams()], 10, [2])[0].token_ids for p in PROMPTS]
        together = [o.token_ids for o in generate(model, PROMPTS, [SamplingParams()] * len(PROMPTS), 10, [2])]
    assert alone == refs and together == refs


@pytest.mark.parametrize("name", ["uneven_tied_tp3", "llama_split_tp2"])
def test_packed_multi_rank_models_match_transformers(name):
    """A tied, uneven vocabulary at TP 3; split KV heads, a batch and sampling at TP 2."""
    from tests.test_model_tp import SPECS, reference as model_reference, requests_for
    from tests.tp_harness import Case, run_tp_in_process, token_ids

    tp = SPECS[name][0]
    config, state_dict, refs = model_reference(name)
    case = Case(name, config, state_dict, requests_for(name), packed_weights=True)
    by_rank = run_tp_in_process(tp, [case], timeout_s=120)
    for rank in range(tp):
        assert [token_ids(r) for r in by_rank[rank][name][:len(refs)]] == [[r] for r in refs]


def test_packed_fused_projections_match_transformers():
    from tests.test_model_tp import reference as model_reference, requests_for
    from tests.tp_harness import Case, run_tp_in_process, token_ids

    config, state_dict, refs = model_reference("qwen2_bias_tp2")
    case = Case("qwen2_bias_tp2", config, state_dict, requests_for("qwen2_bias_tp2"), fused_projections=True,
                packed_weights=True)
    by_rank = run_tp_in_process(2, [case], timeout_s=120)
    assert [token_ids(r) for r in by_rank[0]["qwen2_bias_tp2"][:len(refs)]] == [[r] for r in refs]


def test_packed_families_moe_and_sequence_parallel_match_transformers():
    """At TP 2, packed: Gemma 3 (scaled, tied embedding, q/k norms, windows) with sequence
    parallelism, and Mixtral with expert parallelism (its router packed, its experts not)."""
    from tests.test_sequence_parallel import model_source
    from tests.tp_harness import Case, run_tp_in_process, token_ids
    from shardlib.expert_sharding import EXPERT_PARALLEL

    cases = []
    for name, sharding in (("gemma3", None), ("mixtral", EXPERT_PARALLEL)):
        config, state, _, requests = model_source(name)
        cases.append(Case(name, config, state, requests, moe_sharding=sharding, sequence_parallel=True,
                          packed_weights=True))
    by_rank = run_tp_in_process(2, cases, timeout_s=180)
    for case in cases:
        refs = model_source(case.name)[2]
        for rank in range(2):
            assert [token_ids(o)[0] for o in by_rank[rank][case.name][:2]] == refs, (case.name, rank)


def test_the_operator_refuses_panels_and_bias_that_do_not_fit():
    w = torch.randn(40, 24)
    panels = kernel.pack(w)
    x = torch.randn(3, 24)
    narrow = kernel.pack(w, kernel.build_and_load(kernel.NARROW_SPEC))
    if narrow.shape[2] != panels.shape[2]:  # AVX-512 hosts: panels of the other width are refused
        with pytest.raises(RuntimeError, match="packed by this build"):
            torch.ops.corelaunch.packed_linear_kernel(x, narrow, 40, None)
    with pytest.raises(RuntimeError, match="bias has 39 elements, not out_features 40"):
        torch.ops.corelaunch.packed_linear_kernel(x, panels, 40, torch.zeros(39))
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.corelaunch.packed_linear_kernel(x, panels, 40 + panels.shape[2], None)


def test_a_model_loaded_through_a_cpu_worker_runs_packed(tmp_path, in_process_cluster):
    """The README says every test that loads a model through a cpu worker runs packed; nothing
    checked it, so a worker that stopped packing would still pass every end-to-end test."""
    from launcher.api import Launcher
    from tests.model_factory import save_random_model
    from workers.packed_weight import PackedWeight

    model_dir = str(save_random_model(tmp_path / "m", "llama", num_heads=4, num_kv_heads=2))
    with Launcher(model=model_dir, tp=2, seq_len=32, compile=False, progress=False) as llm:
        for rank in llm._pool.replicas[0].started.group.actors:
            packed = [m for m in rank._model.modules() if isinstance(m, PackedWeight)]
            assert len(packed) >= 7 * len(rank._model.layers), len(packed)  # q k v o gate up down per layer
        assert llm.generate([[1, 2, 3]], max_new_tokens=2)[0].token_ids  # and it runs
