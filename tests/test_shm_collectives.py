"""Shared-memory collectives (workers/shm) in real spawned process groups, checked against gloo.

- 2 ranks: a + b == b + a exactly, so every result must equal gloo's bit for bit.
- 3 ranks: every rank's result, through shared memory and through gloo, must equal
  ((x0 + x1) + x2) computed here bit for bit (the fixed rank order of every path; gloo's own ring
  all-reduce would start each third of the tensor at a different rank and differ by an ulp or
  two); greedy tokens of a TP 3 model are identical with both paths.
- Buffer reuse: thousands of back-to-back calls of varying sizes with random delays, slot size
  forced small so chunking and both buffers are exercised; the same test run against a deliberately
  single-buffered exchange must catch the race (so the stress test can fail).
- Across nodes (several node groups on this machine): hierarchical results equal the rank-order sum
  and gloo's bit for bit, whichever ranks share a node.
- A peer that never arrives raises naming it; a peer that died is noticed within a second.
- Closing a rank's collectives while one of its threads waits in a step (a shutdown beside the
  serving loop) ends that call with CollectivesClosed and unmaps after it leaves (was a segfault);
  misuse (a 0-d gather, a strided in-place sum) raises a ValueError naming the fix on every path.
- Set-up failure on one rank: every rank falls back to gloo together (auto) or all raise (shm).
- No segment of a test's own groups is left in /dev/shm, during a group's life or after (a dead or
  absent peer, a set-up that failed on one rank), nor by a leader killed while another rank still
  builds its helpers. Only the test's own segments are watched (the paths its ranks opened), so
  these tests run beside others whose groups come and go in /dev/shm meanwhile.
- Local trust: a FIFO among the segments stalls neither the orphan sweep nor set-up, and a group
  still forms beside it; a symlink, FIFO or another user's file at a segment path is refused. The
  helper library is built into a 0700 directory of this user's; a library that is group- or
  world-writable, a symlink or another user's is rebuilt (a planted library that would leave a
  marker file is never loaded), and a directory others could write to is refused naming it.

Each test starts one group of processes and runs several checks in it (starting a process costs
about a second here); those are marked slow. The fast lane runs the same exchange protocol with the
ranks as threads of this process sharing one mapped segment (fixed-order sums, gathers, chunking,
reuse under stress including the single-buffer race, an absent peer's timeout); a real TP 2
Launcher using shared memory between processes is tests/test_launcher_generate.py's Ray smoke test.
"""

from __future__ import annotations

import datetime
import glob
import io
import os
import random
import time
import traceback
from queue import Empty

import pytest
import torch

from workers.net import free_port_for_a_late_bind

SEGMENTS_NAMED: list[str] = []
"""In the test process: every path the ranks of this test's groups opened a segment at (created or
attached, or tried to), as run_ranks and the launcher test collect them; emptied as each test starts."""
_opened_here: list[str] = []
"""In a rank process: the paths its own Segments were opened at (_record_segment_paths)."""


def segment_groups(paths) -> set[str]:
    """The group ids in segment paths (…/corelaunch-<id>-node<i>)."""
    return {os.path.basename(path).rsplit("-node", 1)[0] for path in paths}


def assert_segments_gone(paths) -> None:
    left = sorted(path for path in set(paths) if os.path.lexists(path))
    assert not left, f"shared-memory segments left behind: {left}"


@pytest.fixture(autouse=True)
def no_shm_leaks():
    """Once a test ends, every segment its own groups opened is gone, whatever became of their ranks.
    Only its own: the host's whole /dev/shm holds, beside these tests, the segments of other tests'
    groups (the parallel lane), which come and go as they will."""
    SEGMENTS_NAMED.clear()  # a module-scoped group's (three_ranks) were checked where it ran
    yield
    assert_segments_gone(SEGMENTS_NAMED)


# ---- running a function on N spawned ranks ---------------------------------------------------
def _record_segment_paths() -> None:
    """In a rank process: every Segment opened records its path in _opened_here first (a failed open
    too: a leader's segment that another rank could not attach to is still this group's)."""
    from workers.shm.exchange import Segment

    opened = Segment.__init__

    def recording(self, path, *args, **kwargs):
        _opened_here.append(path)
        opened(self, path, *args, **kwargs)

    Segment.__init__ = recording


def own_segments_present() -> list[str]:
    """In a rank process: the segments its groups opened that still have a name."""
    return sorted(path for path in set(_opened_here) if os.path.lexists(path))


