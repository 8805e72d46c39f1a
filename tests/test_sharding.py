"""shardlib.sharding: every rank's shard, computed in one process, against the unsharded torch math.

fairscale-style: seed identically, cut the full weights with slice_for_style/apply_slice, run each
rank's part of the computation, combine the ranks the way the collective would (concatenate for a
gather, sum for an all-reduce) and compare with the plain computation on the full weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from shardlib.model_config import ModelConfig
from shardlib.sharding import (KVStrategy, ShardLayout, Style, TensorSlice, _merge, apply_slice,
                               default_kv_strategy, kv_strategy_problem, slice_for, slice_for_style,
                               style_for)

SHARD, REPL, MHA = KVStrategy.SHARD, KVStrategy.REPLICATE_TO_TP, KVStrategy.CONVERT_TO_MHA
F64 = dict(dtype=torch.float64)
TIGHT = dict(rtol=1e-12, atol=1e-12)  # float64; only the summation order differs


def make_layout(tp, heads=12, kv_heads=4, strategy=None, head_dim=4, hidden=16, inter=10, vocab=11):
    strategy = strategy or default_kv_strategy(heads, kv_heads, tp)
    return ShardLayout(tp_degree=tp, kv_strategy=strategy, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=head_dim, hidden_size=hidden, intermediate_size=inter, vocab_size=vocab)


def shard(tensor, style, rank, layout):
    return apply_slice(tensor, slice_for_style(style, tensor.shape, rank, layout))


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), **F64)


# ---- KV strategies -------------------------------------------------------------------------------
# (H, K, T, expected default strategy, expected kv_head_ids per rank)
KV_CASES = [
    (8, 4, 2, SHARD, [[0, 1], [2, 3]]),
    (8, 4, 4, SHARD, [[0], [1], [2], [3]]),
    (8, 2, 4, REPL, [[0], [0], [1], [1]]),
    (4, 1, 2, REPL, [[0], [0]]),
    (6, 2, 3, MHA, [[0, 0], [0, 1], [1, 1]]),
    (12, 4, 3, MHA, [[0, 0, 0, 1], [1, 1, 2, 2], [2, 3, 3, 3]]),
    (12, 4, 6, MHA, [[0, 0], [0, 1], [1, 1], [2, 2], [2, 3], [3, 3]]),
]
KV_IDS = [f"H{h}K{k}T{t}-{s.value}" for h, k, t, s, _ in KV_CASES]


@pytest.mark.parametrize("h,k,t,expected", [
    *[(h, k, t, s) for h, k, t, s, _ in KV_CASES],
    (9, 3, 3, SHARD), (9, 3, 9, REPL), (8, 8, 8, SHARD), (12, 8, 3, MHA),
    (9, 3, 2, None),  # H % T != 0: nothing works
    (6, 2, 4, None),  # T % K == 0, but 6 Q heads do not split over 4 ranks
])
def test_default_kv_strategy(h, k, t, expected):
    assert default_kv_strategy(h, k, t) == expected


def test_kv_replication_leaves_out_the_slots_of_padded_q_heads():
    """H 9, K 3 at T 4 as multi-head attention with padded Q heads: 12 KV slots, 3 of them for the
    padding heads; each original KV head has 3 copies (its 3 Q heads), not 12 / 3."""
    layout = ShardLayout(tp_degree=4, kv_strategy=MHA, num_heads=9, num_kv_heads=3, head_dim=4, hidden_size=36,
                         intermediate_size=8, vocab_size=11, pad_q_heads=True)
    ids = [kv for r in range(4) for kv in layout.kv_head_ids(r)]
    assert len(ids) == 12 and ids.count(None) == 3
    assert layout.kv_replication == 3 == ids.count(0) == ids.count(1) == ids.count(2)


@pytest.mark.parametrize("h,k,t,strategy,ids", KV_CASES, ids=KV_IDS)
def test_kv_head_ids(h, k, t, strategy, ids):
    layout = make_layout(t, h, k)
    assert layout.kv_strategy is strategy
    assert [layout.kv_head_ids(r) for r in range(t)] == ids
    group = h // k  # Q heads per original KV head
    copies = {kv: sum(row.count(kv) for row in ids) for kv in range(k)}
    assert layout.kv_replication == {SHARD: 1, REPL: t // k, MHA: group}[strategy]
    assert copies == {kv: layout.kv_replication for kv in range(k)}
    if strategy is REPL:  # each head on exactly T/K ranks, once per rank
        assert all(len(row) == 1 for row in ids)
    for r in range(t):
        q_heads = list(layout.q_head_ids(r))
        if strategy is MHA:  # rank r's KV heads are exactly those its Q heads need, one each
            assert ids[r] == [q // group for q in q_heads]
        local_group = layout.q_heads_per_rank // layout.kv_heads_per_rank
        assert local_group * layout.kv_heads_per_rank == layout.q_heads_per_rank
        for q_local, q in enumerate(q_heads):
            assert ids[r][q_local // local_group] == q // group


def test_validation_messages_name_the_values():
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\).*tp_degree \(2\)"):
        make_layout(2, 9, 3, strategy=SHARD)
    with pytest.raises(ValueError, match=r"'shard'.*num_key_value_heads \(2\).*tp_degree \(4\)"):
        make_layout(4, 8, 2, strategy=SHARD)
    with pytest.raises(ValueError, match=r"'replicate_to_tp'.*tp_degree \(6\).*num_key_value_heads \(4\)"):
        make_layout(6, 12, 4, strategy=REPL)
    with pytest.raises(ValueError, match=r"num_attention_heads \(12\).*num_key_value_heads \(8\)"):
        make_layout(3, 12, 8, strategy=MHA)  # not GQA: would hand out KV heads 8..11
    with pytest.raises(ValueError, match=r"tp_degree \(0\)"):
        make_layout(0, 8, 4, strategy=SHARD)
    assert kv_strategy_problem(MHA, 9, 3, 2) == (
        "kv strategy 'convert_to_mha' needs num_attention_heads (9) divisible by tp_degree (2)")
    assert kv_strategy_problem("shard", 8, 4, 2) is None
    assert kv_strategy_problem(REPL, 8, 2, 4) is None
    config = ModelConfig(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152)
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\).*tp_degree \(2\)"):
        ShardLayout.for_model(config, 2)
    assert ShardLayout.for_model(config, 9).kv_strategy is REPL
    assert ShardLayout.for_model(config, 3, "convert_to_mha").kv_heads_per_rank == 3


# ---- linear layers -------------------------------------------------------------------------------
@pytest.mark.parametrize("out_features,tp", [(8, 4), (10, 4), (9, 4), (7, 3)])
def test_column_parallel_linear(out_features, tp):
    """Y = X W^T + b, W split along out_features: concatenating the ranks' Y slices gives Y."""
    layout = make_layout(tp, inter=out_features)
    w, b, x = randn(out_features, 6, seed=1), randn(out_features, seed=2), randn(3, 6, seed=3)
    per = layout.intermediate_per_rank
    parts = []
    for r in range(tp):
        w_r, b_r = shard(w, Style.COLUMN, r, layout), shard(b, Style.COLUMN, r, layout)
        assert w_r.shape == (per, 6) and b_r.shape == (per,)
        parts.append(F.linear(x, w_r, b_r))
    y = torch.cat(parts, dim=-1)
    assert y.shape == (3, per * tp)
    assert torch.equal(y[:, out_features:], torch.zeros(3, per * tp - out_features, **F64))
    assert_close(y[:, :out_features], F.linear(x, w, b), **TIGHT)


