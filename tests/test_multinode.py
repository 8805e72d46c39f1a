"""Several Ray nodes on this machine (ray.cluster_utils.Cluster): placement over nodes, rank order,
placement and device failures, and losing a node in the middle of requests.

One cluster for the module: a head with no CPUs (the driver's node, never removed) and 1-CPU worker
nodes that each declare 8 `neuron_cores`, the CPU backend doing the work. The tests that remove
nodes come last; each one first adds or removes nodes to get the cluster it needs, so none depends
on what an earlier test left.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from launcher.api import Launcher
from launcher.errors import NeuronDevicesMissing, PlacementTimeout, ReplicaFailed
from tests.conftest import start_session_ray
from tests.model_factory import build_random_model, save_model
from tests.test_fault_tolerance import LONG, LONGEST, MODEL_SHAPE, greedy_ignoring_eos, wait_for

WORKER_NODE = dict(num_cpus=1, resources={"neuron_cores": 8})
PROMPTS = [[5, 17, 42, 9], [8, 60, 21]]
# Placement, node loss and restarts are this module's subject: its groups run eagerly. Compiled
# graphs through Ray at TP > 1 are proven in tests/test_compiled.py; compiling here (up to four
# ranks on two cores, again after each restart) would only add minutes.
EAGER = dict(compile=False)

pytestmark = pytest.mark.slow


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _restore(path: str, content: str | None) -> None:
    """Put back the machine's "current Ray cluster" file as it was: Cluster() overwrites it, and
    other Ray users on this machine connect to whatever it names."""
    if content is None:
        if os.path.exists(path):
            os.remove(path)
    else:
        with open(path, "w") as fh:
            fh.write(content)


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray._common.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    session_was_open = ray.is_initialized()  # the session-wide local Ray (tests/conftest.py)
    if session_was_open:
        ray.shutdown()
    address_file = get_ray_address_file(None)
    previous = _read(address_file)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(3):
            cluster.add_node(**WORKER_NODE)
        _restore(address_file, previous)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        _restore(address_file, previous)
        if session_was_open:
            start_session_ray()


def set_worker_nodes(cluster, count: int) -> None:
    """Add or remove worker nodes until `count` are alive (removing from those added last), then wait
    until none of their CPUs is held: Ray frees a killed actor's CPU a moment after the kill, and the
    previous test's last ranks held one node's only CPU past a 3 s placement timeout (a CI failure of
    the suite, not of the code)."""
    import ray

    while len(cluster.worker_nodes) < count:
        cluster.add_node(**WORKER_NODE)
    while len(cluster.worker_nodes) > count:
        cluster.remove_node(sorted(cluster.worker_nodes, key=lambda n: n.node_id)[-1])
    cluster.wait_for_nodes()
    wait_for(lambda: ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0), 60,
             "the previous test's actors releasing their CPUs")


def remove_node_of(cluster, node_id: str) -> None:
    [node] = [n for n in cluster.worker_nodes if n.node_id == node_id]
    cluster.remove_node(node)


@pytest.fixture(scope="module")
def model_and_expected(tmp_path_factory):
    model = build_random_model("llama", seed=5, **MODEL_SHAPE)
    path = save_model(model, tmp_path_factory.mktemp("multinode"))
    return str(path), [greedy_ignoring_eos(model, p, LONG) for p in PROMPTS]


def test_tp_groups_over_two_nodes_give_the_transformers_tokens(cluster, model_and_expected):
    model_dir, expected = model_and_expected
    set_worker_nodes(cluster, 3)
    short = [e[:12] for e in expected]
    # TP 2 on 1-CPU nodes: one rank per node, so the group must span two nodes
    with Launcher(model=model_dir, tp=2, nodes=2, progress=False, **EAGER) as tp2:
        [status] = tp2.replica_status()
        workers = status["workers"]
        assert len({w["node_id"] for w in workers}) == 2, workers
        assert status["node_groups"] == [[0], [1]]
        out2 = tp2.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)
    # TP 4 at half a CPU per rank: two ranks on each of two nodes, each node's ranks contiguous
    with Launcher(model=model_dir, tp=4, nodes=2, cpus_per_rank=0.5, progress=False, **EAGER) as tp4:
        [status] = tp4.replica_status()
        groups, workers = status["node_groups"], status["workers"]
        out4 = tp4.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert sorted(map(sorted, groups)) == [[0, 1], [2, 3]], groups
    assert len({w["node_id"] for w in workers}) == 2
    assert [r.token_ids for r in out2] == short
    assert [r.token_ids for r in out4] == short


def test_a_group_held_to_one_node_fails_placement_within_its_timeout(cluster, model_and_expected):
    model_dir, _ = model_and_expected
    start = time.monotonic()
    with pytest.raises(PlacementTimeout) as info:
        Launcher(model=model_dir, tp=2, nodes=1, cpus_per_rank=1, placement_timeout_s=3, progress=False, **EAGER).start()
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "STRICT_PACK" in message and "can never hold" in message and "--nodes" in message, message
    assert "{CPU: 1, neuron_cores: 8}" in message, message  # what each node has
    assert elapsed < 20, f"took {elapsed:.1f} s"


def test_a_group_nodes_do_not_split_evenly_takes_at_most_its_planned_share_on_each(cluster, tmp_path):
    """--nodes N not dividing TP: each node holds ceil or floor of TP / N ranks, one bundle a node
    (STRICT_SPREAD). The group was PACKed, and PACK put all of TP 3 on one node of two when it held
    them, which the launcher refused (more than the 2 ranks the plan gave that node's RAM to) until
    --placement-timeout ran out; the default share and --replicas auto had counted on [2, 1]."""
    set_worker_nodes(cluster, 3)
    shape = dict(MODEL_SHAPE, num_heads=6, num_kv_heads=3, hidden_size=192)  # heads TP 3 divides
    model = build_random_model("llama", seed=7, **shape)
    expected = [greedy_ignoring_eos(model, p, 8) for p in PROMPTS]
    model_dir = str(save_model(model, tmp_path))
    # a quarter CPU a rank: any one 1-CPU node holds all three, and PACK put them there
    with Launcher(model=model_dir, tp=3, nodes=2, cpus_per_rank=0.25, placement_timeout_s=20, progress=False,
                  **EAGER) as tp3:
        [status] = tp3.replica_status()
        out = tp3.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert status["node_groups"] == [[0, 1], [2]], status["node_groups"]
    assert len({w["node_id"] for w in status["workers"]}) == 2
    assert [r.token_ids for r in out] == expected
    # 1-CPU nodes at 1 CPU a rank: the node of 2 ranks needs 2 CPUs, which none has; the message
    # names each node's share and the --nodes that holds the group (one rank a node)
    with pytest.raises(PlacementTimeout, match=r"2 \+ 1 on 2 different nodes.*--nodes 3 holds it"):
        Launcher(model=model_dir, tp=3, nodes=2, cpus_per_rank=1, placement_timeout_s=3, progress=False,
                 **EAGER).start()


def test_a_device_group_over_several_nodes_gets_its_planned_share_on_each(cluster):
    """The planner checks each node's share of a device group's ranks (TP / nodes, a degree NxD
    Inference supports on one node); Ray's PACK put all four ranks of a 2 x 2 plan on one node when
    it held them (4 ranks on one trn1 node: a degree trn1 does not support)."""
    from ray.util.placement_group import remove_placement_group

    from launcher.cluster.placement import bundle_nodes
    from launcher.cluster.resources import RankResources
    from launcher.cluster.tp_group import GroupTimeouts, TPGroup

    set_worker_nodes(cluster, 3)
    # each node could hold all four (8 neuron_cores, 1 CPU): only the split keeps them apart
    group = TPGroup(tp_degree=4, backend="neuron", nodes=2, timeouts=GroupTimeouts(placement_s=20),
                    resources=RankResources(bundle={"neuron_cores": 1, "CPU": 0.25}, num_cpus=0.25, threads=1))
    group._place()
    try:
        placed = bundle_nodes(group._pg)
        assert len(placed) == 2 and len(set(placed.values())) == 2, placed  # one bundle per node
        assert all(bundle == {"neuron_cores": 2.0, "CPU": 0.5} for bundle in group._pg.bundle_specs)
    finally:
        remove_placement_group(group._pg)


def test_a_node_without_neuron_devices_is_refused_before_the_rendezvous(cluster, model_and_expected):
    model_dir, _ = model_and_expected
    start = time.monotonic()
    with pytest.raises(NeuronDevicesMissing) as info:
        Launcher(model=model_dir, backend="neuron", instance="trn1.32xlarge", tp=1, compile=False,
                 progress=False).start()
    message = str(info.value)
    assert "declares neuron_cores" in message and "/dev/neuron" in message and "neuron-ls" in message, message
    assert time.monotonic() - start < 60


def test_losing_a_node_mid_request_restarts_the_group_on_other_nodes(cluster, model_and_expected):
    model_dir, expected = model_and_expected
    set_worker_nodes(cluster, 3)  # two for the group, one spare
    launcher = Launcher(model=model_dir, tp=2, nodes=2, max_restarts=2, placement_timeout_s=20, progress=False, **EAGER)
    launcher.start()
    try:
        before = launcher.replica_status()[0]
        lost_node = before["workers"][1]["node_id"]
        answers: dict[int, object] = {}

        def ask(i: int) -> None:
            answers[i] = launcher.generate([PROMPTS[i]], max_new_tokens=LONG, ignore_eos=True)[0]

        callers = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in callers:
            t.start()
        wait_for(lambda: launcher.replica_status()[0]["busy"], 30, "the group taking a request")
        time.sleep(0.1)
        remove_node_of(cluster, lost_node)
        for t in callers:
            t.join(120)
        after = launcher.replica_status()[0]
    finally:
        launcher.shutdown()
    assert [answers[i].token_ids for i in range(len(PROMPTS))] == expected
    assert max(a.attempts for a in answers.values()) == 2
    assert after["state"] == "serving" and after["restarts"] == 1
    assert lost_node not in after["nodes"] and len(after["nodes"]) == 2, after["nodes"]


def test_a_replica_the_cluster_cannot_host_fails_its_requests_and_the_rest_are_served(cluster, model_and_expected):
    model_dir, expected = model_and_expected
    set_worker_nodes(cluster, 2)  # one node per replica, no spare
    launcher = Launcher(model=model_dir, tp=1, replicas=2, cpus_per_rank=1, max_restarts=2,
                        placement_timeout_s=3, progress=False, **EAGER)
    launcher.start()
    try:
        status = launcher.replica_status()
        assert len({s["nodes"][0] for s in status}) == 2
        answers: dict[int, object] = {}

        def ask(i: int) -> None:
            try:
                answers[i] = launcher.generate([PROMPTS[i]], max_new_tokens=LONGEST, ignore_eos=True)[0]
            except Exception as err:  # noqa: BLE001 - the test inspects it
                answers[i] = err

        callers = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in callers:
            t.start()
        wait_for(lambda: all(s["busy"] for s in launcher.replica_status()), 30, "both replicas taking a request")
        time.sleep(0.1)
        remove_node_of(cluster, status[1]["nodes"][0])
        for t in callers:
            t.join(120)
        failed = [a for a in answers.values() if isinstance(a, Exception)]
        served = {i: a for i, a in answers.items() if not isinstance(a, Exception)}
        # the survivor serves on; its fault-free answers are the reference for the interrupted wave
        later = launcher.generate(PROMPTS, max_new_tokens=LONGEST, ignore_eos=True)
        after = launcher.replica_status()
    finally:
        launcher.shutdown()
    assert len(failed) == 1 and len(served) == 1, answers
    message = str(failed[0])
    assert isinstance(failed[0], ReplicaFailed), repr(failed[0])
    assert "replica 1" in message and "cannot host it any more" in message and "'CPU': 1" in message, message
    [(i, answer)] = served.items()
    assert answer.replica == 0 and answer.token_ids == later[i].token_ids
    assert [r.token_ids[:LONG] for r in later] == expected and {r.replica for r in later} == {0}
    assert [s["state"] for s in after] == ["serving", "failed"]