def _entry(rank: int, world_size: int, port: int, queue, fn, args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        _record_segment_paths()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
        # Serialised here: tensors put on a queue as they are would be shared through this process's
        # file descriptors, gone if it exits before the parent reads them.
        payload = io.BytesIO()
        torch.save(fn(rank, world_size, *args), payload)
        queue.put((rank, "ok", payload.getvalue(), _opened_here))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc(), _opened_here))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout_s: float = 90.0, expect: int | None = None) -> dict:
    """{rank: fn(rank, world_size, *args)} from `world_size` spawned ranks sharing a gloo group.
    `expect`: how many ranks report (a rank that exits on purpose reports nothing). The paths the
    reporting ranks opened segments at go to SEGMENTS_NAMED."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port_for_a_late_bind()  # rank 0 binds it once spawned and torch is imported
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, queue, fn, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < (world_size if expect is None else expect):
            try:
                rank, status, payload, opened = queue.get(timeout=max(0.1, deadline - time.monotonic()))
            except Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} did not report "
                                   f"within {timeout_s} s") from None
            SEGMENTS_NAMED.extend(opened)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return results


def inputs(rank: int, shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rank `rank`'s input for call `seed`: values of mixed magnitudes, so rounding order matters."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())
    return x.to(dtype)


def fixed_order_sum(world_size: int, shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    total = inputs(0, shape, seed, dtype) + inputs(1, shape, seed, dtype)
    for r in range(2, world_size):
        total = total + inputs(r, shape, seed, dtype)
    return total


def _build(rank, world_size, node_groups="one", timeout_s=60.0, mode="shm", slot_bytes=None):
    from workers.shm.group import DEFAULT_SLOT_BYTES, build_cpu_collectives

    groups = [list(range(world_size))] if node_groups == "one" else node_groups
    return build_cpu_collectives(rank, world_size, groups, timeout_s, mode, slot_bytes or DEFAULT_SLOT_BYTES)


SHAPES = [(1, 576), (1, 1024), (4, 1024), (3, 5, 7), (1,), (2, 40000)]


# ---- 2 ranks: bit-identical to gloo -------------------------------------------------------------
def _two_ranks(rank, world_size):
    import torch.distributed as dist

    from workers.collectives import TorchDistributedCollectives
    from workers.shm.collectives import ShmCollectives

    gloo = TorchDistributedCollectives()
    shm = _build(rank, world_size)
    small = _build(rank, world_size, slot_bytes=4096)  # 1024 floats per step: big tensors go in chunks
    out = {"types": [type(shm).__name__, type(_build(rank, world_size, node_groups=None)).__name__,
                     type(_build(rank, world_size, mode="gloo")).__name__,
                     type(_build(rank, world_size, node_groups=[[0], [1]], mode="auto")).__name__],
           "mismatch": []}
    dist.barrier()  # the leader unlinks right after the last set-up step: let it
    out["segments_while_alive"] = own_segments_present()
    assert isinstance(shm, ShmCollectives)
    for seed, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            x = inputs(rank, shape, seed, dtype)
            want = gloo.all_reduce_sum_(x.clone())
            for name, coll in (("shm", shm), ("shm_chunked", small)):
                got = x.clone()
                assert coll.all_reduce_sum_(got) is got  # in place
                if not torch.equal(got, want):
                    out["mismatch"].append((name, shape, str(dtype)))
            if len(shape) > 1:
                for name, coll in (("shm", shm), ("shm_chunked", small)):
                    if not torch.equal(coll.all_gather_last_dim(x), gloo.all_gather_last_dim(x)):
                        out["mismatch"].append((name + "_gather", shape, str(dtype)))
            for name, coll in (("gloo", gloo), ("shm", shm), ("shm_chunked", small)):
                out["mismatch"] += [(name, *bad) for bad in rows_check(rank, world_size, coll, seed, shape, dtype)]
    out["misuse"] = _misuse_errors(gloo) + _misuse_errors(shm)
    dist.barrier()
    for c in (shm, small):
        c.close()
    return out


def _misuse_errors(coll) -> list:
    """What a 0-d gather and a strided in-place sum raise (ValueErrors naming the fix, on every
    path): the ones that do not."""
    wrong = []
    for call, x, says in ((coll.all_gather_last_dim, torch.tensor(1.0), "at least one"),
                          (coll.all_reduce_sum_, torch.ones(2, 4).t(), "pass tensor.contiguous()")):
        try:
            call(x)
            wrong.append((type(coll).__name__, call.__name__, "returned"))
        except ValueError as e:
            if says not in str(e):
                wrong.append((type(coll).__name__, call.__name__, str(e)))
        except Exception as e:  # noqa: BLE001 - the wrong kind of error is the finding
            wrong.append((type(coll).__name__, call.__name__, f"{type(e).__name__}: {e}"))
    return wrong


@pytest.mark.slow
def test_two_ranks_bitwise_equal_to_gloo_and_selection():
    results = run_ranks(2, _two_ranks)
    # one node explicitly, by hostname, and chunked; none for gloo or ranks on nodes of their own
    assert len(segment_groups(SEGMENTS_NAMED)) == 3  # what no_shm_leaks then finds gone
    for rank, out in results.items():
        assert out["mismatch"] == [], f"rank {rank}: results differ from gloo: {out['mismatch']}"
        assert out["misuse"] == [], f"rank {rank}: {out['misuse']}"
        # explicit one node, hostnames (node_groups None), forced gloo, nobody co-located
        assert out["types"] == ["ShmCollectives", "ShmCollectives", "TorchDistributedCollectives",
                                "TorchDistributedCollectives"]
        # the leader unlinks the name as soon as every rank has attached
        assert out["segments_while_alive"] == []


# ---- 3 ranks (more ranks than cores here): fixed order, agreement, reuse under stress -------------
class _SlowReads:
    """Mixed into an exchange: random delays after each wait, i.e. while peers may run ahead."""

    def _wait(self, target, wanted, sig=0):
        super()._wait(target, wanted, sig)
        if random.random() < 0.2:
            time.sleep(random.random() * 2e-4)


def _stress(rank, world_size, coll, calls: int, seed0: int) -> list:
    """Back-to-back calls of varying sizes; returns the calls whose result was wrong on this rank."""
    rng = random.Random(seed0)  # same sequence of shapes on every rank
    local = random.Random(seed0 * 31 + rank)  # different delays on each rank
    bad = []
    for i in range(calls):
        shape = rng.choice([(1, 64), (1, 1024), (3, 1000), (1, 2500), (2, 17)])
        seed = seed0 * 100000 + i
        if local.random() < 0.1:
            time.sleep(local.random() * 3e-4)
        if rng.random() < 0.2:
            got = coll.all_gather_last_dim(inputs(rank, shape, seed))
            want = torch.cat([inputs(r, shape, seed) for r in range(world_size)], dim=-1)
        else:
            got = coll.all_reduce_sum_(inputs(rank, shape, seed))
            want = fixed_order_sum(world_size, shape, seed)
        if not torch.equal(got, want):
            bad.append(i)
    return bad


def _three_ranks(rank, world_size, calls, case):
    import torch.distributed as dist

    from tests.tp_harness import run_case, token_ids
    from workers.collectives import TorchDistributedCollectives
    from workers.shm.exchange import NodeExchange

    gloo = TorchDistributedCollectives()
    shm = _build(rank, world_size)
    out = {"results": {}, "fixed_order_mismatch": [], "gloo_mismatch": []}
    # A TP 3 model's greedy tokens through each path.
    out["tokens"] = {name: [token_ids(outputs) for outputs in run_case(case, rank, world_size, coll)]
                     for name, coll in (("gloo", gloo), ("shm", shm))}
    for seed, shape in enumerate(SHAPES):
        x = inputs(rank, shape, seed)
        got = shm.all_reduce_sum_(x.clone())
        out["results"][str(shape)] = got
        if not torch.equal(got, fixed_order_sum(world_size, shape, seed)):
            out["fixed_order_mismatch"].append(shape)
        if not torch.equal(gloo.all_reduce_sum_(x.clone()), got):
            out["gloo_mismatch"].append(shape)
        for name, coll in (("gloo", gloo), ("shm", shm)):  # gloo at 3 ranks: all-to-all, then the ordered sum
            out["fixed_order_mismatch"] += [(name, *bad) for bad in rows_check(rank, world_size, coll, seed, shape)]

    # Stress, with slow readers and a one-page slot (chunking, both buffers, every step reused).
    small = _build(rank, world_size, slot_bytes=4096)
    small._x.__class__ = type("SlowReadsExchange", (_SlowReads, NodeExchange), {})
    start = time.perf_counter()
    out["stress_bad"] = _stress(rank, world_size, small, calls, seed0=1)
    out["stress_s"] = time.perf_counter() - start

    # The same stress against a broken protocol: one buffer instead of two must be caught.
    broken = _build(rank, world_size, slot_bytes=4096)

    class SingleBuffer(_SlowReads, NodeExchange):
        def _slots(self, buffer, dtype, numel):
            return super()._slots(0, dtype, numel)

    broken._x.__class__ = SingleBuffer
    out["broken_bad"] = _stress(rank, world_size, broken, calls, seed0=2)
    dist.barrier()
    for c in (shm, small, broken):
        c.close()
    return out


NEW_TOKENS = 12


@pytest.fixture(scope="module")
def three_ranks() -> dict:
    """{rank: _three_ranks output} of one 3-rank group (TP 3: more ranks than this machine's cores)."""
    from shardlib.model_config import ModelConfig
    from tests.model_factory import build_random_model
    from tests.tp_harness import Case, Request, hf_state_dict

    model = build_random_model(hidden_size=96, num_heads=6, num_kv_heads=3, vocab_size=150,
                               intermediate_size=120, num_layers=3, seed=3)
    case = Case("tp3", ModelConfig.from_dict(model.config.to_dict()), hf_state_dict(model),
                [Request([[5, 9, 33, 17, 80, 3], [7, 100, 21]], max_new_tokens=NEW_TOKENS)])
    SEGMENTS_NAMED.clear()
    results = run_ranks(3, _three_ranks, 600, case)
    # checked here, as the ranks have exited: the tests that take this fixture start after it
    assert len(segment_groups(SEGMENTS_NAMED)) == 3  # shm, small and broken
    assert_segments_gone(SEGMENTS_NAMED)
    return results


@pytest.mark.slow
def test_three_ranks_fixed_order_agreement_and_race_free_reuse(three_ranks):
    results = three_ranks
    for rank, out in results.items():
        assert out["fixed_order_mismatch"] == [], f"rank {rank}: not ((x0 + x1) + x2) for {out['fixed_order_mismatch']}"
        assert out["gloo_mismatch"] == [], f"rank {rank}: shared memory != gloo for {out['gloo_mismatch']}"
        for shape, value in out["results"].items():
            assert torch.equal(value, results[0]["results"][shape]), f"ranks 0 and {rank} differ for {shape}"
        assert out["stress_bad"] == [], f"rank {rank}: corrupted results at calls {out['stress_bad'][:10]}"
    assert sum(len(out["broken_bad"]) for out in results.values()) > 0, (
        "the stress test did not catch a single-buffered exchange: it cannot detect reuse races")


# ---- timeouts and dead peers ---------------------------------------------------------------------
def _absent_peers(rank, world_size):
    import torch.distributed as dist

    from workers.shm.exchange import CollectiveTimeout

    out = {}
    late = _build(rank, world_size, timeout_s=1.0)
    if rank == 0:
        start = time.perf_counter()
        try:
            late.all_reduce_sum_(torch.ones(8))
        except CollectiveTimeout as err:
            out["timeout"] = (str(err), time.perf_counter() - start)
        try:
            late.all_reduce_sum_(torch.ones(8))  # the group is now unusable, and says so at once
        except CollectiveTimeout as err:
            out["after"] = str(err)
    dist.barrier()  # rank 1 never joined the all-reduce above
    dead = _build(rank, world_size, timeout_s=60.0)
    dist.barrier()
    if rank == 1:
        os._exit(0)  # dies without a word, as a killed process would
    start = time.perf_counter()
    try:
        dead.all_reduce_sum_(torch.ones(8))
    except Exception as err:  # noqa: BLE001 - the test checks the type below
        out["dead"] = (type(err).__name__, str(err), time.perf_counter() - start)
    return out


@pytest.mark.slow
def test_absent_peer_times_out_and_dead_peer_is_noticed():
    out = run_ranks(2, _absent_peers, expect=1)[0]
    assert len(segment_groups(SEGMENTS_NAMED)) == 2  # late and dead: no_shm_leaks then finds them gone
    message, waited = out["timeout"]
    assert "rank 1" in message and "waited 1 s" in message and "CORELAUNCH_COLLECTIVES=gloo" in message
    assert 0.9 < waited < 10
    assert "rank 1" in out["after"]
    kind, message, waited = out["dead"]
    assert kind == "CollectiveTimeout" and "rank 1" in message and "exited" in message
    assert waited < 10  # checked every 0.2 s; the 60 s timeout never comes into it


# ---- several nodes (node groups on this machine) and set-up failures -------------------------------
def _multi_node(rank, world_size):
    import torch.distributed as dist

    from workers.collectives import TorchDistributedCollectives
    import workers.shm.group as group

    gloo = TorchDistributedCollectives()
    out = {"types": {}, "values": {}, "exact": {}}
    for name, groups in {"2x2": [[0, 1], [2, 3]], "interleaved": [[0, 2], [1, 3]],
                         "1+3": [[0], [1, 2, 3]]}.items():
        coll = _build(rank, world_size, node_groups=groups, slot_bytes=4096)
        out["types"][name] = type(coll).__name__
        if coll._leaders is not None:  # the leaders' group waits as long as the default group (60 s), not torch's 30 min
            backend = coll._leaders._get_backend(torch.device("cpu"))
            out.setdefault("leader_timeout_s", {})[name] = backend.options._timeout.total_seconds()
        for seed, shape in enumerate([(1, 1024), (2, 3000), (3, 5, 7)]):
            x = inputs(rank, shape, seed)
            got = coll.all_reduce_sum_(x.clone())
            out["values"][(name, shape)] = got
            out["exact"][(name, shape)] = torch.equal(got, fixed_order_sum(world_size, shape, seed))
            out["exact"][(name, shape, "gloo")] = torch.equal(got, gloo.all_reduce_sum_(x.clone()))
            gathered = coll.all_gather_last_dim(x)
            out["exact"][(name, shape, "gather")] = torch.equal(gathered, gloo.all_gather_last_dim(x))
            out["exact"][(name, shape, "rows")] = rows_check(rank, world_size, coll, seed, shape) == []
        dist.barrier()
        coll.close()
    # One rank cannot attach (as if its /dev/shm were another machine's): all fall back together.
    if rank == 1:
        group.SHM_DIR = "/nonexistent-corelaunch-test"
    out["fallback_auto"] = type(_build(rank, world_size, mode="auto")).__name__
    try:
        _build(rank, world_size, mode="shm")
        out["fallback_shm"] = "no error"
    except RuntimeError as err:
        out["fallback_shm"] = str(err)
    dist.barrier()
    return out


@pytest.mark.slow
def test_hierarchical_across_node_groups_and_collective_fallback():
    results = run_ranks(4, _multi_node)
    # three groups formed and two failed to (one rank could not attach): no_shm_leaks then finds
    # every node's segment of all five gone
    assert len(segment_groups(SEGMENTS_NAMED)) == 5
    for rank, out in results.items():
        assert out["types"] == {"2x2": "HierarchicalCollectives", "interleaved": "HierarchicalCollectives",
                                "1+3": "HierarchicalCollectives"}
        assert all(out["exact"].values()), [k for k, ok in out["exact"].items() if not ok]
        for key, value in out["values"].items():
            assert torch.equal(value, results[0]["values"][key]), f"ranks 0 and {rank} differ for {key}"
        assert out["fallback_auto"] == "TorchDistributedCollectives"
        assert "rank 1: FileNotFoundError" in out["fallback_shm"]
        leads = {name for name, groups in (("2x2", [[0, 1], [2, 3]]), ("interleaved", [[0, 2], [1, 3]]),
                                           ("1+3", [[0], [1, 2, 3]])) if rank in (g[0] for g in groups)}
        assert out.get("leader_timeout_s", {}) == {name: 60.0 for name in leads}, out.get("leader_timeout_s")


@pytest.mark.slow
def test_tp3_greedy_tokens_identical_with_gloo_and_shared_memory(three_ranks):
    for rank, out in three_ranks.items():
        tokens = out["tokens"]
        assert tokens["shm"] == tokens["gloo"], f"rank {rank}: shm {tokens['shm']} != gloo {tokens['gloo']}"
        assert tokens["shm"] == three_ranks[0]["tokens"]["shm"]
    assert all(len(t) == NEW_TOKENS for t in three_ranks[0]["tokens"]["shm"][0])


# ---- through the launcher: the CPU backend picks shared memory by default ----------------------------
@pytest.mark.slow
def test_launcher_tp2_uses_shared_memory_and_leaves_nothing(tmp_path, ray_session):
    import ray

    from launcher.api import Launcher
    from tests.model_factory import save_random_model

    save_random_model(tmp_path, num_heads=4, num_kv_heads=2)
    with Launcher(model=str(tmp_path), tp=2, progress=False) as llm:
        kinds = ray.get([a.__ray_call__.remote(lambda self: type(self._collectives).__name__)
                         for a in llm._group.actors])
        assert kinds == ["ShmCollectives", "ShmCollectives"]
        # the segment's path as each rank opened it (the group's id is drawn by its rank 0)
        paths = ray.get([a.__ray_call__.remote(lambda self: self._collectives._x.segment.path)
                         for a in llm._group.actors])
        SEGMENTS_NAMED.extend(paths)  # no_shm_leaks: gone after the launch too
        [out] = llm.generate([[5, 17, 42, 9]], max_new_tokens=4, ignore_eos=True)
        assert_segments_gone(paths)  # its name went as soon as both ranks had attached
    assert len(set(paths)) == 1 and os.path.dirname(paths[0]) == "/dev/shm", paths  # one node's, in /dev/shm
    assert len(out.token_ids) == 4


# ---- the same exchange between threads of this process (fast) -------------------------------------
def thread_ranks(tmp_path, size: int, slot_bytes: int = 4096, timeout_s: float = 30.0, exchange_cls=None) -> list:
    """`size` ShmCollectives over one segment in this process, attached as group.py's _build does
    (the leader creates and unlinks the file; every rank maps it), each rank to be run on a thread."""
    from workers.shm.collectives import ShmCollectives
    from workers.shm.exchange import TOKEN_PREFIX, NodeExchange, Segment, SegmentLayout
    from workers.shm.group import SPIN_S, YIELD_S
    from workers.shm.native import native

    layout = SegmentLayout(local_size=size, slot_bytes=slot_bytes)
    token = TOKEN_PREFIX + b"threads"
    path = str(tmp_path / f"corelaunch-threads-{size}-{slot_bytes}")
    segments = [Segment(path, layout, create=True, token=token)]
    segments += [Segment(path, layout, create=False, token=token) for _ in range(1, size)]
    segments[0].unlink()
    exchanges = [(exchange_cls or NodeExchange)(seg, rank, list(range(size)), native(), timeout_s, SPIN_S, YIELD_S)
                 for rank, seg in enumerate(segments)]
    for x in exchanges:
        x.read_peer_pids()
    return [ShmCollectives(x) for x in exchanges]


def on_threads(fn, colls: list, *args, timeout_s: float = 120.0) -> dict:
    """{rank: fn(rank, world_size, coll, *args)}, every rank on its own thread at once."""
    import threading

    results, errors = {}, {}

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, len(colls), colls[rank], *args)
        except BaseException:  # noqa: BLE001 - reported below
            errors[rank] = traceback.format_exc()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(colls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), f"ranks still running after {timeout_s} s"
    assert not errors, errors
    return results