@pytest.mark.parametrize("in_features,tp", [(8, 2), (10, 4), (9, 4)])
def test_row_parallel_linear(in_features, tp):
    """Y = X W^T, W split along in_features: each rank feeds its slice of X; the partial Ys sum to Y."""
    layout = make_layout(tp, inter=in_features)
    w, x = randn(5, in_features, seed=4), randn(3, in_features, seed=5)
    total = torch.zeros(3, 5, **F64)
    for r in range(tp):
        tslice = slice_for_style(Style.ROW, w.shape, r, layout)
        assert tslice.dim == 1
        x_r = apply_slice(x, tslice)  # (batch, in_per_rank): the same columns, zero-padded alike
        total += F.linear(x_r, apply_slice(w, tslice))
    assert_close(total, F.linear(x, w), **TIGHT)


def test_vocab_parallel_embedding_and_lm_head():
    vocab, hidden, tp = 11, 5, 4
    layout = make_layout(tp, vocab=vocab)
    assert (layout.vocab_per_rank, layout.padded_vocab_size) == (3, 12)
    assert [layout.vocab_range(r) for r in range(tp)] == [(0, 3), (3, 6), (6, 9), (9, 11)]
    table, x = randn(vocab, hidden, seed=6), randn(2, hidden, seed=7)
    ids = torch.tensor([[0, 2, 3, 10, 9], [5, 6, 8, 1, 10]])
    embedded, logits = torch.zeros(2, 5, hidden, **F64), []
    for r in range(tp):
        table_r = shard(table, Style.VOCAB, r, layout)
        assert table_r.shape == (3, hidden)
        lo, hi = layout.vocab_range(r)
        owned = (ids >= lo) & (ids < hi)
        local = torch.where(owned, ids - lo, torch.zeros_like(ids))
        embedded += F.embedding(local, table_r) * owned.unsqueeze(-1)
        logits.append(x @ table_r.T)
    assert_close(embedded, F.embedding(ids, table), **TIGHT)
    logits = torch.cat(logits, dim=-1)
    assert logits.shape == (2, 12) and torch.equal(logits[:, vocab:], torch.zeros(2, 1, **F64))
    assert_close(logits[:, :vocab], x @ table.T, **TIGHT)


