"""shardlib.checkpoint: every rank's shard equals apply_slice of the full state_dict, in every format."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardlib.checkpoint import CHECKPOINT_FILES, find_checkpoint, load_rank_shard
from shardlib.model_config import load_model_config
from shardlib.param_shapes import expected_shapes
from shardlib.sharding import KVStrategy, ShardLayout, apply_slice, kv_strategy_problem, slice_for
from tests.model_factory import FORMATS, build_random_model, save_model

# Head counts chosen so each KV strategy is exercised for real; intermediate 100 and vocab 128 do not
# divide by 3, so TP 3 also exercises the zero padding of column and vocabulary slices.
VARIANTS = {
    # K=2: shard at TP 1 and 2 (replicate_to_tp is one head per rank at TP 2), MHA at TP 3
    "llama": ("llama", dict(num_heads=6, num_kv_heads=2)),
    # K=1 with q/k/v biases: replicate_to_tp at TP 2 and 3
    "qwen2_bias": ("qwen2", dict(num_heads=6, num_kv_heads=1)),
    # K=3 tied: shard at TP 3, only MHA at TP 2
    "llama_tied": ("llama", dict(num_heads=6, num_kv_heads=3, tie_word_embeddings=True)),
}
SHAPE = dict(hidden_size=48, intermediate_size=100, vocab_size=128, num_layers=2)


def _cases():
    for variant, (_, kw) in VARIANTS.items():
        for tp in (1, 2, 3):
            for strategy in KVStrategy:
                if kv_strategy_problem(strategy, kw["num_heads"], kw["num_kv_heads"], tp) is None:
                    yield variant, tp, strategy.value


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """variant -> (full state_dict, {format: model dir})."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for variant, (model_type, kw) in VARIANTS.items():
        model = build_random_model(model_type, **SHAPE, **kw)
        dirs = {fmt: save_model(model, root / f"{variant}-{fmt}", fmt) for fmt in FORMATS}
        out[variant] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, dirs)
    return out


def _expected(state, config, layout, rank):
    names = set(expected_shapes(config))
    return {n: apply_slice(state[n], slice_for(config.model_type, n, state[n].shape, rank, layout)) for n in names}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant,tp,strategy", list(_cases()))
def test_every_rank_equals_apply_slice_of_full_state_dict(models, variant, fmt, tp, strategy):
    state, dirs = models[variant]
    config = load_model_config(dirs[fmt])
    layout = ShardLayout.for_model(config, tp, strategy)
    assert find_checkpoint(dirs[fmt]).format == fmt
    for rank in range(tp):
        got = load_rank_shard(dirs[fmt], config, layout, rank)
        want = _expected(state, config, layout, rank)
        assert set(got) == set(want)
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (name, rank)


def test_cases_cover_every_strategy_and_degree():
    seen = {(tp, s) for _, tp, s in _cases()}
    assert {s for _, s in seen} == {s.value for s in KVStrategy}
    assert {tp for tp, _ in seen} == {1, 2, 3}
    assert (3, "replicate_to_tp") in seen and (3, "shard") in seen and (3, "convert_to_mha") in seen


def test_tied_embeddings_have_no_lm_head_in_the_shard(models):
    state, dirs = models["llama_tied"]
    config = load_model_config(dirs["safetensors"])
    assert config.tie_word_embeddings
    shard = load_rank_shard(dirs["safetensors"], config, ShardLayout.for_model(config, 3), 1)
    assert "lm_head.weight" not in shard and "model.embed_tokens.weight" in shard


def test_tied_lm_head_copy_in_the_checkpoint_is_ignored(models, tmp_path):
    state, dirs = models["llama_tied"]
    d = _copy_config(dirs["safetensors"], tmp_path)
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}, d / "model.safetensors")
    config = load_model_config(d)
    assert "lm_head.weight" not in load_rank_shard(d, config, ShardLayout.for_model(config, 1), 0)


