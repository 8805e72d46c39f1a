"""Quantized weights: the formats against plain torch, the quantized checkpoint, sharded against
unsharded (every rank in this process), and one end-to-end run through Ray.

The reference for a quantized model is the same model with every quantized weight dequantized
(q * scale in float32) and loaded into transformers: it computes the same numbers in plain torch,
so greedy tokens must be equal (the random models' logits are peaked: tests/model_factory.py).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from shardlib.model_config import ModelConfig, load_model_config
from shardlib.quantization import (FORMAT_MAX, Quantization, dequantize, dequantize_state_dict, quantize,
                                   quantize_state_dict, scale_name)
from shardlib.quantize_checkpoint import quantize_checkpoint
from tests.model_factory import build_random_model, checkpoint_state_dict, save_model
from tests.tp_harness import Case, Request, build_rank_model, hf_state_dict, run_tp_in_process
from workers.collectives import SingleRank
from workers.engine import generate
from workers.quantized_linear import QuantizedWeight
from workers.sampling import SamplingParams

FORMATS = [(fmt, per_channel) for fmt in ("int8", "f8e4m3", "f8e5m2") for per_channel in (True, False)]
PROMPTS = [[5, 9, 33, 17, 80, 3, 44, 12, 61], [7, 100, 21]]
NEW_TOKENS = 8
EOS = 2


def plain_reference(w: torch.Tensor, fmt: str, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The formats written out independently with plain torch ops."""
    top = {"int8": 127.0, "f8e4m3": 240.0, "f8e5m2": 57344.0}[fmt]
    absmax = w.abs().max(dim=1, keepdim=True).values if per_channel else w.abs().max().view(1)
    scale = absmax / top
    x = torch.clamp(w / scale, -top, top)
    if fmt == "int8":
        return torch.round(x).to(torch.int8), scale
    return x.to(torch.float8_e4m3fn if fmt == "f8e4m3" else torch.float8_e5m2), scale


@pytest.mark.parametrize("fmt,per_channel", FORMATS)
def test_round_trip_matches_plain_torch_and_error_bounds(fmt, per_channel):
    torch.manual_seed(0)
    w = torch.randn(48, 80) * torch.linspace(0.01, 3.0, 48)[:, None]  # rows of very different ranges
    q, scale = quantize(w, fmt, per_channel)
    ref_q, ref_scale = plain_reference(w, fmt, per_channel)
    assert scale.shape == ((48, 1) if per_channel else (1,)) and scale.dtype == torch.float32
    assert q.dtype == ref_q.dtype and torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))  # bit-identical stored values
    # The absmax maps onto the format's maximum (per row, or once per tensor).
    top = q.to(torch.float32).abs().amax(dim=1 if per_channel else None)
    assert torch.all(top == FORMAT_MAX[fmt])
    err = (dequantize(q, scale) - w).abs()
    if fmt == "int8":
        assert torch.all(err <= scale / 2 + 1e-7)  # round to nearest: half a step
    else:  # 3 (e4m3) or 2 (e5m2) mantissa bits: half an ulp relative, or the subnormal step
        mantissa = 3 if fmt == "f8e4m3" else 2
        tiny = scale * (2.0 ** (-9 if fmt == "f8e4m3" else -16))
        assert torch.all(err <= w.abs() * 2.0 ** -(mantissa + 1) + tiny)


def test_int8_rounds_half_to_even_and_zero_rows_are_safe():
    w = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize(w, "int8", per_channel=True)
    assert q[0].tolist() == [127, 0, 2, 2, 0] and q[1].tolist() == [0] * 5
    assert torch.isfinite(scale).all() and torch.equal(dequantize(q, scale)[1], torch.zeros(5))


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("src")
    save_model(build_random_model(seed=3), path)
    (path / "tokenizer.json").write_text("{}")  # copied verbatim
    return path