@pytest.mark.parametrize("inter,tp", [(10, 4), (10, 3), (12, 4)])
def test_mlp_block(inter, tp):
    """down(silu(gate(x)) * up(x)): gate/up column-parallel (zero padded), down row-parallel."""
    hidden = 8
    layout = make_layout(tp, hidden=hidden, inter=inter)
    gate, up, down = randn(inter, hidden, seed=8), randn(inter, hidden, seed=9), randn(hidden, inter, seed=10)
    x = randn(2, 3, hidden, seed=11)
    total = torch.zeros(2, 3, hidden, **F64)
    for r in range(tp):
        act = F.silu(x @ shard(gate, Style.COLUMN, r, layout).T) * (x @ shard(up, Style.COLUMN, r, layout).T)
        real = slice_for_style(Style.COLUMN, gate.shape, r, layout).length()
        assert torch.equal(act[..., real:], torch.zeros_like(act[..., real:]))  # padding stays exact
        total += act @ shard(down, Style.ROW, r, layout).T
    full = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    assert_close(total, full, **TIGHT)


# ---- attention -----------------------------------------------------------------------------------
def rank_attention(x, wq, bq, wk, bk, wv, bv, wo, heads, kv_heads, d):
    """Causal GQA attention on one rank's heads; returns this rank's partial o_proj output."""
    b, s, _ = x.shape
    q = F.linear(x, wq, bq).view(b, s, heads, d).transpose(1, 2)  # (batch, heads, seq, head_dim)
    k = F.linear(x, wk, bk).view(b, s, kv_heads, d).transpose(1, 2)  # (batch, kv_heads, seq, head_dim)
    v = F.linear(x, wv, bv).view(b, s, kv_heads, d).transpose(1, 2)
    k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    scores = q @ k.transpose(-1, -2) / d ** 0.5  # (batch, heads, seq, seq)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return F.linear((probs @ v).transpose(1, 2).reshape(b, s, heads * d), wo)