def test_tied_config_with_another_stored_lm_head_is_refused_before_any_rank(models, tmp_path):
    """transformers 5 would use the stored head, 4.x the embedding; corelaunch used the embedding
    silently (logits off by up to 8 against transformers 5). A copy stays fine (the test above)."""
    from shardlib.checkpoint_files import check_checkpoint

    state, dirs = models["llama_tied"]
    d = _copy_config(dirs["safetensors"], tmp_path / "model")  # the quantized copy goes beside it, not inside
    other = state["model.embed_tokens.weight"].clone()
    other[-1, -1] += 1.0  # one element apart, in the last sample
    save_file({**state, "lm_head.weight": other}, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"tie_word_embeddings=true, but .* stores a lm_head.weight \(F32 \[\d+, \d+\]\) "
                                         r"that is not a copy of model.embed_tokens.weight .* Set tie_word_embeddings to "
                                         r"false to use the stored head"):
        check_checkpoint(d, load_model_config(d))
    from shardlib.quantize_checkpoint import quantize_checkpoint

    with pytest.raises(ValueError, match=r"tie_word_embeddings=true, but .* is not a copy"):  # it dropped the head
        quantize_checkpoint(d, tmp_path / "quantized", "int8")
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}, d / "model.safetensors")
    check_checkpoint(d, load_model_config(d))


def test_dtype_cast_and_progress(models):
    state, dirs = models["qwen2_bias"]
    config = load_model_config(dirs["safetensors_sharded"])
    layout = ShardLayout.for_model(config, 2)
    calls = []
    got = load_rank_shard(dirs["safetensors_sharded"], config, layout, 1, dtype="bf16",
                          progress=lambda name, done, total: calls.append((name, done, total)))
    for name, tensor in _expected(state, config, layout, 1).items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor.to(torch.bfloat16))
    assert [c[1] for c in calls] == list(range(1, len(got) + 1)) and {c[0] for c in calls} == set(got)


def test_a_weight_past_float16s_range_is_refused_when_cast_to_it(tmp_path):
    """A bfloat16 or float32 weight above 65504 became inf in a float16 load, and the model ran,
    giving inf and NaN from its first layer; a value float16 holds still loads, and so does the same
    weight in bfloat16."""
    model = build_random_model("llama", **SHAPE, num_heads=6, num_kv_heads=2)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = 1e6
        model.model.layers[0].mlp.down_proj.weight[0, 0] = 6e4  # within float16's range
    path = save_model(model, tmp_path / "big")
    config = load_model_config(path)
    layout = ShardLayout.for_model(config, 1)
    with pytest.raises(ValueError, match=r"^model\.layers\.1\.mlp\.down_proj\.weight holds values up to 1e\+06 in "
                                         r"magnitude, past float16's largest \(65504\).*--dtype bfloat16"):
        load_rank_shard(path, config, layout, 0, dtype="float16")
    got = load_rank_shard(path, config, layout, 0, dtype="bfloat16")
    assert got["model.layers.1.mlp.down_proj.weight"][3, 5].item() == torch.tensor(1e6).to(torch.bfloat16).item()


def test_bin_tensors_sharing_storage_read_correctly(models, tmp_path):
    # Pages of a pickle are dropped after each tensor; a later tensor on the same storage must re-read them.
    state, dirs = models["llama"]
    d = _copy_config(dirs["bin"], tmp_path)
    shared = dict(state)
    shared["lm_head.weight"] = shared["model.embed_tokens.weight"]
    torch.save(shared, d / "pytorch_model.bin")
    config = load_model_config(d)
    layout = ShardLayout.for_model(config, 2)
    got = load_rank_shard(d, config, layout, 0)
    want = apply_slice(state["model.embed_tokens.weight"], slice_for("llama", "lm_head.weight", (128, 48), 0, layout))
    assert torch.equal(got["lm_head.weight"], want) and torch.equal(got["model.embed_tokens.weight"], want)


def test_format_preference_order(models, tmp_path):
    state, dirs = models["llama"]
    d = tmp_path / "both"
    shutil.copytree(dirs["bin"], d)
    for f in dirs["safetensors"].iterdir():
        shutil.copy(f, d)
    assert find_checkpoint(d).format == "safetensors"
    assert [n for _, n in CHECKPOINT_FILES] == ["model.safetensors", "model.safetensors.index.json",
                                                "pytorch_model.bin", "pytorch_model.bin.index.json"]


