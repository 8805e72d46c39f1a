"""shardlib.planner: every rule on the published configs, bytes checked by hand and against the
sharding plan, and planning speed (pure arithmetic, no Ray)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shardlib.instances import GIB, InstanceType, cpu_host, get_instance, gpu_node
from shardlib.model_config import ModelConfig, load_model_config
from shardlib.param_shapes import expected_shapes
from shardlib.planner import RANK_PROCESS_BYTES, RESERVE_FRACTION, plan
from shardlib.quantization import Quantization
from shardlib.sharding import ShardLayout, slice_for

CONFIGS = Path(__file__).parent / "data" / "configs"
REPO = Path(__file__).resolve().parents[1]


def load(name: str) -> ModelConfig:
    return load_model_config(CONFIGS / f"{name}.json")


LLAMA_8B, LLAMA_70B, LLAMA_405B = load("llama-3.1-8b"), load("llama-3.1-70b"), load("llama-3.1-405b")
QWEN_72B, SMOLLM2 = load("qwen2.5-72b"), load("smollm2-135m-instruct")
MISTRAL_7B, MIXTRAL = load("mistral-7b-v0.1"), load("mixtral-8x7b-v0.1")
ALL = [LLAMA_8B, LLAMA_70B, LLAMA_405B, QWEN_72B, SMOLLM2, MISTRAL_7B, MIXTRAL]

TINY = ModelConfig(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                   torch_dtype="float32", max_position_embeddings=512)


def codes(p) -> set[str]:
    return {issue.code for issue in p.errors}


def message(p, code: str) -> str:
    [text] = [issue.message for issue in p.errors if issue.code == code]
    return text


# ---- bytes --------------------------------------------------------------------------------------
def test_tiny_model_bytes_by_hand():
    p = plan(TINY, instance="cpu", tp=2, seq_len=128, batch_size=1)
    # per rank, float32: embed and lm_head 64 vocab rows x 64 = 2 x 4096; per layer q and o 2 heads
    # x 16 x 64 = 2 x 2048, k and v 1 KV head x 16 x 64 = 2 x 1024, MLP 3 x 64 x 48 = 9216, two
    # norms 128; final norm 64.
    layer = 2 * 2048 + 2 * 1024 + 9216 + 128
    assert p.memory.weight_bytes_per_rank == (2 * 4096 + 2 * layer + 64) * 4 == 156928
    # 2 (K and V) x 2 layers x batch 1 x 128 positions x 1 KV head x 16 x 4 bytes
    assert p.memory.kv_cache_bytes_per_rank == 2 * 2 * 1 * 128 * 1 * 16 * 4 == 32768
    # float32 on cpu: the largest matrix a rank packs counts too, here the fused gate/up (2 x 48 x 64)
    assert p.memory.packing_scratch_bytes_per_rank == 2 * 48 * 64 * 4 == 24576
    # on cpu each rank's process shares the RAM too: counted as its allowance
    assert p.memory.process_bytes_per_rank == RANK_PROCESS_BYTES == 384 * 2**20
    assert p.memory.total_bytes_per_rank == 156928 + 32768 + 24576 + RANK_PROCESS_BYTES
    assert (p.kv_strategy, p.q_heads_per_rank, p.kv_heads_per_rank) == ("shard", 2, 1)
    assert p.memory.model_weight_bytes == TINY.param_count() * 4


def test_tp1_weights_are_the_checkpoint():
    for cfg in ALL:
        p = plan(cfg, instance="trn2.48xlarge", tp=1, dtype="bfloat16")
        assert p.memory.weight_bytes_per_rank == p.memory.model_weight_bytes == cfg.param_count() * 2


def sharded_elements(cfg: ModelConfig, layout: ShardLayout, rank: int) -> int:
    return sum(math.prod(slice_for(cfg.model_type, name, shape, rank, layout).shape(shape))
               for name, shape in expected_shapes(cfg).items())


@pytest.mark.parametrize("cfg, tp, strategy", [
    (SMOLLM2, 3, None), (SMOLLM2, 9, None), (SMOLLM2, 9, "convert_to_mha"), (SMOLLM2, 3, "convert_to_mha"),
    (QWEN_72B, 8, None), (QWEN_72B, 16, None), (MISTRAL_7B, 32, "convert_to_mha"), (MIXTRAL, 8, None),
    (MIXTRAL, 32, None), (TINY, 2, None),
], ids=lambda v: getattr(v, "model_type", v))
def test_weight_bytes_match_the_sharding_plan(cfg, tp, strategy):
    """The planner's arithmetic equals the sum of the slices shardlib.sharding hands each rank."""
    p = plan(cfg, instance="cpu", tp=tp, kv_strategy=strategy, dtype="bfloat16", seq_len=16)
    assert not codes(p) - {"insufficient_memory"}  # only the size of this host may refuse it
    layout = ShardLayout.for_model(cfg, tp, strategy)
    assert p.kv_heads_per_rank == layout.kv_heads_per_rank
    for rank in (0, tp - 1):
        assert p.memory.weight_bytes_per_rank == sharded_elements(cfg, layout, rank) * 2


def test_replication_and_mha_conversion_cost_more_than_sharding():
    shard = plan(SMOLLM2, instance="cpu", tp=3, dtype="bfloat16")
    mha = plan(SMOLLM2, instance="cpu", tp=3, dtype="bfloat16", kv_strategy="convert_to_mha")
    assert (shard.kv_heads_per_rank, mha.kv_heads_per_rank) == (1, 3)
    assert mha.memory.kv_cache_bytes_per_rank == 3 * shard.memory.kv_cache_bytes_per_rank
    # two extra KV heads (k and v rows) per layer: 2 x 2 x 64 x 576 elements x 30 layers x 2 bytes
    assert mha.memory.weight_bytes_per_rank - shard.memory.weight_bytes_per_rank == 2 * 2 * 64 * 576 * 30 * 2