def test_a_killed_quantizes_leftovers_are_swept_by_the_next(source_dir, tmp_path):
    """A quantize killed part way (SIGKILL: no cleanup runs) left `.OUT.partial-PID`, up to
    the model's size, that no later quantize removed."""
    import os
    import subprocess
    import sys

    from shardlib.atomic_dir import owned_sibling
    from shardlib.process_alive import writer_tag

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = writer_tag().rsplit("-", 1)[0]
    leftovers = [tmp_path / f".q.partial-{host}-{dead.stdout.strip()}-0123abcd",  # its writer is gone
                 tmp_path / ".q.partial-4242"]  # the earlier name, which names no host: by its age
    running = owned_sibling(tmp_path / "q", "partial")  # this process's own: a writer still at work
    for folder in (*leftovers, running):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    os.utime(leftovers[1], (0, 0))
    quantize_checkpoint(source_dir, tmp_path / "q", "int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["q", running.name])


@pytest.mark.parametrize("meanwhile", ["written", "empty", "empty-at-the-rename"])
def test_an_out_written_meanwhile_by_another_process_is_refused_as_taken(source_dir, tmp_path, monkeypatch,
                                                                         meanwhile):
    """Two quantizes into one new --out: the loser was told its --out could not be written
    ("Directory not empty"), and an empty folder made meanwhile was replaced without a word."""
    from shardlib import quantize_checkpoint as module

    out = tmp_path / "q"

    def another_process_writes_out(*_):
        out.mkdir()
        if meanwhile == "written":  # another quantize's folder
            (out / "config.json").write_text("{}")

    if meanwhile == "empty-at-the-rename":  # after the check for it: rename(2) replaced it silently
        rename = module.rename_no_replace
        monkeypatch.setattr(module, "rename_no_replace", lambda a, b: another_process_writes_out() or rename(a, b))
    else:
        copy = module._copy_other_files
        monkeypatch.setattr(module, "_copy_other_files", lambda model_dir, partial: copy(model_dir, partial) or
                            another_process_writes_out())
    with pytest.raises(ValueError, match=r"--out .*/q already exists: another process wrote it while this "
                                         r"quantize ran; choose a new directory"):
        quantize_checkpoint(source_dir, out, "int8")
    assert [p.name for p in tmp_path.iterdir()] == ["q"]  # this one's partial folder removed
    assert sorted(p.name for p in out.iterdir()) == (["config.json"] if meanwhile == "written" else [])


def test_every_file_is_fsynced_before_the_rename_and_the_rename_after_it(source_dir, tmp_path, monkeypatch):
    """Only model.safetensors was fsynced: a crash after the rename left a --out whose config.json
    and tokenizer could be empty or missing, though the folder looked complete."""
    from shardlib import quantize_checkpoint as module

    events = []
    for helper in ("fsync_tree", "fsync_dir", "rename_no_replace"):
        real = getattr(module, helper)

        def recorded(*paths, real=real, helper=helper):
            synced = sorted(p.name for p in paths[0].iterdir()) if helper == "fsync_tree" else None
            events.append((helper, paths[-1], synced))
            return real(*paths)

        monkeypatch.setattr(module, helper, recorded)
    out = quantize_checkpoint(source_dir, tmp_path / "q", "int8")
    files = sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert [(helper, path.name if helper != "fsync_tree" else path.name.startswith(".q.partial-"), synced)
            for helper, path, synced in events] == [
        ("fsync_tree", True, files),  # the partial folder, with every file it renames into place
        ("rename_no_replace", "q", None),
        ("fsync_dir", tmp_path.name, None)]  # the folder holding the rename
    assert events[-1][1] == out.parent


def test_quantized_checkpoint_layout_config_and_refusals(source_dir, tmp_path):
    from safetensors.torch import load_file

    out = quantize_checkpoint(source_dir, tmp_path / "q", "f8e4m3", per_channel=False)
    raw = json.loads((out / "config.json").read_text())
    assert raw["quantization_config"] == {"quant_method": "corelaunch", "quantization_dtype": "f8e4m3",
                                          "quantization_type": "per_tensor_symmetric", "modules": "linear"}
    assert (out / "tokenizer.json").read_text() == "{}"
    assert load_model_config(out).quantization == Quantization("f8e4m3", "per_tensor_symmetric")
    stored, source = load_file(out / "model.safetensors"), load_file(source_dir / "model.safetensors")
    expected = quantize_state_dict(source, Quantization("f8e4m3", "per_tensor_symmetric"))
    assert stored.keys() == expected.keys()
    for name, tensor in expected.items():
        assert stored[name].dtype == tensor.dtype and torch.equal(stored[name].view(torch.uint8),
                                                                  tensor.view(torch.uint8)), name
    assert stored["model.embed_tokens.weight"].dtype == torch.float32  # not quantized by default
    with pytest.raises(ValueError, match="unknown quantization dtype 'int4'"):
        quantize_checkpoint(source_dir, tmp_path / "x", "int4")
    (tmp_path / "compiled").mkdir()
    (tmp_path / "compiled" / "manifest.json").write_text("{}")  # a compiled directory: named as one
    with pytest.raises(ValueError, match="is a corelaunch compiled or pre-sharded directory, not a Hugging Face"):
        quantize_checkpoint(tmp_path / "compiled", tmp_path / "x", "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(out, tmp_path / "y", "int8")
    with pytest.raises(ValueError, match="already exists"):
        quantize_checkpoint(source_dir, out, "int8")
    with pytest.raises(ValueError, match=r"config.json is a file; pass the model directory that holds it"):
        quantize_checkpoint(source_dir / "config.json", tmp_path / "z", "int8")
    with pytest.raises(FileNotFoundError, match=r"--model \S+missing does not exist; pass a Hugging Face model"):
        quantize_checkpoint(tmp_path / "missing", tmp_path / "z", "int8")  # said "has no config.json"
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists() and not (tmp_path / "z").exists()


@pytest.mark.parametrize("stored", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_a_weight_stored_in_8_bits_is_quantized_and_other_frameworks_weights_are_not_copied(source_dir, tmp_path,
                                                                                          stored):
    """A review: an fp8-stored weight in a checkpoint of no quantization (the checkpoint check takes
    it) ended quantize in a traceback (torch has no isfinite or amax for it); a Flax or TensorFlow
    copy of the weights beside the checkpoint was copied whole into the quantized folder."""
    from safetensors.torch import load_file, save_file

    source = tmp_path / "fp8-stored"
    shutil.copytree(source_dir, source)
    state = load_file(source / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = state[name].to(stored)
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    (source / "flax_model.msgpack").write_bytes(b"x" * 64)
    (source / "tf_model.h5").write_bytes(b"x" * 64)
    out = quantize_checkpoint(source, tmp_path / "q", "int8")
    quantized = load_file(out / "model.safetensors")
    assert torch.equal(quantized[name], quantize(state[name].float(), "int8", True)[0])
    assert not (out / "flax_model.msgpack").exists() and not (out / "tf_model.h5").exists()
    assert (out / "tokenizer.json").exists()


def test_a_write_that_fails_without_a_file_name_is_said_as_outs(source_dir, tmp_path):
    """A review: a full disk or a file size limit (errors of a write to an open file carry no file
    name) was printed as a bare "[Errno 27] File too large", not as --out's, with no fix."""
    import subprocess
    import sys

    run = ("import resource, signal, sys\n"
           "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal, as a full disk's ENOSPC\n"
           "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
           "from launcher.cli import main\n"
           "sys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "q"
    done = subprocess.run([sys.executable, "-c", run, "quantize", "--model", str(source_dir), "--dtype", "int8",
                           "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"corelaunch quantize: could not write --out {out} ([Errno 27] File too large); "
                                  f"pass a new path"), done.stderr
    assert not out.exists()


def test_the_clis_error_after_some_tensors_starts_a_line_of_its_own(source_dir, tmp_path, capsys):
    """A review: the progress line ("quantize: 16/21 tensors") is written without its end, and an
    error half way was printed on the end of it."""
    from safetensors.torch import load_file, save_file

    from launcher.cli import main

    broken = tmp_path / "broken"
    shutil.copytree(source_dir, broken)
    state = load_file(broken / "model.safetensors")
    name = sorted(n for n in state if n.endswith("down_proj.weight"))[-1]  # late in the order: tensors before it
    state[name][0, 0] = float("nan")
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    assert main(["quantize", "--model", str(broken), "--dtype", "int8", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "tensors\ncorelaunch quantize: tensor " in err and "tensorscorelaunch" not in err, err


def test_an_interrupt_after_some_tensors_starts_a_line_of_its_own(source_dir, tmp_path, capsys, monkeypatch):
    """A review: Ctrl-C or SIGTERM half way printed "quantize: 1/21 tensorscorelaunch: interrupted"."""
    from launcher.cli import main
    from shardlib import quantize_checkpoint as module

    def interrupted(model_dir, config, quant, path, progress):
        progress("first", 1, 21)
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "_write_weights", interrupted)
    assert main(["quantize", "--model", str(source_dir), "--dtype", "int8", "--out", str(tmp_path / "q")]) == 130
    err = capsys.readouterr().err
    assert err.endswith("quantize: 1/21 tensors\ncorelaunch: interrupted\n"), repr(err)
    assert not (tmp_path / "q").exists()


def test_the_built_in_models_marker_is_not_copied(source_dir, tmp_path):
    """A review: quantizing the built-in model copied its conversion record (corelaunch_demo.json,
    listing the source folder's files and sizes) into the quantized folder, where it described
    another folder's files."""
    demo_like = tmp_path / "demo"
    shutil.copytree(source_dir, demo_like)
    (demo_like / "corelaunch_demo.json").write_text('{"files": {"model.safetensors": 1}}')
    out = quantize_checkpoint(demo_like, tmp_path / "q", "int8")
    assert (out / "tokenizer.json").is_file() and not (out / "corelaunch_demo.json").exists()


@pytest.mark.parametrize("fmt,per_channel", [("int8", True), ("f8e4m3", False)])
def test_a_weight_with_nan_or_inf_is_refused_naming_it(source_dir, tmp_path, fmt, per_channel):
    """They were written without a word: NaN scales and codes (every code of the tensor per tensor),
    which the rank then refused saying `corelaunch quantize` clamps every value (it leaves NaN), or
    which loaded and failed every request on NaN logits."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(source_dir, broken)
    state = load_file(broken / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    state[name][3, 5] = float("nan")
    state[name][7, 0] = float("inf")
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    # the rows that hold them: "rows 0-63" named every row of this tensor
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(name)}' holds 2 NaN or infinite value\(s\) in "
                                         rf"row\(s\) 3, 7: their 8-bit codes and scale would be NaN"):
        quantize_checkpoint(broken, tmp_path / "q", fmt, per_channel=per_channel)
    assert not (tmp_path / "q").exists() and [p.name for p in tmp_path.iterdir()] == ["broken"]  # nothing left


def test_a_float64_tensor_is_written_as_float32(source_dir, tmp_path):
    """A norm stored in float64 (which a launch takes, casting it) was refused by quantize: "dtype
    torch.float64, which `corelaunch quantize` cannot write", naming no fix."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    wide = tmp_path / "wide"
    shutil.copytree(source_dir, wide)
    state = load_file(wide / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].double()
    state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"].double()
    save_file(state, wide / "model.safetensors", metadata={"format": "pt"})
    out = quantize_checkpoint(wide, tmp_path / "q", "int8")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("model.norm.weight"), state["model.norm.weight"].float())
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.int8


def test_codes_of_another_format_than_config_json_names_are_refused(source_dir, tmp_path):
    """Loading goes by each code's stored dtype, and the plan, check's tolerances and compiled
    directories by config.json's quantization_dtype: int8 codes under "f8e4m3" (or the reverse)
    loaded and ran, while `plan --dtype int8` said the checkpoint was quantized as fp8."""
    from shardlib.checkpoint_files import check_checkpoint

    out = quantize_checkpoint(source_dir, tmp_path / "q", "int8")
    check_checkpoint(out, load_model_config(out))  # as written: taken
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["quantization_dtype"] = "f8e4m3"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' in model\.safetensors is I8 "
                                         r"\(config\.json's quantization_dtype 'f8e4m3' stores F8_E4M3\)"):
        check_checkpoint(out, load_model_config(out))


def test_lm_head_on_a_tied_model_is_refused_rather_than_recorded_and_skipped(tmp_path):
    from launcher.cli import main

    tied = save_model(build_random_model(tie_word_embeddings=True), tmp_path / "tied")
    with pytest.raises(ValueError, match=r"--lm-head: .* ties its LM head to the embedding table"):
        quantize_checkpoint(tied, tmp_path / "q", "int8", lm_head=True)
    assert main(["quantize", "--model", str(tied), "--dtype", "int8", "--lm-head", "--out", str(tmp_path / "q"),
                 "--quiet"]) == 2
    assert not (tmp_path / "q").exists()
    # --embedding is the way to quantize the shared table, and is recorded as what it did
    out = quantize_checkpoint(tied, tmp_path / "e", "int8", embed=True)
    assert load_model_config(out).quantization.modules == "linear+embed"


def test_streamed_quantizer_writes_the_whole_tensors_bytes(monkeypatch):
    import io

    import shardlib.quantize_checkpoint as qc

    monkeypatch.setattr(qc, "QUANT_BLOCK_BYTES", 4 * 80 * 7)  # 7 rows a block: a ragged last block
    w = torch.randn(50, 80) * torch.linspace(0.1, 3, 50)[:, None]  # rows of different ranges
    for fmt in ("int8", "f8e4m3"):
        for per_channel in (True, False):
            quant = Quantization(fmt, "per_channel_symmetric" if per_channel else "per_tensor_symmetric")
            reads = []
            out = io.BytesIO()
            qc.write_quantized(out, lambda a, b: (reads.append((a, b)), w[a:b].clone())[1], tuple(w.shape), quant)
            ref_q, ref_scale = quantize(w, fmt, per_channel)
            want = ref_q.view(torch.uint8).numpy().tobytes() + ref_scale.numpy().tobytes()
            assert out.getvalue() == want, (fmt, per_channel)
            assert max(b - a for a, b in reads) == 7  # never more than a block of rows at once


# ---- sharded execution ---------------------------------------------------------------------------
# name: (tp, model shape, format, granularity, quantized modules)
SPECS = {
    "int8_channel_tp2": (2, dict(num_heads=4, num_kv_heads=2), "int8", "per_channel_symmetric", "linear+lm_head"),
    "f8e4m3_tensor_tp2": (2, dict(num_heads=4, num_kv_heads=1), "f8e4m3", "per_tensor_symmetric", "linear+embed"),
    "f8e5m2_channel_qwen2_tp3": (3, dict(model_type="qwen2", hidden_size=48, num_heads=6, num_kv_heads=2,
                                         vocab_size=130, intermediate_size=100), "f8e5m2",
                                 "per_channel_symmetric", "linear+embed+lm_head"),
    "int8_channel_tied_tp3": (3, dict(hidden_size=48, num_heads=3, num_kv_heads=1, intermediate_size=100,
                                      vocab_size=130, tie_word_embeddings=True), "int8", "per_channel_symmetric",
                              "linear+embed"),  # the tied LM head is the quantized embedding
    "int8_tensor_tp3": (3, dict(hidden_size=48, num_heads=3, num_kv_heads=1, intermediate_size=100,
                                tie_word_embeddings=True), "int8", "per_tensor_symmetric", "linear"),
}


def quantized_case(name: str):
    """(quantized ModelConfig, quantized state_dict, transformers greedy tokens of the dequantized model)."""
    _, shape, fmt, granularity, modules = SPECS[name]
    model = build_random_model(seed=5, **shape)
    quant = Quantization(fmt, granularity, modules)
    state = quantize_state_dict(hf_state_dict(model), quant, model.config.tie_word_embeddings)
    model.load_state_dict(dequantize_state_dict(state, torch.float32), strict=False)
    ids = [torch.tensor([p]) for p in PROMPTS]
    with torch.no_grad():
        refs = [model.generate(i, attention_mask=torch.ones_like(i), do_sample=False, max_new_tokens=NEW_TOKENS,
                               eos_token_id=EOS, pad_token_id=0)[0, i.shape[1]:].tolist() for i in ids]
    config = ModelConfig.from_dict({**model.config.to_dict(), "quantization_config": quant.to_json()})
    return config, state, refs


@pytest.mark.parametrize("tp", [2, 3])
def test_sharded_quantized_equals_unsharded_and_dequantized_reference(tp):
    names = [n for n, spec in SPECS.items() if spec[0] == tp]
    cases, refs = [], {}
    for name in names:
        config, state, refs[name] = quantized_case(name)
        cases.append(Case(name, config, state, [Request([p], NEW_TOKENS, [EOS]) for p in PROMPTS]))
        # Unsharded, the same quantized weights: 8-bit in memory, tokens equal to transformers'.
        single = build_rank_model(config, state, 0, 1, SingleRank())
        assert isinstance(single.layers[0].mlp.down_weight, QuantizedWeight)
        assert single.layers[0].mlp.down_weight.q.element_size() == 1
        alone = [generate(single, [p], [SamplingParams()], NEW_TOKENS, [EOS])[0].token_ids for p in PROMPTS]
        assert alone == refs[name], name
    by_rank = run_tp_in_process(tp, cases)
    for name in names:
        for rank in range(tp):
            assert [out[0].token_ids for out in by_rank[rank][name]] == refs[name], (name, rank)


def dequantized_moe_tokens(model, state: dict) -> list[list[int]]:
    """transformers' greedy tokens for PROMPTS with `state`'s weights dequantized, read back through
    from_pretrained: a checkpoint names experts one by one where transformers fuses them in memory."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    weights = dequantize_state_dict(state, torch.float32)
    with tempfile.TemporaryDirectory() as directory:
        model.config.save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in weights.items()}, f"{directory}/model.safetensors",
                  metadata={"format": "pt"})
        reference, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = [torch.tensor([p]) for p in PROMPTS]
    with torch.no_grad():
        return [reference.eval().generate(i, attention_mask=torch.ones_like(i), do_sample=False,
                                          max_new_tokens=NEW_TOKENS, eos_token_id=EOS,
                                          pad_token_id=0)[0, i.shape[1]:].tolist() for i in ids]


@pytest.mark.parametrize("family, granularity", [("mixtral", "per_channel_symmetric"),
                                                 ("mixtral", "per_tensor_symmetric"),
                                                 ("qwen3_moe", "per_channel_symmetric")])
@pytest.mark.parametrize("sharding", ["tensor_parallel", "expert_parallel"])
def test_a_quantized_moe_gives_its_tp1_tokens_at_tp2(sharding, family, granularity):
    """An expert's per-channel scale follows its weight: cut with a gate or up projection under
    tensor parallelism, whole or nothing with its expert under expert parallelism (a TP 2 rank
    paired a sliced expert weight with its whole scale and refused to build)."""
    model = build_random_model(family, seed=5)
    quant = Quantization("int8", granularity, "linear")
    state = quantize_state_dict(checkpoint_state_dict(model), quant, model.config.tie_word_embeddings)
    assert any(".experts." in name and name.endswith(".scale") for name in state)  # the experts are quantized
    config = ModelConfig.from_dict({**model.config.to_dict(), "quantization_config": quant.to_json()})
    single = build_rank_model(config, state, 0, 1, SingleRank())
    alone = [generate(single, [p], [SamplingParams()], NEW_TOKENS, [EOS])[0].token_ids for p in PROMPTS]
    assert alone == dequantized_moe_tokens(model, state)  # TP 1 itself against an independent reference
    case = Case(family, config, state, [Request([p], NEW_TOKENS, [EOS]) for p in PROMPTS], moe_sharding=sharding)
    by_rank = run_tp_in_process(2, [case])
    for rank in range(2):
        assert [out[0].token_ids for out in by_rank[rank][family]] == alone, rank


@pytest.mark.parametrize("family, per_channel", [("mixtral", True), ("qwen3_moe", True), ("mixtral", False)])
@pytest.mark.parametrize("sharding", ["tensor_parallel", "expert_parallel"])
def test_the_planner_counts_a_quantized_moe_rank_as_it_loads(family, per_channel, sharding, tmp_path):
    """Every expert is quantized (Qwen3-MoE's were left in full precision while the planner counted
    them as 8-bit) and each rank's weights and scales are planned to the byte (per-tensor scales of
    other ranks' experts were loaded whole under expert parallelism)."""
    from shardlib.checkpoint import load_rank_shard
    from shardlib.planner import plan
    from shardlib.sharding import ShardLayout

    source = save_model(build_random_model(family, seed=5), tmp_path / "m")
    out = quantize_checkpoint(source, tmp_path / "q", "int8", per_channel=per_channel)
    config = load_model_config(out)
    for rank in range(2):
        shard = load_rank_shard(out, config, ShardLayout.for_model(config, 2, moe_sharding=sharding), rank)
        experts = [name for name in shard if ".experts." in name and name.endswith(".weight")]
        assert experts and all(shard[name].element_size() == 1 for name in experts)
        held = sum(t.numel() * t.element_size() for t in shard.values())
        assert plan(config, tp=2, moe_sharding=sharding).memory.weight_bytes_per_rank == held, rank


def test_dbrx_is_refused_by_quantize_and_by_8_bit_plans(tmp_path):
    """Its fused attention and expert matrices are not quantized: quantize wrote a checkpoint that
    said int8 and held none, and the planner counted it as 8-bit."""
    from shardlib.planner import plan

    source = save_model(build_random_model("dbrx", seed=5), tmp_path / "m")
    with pytest.raises(ValueError, match="dbrx model, whose fused attention and expert matrices"):
        quantize_checkpoint(source, tmp_path / "q", "int8")
    assert not (tmp_path / "q").exists()
    config = load_model_config(source)
    with pytest.raises(ValueError, match="does not quantize dbrx models"):
        plan(config, dtype="int8")


def test_scale_slices_follow_the_weight(source_dir):
    """A per-channel scale is cut with a column-parallel weight's rows and whole for a row-parallel one."""
    from shardlib.sharding import ShardLayout, slice_for

    config = load_model_config(source_dir)
    layout = ShardLayout.for_model(config, 2)
    up = slice_for("llama", "model.layers.0.mlp.up_proj.weight", (96, 64), 1, layout)
    assert slice_for("llama", "model.layers.0.mlp.up_proj.scale", (96, 1), 1, layout) == up
    assert slice_for("llama", "model.layers.0.mlp.down_proj.scale", (64, 1), 1, layout).is_whole
    assert slice_for("llama", "model.layers.0.self_attn.k_proj.scale", (1,), 1, layout).is_whole
    assert scale_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.scale"


def test_ray_group_greedy_equals_unsharded_quantized_plain_torch(tmp_path, ray_session):
    """Through Ray at TP 2 (eager: compiled equals eager is tests/test_compiled.py's), a quantized
    checkpoint written by quantize_checkpoint gives the dequantized transformers model's tokens."""
    from launcher.api import Launcher

    model = build_random_model(seed=7, num_heads=4, num_kv_heads=2)
    save_model(model, tmp_path / "src")
    out = quantize_checkpoint(tmp_path / "src", tmp_path / "q", "int8")
    from safetensors.torch import load_file

    model.load_state_dict(dequantize_state_dict(load_file(out / "model.safetensors"), torch.float32), strict=False)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             eos_token_id=EOS, pad_token_id=0)[0, ids.shape[1]:].tolist()
    with Launcher(model=str(out), tp=2, compile=False, progress=False) as launcher:
        [result] = launcher.generate([PROMPTS[0]], max_new_tokens=NEW_TOKENS)
    assert result.token_ids == ref


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_presharded_directory_carries_quantized_shards(source_dir, tmp_path, dtype):
    """A pre-sharded (and so a compiled) directory keeps the 8-bit weights and float32 scales."""
    from shardlib.checkpoint import load_rank_shard
    from shardlib.presharded import load_presharded, save_presharded
    from shardlib.sharding import ShardLayout

    out = quantize_checkpoint(source_dir, tmp_path / "q", "int8")
    config = load_model_config(out)
    layout = ShardLayout.for_model(config, 2)
    save_presharded(tmp_path / "pre", out, config, layout, dtype)
    for rank in range(2):
        direct = load_rank_shard(out, config, layout, rank, dtype)
        loaded = load_presharded(tmp_path / "pre", config, layout, rank, dtype)
        assert loaded.keys() == direct.keys()
        assert all(loaded[n].dtype == t.dtype and torch.equal(loaded[n], t) for n, t in direct.items())
        assert loaded["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
        assert loaded["model.layers.0.mlp.up_proj.scale"].dtype == torch.float32
        assert loaded["model.norm.weight"].dtype == (torch.bfloat16 if dtype else torch.float32)


def test_a_quantized_copy_saved_without_a_dtype_is_taken_by_the_launch_it_fits(source_dir, tmp_path):
    """save_presharded(dtype=None), the default, recorded "mixed" for a quantized checkpoint (int8 codes,
    float32 scales and norms), and every launch, which asks for one dtype, refused it. The dtype
    recorded is now that of the tensors a cast changes; a copy cut in another dtype is still refused."""
    from launcher.api import LaunchConfig
    from launcher.launch_plan import plan_launch
    from launcher.progress import Progress
    from shardlib.presharded import MANIFEST, check_presharded_dir, load_presharded, read_manifest, save_presharded
    from shardlib.sharding import ShardLayout

    out = quantize_checkpoint(source_dir, tmp_path / "q", "int8")
    config = load_model_config(out)
    layout = ShardLayout.for_model(config, 2)
    copy = save_presharded(tmp_path / "pre", out, config, layout)
    planned = plan_launch(LaunchConfig(model=str(out), tp=2, presharded_dir=str(copy)), Progress(False))
    assert planned.plan.dtype == "float32"  # the launch's own dtype, checked against the copy (check_presharded_dir)
    assert read_manifest(copy)["dtype"] == "float32"
    loaded = load_presharded(copy, config, layout, 1, "float32")
    assert loaded["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    # a copy written as "mixed" by the earlier save: its per-tensor records say what it holds
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps({**manifest, "dtype": "mixed"}))
    check_presharded_dir(copy, config, layout, "float32")
    with pytest.raises(ValueError, match=r"dtype: expected 'bfloat16', found 'float32'"):
        check_presharded_dir(copy, config, layout, "bfloat16")
    other = save_presharded(tmp_path / "bf16", out, config, layout, "bfloat16")
    with pytest.raises(ValueError, match=r"dtype: expected 'float32', found 'bfloat16'"):
        check_presharded_dir(other, config, layout, "float32")


@pytest.mark.parametrize("tp,per_channel,lm_head,embed", [(1, True, False, False), (2, True, True, True),
                                                         (2, False, False, True), (3, True, False, False)])
def test_planner_counts_quantized_weights_and_scales_exactly(source_dir, tmp_path, tp, per_channel, lm_head, embed):
    from shardlib.checkpoint import load_rank_shard
    from shardlib.planner import plan
    from shardlib.sharding import ShardLayout

    if tp == 3:  # 4 heads do not split in 3: a model of its own
        source_dir = save_model(build_random_model(hidden_size=48, num_heads=3, num_kv_heads=1, vocab_size=130,
                                                   intermediate_size=100), tmp_path / "src3")
    out = quantize_checkpoint(source_dir, tmp_path / "q", "int8", per_channel=per_channel, lm_head=lm_head,
                              embed=embed)
    config = load_model_config(out)
    for dtype in ("float32", "bfloat16"):
        shard = load_rank_shard(out, config, ShardLayout.for_model(config, tp), 0, dtype)
        held = sum(t.numel() * t.element_size() for t in shard.values())
        assert plan(config, tp=tp, dtype=dtype).memory.weight_bytes_per_rank == held
    # Planning the unquantized model at dtype int8 counts the same checkpoint `quantize` writes (per
    # channel), as it runs: on cpu in the checkpoint's dtype, which it keeps (weights, KV cache and
    # packing scratch alike); on Neuron the rest in bfloat16, as NxD Inference runs it.
    if per_channel and not lm_head and not embed:
        source = load_model_config(source_dir)
        assert plan(source, tp=tp, dtype="int8").memory == plan(config, tp=tp).memory
        neuron = "trn1.32xlarge"
        assert plan(source, instance=neuron, tp=tp, dtype="int8").memory.weight_bytes_per_rank == \
            plan(config, instance=neuron, tp=tp, dtype="bfloat16").memory.weight_bytes_per_rank
        assert plan(source, instance=neuron, tp=tp, dtype="int8").memory.kv_cache_dtype == "bfloat16"
        # ... and `plan --dtype int8` of the quantized checkpoint counts what it promised (the rest
        # and the cache were counted in the checkpoint's float32 there), and the warning names the
        # --dtype that launch needs
        assert plan(config, instance=neuron, tp=tp, dtype="int8").memory == \
            plan(source, instance=neuron, tp=tp, dtype="int8").memory
        before = plan(source, instance=neuron, tp=tp, dtype="int8").warnings
        assert any("launch it with --dtype bfloat16 (it keeps float32)" in w for w in before)
    for other in ("float8_e4m3", "float8_e5m2"):  # the checkpoint's own 8-bit format or a float dtype
        with pytest.raises(ValueError, match=rf"dtype {other}: this checkpoint is quantized as int8; plan --dtype int8"):
            plan(config, tp=tp, dtype=other)


@pytest.mark.slow
def test_the_demo_model_quantized_to_int8_still_answers_paris(tmp_path):
    """The built-in SmolLM2 written by `corelaunch quantize --dtype int8 --per-channel`, run by the
    worker code eagerly in this process: its greedy answer starts with "Paris" and its first 8
    tokens equal the float32 model's (the README's accuracy claim for int8 per channel)."""
    from launcher.api import load_tokenizer
    from launcher.cli import main
    from shardlib.checkpoint import load_rank_shard
    from shardlib.demo_model import ensure_demo_model
    from shardlib.sharding import ShardLayout
    from workers.model import ShardedCausalLM

    demo = ensure_demo_model()
    assert main(["quantize", "--model", str(demo), "--dtype", "int8", "--per-channel",
                 "--out", str(tmp_path / "int8")]) == 0
    tokenizer = load_tokenizer(demo)
    ids = list(tokenizer("The capital of France is")["input_ids"])
    tokens = {}
    for name, d in (("float32", demo), ("int8", tmp_path / "int8")):
        config = load_model_config(d)
        layout = ShardLayout.for_model(config, 1)
        shard = load_rank_shard(d, config, layout, 0)
        if name == "int8":
            assert any(t.dtype == torch.int8 for t in shard.values())  # 8-bit weights, really loaded
        model = ShardedCausalLM(config, layout, 0, shard, SingleRank())
        tokens[name] = generate(model, [ids], [SamplingParams()], 8, [])[0].token_ids
    assert tokenizer.decode(tokens["int8"]).lstrip().startswith("Paris"), tokenizer.decode(tokens["int8"])
    assert tokens["int8"] == tokens["float32"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_one_row_compiled_product_sums_in_float32(dtype):
    """The compiled one-row product (gemv) summed x * q in the compute dtype before the scale: the
    output over the scale, 127 / absmax times larger, overflowed float16 (inf for outputs near 30,
    then NaN logits on the first compiled decode step of a quantized float16 checkpoint)."""
    from shardlib.quantization import quantize
    from workers.quantized_linear import QuantizedWeight

    w = (torch.randn(8, 4096, generator=torch.Generator().manual_seed(0)) * 0.02).clamp(-0.05, 0.05)
    w[:, 0] = 0.05  # absmax 0.05: scale 3.9e-4
    x = torch.randn(1, 1, 4096, generator=torch.Generator().manual_seed(1))
    x[..., 0] = 600.0  # one large activation, as LLM hidden states have
    q, scale = quantize(w, "int8", True)
    weight = QuantizedWeight(q, scale)
    exact = (x.double() @ (q.double() * scale.double()).T).float()
    got = weight.linear(x.to(dtype), None, gemv=True)
    assert got.dtype == dtype and bool(got.isfinite().all())
    torch.testing.assert_close(got.float(), exact, rtol=1e-2, atol=0.1)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_weight_with_nan_or_infinite_codes_is_refused_at_load(fmt):
    """The small-batch kernel widened such codes to finite numbers (e4m3fn's NaN to 480, e5m2's
    infinities to 65536), where F.linear above its row limit gives NaN: one weight, two answers."""
    from workers.quantized_linear import QuantizedWeight

    every_code = torch.arange(256, dtype=torch.uint8).view(fmt).reshape(16, 16)
    expected = int((~torch.isfinite(every_code.float())).sum())
    with pytest.raises(ValueError, match=rf"holds {expected} NaN or infinite fp8 code"):
        QuantizedWeight(every_code, torch.ones(16, 1))
    finite = every_code.float().nan_to_num(0.0, 0.0, 0.0).to(fmt)
    QuantizedWeight(finite, torch.ones(16, 1))


def test_a_quantized_checkpoints_weight_not_stored_as_8_bit_codes_is_refused(tmp_path):
    """A weight beside its scale but stored in full precision (a hand-made or half-converted
    checkpoint) was cast and multiplied by its scale as if it held codes: shrunk, without a word."""
    from safetensors.torch import load_file, save_file

    from shardlib.checkpoint import load_rank_shard
    from shardlib.quantization import dequantize
    from shardlib.sharding import ShardLayout
    from workers.model import ShardedCausalLM

    source = save_model(build_random_model("mixtral", seed=5), tmp_path / "m")
    out = quantize_checkpoint(source, tmp_path / "q", "int8")
    config = load_model_config(out)
    layout = ShardLayout.for_model(config, 1)
    shard = load_rank_shard(out, config, layout, 0)
    name = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    shard[name] = dequantize(shard[name], shard[name[: -len(".weight")] + ".scale"])
    with pytest.raises(ValueError, match=rf"{name} has a scale .* but is stored as torch.float32, not as 8-bit codes"):
        ShardedCausalLM(config, layout, 0, shard, SingleRank())
    # Stored so, the checkpoint itself is refused, by the driver's check and by a rank's load
    from shardlib.checkpoint_files import check_checkpoint

    state = load_file(out / "model.safetensors")
    state[name] = dequantize(state[name], state[name[: -len(".weight")] + ".scale"])
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    for check in (lambda: check_checkpoint(out, config), lambda: load_rank_shard(out, config, layout, 0)):
        with pytest.raises(ValueError, match=rf"'{name}' in model.safetensors is F32 \(config\.json's "
                                             r"quantization_dtype 'int8' stores I8\).*not one `corelaunch quantize` writes"):
            check()


@pytest.mark.parametrize("family, tied, modules", [
    ("llama", True, "linear+embed"),  # the tied table is the LM head: quantized, so nothing is packed
    ("llama", False, "linear+lm_head"),  # the untied head quantized: nothing is packed
    ("llama", False, "linear+embed"),  # the embedding alone is quantized: the float32 head is packed
    ("llama", True, "linear"),  # the float32 tied table is packed
    ("mixtral", False, "linear+lm_head"),  # the float32 router is the one packed matrix
])
def test_the_planned_packing_scratch_is_the_largest_matrix_a_quantized_rank_packs(family, tied, modules):
    """The planner's packing scratch equals the largest matrix pack_linear_weights really packs on a
    quantized rank (it counted a vocabulary shard even where the LM head is quantized, so never packed)."""
    from shardlib.planner import plan
    from workers.packed_weight import PackedWeight, kernel, pack_linear_weights

    if not kernel.available():
        pytest.skip("the packed-weight kernel is not available here: nothing is packed")
    model = build_random_model(family, seed=5, tie_word_embeddings=tied, vocab_size=4096)
    quant = Quantization("int8", "per_channel_symmetric", modules)
    state = quantize_state_dict(checkpoint_state_dict(model), quant, tied)  # the checkpoint's names
    config = ModelConfig.from_dict({**model.config.to_dict(), "quantization_config": quant.to_json()})
    rank_model = build_rank_model(config, state, 0, 1, SingleRank())
    pack_linear_weights(rank_model)
    packed = {id(m): m for m in rank_model.modules() if isinstance(m, PackedWeight)}.values()
    largest = max((m.out_features * m.in_features * 4 for m in packed), default=0)
    assert plan(config, instance="cpu", tp=1).memory.packing_scratch_bytes_per_rank == largest