# ---- errors ----------------------------------------------------------------------------------
def _copy_config(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def _load(d):
    config = load_model_config(d)
    return load_rank_shard(d, config, ShardLayout.for_model(config, 1), 0)


def test_directory_without_checkpoint_lists_what_was_looked_for(models, tmp_path):
    d = _copy_config(models["llama"][1]["safetensors"], tmp_path / "empty")
    with pytest.raises(FileNotFoundError) as err:
        find_checkpoint(d)
    msg = str(err.value)
    assert str(d) in msg and all(name in msg for _, name in CHECKPOINT_FILES) and "config.json" in msg
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_checkpoint(tmp_path / "nowhere")


@pytest.mark.parametrize("fmt", ["safetensors_sharded", "bin_sharded"])
def test_index_naming_a_missing_shard_file(models, tmp_path, fmt):
    d = tmp_path / fmt
    shutil.copytree(models["llama"][1][fmt], d)
    index = next(d.glob("*.index.json"))
    lost = sorted(set(json.loads(index.read_text())["weight_map"].values()))[-1]
    (d / lost).unlink()
    with pytest.raises(FileNotFoundError) as err:
        find_checkpoint(d)
    assert str(index) in str(err.value) and lost in str(err.value)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"metadata": {}}), json.dumps({"weight_map": [1]})])
def test_corrupt_index(models, tmp_path, content):
    d = tmp_path / "idx"
    shutil.copytree(models["llama"][1]["safetensors_sharded"], d)
    (d / "model.safetensors.index.json").write_text(content)
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        find_checkpoint(d)


@pytest.mark.parametrize("fmt", ["safetensors_sharded", "bin_sharded"])
def test_an_index_listing_no_tensors_is_refused_naming_it(models, tmp_path, fmt):
    """A review: an empty weight_map read as a checkpoint of no files, and the weights' dtype, read
    from its first file where config.json names none, ended `plan` and `generate` in an IndexError."""
    from shardlib.weights_dtype import stored_weights_dtype

    d = tmp_path / fmt
    shutil.copytree(models["llama"][1][fmt], d)
    index = next(d.glob("*.index.json"))
    index.write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(ValueError, match=re.escape(f"checkpoint index {index} lists no tensors")):
        find_checkpoint(d)
    assert stored_weights_dtype(d) is None  # left to the checkpoint's own check, which names it


def test_index_and_file_disagree(models, tmp_path):
    d = tmp_path / "idx"
    shutil.copytree(models["llama"][1]["safetensors_sharded"], d)
    index = d / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    files = sorted(set(raw["weight_map"].values()))
    name = next(n for n, f in raw["weight_map"].items() if f == files[0])
    raw["weight_map"][name] = files[1]
    index.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as err:
        _load(d)
    assert name in str(err.value) and files[1] in str(err.value)
    from shardlib.quantize_checkpoint import quantize_checkpoint

    with pytest.raises(ValueError) as err:  # was a KeyError traceback from `corelaunch quantize`
        quantize_checkpoint(d, tmp_path / "q", "int8")
    assert name in str(err.value) and files[1] in str(err.value) and not (tmp_path / "q").exists()


