"""ShardedCausalLM against Hugging Face transformers: greedy tokens must be identical.

TP 1 runs in this process. TP 2 and TP 3 run every rank in this process too, one thread per rank,
their collectives meeting in memory (tests/tp_harness.py's run_tp_in_process), every case of one
degree in a single group. The same cases on real process groups (gloo, one spawned process per
rank) must give the same tokens on every rank: that test is marked slow.
"""

from __future__ import annotations

import functools

import pytest
import torch

from shardlib.model_config import ModelConfig
from shardlib.sharding import KVStrategy, ShardLayout
from tests.model_factory import build_random_model
from tests.tp_harness import (Case, Request, build_rank_model, hf_state_dict, run_tp, run_tp_in_process,
                              shard_for_rank, token_ids)
from workers.collectives import Collectives, SingleRank
from workers.engine import generate
from workers.model import ShardedCausalLM
from workers.rope import RotaryTables, apply_rotary
from workers.sampling import SamplingParams

PROMPTS = [[5, 9, 33, 17, 80, 3, 44, 12, 61], [7, 100, 21]]
NEW_TOKENS = 10
EOS = 2
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# name: (tp degree, build_random_model arguments, the KV strategy the layout must pick)
SPECS = {
    "llama_tp1": (1, dict(), KVStrategy.SHARD),
    "mistral_tp1": (1, dict(model_type="mistral", seed=1), KVStrategy.SHARD),
    "qwen2_tp1": (1, dict(model_type="qwen2"), KVStrategy.SHARD),
    "llama_split_tp2": (2, dict(num_heads=4, num_kv_heads=2), KVStrategy.SHARD),
    "llama_replicate_tp2": (2, dict(num_heads=4, num_kv_heads=1), KVStrategy.REPLICATE_TO_TP),
    "qwen2_bias_tp2": (2, dict(model_type="qwen2"), KVStrategy.SHARD),
    "mistral_tp2": (2, dict(model_type="mistral", seed=1), KVStrategy.SHARD),
    "tied_tp2": (2, dict(tie_word_embeddings=True), KVStrategy.SHARD),
    "llama3_rope_tp2": (2, dict(rope_scaling=LLAMA3_ROPE), KVStrategy.SHARD),
    "convert_to_mha_tp3": (3, dict(hidden_size=48, num_heads=6, num_kv_heads=2), KVStrategy.CONVERT_TO_MHA),
    "uneven_vocab_intermediate_tp3": (3, dict(hidden_size=48, num_heads=3, num_kv_heads=1, vocab_size=130,
                                              intermediate_size=100), KVStrategy.REPLICATE_TO_TP),
    "uneven_tied_tp3": (3, dict(hidden_size=48, num_heads=6, num_kv_heads=3, vocab_size=130,
                                intermediate_size=100, tie_word_embeddings=True), KVStrategy.SHARD),
}
BATCH_CASE = "llama_split_tp2"  # also runs both prompts as one left-padded batch, and sampling


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=None)
def reference(name: str):
    """(ModelConfig, full state_dict, HF greedy tokens per prompt) of a spec."""
    _, kwargs, _ = SPECS[name]
    model = build_random_model(**kwargs)
    config = ModelConfig.from_dict(model.config.to_dict())
    with torch.inference_mode():
        refs = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    return config, hf_state_dict(model), refs


def requests_for(name: str) -> list[Request]:
    requests = [Request([prompt], NEW_TOKENS, [EOS]) for prompt in PROMPTS]
    if name == BATCH_CASE:
        requests.append(Request(PROMPTS, NEW_TOKENS, [EOS]))
        # Unseeded sampling: the engine must still give all ranks one shared seed.
        requests.append(Request([PROMPTS[0]], NEW_TOKENS, [], [SamplingParams(temperature=1.5)]))
    return requests


def multi_rank_cases() -> dict[int, list[Case]]:
    """{tp degree: its cases} for every multi-rank spec."""
    by_degree: dict[int, list[Case]] = {}
    for name, (tp, _, _) in SPECS.items():
        if tp > 1:
            config, state_dict, _ = reference(name)
            by_degree.setdefault(tp, []).append(Case(name, config, state_dict, requests_for(name)))
    return by_degree


def outputs_by_case(run) -> dict[str, dict[int, list[list]]]:
    """{case name: {rank: outputs per request}}: every degree's cases run by `run` (run_tp or
    run_tp_in_process) as one group."""
    outputs: dict[str, dict[int, list[list]]] = {}
    for tp, cases in multi_rank_cases().items():
        by_rank = run(tp, cases, timeout_s=180)
        for case in cases:
            outputs[case.name] = {rank: by_rank[rank][case.name] for rank in by_rank}
    return outputs


@pytest.fixture(scope="module")
def tp_outputs() -> dict[str, dict[int, list[list]]]:
    """Every multi-rank spec's outputs, each rank a thread of this process."""
    return outputs_by_case(run_tp_in_process)


@pytest.mark.parametrize("name", [n for n, spec in SPECS.items() if spec[0] == 1])
def test_tp1_greedy_matches_hf(name):
    config, state_dict, refs = reference(name)
    model = build_rank_model(config, state_dict, 0, 1, SingleRank())
    for prompt, ref in zip(PROMPTS, refs):
        [out] = generate(model, [prompt], [SamplingParams()], NEW_TOKENS, [EOS])
        assert out.token_ids == ref