def rows_check(rank, world_size, coll, seed, shape, dtype=torch.float32) -> list:
    """Sequence parallelism's collectives against the fixed-order sum and concatenation: the failures."""
    stacked = (world_size * shape[0], *shape[1:])  # every rank's block of rows
    n = shape[0]
    bad = []
    got = coll.reduce_scatter_rows(inputs(rank, stacked, seed, dtype))
    if not torch.equal(got, fixed_order_sum(world_size, stacked, seed, dtype)[rank * n: (rank + 1) * n]):
        bad.append(("reduce_scatter_rows", shape, str(dtype)))
    want = torch.cat([inputs(r, shape, seed, dtype) for r in range(world_size)])
    if not torch.equal(coll.all_gather_rows(inputs(rank, shape, seed, dtype)), want):
        bad.append(("all_gather_rows", shape, str(dtype)))
    return bad


def _exact_results(rank, world_size, coll):
    bad = []
    for seed, shape in enumerate(SHAPES):
        bad += rows_check(rank, world_size, coll, seed, shape)
        for dtype in (torch.float32, torch.bfloat16):
            x = inputs(rank, shape, seed, dtype)
            got = x.clone()
            assert coll.all_reduce_sum_(got) is got  # in place
            if not torch.equal(got, fixed_order_sum(world_size, shape, seed, dtype)):
                bad.append(("reduce", shape, str(dtype)))
            if len(shape) > 1:
                want = torch.cat([inputs(r, shape, seed, dtype) for r in range(world_size)], dim=-1)
                if not torch.equal(coll.all_gather_last_dim(x), want):
                    bad.append(("gather", shape, str(dtype)))
    return bad