def test_pickle_with_a_non_tensor_object_is_refused(models, tmp_path):
    d = _copy_config(models["llama"][1]["bin"], tmp_path)
    state = dict(models["llama"][0])
    state["model.norm.weight"] = _NotATensor()
    torch.save(state, d / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        _load(d)
    assert "pytorch_model.bin" in str(err.value) and "_NotATensor" in str(err.value)
    assert "weights_only" in str(err.value)


def test_pickle_with_a_plain_non_tensor_value_is_refused(models, tmp_path):
    d = _copy_config(models["llama"][1]["bin"], tmp_path)
    torch.save({**models["llama"][0], "step": 5}, d / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        _load(d)
    assert "pytorch_model.bin" in str(err.value) and "step" in str(err.value)


def test_legacy_and_corrupt_pickles(models, tmp_path):
    d = _copy_config(models["llama"][1]["bin"], tmp_path)
    for protocol in (2, 4):  # torch's default, and a later one (whose frame header comes before the magic)
        torch.save(models["llama"][0], d / "pytorch_model.bin", _use_new_zipfile_serialization=False,
                   pickle_protocol=protocol)
        with pytest.raises(ValueError, match="pytorch_model.bin.*legacy"):
            _load(d)
    torch.save(models["llama"][0], d / "pytorch_model.bin")
    data = (d / "pytorch_model.bin").read_bytes()
    (d / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="pytorch_model.bin.*truncated or corrupt"):
        _load(d)
    for cut in (b"", bytes(range(256)) * 20):  # a review: empty or garbage was called legacy
        (d / "pytorch_model.bin").write_bytes(cut)
        with pytest.raises(ValueError, match="pytorch_model.bin.*truncated or corrupt"):
            _load(d)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_truncated_or_corrupt_safetensors(models, tmp_path, damage):
    d = tmp_path / "st"
    shutil.copytree(models["llama"][1]["safetensors_sharded"], d)
    victim = sorted(d.glob("model-*.safetensors"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[:-64] if damage == "truncate" else b"\x20" + b"\x00" * 7 + b"{" * 40)
    with pytest.raises(ValueError) as err:
        _load(d)
    assert str(victim) in str(err.value) and "truncated or corrupt" in str(err.value)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_missing_tensor_is_named_with_the_file_set(models, tmp_path, fmt):
    d = _copy_config(models["llama"][1][fmt], tmp_path)
    state = {k: v for k, v in models["llama"][0].items() if k != "model.layers.1.mlp.up_proj.weight"}
    path = _save(state, d, fmt)
    with pytest.raises(ValueError) as err:
        _load(d)
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value) and str(path) in str(err.value)


def test_untied_model_without_lm_head_is_an_error(models, tmp_path):
    d = _copy_config(models["llama"][1]["safetensors"], tmp_path)
    _save({k: v for k, v in models["llama"][0].items() if k != "lm_head.weight"}, d, "safetensors")
    with pytest.raises(ValueError, match="lm_head.weight.*tie_word_embeddings"):
        _load(d)


def test_the_tied_head_stored_only_as_lm_head_is_refused_with_the_fix(models, tmp_path):
    """transformers loads a tied checkpoint that stores the matrix only as lm_head.weight; the
    refusal said "incomplete or saved for another config", and an untied config with no
    tie_word_embeddings key was said to have tie_word_embeddings=false."""
    import json

    state, dirs = models["llama_tied"]
    d = _copy_config(dirs["safetensors"], tmp_path)
    head_only = {k: v for k, v in state.items() if k != "model.embed_tokens.weight"}
    _save({**head_only, "lm_head.weight": state["model.embed_tokens.weight"]}, d, "safetensors")
    with pytest.raises(ValueError, match=r"the tied embedding is stored only as lm_head.weight, which transformers "
                                         r"takes as the embedding .* re-save the checkpoint"):
        _load(d)
    d = _copy_config(models["llama"][1]["safetensors"], tmp_path / "untied")
    raw = json.loads((d / "config.json").read_text())
    raw.pop("tie_word_embeddings")
    (d / "config.json").write_text(json.dumps(raw))
    _save({k: v for k, v in models["llama"][0].items() if k != "lm_head.weight"}, d, "safetensors")
    with pytest.raises(ValueError, match=r"tie_word_embeddings is false \(config.json's value, or the llama default "
                                         r"where it names none\)"):
        _load(d)


@pytest.mark.parametrize("extra", ["model.layers.0.mlp.extra_proj.weight", "model.layers.7.mlp.up_proj.weight"])
def test_unknown_tensor_is_named(models, tmp_path, extra):
    d = _copy_config(models["llama"][1]["safetensors"], tmp_path)
    _save({**models["llama"][0], extra: torch.zeros(3)}, d, "safetensors")
    with pytest.raises(ValueError) as err:
        _load(d)
    assert extra in str(err.value) and "model.safetensors" in str(err.value)


def test_rotary_buffers_are_skipped(models, tmp_path):
    d = _copy_config(models["llama"][1]["bin"], tmp_path)
    _save({**models["llama"][0], "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}, d, "bin")
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in _load(d)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_wrong_shape_names_tensor_expected_and_found(models, tmp_path, fmt):
    d = _copy_config(models["llama"][1][fmt], tmp_path)
    _save({**models["llama"][0], "model.layers.0.self_attn.k_proj.weight": torch.zeros(24, 48)}, d, fmt)
    with pytest.raises(ValueError) as err:
        _load(d)
    msg = str(err.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "(16, 48)" in msg and "(24, 48)" in msg


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_integer_weights_are_refused_by_the_driver_and_the_ranks(models, tmp_path, fmt, dtype):
    """Cast to floating point, integer or boolean weights ran and gave garbage; only a quantized
    config's codes are integers. Refused by the driver's check (before any worker) and by a rank."""
    from shardlib.checkpoint_files import check_checkpoint

    d = _copy_config(models["llama"][1][fmt], tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    state = models["llama"][0]
    _save({**state, name: (state[name] * 10).to(dtype)}, d, fmt)
    config = load_model_config(d)
    for check in (lambda: check_checkpoint(d, config), lambda: _load(d)):
        with pytest.raises(ValueError) as err:
            check()
        msg = str(err.value)
        found = {torch.int32: "I32", torch.int8: "I8", torch.bool: "BOOL"}[dtype]
        assert f"{name!r}" in msg and f"is {found} (expected one of F32, BF16" in msg, msg
        assert "no quantization_config" in msg and "floating-point checkpoint" in msg, msg


@pytest.mark.parametrize("fmt", ["safetensors", "safetensors_sharded"])
def test_a_tensor_of_a_dtype_the_ranks_cannot_read_is_refused_by_the_driver_too(models, tmp_path, fmt):
    """Each rank refuses a file holding any tensor of a dtype it cannot read, used or not; the driver
    checked only the tensors the model reads, so an extra U16 rotary buffer passed it and failed on
    every rank once Ray had started."""
    from shardlib.checkpoint_files import check_checkpoint

    d = tmp_path / fmt
    shutil.copytree(models["llama"][1][fmt], d)
    holder = sorted(d.glob("*.safetensors"))[-1]
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"  # a buffer the model skips
    tensors = load_file(holder)
    save_file({**tensors, name: torch.zeros(4, dtype=torch.uint16)}, holder)
    config = load_model_config(d)
    for check in (lambda: check_checkpoint(d, config), lambda: _load(d)):
        with pytest.raises(ValueError) as err:
            check()
        msg = str(err.value)
        assert f"tensor {name!r} in {holder} has dtype U16" in msg and "save the checkpoint again without it" in msg


def test_a_reference_only_transformers_reads_may_hold_a_dtype_the_ranks_cannot(models, tmp_path):
    """`check --reference DIR` (another checkpoint than --model): transformers reads it, never a rank,
    so the ranks' dtype rule refused a reference they would never open."""
    from types import SimpleNamespace

    from launcher.cli.check_command import _reference_dir

    reference = tmp_path / "reference"
    shutil.copytree(models["llama"][1]["safetensors"], reference)
    [holder] = reference.glob("*.safetensors")
    save_file({**load_file(holder), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4, dtype=torch.uint16)},
              holder)
    model_dir = models["llama"][1]["safetensors"]
    assert _reference_dir(SimpleNamespace(reference=str(reference)), model_dir) == reference
    with pytest.raises(ValueError, match="has dtype U16"):  # as the model, its ranks would read it
        _reference_dir(SimpleNamespace(reference=None), reference)


def test_an_index_mapping_a_tensor_to_two_files_is_refused_naming_both(models, tmp_path):
    """json.loads keeps the last of a repeated key: which copy loaded, and which the weights'
    fingerprint hashed, was the parser's choice."""
    d = tmp_path / "idx"
    shutil.copytree(models["llama"][1]["safetensors_sharded"], d)
    index = d / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    name = next(n for n, f in weight_map.items() if f == files[1])
    entries = [f"{json.dumps(n)}: {json.dumps(f)}" for n, f in weight_map.items()]
    entries.insert(0, f"{json.dumps(name)}: {json.dumps(files[0])}")  # the same tensor, first in another file
    index.write_text('{"weight_map": {' + ", ".join(entries) + "}}")
    with pytest.raises(ValueError) as err:
        find_checkpoint(d)
    msg = str(err.value)
    assert f"checkpoint index {index} maps tensor {name!r} to 2 files" in msg
    assert f"{files[0]} and {files[1]}" in msg and "remove all but the entry" in msg
    entries[0] = f"{json.dumps(name)}: {json.dumps('./' + files[1])}"  # the same file twice: harmless
    index.write_text('{"weight_map": {' + ", ".join(entries) + "}}")
    assert find_checkpoint(d).weight_map[name] == d / files[1]


@pytest.mark.parametrize("fmt", ["bin", "bin_sharded"])
def test_a_pickles_wrong_shape_is_refused_before_any_worker(models, tmp_path, fmt):
    """The driver's check read safetensors headers only: a pickled checkpoint's wrong shape waited for
    the ranks (after Ray had started), and `check` built its reference on it first (a traceback)."""
    from shardlib.checkpoint_files import check_checkpoint

    d = _copy_config(models["llama"][1][fmt], tmp_path)
    state = {**models["llama"][0], "model.layers.0.self_attn.k_proj.weight": torch.zeros(24, 48)}
    if fmt == "bin":
        _save(state, d, fmt)
    else:  # two pickles and their index
        names = sorted(state)
        halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
        for file, part in halves.items():
            torch.save({n: state[n] for n in part}, d / file)
        (d / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"weight_map": {n: file for file, part in halves.items() for n in part}}))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' in pytorch_model.*"
                                         r"\(16, 48\), found \(24, 48\)"):
        check_checkpoint(d, load_model_config(d))


def test_weights_saved_without_the_model_prefix_are_named_so(models, tmp_path):
    """A base model's state_dict (no 'model.' prefix) was refused as tensors the config does not
    describe, with advice to check num_hidden_layers."""
    d = _copy_config(models["llama"][1]["safetensors"], tmp_path)
    state = models["llama"][0]
    _save({n.removeprefix("model."): t for n, t in state.items() if n != "lm_head.weight"}, d, "safetensors")
    with pytest.raises(ValueError, match=r"the names lack the 'model\.' prefix of a causal LM's checkpoint .*save them "
                                         r"from the ForCausalLM model, or add the prefix"):
        _load(d)


def test_rank_and_layout_must_fit(models):
    d = models["llama"][1]["safetensors"]
    config = load_model_config(d)
    with pytest.raises(ValueError, match="rank 2 is outside tp_degree 2"):
        load_rank_shard(d, config, ShardLayout.for_model(config, 2), 2)
    other = ShardLayout(2, "shard", 6, 2, 8, 48, 96, 128)
    with pytest.raises(ValueError, match="another model"):
        load_rank_shard(d, config, other, 0)


def test_safetensors_reads_only_the_shard_bytes(models, monkeypatch):
    # The reader's promise: bytes read from the file are the rank's slices, padding excluded.
    import os

    state, dirs = models["llama"]
    config = load_model_config(dirs["safetensors"])
    layout = ShardLayout.for_model(config, 3)
    read = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: read.append(real_preadv(fd, bufs, off)) or read[-1])
    load_rank_shard(dirs["safetensors"], config, layout, 2)
    wanted = 0
    for name, tensor in state.items():
        tslice = slice_for("llama", name, tensor.shape, 2, layout)
        per_index = tensor.numel() // tensor.shape[tslice.dim] if not tslice.is_whole else 0
        wanted += 4 * (tensor.numel() if tslice.is_whole else tslice.length() * per_index)
    assert sum(read) == wanted


class _NotATensor:
    pass


def _save(state, d: Path, fmt: str) -> Path:
    if fmt == "safetensors":
        path = d / "model.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    else:
        path = d / "pytorch_model.bin"
        torch.save(state, path)
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_a_rank_counts_the_bytes_a_decode_step_reads(tmp_path, tied):
    """decode_read_bytes (the bandwidth bound's numerator in the benchmarks): the whole shard, but an
    untied input embedding, whose lookup reads one row a token, left out; tied, it is the LM head."""
    from workers.rank_worker import LoadSpec, RankWorker, WorkerSpec

    path = save_model(build_random_model("llama", vocab_size=128, hidden_size=64, tie_word_embeddings=tied),
                      tmp_path / "m")
    config = load_model_config(path)
    worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend="cpu", threads=1))
    worker.init_backend("127.0.0.1", 0, 10.0)
    stats = worker.load(LoadSpec(config=config, layout=ShardLayout.for_model(config, 1), dtype="float32",
                                 model_dir=str(path)))
    embedding = 128 * 64 * 4
    assert stats.decode_read_bytes == stats.shard_bytes - (0 if tied else embedding)
    assert stats.shard_bytes > embedding * (1 if tied else 2)  # the table (and an untied head) were read
