"""What a process imports at start: the CLI, the driver API and the Serve front end plan a launch,
and an eager rank loads and decodes, without torch's compiler stack (torch._dynamo alone takes about
2 s to import on a 2-core host, paid again by every `corelaunch` command, every Serve replica and
every rank) and, on the driver side, without the model's code. Also the start-up benchmark's
refusals (benchmarks/startup.py measures what this saves)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_factory import build_random_model, save_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(build_random_model("llama", num_heads=6, num_kv_heads=3, hidden_size=96),
                      tmp_path_factory.mktemp("tiny"))

DRIVER_SIDE = """
import contextlib, io, json, sys
import launcher.api, launcher.cli.serve_command, launcher.serving.openai_app, workers.backends.cpu
from launcher.cli import main
from launcher.launch_plan import plan_launch
from launcher.progress import Progress
with contextlib.redirect_stdout(io.StringIO()):
    code = main(["plan", "--model", sys.argv[1], "--tp", "3", "--json"])
plan_launch(launcher.api.LaunchConfig(model=sys.argv[1], tp=3), Progress(False))
print(json.dumps({"code": code, "loaded": [m for m in ("torch._dynamo", "torch._inductor", "workers.model")
                                             if m in sys.modules]}))
"""


def test_planning_a_launch_imports_neither_the_compiler_nor_the_model(model_dir):
    proc = subprocess.run([sys.executable, "-c", DRIVER_SIDE, str(model_dir)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report == {"code": 0, "loaded": []}


DRIVER_START = """
import json, sys
import launcher.api, launcher.cli.serve_command, launcher.serving.openai_app
import launcher.cluster.ray_worker, launcher.cluster.replica_pool, launcher.cluster.tp_group
from launcher.launch_plan import plan_launch
from launcher.progress import Progress
from launcher.cluster import ray_cluster
plan_launch(launcher.api.LaunchConfig(model=sys.argv[1], tp=3), Progress(False))
connection = ray_cluster.connect("local")  # a private Ray, as `corelaunch serve` opens
connection.close()
print(json.dumps({"torch": "torch" in sys.modules}))
"""


def test_the_driver_plans_and_reaches_ray_without_importing_torch(model_dir):
    """torch takes about 2 s to import here: `corelaunch serve` plans and starts Serve without it, and
    a Launcher's own thread starts Ray and the ranks while its tokenizer thread imports it
    (transformers does) instead of waiting for that import first. The script imports the driver's
    launch and serving modules, plans, and starts (and stops) a private Ray of its own."""
    proc = subprocess.run([sys.executable, "-c", DRIVER_START, str(model_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"torch": False}


EAGER_RANK = """
import json, sys
from shardlib.model_config import load_model_config
from shardlib.sharding import ShardLayout
from workers.rank_worker import GenerateRequest, LoadSpec, RankWorker, WorkerSpec
from workers.sampling import SamplingParams
config = load_model_config(sys.argv[1])
worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend="cpu", threads=1))
worker.init_backend("127.0.0.1", 0, 30.0)
worker.load(LoadSpec(config=config, layout=ShardLayout.for_model(config, 1), dtype="float32", model_dir=sys.argv[1]))
[out] = worker.generate(GenerateRequest(prompts=[[5, 9, 33, 17]], params=[SamplingParams()], max_new_tokens=4))
worker.shutdown()
print(json.dumps({"tokens": len(out.token_ids), "loaded": [m for m in ("torch._dynamo", "torch._inductor")
                                                            if m in sys.modules]}))
"""


def test_an_eager_rank_never_imports_the_compiler(model_dir):
    """An eager rank (--no-compile, and every test that is not about compiling) builds its shard and
    decodes without loading torch's compiler stack."""
    proc = subprocess.run([sys.executable, "-c", EAGER_RANK, str(model_dir)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"tokens": 4, "loaded": []}


EAGER_TP2 = """
import json, sys, threading
from shardlib.checkpoint import load_rank_shard
from shardlib.model_config import load_model_config
from shardlib.sharding import ShardLayout
from tests.tp_harness import InProcessGroup
from workers.engine import generate
from workers.model import ShardedCausalLM
from workers.sampling import SamplingParams
config = load_model_config(sys.argv[1])
layout = ShardLayout.for_model(config, 2)
tokens = {}
def run_rank(rank, collectives):
    shard = load_rank_shard(sys.argv[1], config, layout, rank, dtype="float32")
    model = ShardedCausalLM(config, layout, rank, shard, collectives, "float32")
    tokens[rank] = generate(model, [[5, 9, 33, 17]], [SamplingParams()], 4, [])[0].token_ids
threads = [threading.Thread(target=run_rank, args=(rank, c)) for rank, c in enumerate(InProcessGroup(2).ranks())]
for t in threads: t.start()
for t in threads: t.join(60)
print(json.dumps({"tokens": [len(tokens.get(r, [])) for r in (0, 1)], "agree": tokens.get(0) == tokens.get(1),
                  "loaded": [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules]}))
"""


def test_eager_tp2_ranks_never_import_the_compiler(model_dir):
    """Eager TP 2 ranks (threads here, their collectives the same base-class calls as a Ray group's;
    weights unpacked, so the small-batch kernel runs too): collectives and kernels are plain calls.
    Through the custom operators, or torch's lazy graph-break wrapper, the first call imported
    torch._dynamo: 2-3 s per rank, inside the first request."""
    proc = subprocess.run([sys.executable, "-c", EAGER_TP2, str(model_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"tokens": [4, 4], "agree": True, "loaded": []}


def test_the_startup_benchmark_refuses_what_it_cannot_run(tmp_path):
    def startup(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "benchmarks/startup.py", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=60)

    out = startup("--compare", str(tmp_path))
    assert out.returncode == 2 and f"--compare ({tmp_path}) is not a corelaunch checkout" in out.stderr
    out = startup("--rounds", "0")
    assert out.returncode == 2 and "--rounds (0) must be at least 1" in out.stderr
    out = startup("--commands", "generate,boot")
    assert out.returncode == 2 and "--commands ('generate,boot') must name one or more of generate, serve, convert" \
        in out.stderr


EAGER_PREFILL_PRODUCT = """
import json, sys
import torch
from workers.kernels.prefill_gemm import prefill_linear
x, w = torch.randn(1100, 64), torch.randn(32, 64)
ok = torch.allclose(prefill_linear(x, w, None), x @ w.T, atol=1e-4)
print(json.dumps({"ok": ok, "loaded": [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules]}))
"""


def test_an_eager_prefill_product_does_not_import_the_compiler():
    """A prefill of 1024 rows or more through packed weights called the prefill GEMM's Python custom
    operator even eagerly, whose first call imported torch._dynamo (1.2 s per rank)."""
    proc = subprocess.run([sys.executable, "-c", EAGER_PREFILL_PRODUCT], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"ok": True, "loaded": []}


def test_sampling_params_from_the_launcher_package_imports_no_torch():
    """`from launcher import SamplingParams` took workers.sampling's name, importing torch (7 s on 2
    cores) for a class that lives in shardlib, as the package's lazy imports mean to avoid."""
    code = ("import json, sys\nfrom launcher import SamplingParams\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'module': SamplingParams.__module__}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"torch": False, "module": "shardlib.sampling_params"}