# ---- the documented sizing examples -------------------------------------------------------------
def test_llama_8b_bf16_fits_trn1_2xlarge():
    p = plan(LLAMA_8B, instance="trn1.2xlarge", batch_size=1)
    assert p.valid and p.tp_degree == 2 and p.valid_tp_degrees == (2,)
    assert p.memory.model_weight_bytes == 16_060_522_496  # "about 16 GB"
    assert p.memory.usable_bytes_per_rank == int(16 * GIB * (1 - RESERVE_FRACTION))
    one = plan(LLAMA_8B, instance="trn1.2xlarge", tp=1)
    assert codes(one) == {"insufficient_memory"}


def test_llama_70b_needs_about_148_gb_and_16_trn1_cores():
    p = plan(LLAMA_70B, instance="trn1.32xlarge")
    assert p.valid and p.tp_degree == 16 and p.valid_tp_degrees == (16, 32)
    assert p.kv_strategy == "replicate_to_tp" and p.ranks_per_node == 16
    assert 140e9 < p.memory.total_bytes_all_ranks < 150e9
    assert p.memory.model_weight_bytes == LLAMA_70B.param_count() * 2
    assert codes(plan(LLAMA_70B, instance="trn1.32xlarge", tp=8)) == {"insufficient_memory"}


def test_llama_70b_refused_on_inf2_xlarge_with_ways_out():
    p = plan(LLAMA_70B, instance="inf2.xlarge", tp=2)
    assert not p.valid and codes(p) == {"insufficient_memory"}
    text = message(p, "insufficient_memory")
    assert "inf2.xlarge" in text and "14.4 GiB usable" in text
    assert "trn1.32xlarge (tp 16)" in text  # a bigger instance that works
    auto = plan(LLAMA_70B, instance="inf2.xlarge")
    assert not auto.valid and auto.valid_tp_degrees == ()
    assert auto.error_codes[0] == "no_valid_tp_degree" and "insufficient_memory" in codes(auto)
    assert "no tp_degree passes every rule" in auto.errors[0].message


# ---- heads and KV heads -------------------------------------------------------------------------
def test_qwen_72b_tp6_reports_every_failed_rule():
    p = plan(QWEN_72B, instance="trn1.32xlarge", tp=6)
    assert not p.valid
    assert {"heads_not_divisible", "unsupported_tp_degree", "insufficient_memory"} == codes(p)
    assert message(p, "heads_not_divisible").startswith(
        "num_attention_heads (64) is not divisible by tp_degree (6); degrees that work for this model "
        "on trn1.32xlarge: 16, 32")
    assert "1, 2, 8, 16, 32" in message(p, "unsupported_tp_degree")
    assert p.kv_strategy is None and p.q_heads_per_rank is None
    # padding would fix the heads but not the degree (nor the memory): it is not offered here
    assert "--pad-q-heads" not in message(p, "heads_not_divisible")
    assert "or pad Q heads with zero heads (pad_q_heads, --pad-q-heads)" in message(
        plan(SMOLLM2, instance="cpu", tp=2), "heads_not_divisible")  # where padding passes, it is


