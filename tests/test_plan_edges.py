"""Edges of the planner and of the launcher's accounting around it: a cpu group this host's RAM
cannot hold once its processes are counted, the advice for a group no node holds, the split of a
cpu group over several nodes, and the plan's JSON and suggestions."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from shardlib import instances
from shardlib.instances import GIB
from shardlib.planner import plan as make_plan
from tests.test_planner import TINY


@pytest.fixture
def host_ram(monkeypatch):
    """Sets this host's RAM as the planner reads it (instances._host_ram_bytes, read once by
    cpu_host), so a test does not depend on the machine it runs on."""
    def set_ram(n_bytes: int) -> None:
        monkeypatch.setattr(instances, "_host_ram_bytes", lambda: n_bytes)
        instances.cpu_host.cache_clear()

    yield set_ram
    instances.cpu_host.cache_clear()


def _private_cpu_config(monkeypatch, replicas=1):
    """A launch whose Ray would be private (this host alone), on one node, planned for this host."""
    from launcher.cluster import ray_cluster

    monkeypatch.setattr(ray_cluster, "private_cluster", lambda address: True)
    return SimpleNamespace(instance=None, nodes=1, ray_address=None, replicas=replicas)


def _tight_plan(host_ram):
    """A TP 2 plan of TINY for trn1.32xlarge that the planner accepts, whose ranks a cpu launch runs
    here (planned_on_this_host), on a host whose usable RAM is one MiB short of that group with its
    two rank processes: a cpu plan of this host counts them itself, so only a plan made for another
    --instance (or a server's Serve replica) reaches the launcher's own refusal."""
    from launcher.launch_plan import host_bytes_per_group

    host_ram(64 * GIB)
    per_group = host_bytes_per_group(make_plan(TINY, instance="cpu", tp=2, batch_size=8, seq_len=64))
    host_ram(int((per_group - 2**20) / 0.9))  # the planner keeps 10% back
    plan = make_plan(TINY, instance="trn1.32xlarge", tp=2, batch_size=8, seq_len=64)
    assert plan.valid, plan.errors
    assert not make_plan(TINY, instance="cpu", tp=2, batch_size=8, seq_len=64).valid  # the plan says so here
    return plan


def test_one_cpu_group_this_host_cannot_hold_is_refused_with_its_bytes_and_fixes(host_ram, monkeypatch):
    """holds == 0 (the group's processes take it past this host's RAM) still started one group,
    and asking for two said "Ask for at most 1"."""
    from launcher.launch_plan import check_groups_fit, check_replicas_fit_this_host, groups_this_host_holds
    from launcher.launch_plan import host_bytes_per_group, planned_on_this_host
    from shardlib.planner import format_bytes

    plan = _tight_plan(host_ram)
    config = _private_cpu_config(monkeypatch)
    assert groups_this_host_holds(config, plan, "cpu") == 0
    need = (r"^one TP group of 2 rank\(s\) needs " + re.escape(format_bytes(host_bytes_per_group(planned_on_this_host(plan))))
            + " of this")
    for replicas in (1, 2, "auto"):
        with pytest.raises(ValueError, match=need) as info:
            check_replicas_fit_this_host(_private_cpu_config(monkeypatch, replicas), plan, "cpu")
        text = str(info.value)
        assert "Ask for at most" not in text and "nothing was started" in text
        # its KV cache is a fraction of a MiB: no --seq-len or row count could make up the MiB missing
        assert "Even without its KV cache" in text and "a lower --tp" in text and "--seq-len" not in text, text
    with pytest.raises(ValueError, match=r"for its rank processes and its Serve replica") as info:
        check_groups_fit(1, "--replicas", plan, 0, server=True)
    assert "--max-batch-size" not in str(info.value)  # a server holds no static batch
    check_groups_fit(5, "--replicas", plan, None)  # not this host's to judge: another cluster's nodes


def test_a_host_that_holds_one_group_still_refuses_two_and_names_one(host_ram, monkeypatch):
    from launcher.launch_plan import check_replicas_fit_this_host, host_bytes_per_group

    host_ram(64 * GIB)
    per_group = host_bytes_per_group(make_plan(TINY, instance="cpu", tp=2, batch_size=8, seq_len=64))
    host_ram(int(1.5 * per_group / 0.9))
    plan = make_plan(TINY, instance="cpu", tp=2, batch_size=8, seq_len=64)
    check_replicas_fit_this_host(_private_cpu_config(monkeypatch, 1), plan, "cpu")
    with pytest.raises(ValueError, match=r"^replicas \(2\): 2 TP groups .* Ask for at most 1,"):
        check_replicas_fit_this_host(_private_cpu_config(monkeypatch, 2), plan, "cpu")


def test_a_cpu_bundle_no_node_holds_names_a_share_and_a_node_that_hold_the_group():
    """{CPU: 10} x 4 ranks on an 8-CPU node was told "Lower --cpus-per-rank (at most 8 ...), or add a
    node with {CPU: 10}": 4 ranks need 32 CPUs at 8 each, and a 10-CPU node holds one rank."""
    from launcher.cluster.resources import explain_unplaceable

    why = explain_unplaceable({"CPU": 10.0}, 4, 1, [{"CPU": 8.0}])
    assert why.endswith("Lower --cpus-per-rank (at most 2, the most at which the alive nodes hold the group's 4 "
                        "ranks on at most 1 node(s)), or add a node with {CPU: 40} (the 4 ranks' bundles)"), why
    # split evenly over 2 nodes where one is alive: no share helps, and the group needs two nodes
    lone = explain_unplaceable({"CPU": 10.0}, 2, 2, [{"CPU": 8.0}])
    assert "Lower --cpus-per-rank" not in lone and lone.endswith("add 2 nodes with {CPU: 10} each (one rank's "
                                                                  "bundle each)"), lone


def test_the_largest_cpu_share_named_is_the_largest_that_places_the_group():
    from launcher.cluster.resources import largest_cpu_share, place_group

    for tp, max_nodes, cpus in ((4, 1, [8.0]), (3, 1, [8.0]), (4, 2, [8.0, 6.0]), (3, 2, [5.0, 3.0])):
        totals = [{"CPU": c} for c in cpus]
        share = largest_cpu_share(tp, max_nodes, totals)
        assert place_group(totals, {"CPU": share}, tp, max_nodes) is not None, (tp, cpus, share)
        assert place_group(totals, {"CPU": share + 1e-4}, tp, max_nodes) is None, (tp, cpus, share)
    assert largest_cpu_share(2, 2, [{"CPU": 8.0}]) is None  # an even split over 2 nodes, 1 alive


def test_a_cpu_group_over_several_nodes_takes_its_planned_share_on_each():
    """The planner gives each node's RAM to ceil(TP / nodes) ranks; PACK put a TP 4 group over 2
    nodes all on one 8-CPU node (cpu bundles were split evenly only for device groups)."""
    from launcher.cluster.resources import cpu_rank_resources, even_split, groups_that_fit, place_group

    share = cpu_rank_resources(4, [8.0, 8.0], nodes=2, replicas=2).bundle
    assert even_split(share, 4, 2) == 2
    assert sorted(place_group([{"CPU": 8.0}, {"CPU": 8.0}], share, 4, 2)) == [2, 2]
    assert groups_that_fit([{"CPU": 8.0}] * 2, share, 4, 2) == 2
    # a node that could take the whole group does not: each of the 2 nodes takes 2 ranks or none fits
    assert place_group([{"CPU": 4.0}, {"CPU": 1.0}], {"CPU": 1.0}, 4, 2) is None
    assert even_split({"CPU": 1.0}, 3, 2) is None  # 2 nodes do not split 3 ranks evenly: 2 + 1 (node_split)


def test_the_plans_json_names_the_compute_dtype_and_the_weights_quantization():
    """The text report read "float32, int8 weights, KV cache float8_e4m3"; the JSON said only
    "dtype": "int8", which reads as the compute dtype."""
    fp8_kv = make_plan(TINY, instance="cpu", dtype="int8", kv_cache_dtype="float8_e4m3").to_dict()
    assert fp8_kv["dtype"] == "int8"  # kept as it was
    assert fp8_kv["compute_dtype"] == "float32" and fp8_kv["memory"]["kv_cache_dtype"] == "float8_e4m3"
    assert fp8_kv["weights_quantization"] == {"dtype": "int8", "granularity": "per_channel_symmetric",
                                              "modules": "linear"}
    on_neuron = make_plan(TINY, instance="trn1.32xlarge", tp=2, dtype="int8").to_dict()
    assert on_neuron["compute_dtype"] == "bfloat16" and on_neuron["weights_quantization"]["dtype"] == "int8"
    plain = make_plan(TINY, instance="cpu", dtype="bfloat16").to_dict()
    assert plain["compute_dtype"] == "bfloat16" and plain["weights_quantization"] is None


def test_a_seq_len_of_one_is_never_suggested():
    """A GPU whose room after the weights holds 1.5 positions of the cache: "a smaller seq_len (at
    most 1 ...)" was offered, which plan() refuses (seq_len must be at least 2)."""
    from shardlib.instances import gpu_node
    from shardlib.planner import RESERVE_FRACTION

    roomy = make_plan(TINY, instance=gpu_node(64 * GIB, gpus=1), tp=1, batch_size=1, seq_len=64)
    mem = roomy.memory
    per_position = mem.kv_cache_bytes_per_rank // 64
    need = mem.weight_bytes_per_rank + mem.packing_scratch_bytes_per_rank + per_position * 3 // 2
    tight = make_plan(TINY, instance=gpu_node(int(need / (1 - RESERVE_FRACTION)) + 1, gpus=1), tp=1,
                      batch_size=1, seq_len=64)
    [text] = [e.message for e in tight.errors if e.code == "insufficient_memory"]
    assert "ways out" in text and "seq_len (at most" not in text, text


def _large_model():
    """A 405B-like shape (128 heads, 126 layers): TP 128 needs trn2's LNC 1 (128 logical cores)."""
    import dataclasses

    return dataclasses.replace(TINY, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                               num_attention_heads=128, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                               torch_dtype="bfloat16", max_position_embeddings=131072)


def test_lnc_1_on_trn2_is_suggested_only_where_its_halved_memory_holds_the_layout():
    model = _large_model()
    for batch_size, seq_len in ((1, 1024), (8, 16384)):
        at_lnc2 = make_plan(model, instance="trn2.48xlarge", tp=128, lnc=2, batch_size=batch_size, seq_len=seq_len)
        at_lnc1 = make_plan(model, instance="trn2.48xlarge", tp=128, lnc=1, batch_size=batch_size, seq_len=seq_len)
        [text] = [e.message for e in at_lnc2.errors if e.code == "not_enough_cores"]
        fits = "insufficient_memory" not in at_lnc1.error_codes
        assert ("--lnc 1" in text) == fits, (batch_size, seq_len, at_lnc1.error_codes, text)
    assert fits is False  # the second layout is the one whose LNC 1 memory does not hold it


def test_a_server_group_short_of_ram_even_without_its_kv_cache_is_not_told_to_shrink_it(host_ram, monkeypatch):
    """A host holding the plan with 1 MiB to spare holds no server group (its Serve replica, 448 MiB,
    comes on top): the refusal advised a smaller --seq-len or fewer --max-num-seqs, shrinking a KV
    cache of a MiB against hundreds missing."""
    from launcher.launch_plan import check_groups_fit, groups_this_host_holds
    from shardlib.planner import RESERVE_FRACTION
    from shardlib.serving_shapes import serving_cache_rows

    def server_plan():
        return make_plan(TINY, instance="cpu", tp=1, batch_size=0, serving_rows=serving_cache_rows(4), seq_len=64)

    host_ram(64 * GIB)
    host_ram(int((server_plan().memory.total_bytes_per_rank + 2**20) / (1 - RESERVE_FRACTION)) + 1)
    plan = server_plan()
    assert plan.valid, plan.errors
    holds = groups_this_host_holds(_private_cpu_config(monkeypatch), plan, "cpu", server=True)
    assert holds == 0
    with pytest.raises(ValueError) as info:
        check_groups_fit(1, "--replicas", plan, holds, server=True)
    text = str(info.value)
    assert "Even without its KV cache" in text and "a host with more RAM" in text, text
    assert "--seq-len" not in text and "--max-num-seqs" not in text, text
