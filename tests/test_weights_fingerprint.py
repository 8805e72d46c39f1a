"""shardlib.weights_fingerprint: pre-sharded and compiled copies are refused with other weights of the
same config (a fine-tune, a checkpoint replaced in place), before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from launcher.api import LaunchConfig
from launcher.artifacts import compiled_dir
from launcher.launch_plan import plan_launch
from launcher.progress import Progress
from shardlib.model_config import load_model_config
from shardlib.presharded import read_manifest, save_presharded
from shardlib.sharding import ShardLayout
from shardlib.weights_fingerprint import SAMPLE_BYTES, check_same_weights, weights_fingerprint
from tests.model_factory import build_random_model, save_model

SHAPE = dict(num_heads=4, num_kv_heads=2, hidden_size=64, intermediate_size=128, vocab_size=96, num_layers=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two llamas of one config.json and different weights (base and "fine-tune"), the base again
    in two safetensors shards, and the base as a pickle."""
    root = tmp_path_factory.mktemp("fp")
    base = build_random_model("llama", seed=1, **SHAPE)
    tuned = build_random_model("llama", seed=2, **SHAPE)
    return {"base": save_model(base, root / "base"), "tuned": save_model(tuned, root / "tuned"),
            "sharded": save_model(base, root / "sharded", "safetensors_sharded"),
            "bin": save_model(base, root / "bin", "bin")}


def test_same_tensors_in_other_shards_match_and_other_weights_do_not(models):
    base = weights_fingerprint(models["base"])
    assert base is not None and len(base) == 64
    assert weights_fingerprint(models["sharded"]) == base
    assert weights_fingerprint(models["tuned"]) != base
    assert load_model_config(models["tuned"]).config_hash() == load_model_config(models["base"]).config_hash()
    assert weights_fingerprint(models["bin"]) not in (None, base)


def test_a_change_inside_a_sampled_span_changes_it(models, tmp_path):
    """One value in the middle of the largest tensor (an edit as small as a retrained row)."""
    tensors = load_file(models["base"] / "model.safetensors")
    name = max(tensors, key=lambda n: tensors[n].numel())
    assert tensors[name].numel() * tensors[name].element_size() > 3 * SAMPLE_BYTES  # sampled, not read whole
    flat = tensors[name].view(-1)
    flat[flat.numel() // 2] += 1.0
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "config.json").write_text((models["base"] / "config.json").read_text())
    save_file(tensors, edited / "model.safetensors")
    assert weights_fingerprint(edited) != weights_fingerprint(models["base"])


def test_a_directory_without_weights_has_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert weights_fingerprint(tmp_path) is None
    check_same_weights("0" * 64, tmp_path, copy="c", source=None, fix="f")  # nothing to compare: no error


def test_a_copy_that_recorded_nothing_is_not_compared(models):
    check_same_weights(None, models["tuned"], copy="c", source=None, fix="f")


@pytest.fixture(scope="module")
def base_presharded(models, tmp_path_factory) -> Path:
    config = load_model_config(models["base"])
    return save_presharded(tmp_path_factory.mktemp("pre") / "base-tp1", models["base"], config,
                           ShardLayout.for_model(config, 1))


def test_the_manifest_records_the_source_fingerprint(models, base_presharded):
    assert read_manifest(base_presharded)["weights_fingerprint"] == weights_fingerprint(models["base"])


def test_a_presharded_dir_with_another_models_weights_is_refused_at_planning(models, base_presharded):
    config = LaunchConfig(model=str(models["tuned"]), tp=1, presharded_dir=str(base_presharded))
    with pytest.raises(ValueError) as err:
        plan_launch(config, Progress(False))
    message = str(err.value)
    assert f"pre-sharded checkpoint {base_presharded} was cut from other weights than {models['tuned']}" in message
    assert f"written from {models['base'].resolve()}" in message and "save_presharded" in message
    for same in ("base", "sharded"):  # the weights it was cut from, in any shards
        plan_launch(LaunchConfig(model=str(models[same]), tp=1, presharded_dir=str(base_presharded)), Progress(False))