@pytest.mark.parametrize("size", [2, 3])
def test_threads_sharing_a_segment_sum_in_rank_order_and_gather_in_chunks(tmp_path, size):
    colls = thread_ranks(tmp_path, size)  # one-page slots: (2, 40000) goes in many chunks
    try:
        results = on_threads(_exact_results, colls)
    finally:
        for c in colls:
            c.close()
    assert results == {rank: [] for rank in range(size)}, results


def _stress_on_thread(rank, world_size, coll, calls, seed0):
    return _stress(rank, world_size, coll, calls, seed0)


def test_threads_reuse_buffers_race_free_and_the_stress_catches_a_single_buffer(tmp_path):
    from workers.shm.exchange import NodeExchange

    class SingleBuffer(_SlowReads, NodeExchange):
        def _slots(self, buffer, dtype, numel):
            return super()._slots(0, dtype, numel)

    good = thread_ranks(tmp_path, 3, exchange_cls=type("SlowReadsExchange", (_SlowReads, NodeExchange), {}))
    broken = thread_ranks(tmp_path, 3, exchange_cls=SingleBuffer)
    try:
        good_bad = on_threads(_stress_on_thread, good, 300, 1)
        broken_bad = on_threads(_stress_on_thread, broken, 300, 2)
    finally:
        for c in good + broken:
            c.close()
    assert good_bad == {0: [], 1: [], 2: []}, {r: b[:10] for r, b in good_bad.items()}
    assert sum(len(b) for b in broken_bad.values()) > 0, (
        "the stress test did not catch a single-buffered exchange: it cannot detect reuse races")


