"""Shared fixtures: one local Ray instance for the whole test session (ray.init costs ~2 s), and
the Launcher's TP groups run in-process without Ray (tests/in_process_cluster.py)."""

from __future__ import annotations

import os

import pytest

# With pytest-xdist two test workers share the host's cores, which the suite keeps busy, so two
# defaults tuned for a machine of one's own cost time (README, Tests). Each TP rank runs one OpenMP
# thread per core, and a thread at a barrier spins (libgomp's default) while the partner it waits
# for is off its core running the other worker's test: wait passively. Inductor compiles through a
# pool of processes that each import torch first: with no idle core to gain, compile in the
# compiling process. Set before torch is imported here, and inherited by the Ray workers and
# subprocesses the tests start.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


# The files that take about 35 s or more on 2 cores, longest first: per-file sums of a junit report
# of the parallel lane on machine S (session 78, 4583 tests, 2958 worker-seconds), since CI's first
# step runs the fast and slow tests together (README, Tests); test_check_bench_cpu_share.py is new
# since (its slow case about 70 s), test_shm_collectives.py has left the exclusive step since (about
# 170 s alone) and test_compiled.py runs one Ray case instead of two. Under `-n 2 --dist loadfile` xdist hands the workers whole files
# from one queue, in its order (each holds up to two and is sent the next when nearly done), so a
# long file handed out last keeps one worker busy after the other has run out: queued first, the
# many short files after them even out the two workers' ends. Only the order changes; a file
# missing here runs after them, in collection order.
LONGEST_FILES = ("test_openai_server.py", "test_multinode.py", "test_shm_collectives.py", "test_compile_cli.py",
                 "test_fault_tolerance.py", "test_ray_connect_e2e.py", "test_check_bench_cli.py", "test_compiled.py",
                 "test_check_bench_cpu_share.py", "test_compile_message_e2e.py", "test_flagged_server.py",
                 "test_pythonic_calls.py", "test_quantized_check_tolerances.py", "test_compile_once.py",
                 "test_join_without_a_local_node.py", "test_ray_job.py", "test_launcher_failures.py",
                 "test_wrong_ray_token_refused_at_once.py", "test_demo_model.py", "test_smollm2_e2e.py")


def pytest_configure(config):
    # xdist's default queues files by their number of tests, most first; keep this file's order
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


# Marks a test file as holding exclusive cases: `pytest.mark.exclusive` on a test or the file's
# pytestmark (tests/test_exclusive_collection.py checks no other spelling is used).
EXCLUSIVE_MARK_TEXT = "mark.exclusive"


def pytest_ignore_collect(collection_path, config):
    """The test command's second step (`-m exclusive`) runs 13 cases from a few files, but
    collecting every file (importing each, transformers' and Ray's modules with them) took 16 s of
    it, run alone: files that never name the mark are not collected for it."""
    if config.option.markexpr != "exclusive" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py":
        return None
    return True if EXCLUSIVE_MARK_TEXT not in collection_path.read_text(encoding="utf-8") else None


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: each file's tests, and the other files, keep their order


def start_session_ray() -> None:
    """ray.init for the session's Ray (tests/test_multinode.py re-opens it with this too).

    address="local": always a Ray of this session's own. Without an address ray.init joins the
    newest cluster recorded on the machine as the `ray start` one, and with the slow tests two at a
    time the other worker's multi-node tests record theirs while they build it."""
    import ray

    from shardlib.host_cpus import host_cpus

    # the CPUs a private cluster of a launch declares (shardlib/host_cpus.py), which tests compare with
    ray.init(address="local", num_cpus=host_cpus(), include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with this machine's CPU count, shared by every test that needs Ray."""
    import ray

    if not ray.is_initialized():
        start_session_ray()
    yield ray
    ray.shutdown()


@pytest.fixture
def ray_address(ray_session) -> str:
    """The session Ray's address, for a `corelaunch` subprocess to join with --ray-address: the
    command's output is those tests' subject, and a private Ray of its own cost each one 6-7 s to
    start and stop (a private Ray is tests/test_hardening_e2e.py's subject). The workers of a
    joined cluster inherit the pytest process's environment, not the subprocess's."""
    return ray_session.get_runtime_context().gcs_address


@pytest.fixture
def ray_tripwire(monkeypatch):
    """Fails the test if the code under test reaches for Ray: `ray_cluster.connect` is the driver's
    one way in (Launcher.start, `corelaunch serve`). For refusals that must come before any start-up.
    Comparing ray.is_initialized() before and after cannot fail once the session's Ray is up (an
    earlier test on the same pytest worker started it). Yields the calls it refused."""
    from launcher.cluster import ray_cluster

    calls: list[tuple] = []

    def refuse(*args, **kwargs):
        calls.append((args, kwargs))
        raise AssertionError(f"the code under test connected to Ray (connect{args}) before refusing")

    monkeypatch.setattr(ray_cluster, "connect", refuse)
    yield calls
    assert calls == [], "the code under test connected to Ray before refusing"


@pytest.fixture
def in_process_cluster(monkeypatch):
    """Launchers started in this test run every TP group as threads of this process (no Ray):
    see tests/in_process_cluster.py. Yields its record of the groups started."""
    from tests.in_process_cluster import use_in_process_groups

    return use_in_process_groups(monkeypatch)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer (the built-in demo model's), loaded once per test process. Shared:
    a test that changes it (a chat template, say) changes a copy."""
    from transformers import AutoTokenizer

    from shardlib.demo_model import ensure_demo_model

    return AutoTokenizer.from_pretrained(ensure_demo_model())
