"""A config.json that names no dtype: the checkpoint's dtype comes from its weights, as transformers'
dtype "auto" takes it, so the plan sizes the ranks for what they load (a bf16 checkpoint planned as
float32 needed twice the memory per rank in the plan and on every rank)."""

from __future__ import annotations

import json

import pytest
import torch

from launcher.cli import main
from shardlib.model_config import load_model_config
from shardlib.weights_dtype import stored_weights_dtype
from tests.model_factory import build_random_model, save_model


def _without_dtype(model_dir):
    config_file = model_dir / "config.json"
    raw = json.loads(config_file.read_text())
    raw.pop("dtype", None)
    raw.pop("torch_dtype", None)
    config_file.write_text(json.dumps(raw))
    return model_dir


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["safetensors", "safetensors_sharded"])
def test_a_config_without_dtype_takes_the_dtype_transformers_loads(tmp_path, dtype, fmt):
    import transformers

    model_dir = _without_dtype(save_model(build_random_model().to(dtype), tmp_path / "m", fmt))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir)  # dtype "auto", transformers 5's default
    assert reference.dtype == dtype
    assert load_model_config(model_dir).torch_dtype == str(dtype).removeprefix("torch.")


def test_the_dtype_config_json_names_wins_over_the_weights(tmp_path):
    model_dir = save_model(build_random_model().to(torch.bfloat16), tmp_path / "m")
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("dtype", None)
    (model_dir / "config.json").write_text(json.dumps({**raw, "torch_dtype": "float16"}))
    assert load_model_config(model_dir).torch_dtype == "float16"


def test_float8_tensors_are_skipped_and_a_config_alone_is_float32(tmp_path):
    from safetensors.torch import save_file

    from tests.model_factory import checkpoint_state_dict

    model_dir = _without_dtype(save_model(build_random_model(), tmp_path / "m"))
    state = {name: t.to(torch.bfloat16) for name, t in checkpoint_state_dict(build_random_model()).items()}
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].to(torch.float8_e4m3fn)  # sorts first
    save_file(state, model_dir / "model.safetensors")
    assert load_model_config(model_dir).torch_dtype == "bfloat16"
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    assert load_model_config(alone / "config.json").torch_dtype == "float32"  # no weights to read it from


