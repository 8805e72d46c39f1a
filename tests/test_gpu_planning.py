"""The planner's gpu nodes (shardlib.instances.gpu_node): one rank per GPU, each against its own memory."""

from __future__ import annotations

from shardlib.demo_model import PACKAGED_CONFIG
from shardlib.instances import GIB, gpu_node
from shardlib.model_config import load_model_config
from shardlib.planner import plan

SMOLLM2 = load_model_config(PACKAGED_CONFIG)  # 9 heads, 3 KV heads


def test_each_rank_plans_against_one_gpu():
    result = plan(SMOLLM2, instance=gpu_node(80 * GIB, 8, "H100"), tp=3)
    assert result.valid and result.family == "gpu" and result.instance == "8 x H100 (80.0 GiB each)"
    assert result.memory.capacity_bytes_per_rank == 80 * GIB and result.logical_cores_per_node == 8


def test_more_ranks_than_gpus_on_a_node_is_refused():
    result = plan(SMOLLM2, instance=gpu_node(80 * GIB, 2, "H100"), tp=3)
    assert result.error_codes == ("not_enough_cores",)
    message = result.errors[0].message
    assert "puts 3 ranks on a node, one per GPU, but 2 x H100 (80.0 GiB each) has 2 GPU(s)" in message
    assert "--nodes 2" in message
    assert plan(SMOLLM2, instance=gpu_node(80 * GIB, 2, "H100"), tp=3, nodes=2).valid


def test_a_gpu_too_small_names_the_memory_of_one_gpu():
    result = plan(SMOLLM2, instance=gpu_node(GIB // 8, 8, "T4"), tp=1, seq_len=4096, batch_size=8)
    assert "insufficient_memory" in result.error_codes
    message = dict(zip(result.error_codes, (e.message for e in result.errors)))["insufficient_memory"]
    assert "of one GPU less the 10% reserve" in message


def test_an_unknown_gpu_count_is_left_to_placement():
    result = plan(SMOLLM2, instance=gpu_node(80 * GIB), tp=9)
    assert result.valid and result.logical_cores_per_node is None
    assert result.instance == "GPU (80.0 GiB each), count unknown"
