"""The real model end to end: SmolLM2-135M-Instruct through Ray at TP 1, compiled, and through the CLI
(slow). SmolLM2 at TP 3 through Ray is tests/test_check_bench_cli.py's logit-matching launch.

The generate command's refusals are checked in-process too (fast), with the demo model's packaged
config standing in for the converted model (planning needs only the config).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.api import Launcher
from workers.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def demo_dir():
    from shardlib.demo_model import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="module")
def hf_tokens(demo_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


# At TP 3 SmolLM2 says "Paris" with transformers' tokens in tests/test_check_bench_cli.py's
# logit-matching launch (eager there); this is the compiled SmolLM2 run through Ray.
@pytest.mark.slow
def test_smollm2_greedy_says_paris_and_matches_transformers(demo_dir, hf_tokens, ray_session):
    with Launcher(model=str(demo_dir), tp=1, progress=False) as launcher:
        [out] = launcher.generate(PROMPT, max_new_tokens=8)
        sampled_a = launcher.generate(PROMPT, SamplingParams(temperature=0.9, top_k=20, seed=7), max_new_tokens=8)
        sampled_b = launcher.generate(PROMPT, SamplingParams(temperature=0.9, top_k=20, seed=7), max_new_tokens=8)
    assert out.text.lstrip().startswith("Paris"), out.text
    assert out.token_ids == hf_tokens
    assert sampled_a[0].token_ids == sampled_b[0].token_ids  # reproducible with a seed


@pytest.mark.slow
def test_cli_generate_json_prints_only_json(demo_dir, ray_address):
    proc = subprocess.run(
        # The CLI's output is the subject, not the group: the session's Ray (not whatever cluster
        # earlier tests left discoverable), TP 1 (three ranks on two cores took twice as long) and
        # --no-compile (a batch of two would build two more SmolLM2 graphs).
        [sys.executable, "-m", "launcher", "generate", "--model", str(demo_dir), "--tp", "1", "--no-compile",
         "--ray-address", ray_address, "--max-new-tokens", "4", "--json", PROMPT,
         "--prompt", "The capital of Italy is"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # the whole stdout is one JSON object
    assert report["tp_degree"] == 1 and report["kv_strategy"] == "shard" and report["compile"] is None
    first, second = report["outputs"]
    assert first["prompt"] == PROMPT and "Paris" in first["text"]
    assert second["prompt"] == "The capital of Italy is" and "Rome" in second["text"]
    assert len(first["token_ids"]) <= 4 and first["finish_reason"] in ("stop", "length")


def test_cli_generate_refusals_in_process(tmp_path, capsys, monkeypatch, in_process_cluster):
    import shutil

    import shardlib.demo_model
    from launcher.cli import main

    demo = tmp_path / "demo"
    demo.mkdir()
    shutil.copy(shardlib.demo_model.PACKAGED_CONFIG, demo / "config.json")
    monkeypatch.setattr(shardlib.demo_model, "ensure_demo_model", lambda *a, **k: demo)

    def refused(*args: str) -> str:
        capsys.readouterr()
        assert main(["generate", *args]) == 2, args
        return capsys.readouterr().err

    missing = refused("--model", str(tmp_path / "nope"), "hi")
    assert "nope" in missing and "does not exist" in missing
    assert "--top-p 2.0 must be a number in (0, 1]" in refused("--top-p", "2", "hi")
    assert "--repetition-penalty 0.0 must be a finite number > 0" in refused("--repetition-penalty", "0", "hi")
    bad_tp = refused("--tp", "2", "--quiet", "hi")
    assert "heads_not_divisible" in bad_tp and "num_attention_heads (9)" in bad_tp, bad_tp
    assert "give at least one PROMPT" in refused("--quiet")
    assert in_process_cluster.groups == []  # every refusal came before any group started


@pytest.mark.slow
def test_cli_generate_refuses_bad_input_with_exit_2():
    """Exit 2 reaches the shell through `python -m launcher` (one subprocess: the refusals and their
    messages are test_cli_generate_refusals_in_process's)."""
    bad_tp = subprocess.run([sys.executable, "-m", "launcher", "generate", "--tp", "2", "--quiet", "hi"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad_tp.returncode == 2 and "heads_not_divisible" in bad_tp.stderr, bad_tp.stderr
