"""benchmarks/gpu_rank.py, the cuda backend's check on a lent GPU, run here on the CPU (--backend
cpu) so that the script the GPU figures come from keeps working between GPU sessions: its rank is
built as a Ray actor builds one, and its accuracy phase compares real transformers output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_accuracy_phase_on_the_cpu_agrees_with_transformers(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_rank.py", "--backend", "cpu", "--shapes", "tiny",
                           "--accuracy-only", "--batch", "2", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report == json.loads(out.read_text())
    tiny = report["shapes"]["tiny"]
    accuracy = tiny["accuracy"]
    assert "error" not in accuracy, accuracy.get("traceback")
    for path in ("eager_static_batch", "compiled_static_batch", "serving_loop_16_requests"):
        assert accuracy[path] == {"equal": 4, "of": 4}, (path, accuracy[path])
    assert 0 <= accuracy["logits_max_abs_diff"] < 1e-4 and accuracy["logits_ref_std"] > 0.05
    assert "single_stream" not in tiny and tiny["compiled_graphs_built"] >= 2
    assert report["device"] == "cpu" and report["device_read_GBps"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_the_cuda_backend_without_a_gpu_is_refused_naming_the_cpu_option():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_rank.py", "--shapes", "tiny"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--backend cuda: torch sees no CUDA GPU here (use --backend cpu to try the script)" in proc.stderr