def test_a_peer_that_never_arrives_times_out_naming_it(tmp_path):
    from workers.shm.exchange import CollectiveTimeout

    first, second = thread_ranks(tmp_path, 2, timeout_s=1.0)
    try:
        start = time.perf_counter()
        with pytest.raises(CollectiveTimeout) as info:
            first.all_reduce_sum_(torch.ones(8))
        waited = time.perf_counter() - start
        message = str(info.value)
        assert "rank 1" in message and "waited 1 s" in message and "CORELAUNCH_COLLECTIVES=gloo" in message
        assert 0.9 < waited < 10
        with pytest.raises(CollectiveTimeout, match="rank 1"):  # the group is unusable now, and says so at once
            first.all_reduce_sum_(torch.ones(8))
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("step", ["all_reduce", "all_reduce_dtype", "broadcast", "gather", "whole_slots",
                                  "reduce_beside_gather"])
def test_ranks_whose_calls_differ_in_size_or_dtype_fail_the_step_naming_both(tmp_path, step):
    """Rank 0 moves 4 float32 elements, rank 1 six (or bf16): the step fails on both, naming what
    each sent, where the longer rank summed stale slot bytes into its tail and nobody noticed.
    whole_slots: rank 0's call is two slots long, rank 1's one slot, then another: chunk for chunk
    they matched, and rank 1's second call was summed into rank 0's second half, silently."""
    from workers.shm.exchange import CollectiveTimeout

    colls = thread_ranks(tmp_path, 2, timeout_s=10.0)  # 4096-byte slots: 1024 float32 elements

    def call(rank, world, coll):
        other = step == "all_reduce_dtype"
        x = torch.ones(4 if rank == 0 or other else 6, dtype=torch.bfloat16 if rank == 1 and other else torch.float32)
        try:
            if step == "broadcast":
                coll._x.broadcast_(x, 0)  # the exchange's own (the plan's broadcast goes through gloo)
            elif step == "gather":
                coll.all_gather_rows(x)
            elif step == "whole_slots":
                for part in ([torch.ones(2048)] if rank == 0 else [torch.ones(1024), torch.ones(1024)]):
                    coll.all_reduce_sum_(part)
            elif step == "reduce_beside_gather":
                coll.all_reduce_sum_(torch.ones(4)) if rank == 0 else coll.all_gather_rows(torch.ones(4))
            else:
                coll.all_reduce_sum_(x)
        except CollectiveTimeout as err:
            return str(err)
        return None

    try:
        messages = on_threads(call, colls, timeout_s=60)
    finally:
        for coll in colls:
            coll.close()
    if step == "broadcast":  # the root waits for nobody; the receiver names what the root sent
        assert ("moves a broadcast of 6 elements of torch.float32 here but a broadcast of 4 elements of "
                "torch.float32 from rank 0") in messages[1]
        return
    theirs = {"all_reduce_dtype": "a reduce of 4 elements of torch.bfloat16",
              "whole_slots": "a reduce of 1024 elements of torch.float32",
              "reduce_beside_gather": "a gather of 4 elements of torch.float32"}.get(
        step, f"a {'gather' if step == 'gather' else 'reduce'} of 6 elements of torch.float32")
    assert f"here but {theirs} from rank 1" in messages[0], messages
    assert "the ranks called different collectives" in messages[1], messages


# ---- closing while a call is in flight -------------------------------------------------------------
# Run in a fresh interpreter: unmapping the segment under a waiting thread was a segfault, which
# must fail one test (exit -11), not kill the pytest process. Prints one JSON line of findings.
_CLOSE_IN_FLIGHT = r"""
import json, os, pathlib, sys, threading, time
import torch
from tests.test_shm_collectives import thread_ranks
from workers.shm.exchange import NodeExchange

scenario, tmp = sys.argv[1], pathlib.Path(sys.argv[2])
found = {}


def attempt(coll, x):
    try:
        coll.all_reduce_sum_(x)
        return f"returned {x.tolist()}"
    except BaseException as e:  # noqa: BLE001 - reported
        return f"{type(e).__name__}: {e}"


released = threading.Event()  # set once close() has returned


class Signalled(NodeExchange):
    # `inside`: set once this rank's call is where the scenario closes under it, so the main thread
    # closes only then, however long a loaded machine takes to start the call's thread.
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inside = threading.Event()


class InWait(Signalled):
    # peer_wait, reuse_wait: the call is in its wait for a peer that never comes.
    def _wait(self, *args, **kwargs):
        self.inside.set()
        super()._wait(*args, **kwargs)


class HeldAfterWait(Signalled):
    # slow_reader: the call is past the wait (reading the slots next) and held there until close()
    # has returned: a fixed hold could end first on a loaded machine. A close() that waited the
    # calls out would wait out the whole 30 s.
    def _wait(self, *args, **kwargs):
        super()._wait(*args, **kwargs)
        self.inside.set()
        released.wait(30)


if scenario == "slow_reader":
    first, second = thread_ranks(tmp, 2, timeout_s=60.0, exchange_cls=HeldAfterWait)
    results = {}
    threads = [threading.Thread(target=lambda r=r, c=c: results.__setitem__(r, attempt(c, torch.full((4,), 1.0 + r))))
               for r, c in enumerate((first, second))]
else:
    first, second = thread_ranks(tmp, 2, timeout_s=60.0, exchange_cls=InWait)
    if scenario == "reuse_wait":  # rank 1 never reads this: the next step waits in _post to reuse the buffer
        first._x.broadcast_(torch.ones(8), root=0)
    results = {}
    threads = [threading.Thread(target=lambda: results.__setitem__(0, attempt(first, torch.ones(8))))]
for t in threads:
    t.start()
for rank, coll in enumerate((first, second)[:len(threads)]):
    if not coll._x.inside.wait(30):  # exits now: a waiting thread would hold the interpreter 60 s
        print(f"{scenario}: rank {rank}'s call never reached the exchange's wait in 30 s", file=sys.stderr, flush=True)
        os._exit(1)
start = time.monotonic()
if scenario == "slow_reader":
    first._x.close(wait_s=0.1)
else:
    first.close()  # as RankWorker.shutdown does
found["close_s"] = time.monotonic() - start
found["mapped_after_close"] = not first._x.segment._map.closed
released.set()
for t in threads:
    t.join(10)
found["ended_s"] = time.monotonic() - start
found["still_waiting"] = any(t.is_alive() for t in threads)
found["results"] = results
found["mapped_at_end"] = not first._x.segment._map.closed
found["later"] = attempt(first, torch.ones(8))
first.close()  # again: nothing happens
second.close()
print(json.dumps(found), flush=True)
"""


def _close_in_flight(tmp_path, scenario: str) -> dict:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _CLOSE_IN_FLIGHT, scenario, str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (f"closing with a call in flight ({scenario}) ended the process with "
                                  f"{done.returncode} (-11: a segfault):\n{done.stdout}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario", ["peer_wait", "reuse_wait"])
def test_closing_under_a_thread_waiting_for_a_peer_ends_its_call_with_a_clear_error(tmp_path, scenario):
    """peer_wait: the thread waits for rank 1's data in a reduce; reuse_wait: it waits in _post for
    rank 1 to finish reading a broadcast before reusing the buffer. The peer never comes; another
    thread closes (RankWorker.shutdown beside a serving loop). Unmapping under the waiter was a
    segfault; now the waiter raises on its next liveness check and the segment is unmapped after."""
    found = _close_in_flight(tmp_path, scenario)
    assert not found["still_waiting"] and found["ended_s"] < 3, found
    assert found["results"]["0"].startswith("CollectivesClosed: ") and "was waiting for a peer when" in found["results"]["0"], found
    assert found["close_s"] < 3 and not found["mapped_after_close"], found  # the waiter left within close()'s wait
    assert found["later"].startswith("CollectivesClosed: ") and "was called after" in found["later"], found