@pytest.mark.parametrize("h,k,t,strategy,ids", KV_CASES, ids=KV_IDS)
def test_gqa_attention_block(h, k, t, strategy, ids):
    d, hidden = 4, 16
    layout = make_layout(t, h, k, head_dim=d, hidden=hidden)
    assert layout.kv_strategy is strategy
    wq, bq = randn(h * d, hidden, seed=12), randn(h * d, seed=13)
    wk, bk = randn(k * d, hidden, seed=14), randn(k * d, seed=15)
    wv, bv = randn(k * d, hidden, seed=16), randn(k * d, seed=17)
    wo, x = randn(hidden, h * d, seed=18), randn(2, 5, hidden, seed=19)

    total = torch.zeros(2, 5, hidden, **F64)
    for r in range(t):
        q_parts = [shard(p, Style.Q_HEADS, r, layout) for p in (wq, bq)]
        kv_parts = [shard(p, Style.KV_HEADS, r, layout) for p in (wk, bk, wv, bv)]
        wo_r = shard(wo, Style.ROW_HEADS, r, layout)
        assert q_parts[0].shape == (layout.q_heads_per_rank * d, hidden)
        assert kv_parts[0].shape == (len(ids[r]) * d, hidden) and wo_r.shape == (hidden, h // t * d)
        total += rank_attention(x, *q_parts, *kv_parts[:2], *kv_parts[2:], wo_r,
                                layout.q_heads_per_rank, layout.kv_heads_per_rank, d)

    # Reference: the whole block, with torch's own GQA attention (independent of rank_attention).
    q = F.linear(x, wq, bq).view(2, 5, h, d).transpose(1, 2)
    key = F.linear(x, wk, bk).view(2, 5, k, d).transpose(1, 2)
    val = F.linear(x, wv, bv).view(2, 5, k, d).transpose(1, 2)
    attn = F.scaled_dot_product_attention(q, key, val, is_causal=True, enable_gqa=True)
    full = F.linear(attn.transpose(1, 2).reshape(2, 5, h * d), wo)
    assert_close(total, full, rtol=1e-10, atol=1e-10)


# ---- sharding plans on real transformers models --------------------------------------------------
MODELS = [  # model_type, shape, tp degrees (covering shard, replicate_to_tp, convert_to_mha)
    ("llama", dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=True), (2, 4)),
    ("mistral", dict(num_heads=4, num_kv_heads=1), (2, 4)),
    ("qwen2", dict(num_heads=6, num_kv_heads=2), (2, 3)),
]
EXPECTED_STYLES = {
    "model.embed_tokens.weight": Style.VOCAB, "lm_head.weight": Style.VOCAB,
    "model.norm.weight": Style.REPLICATE,
    "model.layers.1.self_attn.q_proj.weight": Style.Q_HEADS,
    "model.layers.1.self_attn.k_proj.weight": Style.KV_HEADS,
    "model.layers.1.self_attn.v_proj.weight": Style.KV_HEADS,
    "model.layers.1.self_attn.o_proj.weight": Style.ROW_HEADS,
    "model.layers.1.mlp.gate_proj.weight": Style.COLUMN, "model.layers.1.mlp.up_proj.weight": Style.COLUMN,
    "model.layers.1.mlp.down_proj.weight": Style.ROW,
    "model.layers.1.input_layernorm.weight": Style.REPLICATE,
    "model.layers.1.post_attention_layernorm.weight": Style.REPLICATE,
}


@pytest.mark.parametrize("model_type,shape,tps", MODELS, ids=[m[0] for m in MODELS])
def test_plan_covers_and_reassembles_real_model(model_type, shape, tps):
    pytest.importorskip("transformers")
    from tests.model_factory import build_random_model

    model = build_random_model(model_type, hidden_size=24 if shape["num_heads"] == 6 else 16,
                               intermediate_size=26, num_layers=2, vocab_size=31, **shape)
    state = model.state_dict()
    config = ModelConfig.from_dict(model.config.to_dict())
    expected = dict(EXPECTED_STYLES)
    if model_type == "qwen2":
        expected.update({f"model.layers.1.self_attn.{p}_proj.bias": s
                         for p, s in (("q", Style.Q_HEADS), ("k", Style.KV_HEADS), ("v", Style.KV_HEADS))})
    assert {n: style_for(model_type, n) for n in state if n.startswith(("model.layers.1.", "model.e",
                                                                         "model.n", "lm_"))} == expected
    seen = set()
    for tp in tps:
        layout = ShardLayout.for_model(config, tp)
        seen.add(layout.kv_strategy)
        for name, full in state.items():
            style = style_for(model_type, name)
            shards = []
            for r in range(tp):
                tslice = slice_for(model_type, name, full.shape, r, layout)
                shards.append(apply_slice(full, tslice))
                assert shards[-1].shape == tslice.shape(full.shape), (name, r)
            if style is Style.REPLICATE:
                assert all(torch.equal(s, full) for s in shards)
            elif style is Style.KV_HEADS:  # each slot holds the original head kv_head_ids names
                d = layout.head_dim
                for r, s in enumerate(shards):
                    ids = layout.kv_head_ids(r)
                    assert s.shape[0] == len(ids) * d
                    for slot, kv in enumerate(ids):
                        assert torch.equal(s[slot * d:(slot + 1) * d], full[kv * d:(kv + 1) * d]), (name, r)
                assert {kv for r in range(tp) for kv in layout.kv_head_ids(r)} == set(range(layout.num_kv_heads))
            else:
                dim = 1 if style in (Style.ROW, Style.ROW_HEADS) else 0
                joined = torch.cat(shards, dim=dim).narrow(dim, 0, full.shape[dim])
                assert torch.equal(joined, full), (name, tp)
    assert seen == {"llama": {SHARD, REPL}, "mistral": {REPL}, "qwen2": {SHARD, MHA}}[model_type]