def test_a_compiled_dir_started_with_a_fine_tune_is_refused(models, base_presharded, tmp_path, capsys,
                                                            in_process_cluster):
    from tests.test_compile_cli import corelaunch_in_process, fake_compiled_dir

    root = fake_compiled_dir(tmp_path / "c", models["base"])
    (root / "weights").rmdir()
    (root / "weights").symlink_to(base_presharded)
    config = compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), model=str(models["tuned"])))
    with pytest.raises(ValueError, match=rf"compiled-model directory {root} was cut from other weights .*"
                                         rf"`corelaunch compile --model {models['tuned']} --out DIR`"):
        plan_launch(config, Progress(False))
    plan_launch(compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root))), Progress(False))  # its own model/
    code, err = corelaunch_in_process(capsys, "generate", "--compiled", str(root), "--model", str(models["tuned"]),
                                      "--quiet", "t1")
    assert code == 2 and "was cut from other weights" in err


def test_the_refusal_names_the_compiled_link_given_not_its_hidden_version(models, base_presharded, tmp_path):
    """A launch pins the version the link names (compiled_dir.pinned_version); the refusal named
    that `.c.v-HOST-PID-RANDOM` folder, which the user never typed."""
    from shardlib.atomic_dir import current_version
    from tests.test_compile_cli import fake_compiled_dir

    version = fake_compiled_dir(tmp_path / ".c.v-host-1-aaaaaaaa", models["base"])
    (version / "weights").rmdir()
    (version / "weights").symlink_to(base_presharded)
    (tmp_path / "c").symlink_to(version.name)
    assert current_version(tmp_path / "c") == version
    config = compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(tmp_path / "c"), model=str(models["tuned"])))
    assert config.compiled_dir == str(version)
    with pytest.raises(ValueError, match=rf"^compiled-model directory {tmp_path / 'c'} was cut from other weights"):
        plan_launch(config, Progress(False))


def test_a_manifest_fingerprint_of_the_wrong_type_is_named(base_presharded, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(base_presharded.resolve(), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["weights_fingerprint"] = 7
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="field 'weights_fingerprint' must be a string"):
        read_manifest(copy)


def test_a_tensor_without_elements_owns_no_bytes(tmp_path):
    """An empty tensor shares its offset with the next one: it was hashed with that one's bytes,
    so the same tensors saved in other shards fingerprinted differently."""
    import torch

    tensors = {"a.empty": torch.zeros(0), "b.weight": torch.randn(5000), "c.weight": torch.randn(3000)}
    whole, split = tmp_path / "whole", tmp_path / "split"
    whole.mkdir(), split.mkdir()
    save_file(tensors, whole / "model.safetensors")
    save_file({"a.empty": tensors["a.empty"], "c.weight": tensors["c.weight"]}, split / "part-1.safetensors")
    save_file({"b.weight": tensors["b.weight"]}, split / "part-2.safetensors")
    (split / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a.empty": "part-1.safetensors", "c.weight": "part-1.safetensors",
                        "b.weight": "part-2.safetensors"}}))
    assert weights_fingerprint(whole) == weights_fingerprint(split)


def _fingerprint_before_the_index_chose_the_copy(model_dir: Path) -> str:
    """weights_fingerprint of a safetensors checkpoint as corelaunch computed it when every manifest
    written so far recorded it: every tensor of every file's header hashed."""
    import hashlib

    from shardlib.checkpoint_files import find_checkpoint, safetensors_header, sampled_bytes

    ckpt = find_checkpoint(model_dir)
    digest = hashlib.sha256(f"{ckpt.format.split('_')[0]}\n".encode())
    spans = []
    for path in ckpt.files:
        header = safetensors_header(path)
        starts = sorted({entry.begin for entry in header.values()}) + [path.stat().st_size]
        next_begin = dict(zip(starts, starts[1:]))
        spans += [(name, entry, path, entry.begin if 0 in entry.shape else next_begin[entry.begin])
                  for name, entry in header.items()]
    for name, entry, path, end in sorted(spans, key=lambda span: span[0]):
        digest.update(f"{name}\n{entry.dtype}\n{list(entry.shape)}\n".encode())
        digest.update(sampled_bytes(path, entry.begin, end, 3, SAMPLE_BYTES))
    return digest.hexdigest()