def test_a_call_still_reading_when_close_gives_up_waiting_unmaps_on_its_way_out(tmp_path):
    """Both ranks are inside a reduce (past the wait, about to read the slots) when rank 0 closes
    with a 0.1 s wait: close() returns with the segment still mapped, the call completes with the
    right sum, and the segment goes when it leaves."""
    found = _close_in_flight(tmp_path, "slow_reader")
    # the calls are held until close() returns: one that waited them out took 30 s
    assert found["close_s"] < 5 and found["mapped_after_close"], found
    assert found["results"] == {"0": "returned [3.0, 3.0, 3.0, 3.0]", "1": "returned [3.0, 3.0, 3.0, 3.0]"}, found
    assert not found["mapped_at_end"], found
    assert found["later"].startswith("CollectivesClosed: "), found


def test_close_with_nothing_in_flight_unmaps_at_once_and_later_calls_say_closed(tmp_path):
    from workers.shm.exchange import CollectivesClosed

    first, second = thread_ranks(tmp_path, 2)
    start = time.perf_counter()
    first.close()
    assert time.perf_counter() - start < 0.5 and first._x.segment._map.closed
    first.close()  # idempotent
    with pytest.raises(CollectivesClosed, match="rank 0 was called after this rank's collectives were closed"):
        first.all_reduce_sum_(torch.ones(8))
    with pytest.raises(CollectivesClosed):
        first.all_gather_last_dim(torch.ones(2, 3))
    second.close()


def test_misuse_raises_value_errors_naming_the_fix(tmp_path):
    """Checked before any step, so one rank alone raises (its peer is never waited for); if-checks
    rather than asserts, which python -O strips."""
    first, second = thread_ranks(tmp_path, 2, timeout_s=5.0)
    try:
        with pytest.raises(ValueError, match=r"at least one.*0-d tensor: pass tensor.reshape\(1\)"):
            first.all_gather_last_dim(torch.tensor(1.0))
        with pytest.raises(ValueError, match=r"contiguous tensor, got shape \(4, 2\).*pass tensor.contiguous\(\)"):
            first.all_reduce_sum_(torch.ones(2, 4).t())
    finally:
        first.close()
        second.close()


# ---- orphans: a leader killed during set-up ---------------------------------------------------------
def make_orphan(segment) -> None:
    """Make `segment` what a killed creator leaves: its lock released (the process is gone) and a
    recorded pid that no longer runs."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    at = segment.layout.counter_offset(0) + 8
    segment.bytes[at: at + 4] = torch.tensor([gone.pid], dtype=torch.int32).view(torch.uint8)
    segment._release()


def test_orphaned_segment_of_a_dead_creator_is_removed(tmp_path):
    from workers.shm.exchange import TOKEN_PREFIX, Segment, SegmentLayout, remove_orphans

    layout = SegmentLayout(local_size=2, slot_bytes=4096)
    live = Segment(str(tmp_path / "corelaunch-live-node0"), layout, create=True, token=TOKEN_PREFIX + b"a")
    orphan = Segment(str(tmp_path / "corelaunch-orphan-node0"), layout, create=True, token=TOKEN_PREFIX + b"b")
    make_orphan(orphan)
    (tmp_path / "corelaunch-not-a-segment").write_bytes(b"x" * 512)
    assert remove_orphans(str(tmp_path)) == [str(tmp_path / "corelaunch-orphan-node0")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corelaunch-live-node0", "corelaunch-not-a-segment"]
    for seg in (live, orphan):
        seg.close()
    live.unlink()


def test_a_segment_whose_creator_died_before_writing_its_token_is_removed_once_stale(tmp_path):
    """A review: a leader killed between creating its segment (full size, or still empty) and writing
    its token left it in /dev/shm until reboot: the sweep skipped every file without a token. Now a
    segment's name without one for SET_UP_GRACE_S, held by no process, is removed; a fresh one (being
    set up), a held one and a name of no segment's are not."""
    import fcntl

    from workers.shm.exchange import SET_UP_GRACE_S, remove_orphans

    stale = time.time() - SET_UP_GRACE_S - 5
    for name, size in (("corelaunch-0a1b-node0", 4 << 20), ("corelaunch-0a1c-node1", 0), ("corelaunch-0a1d-node0", 4096),
                       ("corelaunch-0a1e-node0", 4096), ("corelaunch-not-a-segment", 4096)):
        (tmp_path / name).write_bytes(bytes(size))
        os.chmod(tmp_path / name, 0o600)  # as a creator makes it
        if name != "corelaunch-0a1d-node0":  # the fresh one: being set up
            os.utime(tmp_path / name, (stale, stale))
    holder = os.open(tmp_path / "corelaunch-0a1e-node0", os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_SH)  # its creator is alive, setting it up
        removed = sorted(os.path.basename(p) for p in remove_orphans(str(tmp_path)))
    finally:
        os.close(holder)
    assert removed == ["corelaunch-0a1b-node0", "corelaunch-0a1c-node1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corelaunch-0a1d-node0", "corelaunch-0a1e-node0",
                                                          "corelaunch-not-a-segment"]


