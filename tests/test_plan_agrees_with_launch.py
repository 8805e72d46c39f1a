"""`corelaunch plan` and a launch reach the same verdict on the cpu target: the plan counts each
rank's process (RANK_PROCESS_BYTES) as the launch does, so a layout the plan calls valid is not
refused as the launch starts, and the plan's suggested --seq-len and --max-num-seqs are taken.

Before, the plan said VALID on a 23.5 GiB host for `--seq-len 4747 --max-num-seqs 100` at TP 1
where `generate` refused it ("Lower --tp", at TP 1), and the suggestions of the launch's own
refusal were refused again by its rank-process check."""

from __future__ import annotations

import math
import re

import pytest

from launcher.api import LaunchConfig
from launcher.errors import PlanRejected
from launcher.launch_plan import RANK_PROCESS_BYTES, check_groups_fit, groups_this_host_holds, plan_launch
from launcher.progress import Progress
from shardlib.model_config import load_model_config
from shardlib.planner import RESERVE_FRACTION, plan as make_plan
from shardlib.serving_shapes import serving_cache_rows
from tests.model_factory import save_random_model
from tests.test_plan_edges import host_ram  # noqa: F401 (the fixture: this host's RAM as the test sets it)

SEQ_LEN = 256
ROWS_AT_EDGE = 10
"""The max_num_seqs the host below holds at TP 1 and SEQ_LEN, and no more."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_random_model(tmp_path_factory.mktemp("m"), "llama", num_heads=4, num_kv_heads=2))


@pytest.fixture
def private_host(monkeypatch, ray_tripwire):
    """A launch whose Ray would be private (this host alone), as `corelaunch generate` on a laptop."""
    from launcher.cluster import ray_cluster

    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process (not the suite's session)


def _serving_plan(config, tp, max_num_seqs, seq_len=SEQ_LEN):
    """`corelaunch plan --batch-size 0 --max-num-seqs N`: what generate's launch plans."""
    return make_plan(config, instance="cpu", tp=tp, batch_size=0, serving_rows=serving_cache_rows(max_num_seqs),
                     seq_len=seq_len)


def _launch_verdict(model_dir, tp, max_num_seqs, seq_len=SEQ_LEN):
    """(taken, the tp planned or the refusal) of generate's launch: no static batch, eager."""
    config = LaunchConfig(model=model_dir, tp=tp, compile=False, max_batch_size=0, max_num_seqs=max_num_seqs,
                          seq_len=seq_len)
    try:
        return True, plan_launch(config, Progress(False)).plan.tp_degree
    except (PlanRejected, ValueError) as err:
        return False, str(err)


def _edge_host(model_dir, host_ram) -> None:
    """A host whose usable RAM holds one TP 1 rank with ROWS_AT_EDGE serving slots and half a slot
    more: its weights, scratch and process, and the KV cache of those rows."""
    config = load_model_config(model_dir)
    host_ram(64 * 2**30)
    at_edge = _serving_plan(config, 1, ROWS_AT_EDGE).memory
    per_row = at_edge.kv_cache_bytes_per_rank // serving_cache_rows(ROWS_AT_EDGE)
    usable = (at_edge.weight_bytes_per_rank + at_edge.packing_scratch_bytes_per_rank + RANK_PROCESS_BYTES
              + at_edge.kv_cache_bytes_per_rank + per_row // 2)
    host_ram(math.ceil(usable / (1 - RESERVE_FRACTION)))


def test_plan_and_launch_agree_at_the_edge_of_this_hosts_ram(model_dir, host_ram, private_host):
    _edge_host(model_dir, host_ram)
    config = load_model_config(model_dir)
    for max_num_seqs in (ROWS_AT_EDGE - 1, ROWS_AT_EDGE, ROWS_AT_EDGE + 1, 4 * ROWS_AT_EDGE):
        for tp in (1, 2, 4):
            planned = _serving_plan(config, tp, max_num_seqs)
            taken, said = _launch_verdict(model_dir, tp, max_num_seqs)
            assert planned.valid == taken, (tp, max_num_seqs, planned.error_codes, said)
            if not taken:  # refused by the planner's rule, with the planner's words, not after it
                assert "[insufficient_memory]" in said, said
        # --tp auto: the plan's valid degrees (each with its own process) are the launch's
        auto = _serving_plan(config, "auto", max_num_seqs)
        taken, said = _launch_verdict(model_dir, "auto", max_num_seqs)
        assert auto.valid == taken and (not taken or said == auto.tp_degree), (max_num_seqs, auto.error_codes, said)
    # at the edge one rank fits, and two ranks (two processes) do not: auto picks TP 1
    assert _serving_plan(config, "auto", ROWS_AT_EDGE).valid_tp_degrees == (1,)
    assert not _serving_plan(config, 1, ROWS_AT_EDGE + 1).valid


def test_the_ways_out_a_refusal_names_are_taken_by_the_launch(model_dir, host_ram, private_host):
    """generate --tp 1 --seq-len 8192 --max-num-seqs 100 suggested a --seq-len and a --max-num-seqs
    that counted no rank process, and each was then refused."""
    _edge_host(model_dir, host_ram)
    too_many = 4 * ROWS_AT_EDGE
    taken, said = _launch_verdict(model_dir, 1, too_many)
    assert not taken and "[insufficient_memory]" in said, said
    assert "rank process 384.0 MiB" in said, said
    seqs = int(re.search(r"fewer serving rows \(--max-num-seqs at most (\d+)\)", said).group(1))
    seq_len = int(re.search(r"a smaller seq_len \(at most (\d+) at", said).group(1))
    assert seqs == ROWS_AT_EDGE, said  # the largest count that fits: one more does not
    assert _launch_verdict(model_dir, 1, seqs) == (True, 1)
    assert _launch_verdict(model_dir, 1, too_many, seq_len) == (True, 1)
    assert _launch_verdict(model_dir, 1, too_many, seq_len + 1)[0] is False


def test_a_group_no_host_holds_is_told_to_lower_tp_only_where_there_is_a_lower_tp(model_dir, host_ram, private_host):
    """A server's group (its Serve replica, which the plan leaves out) this host cannot hold: at
    TP 1 "Lower --tp (fewer rank processes)" was advice that changed nothing."""
    config = load_model_config(model_dir)
    host_ram(8 * 2**30)
    for tp, told in ((1, False), (2, True)):
        planned = _serving_plan(config, tp, 2)
        launch = LaunchConfig(model=model_dir, tp=tp, compile=False, max_batch_size=0, max_num_seqs=2)
        assert groups_this_host_holds(launch, planned, "cpu", server=True) >= 1
        with pytest.raises(ValueError, match=r"^one TP group of \d rank\(s\) needs") as info:
            check_groups_fit(1, "--replicas", planned, 0, server=True)
        text = str(info.value)
        assert ("Lower --tp" in text) == told and "--seq-len" in text and "--max-num-seqs" in text, text