@pytest.mark.parametrize("name", [n for n, spec in SPECS.items() if spec[0] > 1])
def test_multi_rank_greedy_matches_hf(name, tp_outputs):
    tp, _, strategy = SPECS[name]
    config, _, refs = reference(name)
    assert ShardLayout.for_model(config, tp).kv_strategy is strategy  # the case tests what it claims
    by_rank = tp_outputs[name]
    assert sorted(by_rank) == list(range(tp))
    for i, ref in enumerate(refs):
        assert token_ids(by_rank[0][i]) == [ref], f"prompt {i}"
    for rank in range(1, tp):
        assert [token_ids(r) for r in by_rank[rank]] == [token_ids(r) for r in by_rank[0]], f"rank {rank}"


def test_multi_rank_left_padded_batch_equals_each_prompt_alone(tp_outputs):
    _, _, refs = reference(BATCH_CASE)
    batch = tp_outputs[BATCH_CASE][0][len(PROMPTS)]
    assert token_ids(batch) == refs
    assert [out.prompt_length for out in batch] == [len(p) for p in PROMPTS]


def test_multi_rank_unseeded_sampling_agrees_across_ranks(tp_outputs):
    by_rank = tp_outputs[BATCH_CASE]
    sampled = [token_ids(by_rank[rank][-1]) for rank in sorted(by_rank)]
    assert len(sampled[0][0]) == NEW_TOKENS
    assert all(tokens == sampled[0] for tokens in sampled)


@pytest.mark.slow
def test_gloo_process_groups_give_every_rank_the_in_process_tokens(tp_outputs):
    """The same cases on real process groups (one spawned process per rank, gloo): the greedy tokens
    equal the in-process ranks' on every rank (the unseeded sampled request draws other seeds, so
    only its agreement across ranks is compared)."""
    gloo = outputs_by_case(run_tp)
    assert gloo.keys() == tp_outputs.keys()
    for name, by_rank in gloo.items():
        greedy = len(requests_for(name)) - (1 if name == BATCH_CASE else 0)
        for rank, outputs in by_rank.items():
            assert [token_ids(r) for r in outputs[:greedy]] == \
                [token_ids(r) for r in tp_outputs[name][rank][:greedy]], (name, rank)
            assert token_ids(outputs[-1]) == token_ids(by_rank[0][-1]), (name, rank)


# ---- rotary numerics ---------------------------------------------------------------------------
@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_ROPE], ids=["default", "llama3"])
def test_rotary_tables_equal_transformers_bitwise(rope_scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf_model = build_random_model(rope_scaling=rope_scaling, num_layers=1)
    config = ModelConfig.from_dict(hf_model.config.to_dict())
    hf_rope = LlamaRotaryEmbedding(hf_model.config)
    tables = RotaryTables(config.head_dim, 64, config.rope_theta, config.rope_scaling)
    position_ids = torch.tensor([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])  # a left-padded row
    x = torch.randn(2, 2, 6, config.head_dim)
    hf_cos, hf_sin = hf_rope(x, position_ids)
    cos, sin = tables.lookup(position_ids, x.dtype)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)
    hf_q, _ = apply_rotary_pos_emb(x, x, hf_cos, hf_sin)
    assert torch.equal(apply_rotary(x, cos, sin), hf_q)


# ---- communication count and refusals ----------------------------------------------------------
class CountingRank(Collectives):
    """One rank that counts what it is asked to communicate (through the custom operators, which
    SingleRank skips since it has nothing to communicate)."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.all_reduces = self.all_gathers = 0

    def all_reduce_sum_(self, tensor):
        self.all_reduces += 1
        return tensor

    def all_gather_last_dim(self, tensor):
        self.all_gathers += 1
        return tensor


def test_one_all_reduce_per_row_parallel_block_plus_embedding():
    config, state_dict, _ = reference("llama_tp1")
    collectives = CountingRank()
    model = build_rank_model(config, state_dict, 0, 1, collectives)
    cache = model.new_cache(1, 16)
    with torch.inference_mode():
        logits = model(torch.tensor([[3, 4, 5]]), torch.tensor([[0, 1, 2]]), cache, torch.arange(3))
    assert logits.shape == (1, config.vocab_size) and logits.dtype == torch.float32
    assert collectives.all_reduces == 2 * config.num_hidden_layers + 1
    assert collectives.all_gathers == 1


def test_layout_of_another_model_and_wrong_shapes_are_refused():
    config, state_dict, _ = reference("llama_tp1")
    other = ShardLayout.for_model(ModelConfig.from_dict({**build_config_dict(config), "num_attention_heads": 8}), 1)
    with pytest.raises(ValueError, match=r"layout.num_heads \(8\) differs .* \(4\)"):
        ShardedCausalLM(config, other, 0, {}, SingleRank())
    layout = ShardLayout.for_model(config, 2)
    shard = shard_for_rank(config, state_dict, 0, ShardLayout.for_model(config, 1))  # TP 1 slices
    with pytest.raises(ValueError, match="world_size 1 but the model is built as rank 0 of tp_degree 2"):
        ShardedCausalLM(config, layout, 0, shard, SingleRank())
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight' has shape \(128, 64\) .* \(64, 64\)"):
        ShardedCausalLM(config, layout, 0, shard, _FakeRank0Of2())


class _FakeRank0Of2(SingleRank):
    @property
    def world_size(self) -> int:
        return 2


def build_config_dict(config: ModelConfig) -> dict:
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
            "vocab_size": config.vocab_size}


def test_shard_tensors_are_used_without_copy():
    config, state_dict, _ = reference("llama_tp1")
    shard = shard_for_rank(config, state_dict, 0, ShardLayout.for_model(config, 1))
    model = ShardedCausalLM(config, ShardLayout.for_model(config, 1), 0, shard, SingleRank(), torch.float32)
    assert model.embed.weight.data_ptr() == shard["model.embed_tokens.weight"].data_ptr()
    assert model.layers[0].mlp.down_weight.data_ptr() == shard["model.layers.0.mlp.down_proj.weight"].data_ptr()