def test_the_sweep_goes_by_the_creators_lock_not_its_pid(tmp_path):
    """From another pid namespace sharing /dev/shm a live creator's pid does not run (its segment
    was removed during its set-up); a dead creator's pid may run again, reused (never removed)."""
    import subprocess

    from workers.shm.exchange import TOKEN_PREFIX, Segment, SegmentLayout, remove_orphans

    layout = SegmentLayout(local_size=2, slot_bytes=4096)
    held = Segment(str(tmp_path / "corelaunch-held-node0"), layout, create=True, token=TOKEN_PREFIX + b"a")
    gone = subprocess.Popen(["true"])
    gone.wait()
    at = layout.counter_offset(0) + 8
    held.bytes[at: at + 4] = torch.tensor([gone.pid], dtype=torch.int32).view(torch.uint8)  # "not visible"
    reused = Segment(str(tmp_path / "corelaunch-reused-node0"), layout, create=True, token=TOKEN_PREFIX + b"b")
    reused._release()  # its creator died; the pid recorded (this process's) runs
    assert remove_orphans(str(tmp_path)) == [str(tmp_path / "corelaunch-reused-node0")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corelaunch-held-node0"]
    for seg in (held, reused):
        seg.close()
    held.unlink()


LEADER_SET_UP_S = 2.0
"""How long rank 1 gives the leader, its helpers cached, to create its segment (milliseconds when it
did so before every rank had its helpers) before killing it anyway."""


def _kill_the_leader_while_building_the_helpers(rank, world_size, shm_dir):
    """Rank 1 builds its helpers slowly (a cold cache, a busy host); meanwhile it SIGKILLs the leader,
    as soon as the leader's segment appears or LEADER_SET_UP_S on. What rank 1's set-up ended with."""
    import signal

    import torch.distributed as dist

    import workers.shm.group as group
    from workers.shm import native as native_module

    group.SHM_DIR = shm_dir  # both ranks: never the host's /dev/shm
    pids: list = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        load = native_module.native

        def slow_build():
            deadline = time.monotonic() + LEADER_SET_UP_S
            while not glob.glob(os.path.join(shm_dir, "corelaunch-*")) and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(pids[0], signal.SIGKILL)  # the launcher giving up on a stuck start, the OOM killer
            return load()

        native_module.native = slow_build
    try:
        _build(rank, world_size, timeout_s=20.0)
    except Exception as err:  # noqa: BLE001 - the outcome is the finding
        return f"{type(err).__name__}: {err}"
    return "formed"


@pytest.mark.slow
def test_a_leader_killed_while_a_rank_builds_its_helpers_leaves_no_segment(tmp_path):
    """A review: the leader created its segment before the others had their helpers, then waited
    for them; killed in that wait (seconds: a C build on a cold cache), it left the segment named
    until another group formed on the node. Now every rank has its helpers before any segment exists."""
    from workers.shm.native import native

    native()  # cached: the leader gets to its segment at once, where it still makes one first
    results = run_ranks(2, _kill_the_leader_while_building_the_helpers, str(tmp_path), timeout_s=60, expect=1)
    assert results[1] != "formed", results
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "the killed leader's segment was left behind"


# ---- local trust: what other users of this host can place in /dev/shm or the cache -----------------
# FIFOs and symlinks are planted in a test directory standing in for /dev/shm (group.SHM_DIR), never
# in /dev/shm itself: groups of other test runs on this host would see them.
def _sweep_on_thread(shm_dir, fifos=()) -> tuple[list, float]:
    """remove_orphans(shm_dir) on a thread: (removed, seconds); fails instead of hanging if it blocks
    (the FIFOs are then opened for writing, which releases a reader stuck on one)."""
    import threading

    from workers.shm.exchange import remove_orphans

    out = {}
    start = time.perf_counter()
    thread = threading.Thread(target=lambda: out.setdefault("removed", remove_orphans(str(shm_dir))),
                              daemon=True)
    thread.start()
    thread.join(5.0)
    if thread.is_alive():
        for fifo in fifos:
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        thread.join(5.0)
        pytest.fail(f"remove_orphans({shm_dir}) blocked on a FIFO")
    return out["removed"], time.perf_counter() - start


def test_a_fifo_among_segments_stalls_nothing_and_a_group_still_forms(tmp_path):
    from workers.shm.exchange import TOKEN_PREFIX, Segment, SegmentLayout, UntrustedEntry

    fifo = tmp_path / "corelaunch-x"
    os.mkfifo(fifo, 0o666)
    removed, waited = _sweep_on_thread(tmp_path, [fifo])
    assert removed == [] and waited < 2 and fifo.exists()  # skipped, not read, not removed

    # A FIFO at the very name a leader creates, or attaches to: refused at once, naming it.
    layout = SegmentLayout(local_size=2, slot_bytes=4096)
    start = time.perf_counter()
    with pytest.raises(FileExistsError):
        Segment(str(fifo), layout, create=True, token=TOKEN_PREFIX + b"f")
    with pytest.raises(UntrustedEntry, match=f"{fifo} is not a regular file"):
        Segment(str(fifo), layout, create=False, token=TOKEN_PREFIX + b"f")
    assert time.perf_counter() - start < 2

    # With the FIFO still there, a TP 2 group forms in the same directory and reduces correctly.
    colls = thread_ranks(tmp_path, 2)
    try:
        results = on_threads(_exact_results, colls)
    finally:
        for c in colls:
            c.close()
    assert results == {0: [], 1: []}, results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corelaunch-x"]


def test_a_symlink_at_a_segment_path_is_refused(tmp_path):
    from workers.shm.exchange import TOKEN_PREFIX, Segment, SegmentLayout, UntrustedEntry

    layout = SegmentLayout(local_size=2, slot_bytes=4096)
    token = TOKEN_PREFIX + b"s"
    real = Segment(str(tmp_path / "elsewhere"), layout, create=True, token=token)  # a valid segment
    link = tmp_path / "corelaunch-link-node0"
    link.symlink_to(tmp_path / "elsewhere")
    try:
        with pytest.raises(UntrustedEntry, match=f"{link} is a symlink"):
            Segment(str(link), layout, create=False, token=token)
        with pytest.raises(FileExistsError):  # O_EXCL: never created through it
            Segment(str(link), layout, create=True, token=token)
        dangling = tmp_path / "corelaunch-dangling-node0"
        dangling.symlink_to(tmp_path / "target-someone-wants-created")
        with pytest.raises(FileExistsError):
            Segment(str(dangling), layout, create=True, token=token)
        assert not (tmp_path / "target-someone-wants-created").exists()
        # The sweep neither follows nor removes symlinks, even to an orphan-looking segment.
        make_orphan(real)
        assert _sweep_on_thread(tmp_path)[0] == []
        assert link.is_symlink() and (tmp_path / "elsewhere").exists()
    finally:
        real.close()
        real.unlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_segment_is_neither_attached_nor_swept(tmp_path):
    from workers.shm.exchange import TOKEN_PREFIX, Segment, SegmentLayout, UntrustedEntry

    layout = SegmentLayout(local_size=2, slot_bytes=4096)
    token = TOKEN_PREFIX + b"o"
    path = tmp_path / "corelaunch-theirs-node0"
    seg = Segment(str(path), layout, create=True, token=token)
    make_orphan(seg)
    seg.close()
    os.chown(path, 65534, 65534)
    with pytest.raises(UntrustedEntry, match=f"{path} is owned by uid 65534"):
        Segment(str(path), layout, create=False, token=token)
    assert _sweep_on_thread(tmp_path)[0] == [] and path.exists()
    os.chown(path, os.getuid(), os.getgid())
    assert _sweep_on_thread(tmp_path)[0] == [str(path)]  # the control: ours, it would be removed


def _group_beside_a_fifo(rank, world_size, shm_dir):
    import workers.shm.group as group

    group.SHM_DIR = shm_dir  # both ranks: a directory holding a planted FIFO, as /dev/shm might
    coll = _build(rank, world_size, mode="shm")
    x = inputs(rank, (2, 300), 0)
    got = coll.all_reduce_sum_(x.clone())
    coll.close()
    return type(coll).__name__, torch.equal(got, fixed_order_sum(world_size, (2, 300), 0))


@pytest.mark.slow
def test_processes_form_a_shared_memory_group_beside_a_planted_fifo(tmp_path):
    """group.py's own set-up (the leader sweeps orphans first) between two real processes."""
    fifo = tmp_path / "corelaunch-x"
    os.mkfifo(fifo, 0o666)
    try:
        results = run_ranks(2, _group_beside_a_fifo, str(tmp_path), timeout_s=60)
    finally:
        if fifo.exists():  # release a sweep that would be stuck on it, if any
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
    assert results == {0: ("ShmCollectives", True), 1: ("ShmCollectives", True)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corelaunch-x"]


# ---- the helper library: built and loaded only where no other user can write -----------------------
def _planted_library(tmp_path, marker) -> bytes:
    """A library that, once loaded, creates `marker`: standing in for one another user placed."""
    import subprocess

    src = tmp_path / "planted.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    out = tmp_path / "planted.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out.read_bytes()


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    """(cache, this user's library dir, library name, planted library bytes, its marker) with
    CORELAUNCH_CACHE pointing at a fresh directory; the probe is shown to work first."""
    import ctypes
    import shutil

    from workers.shm import native

    if not (os.environ.get("CC") or shutil.which("cc")):
        pytest.skip("no C compiler")
    cache = tmp_path / "cache"
    monkeypatch.setenv("CORELAUNCH_CACHE", str(cache))
    marker = tmp_path / "planted-library-ran"
    planted = _planted_library(tmp_path, marker)
    probe = tmp_path / "probe.so"
    probe.write_bytes(planted)
    ctypes.CDLL(str(probe))
    assert marker.exists(), "the planted library's constructor did not run: the probe proves nothing"
    marker.unlink()
    directory = native.library_dir()
    assert directory == cache / f"native-uid{os.getuid()}"
    return cache, directory, native.library_path().name, planted, marker


def test_library_is_built_into_a_0700_directory_of_this_user(user_cache):
    import ctypes
    import stat

    from workers.shm.native import Native, library_path

    cache, directory, name, _, _ = user_cache
    old = os.umask(0o002)  # a group-writable default (user private groups) must not leak through
    try:
        lib = Native()
    finally:
        os.umask(old)
    st_dir, st_lib = os.stat(directory), os.stat(library_path())
    assert stat.S_IMODE(st_dir.st_mode) == 0o700 and st_dir.st_uid == os.getuid()
    assert stat.S_IMODE(st_lib.st_mode) & 0o022 == 0 and st_lib.st_uid == os.getuid()
    assert sorted(os.listdir(directory)) == [name]  # no temporary files left behind
    box = ctypes.c_uint64(0)
    lib.publish(ctypes.addressof(box), 7, 0)  # the library loaded works (no signature: one word)
    assert box.value == 7


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "symlink", "other owner"])
def test_an_untrustworthy_library_file_is_rebuilt_not_loaded(user_cache, tmp_path, how):
    from workers.shm.native import Native

    if how == "other owner" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    _, directory, name, planted, marker = user_cache
    Native()  # a good library exists ...
    path = directory / name
    path.unlink()  # ... and is replaced by the planted one
    if how == "symlink":
        elsewhere = tmp_path / "planted-elsewhere.so"
        elsewhere.write_bytes(planted)
        os.chmod(elsewhere, 0o700)
        path.symlink_to(elsewhere)
    else:
        path.write_bytes(planted)
        os.chmod(path, {"group-writable": 0o770, "world-writable": 0o777, "other owner": 0o755}[how])
        if how == "other owner":
            os.chown(path, 65534, 65534)
    Native()
    assert not marker.exists(), f"a {how} library was loaded"
    assert not path.is_symlink() and path.read_bytes() != planted  # rebuilt in its place
    assert os.stat(path).st_uid == os.getuid() and os.stat(path).st_mode & 0o022 == 0