def test_a_config_file_given_beside_its_weights_takes_their_dtype(tmp_path, capsys):
    """`plan --model DIR/config.json` planned float32 beside bf16 weights: twice their memory."""
    model_dir = _without_dtype(save_model(build_random_model().to(torch.bfloat16), tmp_path / "m"))
    assert load_model_config(model_dir / "config.json").torch_dtype == "bfloat16"
    assert main(["plan", "--model", str(model_dir / "config.json"), "--tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    # another JSON file is no model folder's own config: the weights beside it may be another model's
    (model_dir / "planned-llama.json").write_bytes((model_dir / "config.json").read_bytes())
    assert load_model_config(model_dir / "planned-llama.json").torch_dtype == "float32"


def test_plan_sizes_a_bf16_checkpoint_without_dtype_as_bf16(tmp_path, capsys):
    model_dir = _without_dtype(save_model(build_random_model().to(torch.bfloat16), tmp_path / "m"))
    assert main(["plan", "--model", str(model_dir), "--tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_pickled_checkpoint_gives_its_dtype_without_torch(tmp_path, dtype):
    """Pickled weights were planned as float32 whatever they held (twice a bf16 checkpoint's memory);
    their dtype is now read from the storage types data.pkl names, still without importing torch
    or unpickling anything, as transformers takes it (the first floating tensor in the dict's order)."""
    import subprocess
    import sys
    from pathlib import Path

    import transformers

    model_dir = _without_dtype(save_model(build_random_model().to(dtype), tmp_path / "m", "bin"))
    assert transformers.AutoModelForCausalLM.from_pretrained(model_dir).dtype == dtype
    code = ("import sys\nfrom shardlib.model_config import load_model_config\n"
            f"print(load_model_config({str(model_dir)!r}).torch_dtype, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == [str(dtype).removeprefix("torch."), "False"], out.stderr


def test_a_pickle_whose_first_floating_tensor_is_float64_or_unreadable_stays_float32(tmp_path):
    from shardlib.weights_dtype import pickled_weights_dtype

    path = tmp_path / "w.bin"
    torch.save({"a.ids": torch.arange(3), "b": torch.zeros(2, dtype=torch.bfloat16)}, path)  # ints skipped
    assert pickled_weights_dtype(path) == "bfloat16"
    torch.save({"a": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.bfloat16)}, path)
    assert pickled_weights_dtype(path) is None
    torch.save({"a": torch.zeros(2, dtype=torch.float16)}, path, pickle_protocol=4)  # STACK_GLOBAL
    assert pickled_weights_dtype(path) == "float16"
    # protocol 4 writes 'torch' once and fetches it from the memo after: the bfloat16 storage was missed
    torch.save({"ids": torch.arange(3), "w": torch.zeros(2, dtype=torch.bfloat16)}, path, pickle_protocol=4)
    assert pickled_weights_dtype(path) == "bfloat16"
    path.write_bytes(path.read_bytes()[:100])
    assert pickled_weights_dtype(path) is None


def test_with_both_dtype_keys_dtype_decides_as_in_transformers_5(tmp_path):
    import transformers

    model_dir = save_model(build_random_model().to(torch.bfloat16), tmp_path / "m")
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "dtype": "bfloat16", "torch_dtype": "float16"}))
    assert transformers.AutoModelForCausalLM.from_pretrained(model_dir).dtype == torch.bfloat16
    assert load_model_config(model_dir).torch_dtype == "bfloat16"


def test_a_pickles_float8_tensors_are_skipped_as_safetensors_are(tmp_path):
    from shardlib.weights_dtype import pickled_weights_dtype

    path = tmp_path / "w.bin"
    torch.save({"a": torch.zeros(2).to(torch.float8_e4m3fn), "b": torch.zeros(2, dtype=torch.float16)}, path)
    assert pickled_weights_dtype(path) == "float16"


def test_a_corrupt_compressed_pickle_plans_as_float32_without_a_traceback(tmp_path):
    """A .bin re-zipped with DEFLATE whose data.pkl is damaged raised zlib.error out of `plan`."""
    import zipfile

    from shardlib.weights_dtype import pickled_weights_dtype

    plain, packed = tmp_path / "w.bin", tmp_path / "packed.bin"
    torch.save({"w": torch.zeros(64, dtype=torch.bfloat16)}, plain)
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
    assert pickled_weights_dtype(packed) == "bfloat16"  # intact, compressed: read
    raw = bytearray(packed.read_bytes())
    with zipfile.ZipFile(packed) as archive:
        record = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    start = record.header_offset + 30 + len(record.filename.encode()) + len(record.extra)
    for k in range(start, start + min(40, record.compress_size)):
        raw[k] ^= 0x5A
    packed.write_bytes(bytes(raw))
    assert pickled_weights_dtype(packed) is None


def test_a_float64_checkpoint_runs_in_float32(tmp_path, capsys):
    """config.json's "float64" was refused ("must name a dtype"), --dtype float32 included: no rank
    computes in float64, but every weight casts to float32 as it loads, which the plan now says."""
    from shardlib.checkpoint import load_rank_shard
    from shardlib.sharding import ShardLayout

    model_dir = save_model(build_random_model().to(torch.float64), tmp_path / "m")
    assert json.loads((model_dir / "config.json").read_text()).get("dtype") == "float64"
    config = load_model_config(model_dir)
    assert config.torch_dtype == "float32"
    assert main(["plan", "--model", str(model_dir), "--tp", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"
    shard = load_rank_shard(model_dir, config, ShardLayout.for_model(config, 1), 0, dtype=config.torch_dtype)
    assert {t.dtype for t in shard.values()} == {torch.float32}


@pytest.mark.parametrize("quantized", ["I8", "F8_E4M3"])
def test_a_quantized_checkpoints_scales_and_8_bit_weights_are_skipped(tmp_path, quantized):
    """`<m>.scale` (float32) sorts before `<m>.weight`: a float16 checkpoint whose embedding was
    quantized read as float32, its plan and KV cache twice the size."""
    from safetensors.torch import save_file

    stored = {"I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn}[quantized]
    state = {"model.embed_tokens.weight": torch.zeros(8, 4, dtype=stored),
             "model.embed_tokens.scale": torch.ones(8, 1),
             "model.layers.0.mlp.up_proj.weight": torch.zeros(6, 4, dtype=stored),
             "model.layers.0.mlp.up_proj.scale": torch.ones(6, 1),
             "model.norm.weight": torch.ones(4, dtype=torch.float16)}
    save_file(state, tmp_path / "model.safetensors")
    assert stored_weights_dtype(tmp_path) == "float16"


def test_a_scale_of_no_8_bit_weight_is_the_models_own_and_counts(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.layers.0.layer.scale": torch.ones(4), "model.layers.0.layer.weight": torch.ones(4, 4),
               "model.norm.weight": torch.ones(4, dtype=torch.float16)}, tmp_path / "model.safetensors")
    assert stored_weights_dtype(tmp_path) == "float32"  # transformers takes the first floating tensor


@pytest.mark.parametrize("tied,option", [(True, "embed"), (False, "embed"), (False, "lm_head")])
def test_quantize_writes_the_sources_dtype_where_its_config_names_none(tmp_path, tied, option):
    """The output's first floating tensor by name is a float32 scale once the embedding or LM head is
    quantized: its config.json names the source's dtype, so nothing reads it from the weights."""
    from shardlib.quantize_checkpoint import quantize_checkpoint

    source = _without_dtype(save_model(build_random_model(tie_word_embeddings=tied, num_layers=1).to(torch.bfloat16),
                                       tmp_path / "m"))
    out = quantize_checkpoint(source, tmp_path / "q", "int8", **{option: True})
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_model_config(out).torch_dtype == "bfloat16"


def test_quantize_leaves_a_dtype_the_sources_config_names_as_it_is(tmp_path):
    from shardlib.quantize_checkpoint import quantize_checkpoint

    source = _without_dtype(save_model(build_random_model(num_layers=1).to(torch.bfloat16), tmp_path / "m"))
    raw = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**raw, "dtype": "float16"}))
    written = json.loads((quantize_checkpoint(source, tmp_path / "q", "int8", embed=True) / "config.json").read_text())
    assert written["dtype"] == "float16" and "torch_dtype" not in written
