"""The paths a rank opens are absolute: a rank runs in its raylet's working directory, not the
command's. On a cluster joined with --ray-address (or a `ray start` one recorded on the host) a
relative `compile --out` or `generate --model` named nothing there, and every rank failed ("rank 0
failed to load its shard: .crel.v-.../weights is not a pre-sharded checkpoint").

The ranks run in-process (tests/in_process_cluster.py); the relative paths they are given are
opened from another folder, as a joined cluster's raylet's working directory is.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tests.in_process_cluster import ThreadTPGroup
from tests.model_factory import build_random_model, save_model
from tests.test_compile_cli import LAYERS, VOCAB, corelaunch_in_process, save_word_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = save_model(build_random_model("llama", seed=3, vocab_size=VOCAB, num_layers=LAYERS),  # compiles faster
                      tmp_path_factory.mktemp("tiny"))
    save_word_tokenizer(path)
    return path


def as_the_raylet_reads(spec, raylet: Path):
    """`spec` with each relative path in it taken from `raylet`, as a rank running there opens it
    (a string field that names something from here or has a folder in it is a path; the others,
    dtype names, are left). Not os.chdir: the driver's threads (its tokenizer's load) share the
    process's directory."""
    if not dataclasses.is_dataclass(spec):
        return spec
    moved = {}
    for entry in dataclasses.fields(spec):
        value = getattr(spec, entry.name)
        if isinstance(value, str) and not os.path.isabs(value) and (os.sep in value or os.path.exists(value)):
            moved[entry.name] = os.path.join(raylet, value)
    return dataclasses.replace(spec, **moved)


@pytest.fixture
def ranks_elsewhere(tmp_path, monkeypatch, in_process_cluster):
    """The ranks' steps open relative paths from tmp_path/raylet; returns the folder the command
    runs in (tmp_path/work), and records each LoadSpec the ranks got."""
    raylet, work = tmp_path / "raylet", tmp_path / "work"
    raylet.mkdir()
    work.mkdir()
    specs = []

    def in_raylet_dir(step):
        def run(self, spec):
            specs.append(spec)
            return step(self, as_the_raylet_reads(spec, raylet))
        return run

    monkeypatch.setattr(ThreadTPGroup, "load", in_raylet_dir(ThreadTPGroup.load))
    monkeypatch.setattr(ThreadTPGroup, "start_serving", in_raylet_dir(ThreadTPGroup.start_serving))
    monkeypatch.chdir(work)
    return work, specs


def test_generate_with_a_relative_model_loads_on_ranks_elsewhere(model_dir, ranks_elsewhere, capsys):
    work, specs = ranks_elsewhere
    os.symlink(model_dir, work / "m")
    code, err = corelaunch_in_process(capsys, "generate", "--model", "m", "--no-compile", "--max-new-tokens", "2",
                                      "--seq-len", "32", "--quiet", "t1 t2")
    assert code == 0, err
    assert specs[0].model_dir == str(work / "m")  # absolute, the link kept (not resolved to its target)


def test_compile_with_a_relative_out_loads_on_ranks_elsewhere(model_dir, ranks_elsewhere, capsys, monkeypatch):
    from workers.compiled import CompiledCausalLM
    from workers.serving.loop import ServingLoop

    work, specs = ranks_elsewhere
    # the paths, not graphs: neither the serving loop's nor the static engine's graphs are compiled
    # (the load, the weights' write and the manifest still run, and they are what name the paths)
    monkeypatch.setattr(ServingLoop, "warm_up", lambda self, shapes, progress=None: None)
    monkeypatch.setattr(CompiledCausalLM, "warm_up", lambda self, shapes=None, progress=None: None)
    code, err = corelaunch_in_process(capsys, "compile", "--model", str(model_dir), "--out", "crel",
                                      "--buckets", "16", "--max-num-seqs", "1", "--quiet")
    assert code == 0, err
    assert (work / "crel" / "manifest.json").is_file()
    spec = next(s for s in specs if hasattr(s, "presharded_dir"))
    for path in (spec.presharded_dir, spec.compile_cache_dir, spec.progress_file):
        assert path.startswith(f"{work}/.crel.v-"), path  # the version written, by its absolute path
    assert not any((work.parent / "raylet").iterdir())  # nothing written in the ranks' own directory