@pytest.mark.parametrize("how", ["writable by others", "symlink", "other owner"])
def test_a_library_directory_others_could_write_is_refused_naming_it(user_cache, tmp_path, how):
    from workers.shm.native import Native, NativeUnavailable

    if how == "other owner" and os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    _, directory, name, planted, marker = user_cache
    if how == "symlink":
        target = tmp_path / "their-dir"
        target.mkdir(mode=0o700)
        directory.parent.mkdir(parents=True)
        directory.symlink_to(target)
    else:
        directory.mkdir(parents=True)
    library = directory / name
    library.write_bytes(planted)
    os.chmod(library, 0o755)  # the file itself looks fine: only the directory gives it away
    if how == "writable by others":
        os.chmod(directory, 0o777)
    elif how == "other owner":
        os.chown(directory, 65534, 65534)
        os.chown(library, 65534, 65534)
    with pytest.raises(NativeUnavailable) as info:
        Native()
    message = str(info.value)
    assert str(directory) in message and "CORELAUNCH_CACHE" in message and "Remove" in message
    assert {"writable by others": "writable by group or others", "symlink": "symlink",
            "other owner": "owned by uid 65534"}[how] in message
    assert not marker.exists(), "the planted library was loaded"
    assert library.read_bytes() == planted  # refused, not written through


def test_concurrent_builds_leave_one_whole_library(user_cache):
    import threading

    from workers.shm.native import Native

    _, directory, name, _, _ = user_cache
    errors = []

    def build() -> None:
        try:
            Native()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and sorted(os.listdir(directory)) == [name]


def test_a_cached_library_cut_short_is_built_again_not_refused_for_good(user_cache):
    """A crash or a full disk could leave a short library in the cache (written without an fsync):
    every later launch failed to load it ("file too short") and fell back for good, or, cut in the
    middle, faulted the process in dlopen (SIGBUS). It is checked against its ELF header first."""
    import ctypes

    from workers import native_build
    from workers.shm.native import SPEC

    _, directory, name, _, _ = user_cache
    os.close(native_build.build(SPEC, directory))  # compiled, not loaded: truncating a loaded library faults
    whole = (directory / name).read_bytes()
    (directory / name).write_bytes(whole[: len(whole) // 2])  # what a crash before writeback leaves
    lib = native_build.build_and_load(SPEC, directory)
    box = ctypes.c_uint64(0)
    lib.cl_publish.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
    lib.cl_publish(ctypes.addressof(box), 9, 0)  # no signature: the one word
    assert box.value == 9 and (directory / name).stat().st_size > 0


def test_each_users_libraries_sit_straight_under_the_cache(user_cache):
    """Under a `native/` of their own, the first user to create it (mode 0755) locked every other
    user of a shared cache out: their own uid folder could not be created there."""
    cache, directory, _, _, _ = user_cache
    assert directory.parent == cache and directory.name == f"native-uid{os.getuid()}"


def test_a_cached_library_of_full_length_that_does_not_load_names_the_file_to_delete(user_cache):
    """Zeroed blocks at full length (a crash before writeback on some file systems) pass the length
    check and fail to load; the error named no remedy."""
    from workers import native_build
    from workers.shm.native import SPEC

    _, directory, name, _, _ = user_cache
    os.close(native_build.build(SPEC, directory))
    whole = bytearray((directory / name).read_bytes())
    whole[64: len(whole) // 2] = bytes(len(whole) // 2 - 64)
    (directory / name).write_bytes(bytes(whole))
    with pytest.raises(native_build.NativeUnavailable, match=f"if {directory / name} is damaged, delete it"):
        native_build.build_and_load(SPEC, directory)