@pytest.mark.parametrize("tp, strategy", [(8, "shard"), (16, "replicate_to_tp"), (32, "replicate_to_tp")])
def test_qwen_72b_kv_strategy_per_degree(tp, strategy):
    p = plan(QWEN_72B, instance="trn2.48xlarge", tp=tp)
    assert p.valid, p.errors
    assert (p.kv_strategy, p.q_heads_per_rank, p.kv_heads_per_rank) == (strategy, 64 // tp, 1)
    assert p.layout().kv_strategy.value == strategy


def test_smollm2_head_valid_degrees():
    for tp in range(1, 10):
        p = plan(SMOLLM2, instance="cpu", tp=tp)
        assert ("heads_not_divisible" in codes(p)) == (tp not in (1, 3, 9)), tp
    assert plan(SMOLLM2, instance="cpu").valid_tp_degrees == (1, 3, 9)
    trn1 = plan(SMOLLM2, instance="trn1.32xlarge")
    assert trn1.valid_tp_degrees == (1,) and trn1.tp_degree == 1
    for tp in (3, 9):
        p = plan(SMOLLM2, instance="trn1.32xlarge", tp=tp)
        assert codes(p) == {"unsupported_tp_degree"}
        assert "degrees that work for this model on trn1.32xlarge: 1" in p.errors[0].message


def test_smollm2_kv_strategy_override_at_tp9():
    mha = plan(SMOLLM2, instance="cpu", tp=9, kv_strategy="convert_to_mha")
    assert mha.valid and (mha.kv_strategy, mha.q_heads_per_rank, mha.kv_heads_per_rank) == ("convert_to_mha", 1, 1)
    if get_instance("cpu").physical_cores < 9:
        assert any("time-share" in w for w in mha.warnings)  # 9 ranks on a host with fewer cores
    shard = plan(SMOLLM2, instance="cpu", tp=9, kv_strategy="shard")
    assert codes(shard) == {"kv_heads_incompatible"}
    assert "num_key_value_heads (3) divisible by tp_degree (9)" in shard.errors[0].message
    assert "replicate_to_tp, convert_to_mha" in shard.errors[0].message
    # the way out names the option as both the API and the CLI spell it
    assert "or leave kv_strategy (--kv-strategy) unset for the default (replicate_to_tp)" in shard.errors[0].message
    assert plan(SMOLLM2, instance="cpu", tp=9).kv_strategy == "replicate_to_tp"


def test_pad_q_heads_reports_the_waste():
    plain = plan(SMOLLM2, instance="cpu", tp=2, dtype="bfloat16")
    assert codes(plain) == {"heads_not_divisible"}
    p = plan(SMOLLM2, instance="cpu", tp=2, dtype="bfloat16", pad_q_heads=True)
    assert p.valid and p.padded_q_heads == 10 and p.q_heads_per_rank == 5
    # one zero head: a q_proj row block and an o_proj column block of 64 x 576, 30 layers, 2 bytes
    assert p.padding_waste.extra_q_heads == 1
    assert p.padding_waste.extra_qo_weight_bytes == 2 * 64 * 576 * 30 * 2
    assert p.padding_waste.extra_qo_fraction == pytest.approx(1 / 9)
    assert any("padded from 9 to 10" in w for w in p.warnings)
    layout = p.layout()  # executed: tests/test_padded_heads.py
    assert layout.pad_q_heads and layout.q_heads_per_rank == 5
    # 3 KV heads over 2 ranks: convert_to_mha, one KV head per Q head, 10 for the checkpoint's 3, one zero
    mha = p
    assert mha.kv_strategy == "convert_to_mha"
    assert sum(head is None for rank in range(2) for head in mha.layout().kv_head_ids(rank)) == 1
    assert mha.padding_waste.extra_kv_heads == 1
    assert mha.padding_waste.extra_kv_weight_bytes == 2 * 576 * 64 * 30 * 2  # k and v rows, 30 layers, bf16
    assert mha.padding_waste.extra_kv_cache_bytes * 10 == mha.memory.kv_cache_bytes_per_rank * 2  # 1 of 10 heads
    assert any("plus 1 zero KV head(s) beside the padded Q heads: KV weights and KV cache cost 3.33x" in w
               for w in mha.warnings)
    replicated = plan(SMOLLM2, instance="cpu", tp=6, dtype="bfloat16", pad_q_heads=True)
    assert replicated.kv_strategy == "replicate_to_tp" and replicated.padding_waste.extra_kv_heads == 0
    assert not any("pads nothing" in w for w in p.warnings + replicated.warnings)


def test_pad_q_heads_at_a_degree_that_divides_the_heads_is_said_to_pad_nothing():
    p = plan(SMOLLM2, instance="cpu", tp=3, pad_q_heads=True)
    assert p.valid and p.padded_q_heads == 9 and p.padding_waste.extra_q_heads == 0
    assert ("pad_q_heads (--pad-q-heads) pads nothing: tp_degree 3 divides num_attention_heads (9) evenly, so "
            "the layout is the unpadded one") in p.warnings
    assert not any("pads nothing" in w for w in plan(SMOLLM2, instance="cpu", tp=3).warnings)


# ---- cores, LNC, nodes --------------------------------------------------------------------------
def test_lnc2_only_on_trn2():
    p = plan(SMOLLM2, instance="trn1.32xlarge", tp=1, lnc=2)
    assert codes(p) == {"invalid_lnc"} and p.lnc == 2
    assert codes(plan(SMOLLM2, instance="trn2.48xlarge", tp=1, lnc=0)) == {"invalid_lnc"}  # an int: the rule's
    assert "only on trn2" in p.errors[0].message
    assert "invalid_lnc" in codes(plan(SMOLLM2, instance="trn2.48xlarge", tp=1, lnc=3))
    assert "invalid_lnc" in codes(plan(SMOLLM2, instance="cpu", tp=1, lnc=2))
    assert plan(SMOLLM2, instance="trn2.48xlarge", tp=1, lnc=1).valid


def test_trn2_defaults_to_lnc2_with_64_logical_cores():
    p = plan(LLAMA_405B, instance="trn2.48xlarge", tp=64)
    assert p.valid and p.lnc == 2 and p.logical_cores_per_node == 64 and p.cores_per_rank == 2
    assert p.memory.capacity_bytes_per_rank == 24 * GIB and p.memory.capacity_bytes_per_core == 12 * GIB
    assert plan(LLAMA_405B, instance="trn2.48xlarge").tp_degree == 64
    one_node = plan(LLAMA_405B, instance="trn2.48xlarge", tp=128)
    assert "not_enough_cores" in codes(one_node)
    assert "--nodes 2" in message(one_node, "not_enough_cores")
    two = plan(LLAMA_405B, instance="trn2.48xlarge", tp=128, nodes=2)
    assert two.valid and two.ranks_per_node == 64
    lnc1 = plan(LLAMA_405B, instance="trn2.48xlarge", tp=128, lnc=1)
    assert lnc1.valid and lnc1.logical_cores_per_node == 128 and lnc1.memory.capacity_bytes_per_rank == 12 * GIB


def test_memory_short_at_lnc_1_names_the_default_lnc_2_as_a_way_out():
    """trn2 at LNC 1 gives each rank one core's 12 GiB; the default LNC 2 gives 24 GiB at the same
    degree, but the ways out named other degrees, dtypes, nodes and instances and never the LNC."""
    short = plan(LLAMA_70B, instance="trn2.48xlarge", tp=8, lnc=1)
    assert codes(short) == {"insufficient_memory"}
    assert "--lnc 2 (the default, 24.0 GiB per logical core) fits at tp 8," in message(short, "insufficient_memory")
    assert plan(LLAMA_70B, instance="trn2.48xlarge", tp=8).valid
    assert "--lnc" not in message(plan(LLAMA_70B, instance="trn2.48xlarge", tp=2), "insufficient_memory")


def test_not_enough_cores_on_inf2_xlarge_and_more_nodes():
    p = plan(MISTRAL_7B, instance="inf2.xlarge", tp=8)
    assert codes(p) == {"not_enough_cores"}
    assert "--nodes 4" in p.errors[0].message
    assert plan(MISTRAL_7B, instance="inf2.xlarge", tp=8, nodes=4).valid
    uneven = plan(MISTRAL_7B, instance="trn1.32xlarge", tp=8, nodes=2)  # 4 per node: not a trn1 degree
    assert codes(uneven) == {"unsupported_tp_degree"}


def test_neuron_tp_4_keeps_its_four_ranks_on_one_node():
    """neuronx-distributed's parallel_state builds TP 4 groups from one node's ranks (it divides
    LOCAL_WORLD_SIZE by 4): TP 4 as 2 + 2 over two nodes passed the plan and would fail as the
    ranks start. Refused, with the way out a larger instance rather than more nodes, where the
    family runs TP 4 at all: trn1 does not, and its larger instance was named, then refused."""
    split = plan(MISTRAL_7B, instance="inf2.xlarge", tp=4, nodes=2)
    assert codes(split) == {"unsupported_tp_degree"}
    assert "one node" in split.errors[0].message and "use --nodes 1 on an instance with 4" in split.errors[0].message
    alone = message(plan(MISTRAL_7B, instance="inf2.xlarge", tp=4), "not_enough_cores")
    # the larger instances are named (they were only described)
    assert "--nodes" not in alone and "use an instance with 4 or more NeuronCores (inf2.24xlarge, inf2.48xlarge)" in alone
    elsewhere = "trn1 supports no tp 4 on any instance: use another degree (instances that run tp 4: inf2.24xlarge, "
    for nodes, code in ((2, "unsupported_tp_degree"), (1, "not_enough_cores")):
        text = message(plan(MISTRAL_7B, instance="trn1.2xlarge", tp=4, nodes=nodes), code)
        assert elsewhere in text and "or more NeuronCores" not in text
    assert codes(plan(MISTRAL_7B, instance="trn1.32xlarge", tp=4)) == {"unsupported_tp_degree"}
    for named in ("inf2.24xlarge", "inf2.48xlarge", "trn2.48xlarge"):
        assert plan(MISTRAL_7B, instance=named, tp=4).valid
    assert plan(MISTRAL_7B, instance="inf2.24xlarge", tp=4).valid  # four cores of one node
    assert plan(MISTRAL_7B, instance="trn1.32xlarge", tp=16, nodes=2).valid  # other degrees still split
    assert plan(MISTRAL_7B, instance="cpu", tp=4, nodes=2).valid  # no NxD on the cpu backend


def test_the_node_count_named_for_more_cores_passes_the_per_node_degrees():
    """inf2.24xlarge has 12 cores and supports 1, 2, 4, 8 or 24 ranks per node: 24 ranks need 3
    nodes of 8 (2 nodes of 12 was named, which fails unsupported_tp_degree)."""
    heads48 = dataclasses.replace(MISTRAL_7B, num_attention_heads=48, num_key_value_heads=8)
    for tp, nodes in ((24, 3), (48, 6)):
        text = message(plan(heads48, instance="inf2.24xlarge", tp=tp), "not_enough_cores")
        assert f"use --nodes {nodes} (8 ranks per node);" in text
        assert plan(heads48, instance="inf2.24xlarge", tp=tp, nodes=nodes).valid


def test_a_huge_prime_degree_names_its_node_count_at_once():
    """The node count for more cores was searched over every count up to the degree: a prime
    --tp 1000000007 took about a minute and a larger one hung `corelaunch plan`. Now a search over
    the ranks one node takes; and a degree past 2**53 keeps its exact ranks per node (a float
    division printed 99999999999999991611392 for 99999999999999999999999)."""
    prime = 10**12 + 39
    text = message(plan(MISTRAL_7B, instance="trn1.32xlarge", tp=prime), "not_enough_cores")
    assert f"use --nodes {prime} (1 ranks per node)" in text
    assert "use --nodes 31250 (32 ranks per node)" in message(plan(MISTRAL_7B, instance="trn1.32xlarge",
                                                                    tp=1_000_000), "not_enough_cores")
    huge = 10**23 - 1
    assert plan(MISTRAL_7B, instance="trn1.32xlarge", tp=huge).ranks_per_node == huge
    assert plan(MISTRAL_7B, instance="cpu", tp=huge, nodes=7).ranks_per_node == 14285714285714285714286
    assert f"use --nodes {-(-huge // 8)}" in message(plan(MISTRAL_7B, instance=gpu_node(80 * GIB, 8), tp=huge),
                                                     "not_enough_cores")


def test_auto_picks_the_smallest_valid_degree():
    for cfg, instance in [(LLAMA_70B, "trn1.32xlarge"), (QWEN_72B, "trn2.48xlarge"), (MIXTRAL, "trn1.32xlarge"),
                          (SMOLLM2, "cpu"), (LLAMA_8B, "inf2.48xlarge")]:
        p = plan(cfg, instance=instance)
        assert p.valid and p.tp_degree == p.valid_tp_degrees[0] == min(p.valid_tp_degrees)
        assert p.tp_requested == "auto"
    assert plan(QWEN_72B, instance="trn2.48xlarge").tp_degree == 8


def test_mixtral_counts_every_expert():
    p = plan(MIXTRAL, instance="trn1.32xlarge", tp=8)
    experts = 8 * 3 * 4096 * math.ceil(14336 / 8) * 32 * 2  # all 8 experts' w1/w3/w2 shards, 32 layers
    assert p.valid and p.memory.weight_bytes_per_rank > experts
    assert p.memory.model_weight_bytes == MIXTRAL.param_count() * 2


# ---- the cpu target -----------------------------------------------------------------------------
def test_cpu_memory_is_checked_against_one_nodes_ram():
    host = cpu_host()
    p = plan(LLAMA_405B, instance="cpu", tp=1)
    assert p.memory.capacity_bytes_per_rank == host.memory_bytes
    p3 = plan(SMOLLM2, instance="cpu", tp=3, nodes=2)  # 2 ranks on the fuller node share its RAM
    assert p3.memory.capacity_bytes_per_rank == host.memory_bytes // 2
    if p.memory.total_bytes_all_ranks <= host.memory_bytes * (1 - RESERVE_FRACTION):
        pytest.skip("this host has enough RAM for Llama-3.1-405B")
    assert "insufficient_memory" in codes(p) and "RAM" in message(p, "insufficient_memory")


def test_cpu_nodes_never_pool_their_ram_for_one_rank():
    """Llama-3-8B in float32 (~33 GB a rank at TP 1) does not fit a 24 GiB node, however many nodes
    there are; at TP 2 over 2 nodes each node holds one rank of half the size and it fits."""
    host = InstanceType(name="cpu", family="cpu", physical_cores=2, memory_bytes=24 * GIB)
    for nodes in (1, 2, 3):
        p = plan(LLAMA_8B, instance=host, tp=1, nodes=nodes, dtype="float32", seq_len=1024)
        assert not p.valid and "insufficient_memory" in codes(p), nodes
        assert p.memory.capacity_bytes_per_rank == 24 * GIB
    text = message(plan(LLAMA_8B, instance=host, tp=1, nodes=2, dtype="float32", seq_len=1024), "insufficient_memory")
    assert "for the 1 rank of one node (1 over 2 nodes)" in text and "but a node has 24.0 GiB RAM" in text
    assert plan(LLAMA_8B, instance=host, tp=2, nodes=2, dtype="float32", seq_len=1024).valid
    assert not plan(LLAMA_8B, instance=host, tp=2, nodes=1, dtype="float32", seq_len=1024).valid


def test_a_memory_refusal_says_its_shortfall_and_its_one_rank_as_one():
    """Rounded alike, the need and the room read as if the layout fit ("needs 21.2 GiB for all 1 ranks
    ... 21.2 GiB after the 10% reserve"): the shortfall is said, and one rank as one."""
    from shardlib.planner import format_bytes

    host = InstanceType(name="cpu", family="cpu", physical_cores=2, memory_bytes=24 * GIB)
    p = plan(LLAMA_8B, instance=host, tp=1, dtype="float32", seq_len=1024)
    short = p.memory.total_bytes_per_rank - host.memory_bytes * (1 - RESERVE_FRACTION)
    text = message(p, "insufficient_memory")
    assert " for its one rank (per rank: " in text and f"reserve, short by {format_bytes(short)} (" in text, text
    trn1 = get_instance("trn1.32xlarge")
    p = plan(LLAMA_8B, instance=trn1, tp=1, dtype="bfloat16", seq_len=4096)
    short = p.memory.total_bytes_per_rank - p.memory.usable_bytes_per_rank
    assert f"reserve), short by {format_bytes(short)} (" in message(p, "insufficient_memory")


def test_serving_rows_count_in_memory_and_the_advised_batch_size_leaves_room_for_them():
    import re

    host = InstanceType(name="cpu", family="cpu", physical_cores=2, memory_bytes=24 * GIB)
    refused = plan(SMOLLM2, instance=host, tp=1, dtype="float32", batch_size=1000, serving_rows=9)
    assert refused.serving_rows == 9 and refused.to_dict()["serving_rows"] == 9
    text = message(refused, "insufficient_memory")
    assert "batch_size 1000 + 9 serving rows" in text
    advised = int(re.search(r"a smaller batch_size \(at most (\d+) besides the 9 serving rows\)", text).group(1))
    # The advice is the largest batch that fits with the serving rows on top: taking it fits, one more does not.
    assert plan(SMOLLM2, instance=host, tp=1, dtype="float32", batch_size=advised, serving_rows=9).valid
    assert not plan(SMOLLM2, instance=host, tp=1, dtype="float32", batch_size=advised + 1, serving_rows=9).valid
    alone = plan(SMOLLM2, instance=host, tp=1, dtype="float32", batch_size=advised + 9)
    assert alone.memory.kv_cache_bytes_per_rank == plan(
        SMOLLM2, instance=host, tp=1, dtype="float32", batch_size=advised, serving_rows=9).memory.kv_cache_bytes_per_rank
    with pytest.raises(ValueError, match=r"serving_rows \(-1\)"):
        plan(SMOLLM2, instance=host, serving_rows=-1)


def test_tp_above_core_count_is_a_warning_on_cpu():
    if get_instance("cpu").physical_cores >= 9:
        pytest.skip("this host has 9 or more cores")
    p = plan(SMOLLM2, instance="cpu", tp=9)
    assert p.valid and any("time-share" in w for w in p.warnings)


def test_packing_scratch_is_the_largest_packed_matrix_on_cpu_float32_only():
    # SmolLM2's tied embedding / LM head (49152 x 576) is its largest matrix; split over TP by rows.
    for tp in (1, 3):
        p = plan(SMOLLM2, instance="cpu", tp=tp, dtype="float32")
        assert p.memory.packing_scratch_bytes_per_rank == math.ceil(49152 / tp) * 576 * 4
        assert p.memory.total_bytes_per_rank == (p.memory.weight_bytes_per_rank + p.memory.kv_cache_bytes_per_rank
                                                 + p.memory.packing_scratch_bytes_per_rank + RANK_PROCESS_BYTES)
    # Nothing is packed in bfloat16, on a Neuron device, or for a plan quantized on Neuron; on cpu a
    # quantized model's float32 LM head still is (here the tied embedding, left unquantized).
    assert plan(SMOLLM2, instance="cpu", tp=1, dtype="bfloat16").memory.packing_scratch_bytes_per_rank == 0
    assert plan(SMOLLM2, instance="trn1.2xlarge", tp=1, dtype="float32").memory.packing_scratch_bytes_per_rank == 0
    assert plan(SMOLLM2, instance="trn1.2xlarge", tp=1, dtype="int8").memory.packing_scratch_bytes_per_rank == 0
    assert plan(SMOLLM2, instance="cpu", tp=1, dtype="int8").memory.packing_scratch_bytes_per_rank == 0  # bf16 config
    fp32 = dataclasses.replace(SMOLLM2, torch_dtype="float32")
    assert plan(fp32, instance="cpu", tp=1, dtype="int8").memory.packing_scratch_bytes_per_rank == 49152 * 576 * 4
    # With `--embedding` the tied table (the LM head) is quantized too: no matrix is left to pack.
    embedding = dataclasses.replace(fp32, quantization=Quantization("int8", "per_channel_symmetric", "linear+embed"))
    for tp in (1, 3):
        assert plan(embedding, instance="cpu", tp=tp).memory.packing_scratch_bytes_per_rank == 0


def test_packing_scratch_decides_a_plan_at_the_edge_of_the_ram():
    # A host whose RAM after the reserve holds the shard and KV cache but not the packing scratch.
    base = plan(SMOLLM2, instance="cpu", tp=1, dtype="float32", seq_len=256)
    without_scratch = base.memory.weight_bytes_per_rank + base.memory.kv_cache_bytes_per_rank + RANK_PROCESS_BYTES
    ram = math.ceil((without_scratch + base.memory.packing_scratch_bytes_per_rank // 2) / (1 - RESERVE_FRACTION))
    host = InstanceType(name="cpu", family="cpu", physical_cores=2, memory_bytes=ram)
    p = plan(SMOLLM2, instance=host, tp=1, dtype="float32", seq_len=256)
    assert not p.valid and "insufficient_memory" in codes(p)
    assert "packing scratch 108.0 MiB" in message(p, "insufficient_memory")
    assert plan(SMOLLM2, instance=host, tp=1, dtype="bfloat16", seq_len=256).valid


# ---- defaults, arguments, output ----------------------------------------------------------------
def test_defaults_seq_len_and_dtype():
    p = plan(LLAMA_70B, instance="trn1.32xlarge")
    assert p.seq_len == 4096 and p.dtype == "bfloat16" and p.batch_size == 1
    assert plan(TINY).seq_len == 512 and plan(TINY).dtype == "float32"
    fp32 = plan(LLAMA_8B, instance="trn1.32xlarge", tp=8, dtype="fp32")
    bf16 = plan(LLAMA_8B, instance="trn1.32xlarge", tp=8)
    assert fp32.dtype == "float32" and fp32.memory.weight_bytes_per_rank == 2 * bf16.memory.weight_bytes_per_rank
    fp8 = plan(LLAMA_8B, instance="trn1.32xlarge", tp=8, dtype="float8_e4m3")
    assert fp8.memory.kv_cache_dtype == "bfloat16"
    assert fp8.memory.kv_cache_bytes_per_rank == bf16.memory.kv_cache_bytes_per_rank


@pytest.mark.parametrize("kwargs, match", [
    (dict(instance="trn3.huge"), "unknown instance 'trn3.huge'"),
    (dict(tp=0), r"tp \(0\) must be a positive integer"),
    (dict(tp="eight"), "positive integer or 'auto'"),
    (dict(nodes=0), r"nodes \(0\)"),
    (dict(seq_len=1), r"seq_len \(1\) must be at least 2"),
    (dict(seq_len=0), r"seq_len \(0\) must be a positive integer"),
    (dict(dtype="int4"), "unknown dtype 'int4'"),
    (dict(kv_strategy="split"), "kv_strategy"),
    (dict(instance="trn2.48xlarge", lnc="2"), r"lnc \('2'\) must be an integer, 1 or 2"),
    (dict(instance="trn2.48xlarge", lnc=2.0), r"lnc \(2.0\) must be an integer, 1 or 2"),
    (dict(instance="trn2.48xlarge", lnc=True), r"lnc \(True\) must be an integer, 1 or 2"),
])
def test_malformed_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(SMOLLM2, **kwargs)


def test_to_dict_is_json_with_the_contract_keys():
    d = json.loads(json.dumps(plan(QWEN_72B, instance="trn1.32xlarge", tp=6).to_dict()))
    for key in ("valid", "tp_degree", "instance", "nodes", "lnc", "cores_per_rank", "ranks_per_node", "dtype",
                "batch_size", "seq_len", "errors", "warnings", "kv_strategy", "q_heads_per_rank",
                "kv_heads_per_rank", "memory", "valid_tp_degrees"):
        assert key in d
    for key in ("weight_bytes_per_rank", "kv_cache_bytes_per_rank", "total_bytes_per_rank",
                "capacity_bytes_per_rank", "capacity_bytes_per_core", "reserve_fraction"):
        assert key in d["memory"]
    assert all(set(e) == {"code", "message"} for e in d["errors"])
    assert d["valid_tp_degrees"] == [16, 32]


def test_invalid_plan_has_no_layout():
    with pytest.raises(ValueError, match="invalid plan"):
        plan(QWEN_72B, instance="trn1.32xlarge", tp=6).layout()


# ---- speed and imports --------------------------------------------------------------------------
PLAN_IN_FRESH_PROCESS = (
    "import sys\n"
    "from shardlib.model_config import load_model_config\n"
    "from shardlib.planner import plan\n"
    f"p = plan(load_model_config({str(CONFIGS / 'llama-3.1-405b.json')!r}), instance='trn2.48xlarge')\n"
    "assert p.valid\n"
    "print(sorted(m for m in ('ray', 'transformers', 'torch') if m in sys.modules))\n"
)


def test_planning_imports_neither_ray_nor_torch_nor_transformers():
    # (planning time is measured by benchmarks/plan_speed.py, not asserted here)
    out = subprocess.run([sys.executable, "-c", PLAN_IN_FRESH_PROCESS], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("extra, gap", [
    ({"rope_scaling": {"rope_type": "mrope", "factor": 4.0}}, "rope scaling type 'mrope'"),
])
def test_configs_the_workers_cannot_run_are_sized_but_flagged(extra, gap):
    raw = json.loads((CONFIGS / "llama-3.1-8b.json").read_text()) | extra
    p = plan(ModelConfig.from_dict(raw), instance="trn1.32xlarge", tp=8)
    assert p.valid  # the sizing stands
    assert any(gap in w and "not runnable by corelaunch" in w for w in p.warnings), p.warnings
    assert any(gap in g for g in ModelConfig.from_dict(raw).executor_gaps())
    assert plan(LLAMA_8B, instance="trn1.32xlarge", tp=8).warnings == ()


@pytest.mark.parametrize("extra", [{"attention_bias": True}, {"mlp_bias": True},
                                   {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}])
def test_llama_variants_are_runnable(extra):
    raw = json.loads((CONFIGS / "llama-3.1-8b.json").read_text()) | extra
    assert ModelConfig.from_dict(raw).executor_gaps() == []


def test_mixtral_runs_and_a_sliding_window_is_applied_past_it():
    assert MIXTRAL.executor_gaps() == []  # mixture-of-experts models run (tests/test_moe.py)
    windowed = ModelConfig.from_dict(json.loads((CONFIGS / "mixtral-8x7b-v0.1.json").read_text())
                                     | {"sliding_window": 4096})  # families' window rule covers Mixtral
    assert windowed.window_of(0) == 4096 and windowed.executor_gaps(8192) == []
    mistral = load_model_config(CONFIGS / "mistral-7b-v0.1.json")
    assert mistral.sliding_window == 4096 and mistral.executor_gaps(8192) == []
    assert mistral.window_of(0) == 4096
    assert QWEN_72B.sliding_window is None  # use_sliding_window is false in its config


@pytest.mark.parametrize("raw, match", [
    ([1, 2], "must hold a JSON object, not list"),
    ({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
      "num_attention_heads": 0, "vocab_size": 10}, "num_attention_heads=0"),
    ({"model_type": "llama", "hidden_size": 64}, "lacks required field"),
    ({"model_type": "gpt2"}, "unsupported architecture model_type='gpt2'"),
    # no model_type was "unsupported architecture model_type=None", as if None were one
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, r"config.json names no model_type \(architectures="
                                                                  r"\['LlamaForCausalLM'\]\); add the one"),
])
def test_malformed_configs_raise_value_errors(raw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)


def test_qwen3_and_gemma3_configs_are_understood():
    qwen3 = load_model_config(CONFIGS / "qwen3-0.6b.json")
    assert qwen3.head_dim == 128 and qwen3.q_size == 2048  # head_dim given, not hidden_size / heads
    assert qwen3.param_count() == 596_049_920 and qwen3.layer_types is None  # use_sliding_window false
    gemma = load_model_config(CONFIGS / "gemma-3-1b-it.json")
    assert gemma.tie_word_embeddings  # Gemma 3's default when config.json leaves it out
    assert gemma.param_count() == 999_885_952
    assert [i for i in range(26) if gemma.window_of(i) is None] == [5, 11, 17, 23]  # every 6th global
    assert gemma.sliding_window == 512 and (gemma.rope_theta, gemma.local_rope_theta) == (1e6, 1e4)
    for config, tp, strategy in ((qwen3, 8, "shard"), (gemma, 2, "replicate_to_tp")):
        p = plan(config, instance="trn1.32xlarge", tp=tp, dtype="bfloat16")
        assert p.valid and p.kv_strategy == strategy and config.executor_gaps() == []
        assert p.memory.weight_bytes_per_rank * tp >= config.param_count() * 2
    assert plan(gemma, tp=1, dtype="bfloat16").memory.weight_bytes_per_rank == gemma.param_count() * 2
    padded = plan(gemma, instance="trn1.32xlarge", tp=8, pad_q_heads=True)
    assert padded.valid and padded.padded_q_heads == 8 and padded.kv_strategy == "replicate_to_tp"


def test_a_quantized_checkpoint_that_does_not_fit_gets_its_ways_out():
    """The ways out re-planned it at float8_e4m3, which a checkpoint quantized as int8 refuses: the
    whole plan failed as unplannable, naming a dtype nobody asked for."""
    import dataclasses

    from shardlib.quantization import Quantization

    q70 = dataclasses.replace(LLAMA_70B, quantization=Quantization("int8"))
    p = plan(q70, instance="trn1.32xlarge", tp=2)
    assert codes(p) == {"insufficient_memory"}
    text = message(p, "insufficient_memory")
    assert "a degree that fits: 8, 16, 32" in text and "float8" not in text


def test_padding_waste_of_a_quantized_checkpoint_counts_its_one_byte_weights():
    """It counted the padded heads' projections at the compute dtype (2 bytes for bfloat16): twice
    what an int8 checkpoint's zero heads weigh."""
    import dataclasses

    from shardlib.quantization import Quantization

    q70 = dataclasses.replace(LLAMA_70B, quantization=Quantization("int8"))
    waste = plan(q70, instance="inf2.48xlarge", tp=24, pad_q_heads=True).padding_waste
    assert waste.extra_qo_weight_bytes == 8 * 2 * 128 * 8192 * 80  # 8 zero heads, q and o, 1 byte each
    assert waste.extra_qo_weight_bytes == plan(LLAMA_70B, instance="inf2.48xlarge", tp=24, pad_q_heads=True,
                                               dtype="int8").padding_waste.extra_qo_weight_bytes


def test_ways_out_name_fewer_nodes_where_the_node_count_is_the_problem():
    """On 3 trn1 nodes no supported degree splits a 64-head model evenly: the ways out offered only
    --nodes 4, and the degrees "that work" were said to be for one node while computed for three."""
    p = plan(LLAMA_70B, instance="trn1.32xlarge", nodes=3)
    text = message(p, "no_valid_tp_degree")
    assert "fewer nodes: --nodes 2 fits at tp 16, 32, 64" in text and "more nodes: --nodes 4" in text
    assert "degrees that work for this model on 3 x trn1.32xlarge: none" in message(p, "heads_not_divisible")


def test_a_smaller_seq_len_named_as_a_way_out_never_passes_the_models_own_limit():
    """A seq_len past max_position_embeddings short of memory was told "at most 28208", which the
    model's own limit (8192) then refused."""
    text = message(plan(SMOLLM2, instance="trn1.2xlarge", tp=1, seq_len=100_000, batch_size=8),
                   "insufficient_memory")
    assert "a smaller seq_len (at most 8192 at batch_size 8, the model's max_position_embeddings)" in text, text


def test_a_seq_len_past_the_models_positions_is_refused_as_every_launch_refuses_it():
    """plan said VALID (a warning), a compiled launch refused the value and an eager one took it,
    holding cache slots no request may reach. One rule now, the planner's."""
    p = plan(SMOLLM2, instance="cpu", tp=1, seq_len=SMOLLM2.max_position_embeddings + 1)
    assert not p.valid and codes(p) == {"seq_len_too_long"}
    assert p.valid_tp_degrees == ()  # every degree fails it (`plan` listed 1, 3, 9 as valid beside it)
    assert p.errors[0].message == (
        f"seq_len ({SMOLLM2.max_position_embeddings + 1}) exceeds the model's max_position_embeddings "
        f"({SMOLLM2.max_position_embeddings}): no request runs past that position, so the cache slots above it "
        f"would be held and never used; lower seq_len (--seq-len) to {SMOLLM2.max_position_embeddings} or less")
    assert plan(SMOLLM2, instance="cpu", tp=1, seq_len=SMOLLM2.max_position_embeddings).valid
    assert plan(SMOLLM2, instance="cpu", seq_len=SMOLLM2.max_position_embeddings + 1).tp_degree == 1  # auto: as before


# ---- node counts as the way out, trn2's TP 64 at LNC 1 ------------------------------------------
def test_an_explicit_tp_with_no_degree_at_this_node_count_names_the_node_counts_that_work():
    """`--nodes 3 --tp 48` for a 64-head model on trn1, and `--nodes 2 --tp 4` for SmolLM2 on
    inf2.xlarge, said "degrees that work ...: none" and nothing else; the node counts were named
    only for --tp auto or insufficient memory."""
    import re

    for cfg, instance, nodes, tp in ((QWEN_72B, "trn1.32xlarge", 3, 48), (SMOLLM2, "inf2.xlarge", 2, 4)):
        p = plan(cfg, instance=instance, nodes=nodes, tp=tp)
        assert not p.valid and p.valid_tp_degrees == (), (instance, p.error_codes)
        with_none = [issue for issue in p.errors if ": none" in issue.message]
        assert with_none, [issue.message for issue in p.errors]  # else the loop below checks nothing
        for issue in with_none:
            offered = re.findall(r"(?:more|fewer) nodes: --nodes (\d+) fits at tp ([\d, ]+)", issue.message)
            assert offered, issue.message
            for other_nodes, degrees in offered:  # every degree named passes at the node count named
                for degree in degrees.split(", "):
                    assert plan(cfg, instance=instance, nodes=int(other_nodes), tp=int(degree)).valid, (
                        issue.message, other_nodes, degree)
    text = message(plan(SMOLLM2, instance="inf2.xlarge", nodes=2, tp=4), "unsupported_tp_degree")
    assert "fewer nodes: --nodes 1 fits at tp 1" in text, text
    # where a degree works at this node count, the message names it and no node count
    assert "--nodes" not in message(plan(QWEN_72B, instance="trn1.32xlarge", tp=6), "heads_not_divisible")


def test_trn2_refuses_tp_64_at_lnc_1_naming_lnc_2():
    """neuronx-distributed builds a 64-rank world at LNC 1 on trn2 as two TP groups of 32, so a
    64-way sharded model would not match its groups; LNC 1 listed TP 64 as supported."""
    for nodes in (1, 2):
        p = plan(LLAMA_70B, instance="trn2.48xlarge", tp=64, lnc=1, nodes=nodes, seq_len=1024)
        assert "unsupported_tp_degree" in codes(p), (nodes, p.error_codes)
        text = message(p, "unsupported_tp_degree")
        assert "two TP groups of 32" in text and "use --lnc 2" in text and "or tp 32" in text, text
        assert 64 not in p.valid_tp_degrees
        assert plan(LLAMA_70B, instance="trn2.48xlarge", tp=64, lnc=2, nodes=nodes, seq_len=1024).valid
    assert plan(LLAMA_70B, instance="trn2.48xlarge", tp=32, lnc=1, seq_len=1024).valid
    # TP 128 at LNC 1 (64 ranks on each of 2 nodes, or 128 on one) is not the 64-rank world
    assert plan(LLAMA_405B, instance="trn2.48xlarge", tp=128, lnc=1, nodes=2, seq_len=1024).valid
    # auto at LNC 1 never picks 64: a model that needs more than 32 ranks' memory gets 128
    assert plan(LLAMA_405B, instance="trn2.48xlarge", lnc=1, seq_len=1024).tp_degree == 128


def test_more_nodes_names_only_the_degrees_they_make_work():
    """"more nodes: --nodes 2 fits at tp 16, 32, 64" named degrees that fit on the one node asked,
    already offered as "a degree that fits"; only 64 needs the second node."""
    text = message(plan(QWEN_72B, instance="trn1.32xlarge", tp=6), "insufficient_memory")
    assert "a degree that fits: 16, 32;" in text and "more nodes: --nodes 2 fits at tp 64;" in text, text


def test_on_cpu_nothing_fits_names_no_instances_it_never_tried():
    """Other instances are tried for Neuron targets alone: on cpu the refusal claimed them too."""
    host = InstanceType(name="cpu", family="cpu", physical_cores=2, memory_bytes=24 * GIB)
    text = message(plan(LLAMA_405B, instance=host, tp=1, dtype="float32", seq_len=1024), "insufficient_memory")
    assert "none found with up to 8 nodes and the lower-precision dtypes;" in text, text