def test_style_for_names_and_errors():
    assert style_for("llama", "model.layers.12.self_attn.rotary_emb.inv_freq") is Style.SKIP
    layout = make_layout(2)
    assert slice_for("llama", "model.layers.0.self_attn.rotary_emb.inv_freq", (2,), 0, layout) is None
    assert style_for("mixtral", "model.layers.3.block_sparse_moe.experts.7.w3.weight") is Style.EXPERT_COLUMN
    assert style_for("mixtral", "model.layers.3.block_sparse_moe.experts.7.w2.weight") is Style.EXPERT_ROW
    assert style_for("mixtral", "model.layers.3.block_sparse_moe.gate.weight") is Style.REPLICATE
    assert style_for("llama", "model.layers.0.mlp.gate_proj.bias") is Style.COLUMN  # mlp_bias
    assert style_for("llama", "model.layers.0.mlp.down_proj.bias") is Style.REPLICATE  # added after the sum
    assert style_for("llama", "model.layers.0.self_attn.o_proj.bias") is Style.REPLICATE
    assert style_for("qwen3", "model.layers.0.self_attn.k_norm.weight") is Style.REPLICATE
    assert style_for("gemma3_text", "model.layers.0.pre_feedforward_layernorm.weight") is Style.REPLICATE
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.scale"):
        style_for("llama", "model.layers.0.mlp.gate_proj.scale")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight"):
        style_for("mixtral", "model.layers.0.mlp.gate_proj.weight")
    with pytest.raises(ValueError, match="'gpt2'"):
        style_for("gpt2", "transformer.wte.weight")


# ---- TensorSlice ---------------------------------------------------------------------------------
def test_tensor_slice_merges_touching_ranges():
    assert _merge([(0, 2), (2, 5), (7, 9), (9, 10), (3, 4)]) == ((0, 5), (7, 10), (3, 4))
    layout = make_layout(2, 8, 4)  # D = 4: rank 1 holds Q heads 4..7 = rows 16..32, one read
    assert slice_for_style(Style.Q_HEADS, (32, 16), 1, layout) == TensorSlice(dim=0, ranges=((16, 32),))
    assert slice_for_style(Style.ROW_HEADS, (16, 32), 1, layout) == TensorSlice(dim=1, ranges=((16, 32),))
    mha = make_layout(3, 12, 4)  # rank 0 KV slots: heads 0, 0, 0, 1
    tslice = slice_for_style(Style.KV_HEADS, (16, 16), 0, mha)
    assert tslice.ranges == ((0, 4), (0, 4), (0, 8)) and tslice.shape((16, 16)) == (16, 16)
    empty = slice_for_style(Style.COLUMN, (9, 5), 3, make_layout(4, inter=9))  # all padding
    assert empty == TensorSlice(dim=0, ranges=(), pad_to=3) and empty.shape((9, 5)) == (3, 5)
    assert torch.equal(apply_slice(torch.ones(9, 5), empty), torch.zeros(3, 5))
    assert TensorSlice(dim=None).shape((4, 5)) == (4, 5)


@pytest.mark.parametrize("tslice", [TensorSlice(dim=None), TensorSlice(dim=0, ranges=((2, 6),)),
                                    TensorSlice(dim=1, ranges=((1, 3),)),
                                    TensorSlice(dim=0, ranges=((0, 2), (4, 6)), pad_to=6)])
def test_apply_slice_returns_new_memory(tslice):
    tensor = torch.arange(48.0).view(8, 6)
    before = tensor.clone()
    out = apply_slice(tensor, tslice)
    assert out.is_contiguous()
    assert out.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    out.fill_(-1.0)
    assert torch.equal(tensor, before)
    if tslice.dim == 0 and tslice.pad_to:
        assert torch.equal(apply_slice(tensor, tslice)[4:], torch.zeros(2, 6))