def test_fingerprints_already_recorded_stay_valid(models):
    """Manifests written before hashed every tensor of every file: for a checkpoint holding each
    tensor once, in one file or in shards, the fingerprint is the same as then."""
    for name in ("base", "tuned", "sharded"):
        assert weights_fingerprint(models[name]) == _fingerprint_before_the_index_chose_the_copy(models[name])


def _stored_twice(models, directory: Path) -> tuple[Path, str]:
    """The base model in two shards, the second's last tensor stored again, with other values, in the
    first; the index maps it to the second (the base's values)."""
    directory.mkdir()
    (directory / "config.json").write_text((models["base"] / "config.json").read_text())
    tensors = load_file(models["base"] / "model.safetensors")
    names = sorted(tensors)
    first, second = names[:len(names) // 2], names[len(names) // 2:]
    twice = second[-1]
    save_file({**{n: tensors[n] for n in first}, twice: tensors[twice] + 1.0}, directory / "s1.safetensors")
    save_file({n: tensors[n] for n in second}, directory / "s2.safetensors")
    _write_index(directory, {**{n: "s1.safetensors" for n in first}, **{n: "s2.safetensors" for n in second}})
    return directory, twice


def _write_index(directory: Path, weight_map: dict[str, str]) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_of_a_tensor_stored_twice_only_the_copy_the_index_loads_counts(models, tmp_path):
    """Both copies were hashed: re-pointing the index at the other copy (other weights load) left
    the fingerprint as it was, and a pre-sharded or compiled copy cut before was used silently."""
    directory, twice = _stored_twice(models, tmp_path / "twice")
    assert weights_fingerprint(directory) == weights_fingerprint(models["base"])  # what loads: the base
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    _write_index(directory, {**weight_map, twice: "s1.safetensors"})
    assert weights_fingerprint(directory) not in (None, weights_fingerprint(models["base"]))


def test_unreadable_weights_are_not_compared(models, base_presharded, tmp_path):
    """A --model whose weights cannot be read (LFS pointers, a truncated download) with a pre-sharded
    copy, which is all the ranks read: nothing to compare, no refusal (it was a new one)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((models["base"] / "config.json").read_text())
    (broken / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    assert weights_fingerprint(broken) is None
    plan_launch(LaunchConfig(model=str(broken), tp=1, presharded_dir=str(base_presharded)), Progress(False))


def test_a_copy_of_another_config_is_refused_before_any_start_as_the_ranks_refuse_it(base_presharded, tmp_path):
    """Not "a fine-tune of the same model": the config differs, and the refusal lists every field
    that does; a manifest that is not an object is refused too (it crashed). Both were left to the
    ranks' load, after Ray and every rank had started; the driver now says what the ranks would."""
    from shardlib.presharded import load_presharded

    other = save_model(build_random_model("llama", seed=1, **{**SHAPE, "num_layers": 3}), tmp_path / "other")
    config = load_model_config(other)
    layout = ShardLayout.for_model(config, 1)
    with pytest.raises(ValueError, match=r"was written for other settings: config_hash: expected "):
        plan_launch(LaunchConfig(model=str(other), tp=1, presharded_dir=str(base_presharded)), Progress(False))
    with pytest.raises(ValueError, match=r"was written for other settings: config_hash: expected "):
        load_presharded(base_presharded, config, layout, 0)  # what each rank's load does
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "manifest.json").write_text("[]")
    with pytest.raises(ValueError, match=r"manifest\.json"):
        plan_launch(LaunchConfig(model=str(other), tp=1, presharded_dir=str(odd)), Progress(False))
    with pytest.raises(ValueError, match=r"manifest\.json"):
        load_presharded(odd, config, layout, 0)
