"""Quantized weights and the fp8 KV cache against float32, side by side in one run; one JSON object.

SmolLM2-135M-Instruct (float32) and its copies written by `corelaunch quantize` (per channel, the
embedding quantized too, `--embedding`) into a temporary directory. Sections:

- quantize: peak host memory each `quantize` run adds over its imports (VmHWM in a fresh process)
  against the largest tensor of the checkpoint (target <= 1.5x), and its time;
- weights: bytes of one rank's loaded shard, TP 1 and TP 3 (2 where heads do not divide by 3)
  rank 0, each format over float32
  (target <= 0.27), with the peak memory each load added (benchmarks/load_memory.py's fresh-process
  measurement);
- kv_cache: bytes per token of the KV cache, fp8 e4m3 over float32 (target <= 0.26);
- accuracy: the first 16 greedy tokens of the README's demo prompts, each format against float32
  (eager, in this process);
- decode: decode tokens/s of the worker code in this process (benchmarks/decode.py's runner), eager
  and compiled, float32 and each format, runs interleaved so machine noise hits all alike; each
  format's median over float32's.

    python benchmarks/quantized.py [--formats int8,f8e4m3] [--repeats 3] [--new-tokens 64]
                                   [--prompt-tokens 128] [--threads 2] [--skip-decode] [--skip-compiled]
                                   [--model-dir DIR | --random-254m]

--random-254m runs the 254M random Llama of benchmarks/tp_scaling.py (built once in the temporary
directory) instead of SmolLM2. It has no tokenizer, so its prompts are fixed token ids and the
accuracy section compares token ids only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.decode import prompt_ids, worker_runner  # noqa: E402
from benchmarks.load_memory import _proc_field, _run_child  # noqa: E402
from benchmarks.tp_scaling import save_random_254m  # noqa: E402
from benchmarks.arguments import check_context, model_folder  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402

DEMO_PROMPTS = ["The capital of France is", "2 + 2 =", "Once upon a time"]
TARGETS = {"weights_over_fp32": 0.27, "quantize_peak_over_largest_tensor": 1.5, "kv_fp8_over_fp32": 0.26}


def _quantize_child(spec: dict) -> dict:
    """Runs in a fresh process: import, take the baseline, quantize, measure."""
    from shardlib.quantize_checkpoint import quantize_checkpoint

    before = _proc_field("/proc/self/status", "VmHWM:") * 1024
    start = time.perf_counter()
    quantize_checkpoint(spec["model_dir"], spec["out"], spec["dtype"], embed=True)
    return {"added_peak_bytes": _proc_field("/proc/self/status", "VmHWM:") * 1024 - before,
            "time_s": round(time.perf_counter() - start, 2)}


def quantize_in_child(model_dir: Path, out: Path, fmt: str) -> dict:
    spec = json.dumps({"model_dir": str(model_dir), "out": str(out), "dtype": fmt})
    proc = subprocess.run([sys.executable, __file__, "--quantize-child", spec], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"quantize {fmt} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def largest_tensor_bytes(model_dir: Path) -> int:
    from shardlib.checkpoint import find_checkpoint, SafetensorsFile

    ckpt = find_checkpoint(model_dir)
    return max(math.prod(e.shape) * e.dtype.itemsize for f in ckpt.files for e in SafetensorsFile(f).entries.values())


def weights_section(dirs: dict[str, Path]) -> dict:
    from shardlib.model_config import load_model_config

    heads = load_model_config(dirs["float32"]).num_attention_heads
    second = next((tp for tp in (3, 2, 4) if heads % tp == 0), None)  # SmolLM2: 3; the 254M model: 2
    out = {}
    for tp in (1,) if second is None else (1, second):  # heads none of 2-4 divides: TP 1 alone
        rows = {name: _run_child({"model_dir": str(d), "tp": tp, "rank": 0, "source": "checkpoint",
                                  "presharded_dir": None}) for name, d in dirs.items()}
        base = rows["float32"]["shard_bytes"]
        out[f"tp{tp}_rank0"] = {name: {"shard_bytes": r["shard_bytes"], "over_fp32": round(r["shard_bytes"] / base, 4),
                                       "added_peak_bytes": r["added_peak_bytes"]} for name, r in rows.items()}
    return out


def kv_section(model_dir: Path) -> dict:
    import torch

    from shardlib.model_config import load_model_config
    from workers.kv_cache import KVCache
    from workers.kv_quant import KV_FP8

    config = load_model_config(model_dir)
    per_token = {}
    for name, dtype in (("float32", torch.float32), ("f8e4m3", KV_FP8)):
        cache = KVCache(config.num_hidden_layers, 1, config.num_key_value_heads, 64, config.head_dim, dtype=dtype)
        per_token[name] = cache.nbytes() // 64
    return {"bytes_per_token": per_token, "fp8_over_fp32": per_token["f8e4m3"] / per_token["float32"]}


def accuracy_section(dirs: dict[str, Path]) -> dict:
    from launcher.api import load_tokenizer
    from shardlib.checkpoint import load_rank_shard
    from shardlib.model_config import load_model_config
    from shardlib.sharding import ShardLayout
    from workers.collectives import SingleRank
    from workers.engine import generate
    from workers.model import ShardedCausalLM
    from workers.sampling import SamplingParams

    tokenizer = load_tokenizer(dirs["float32"])  # None for the random 254M model
    prompts = ([list(tokenizer(p)["input_ids"]) for p in DEMO_PROMPTS] if tokenizer
               else [synthetic_ids(dirs["float32"], 16, offset) for offset in range(len(DEMO_PROMPTS))])
    tokens = {}
    for name, d in dirs.items():
        config = load_model_config(d)
        layout = ShardLayout.for_model(config, 1)
        model = ShardedCausalLM(config, layout, 0, load_rank_shard(d, config, layout, 0), SingleRank())
        tokens[name] = [generate(model, [p], [SamplingParams()], 16, [])[0].token_ids for p in prompts]
    return {name: {"first_16_equal_fp32": [t == f for t, f in zip(toks, tokens["float32"])],
                   "texts": [tokenizer.decode(t) if tokenizer else t for t in toks]}
            for name, toks in tokens.items()}


def synthetic_ids(model_dir: Path, length: int, offset: int = 0) -> list[int]:
    """Fixed, spread-out token ids for a checkpoint without a tokenizer (the random 254M model)."""
    from shardlib.model_config import load_model_config

    vocab = load_model_config(model_dir).vocab_size
    return [(offset * 131 + i * 7919) % (vocab - 1) + 1 for i in range(length)]


def decode_section(dirs: dict[str, Path], args) -> dict:
    from launcher.api import load_tokenizer

    tokenizer = load_tokenizer(dirs["float32"])
    ids = prompt_ids(tokenizer, args.prompt_tokens) if tokenizer else synthetic_ids(dirs["float32"], args.prompt_tokens)
    modes = ["eager"] + ([] if args.skip_compiled else ["compiled"])
    runners, workers = {}, []
    for mode in modes:
        for name, d in dirs.items():
            start = time.perf_counter()
            run, worker = worker_runner(d, ids, args.new_tokens, args.threads, compile_=mode == "compiled")
            run()  # warm-up (compiled: builds the graphs)
            print(f"{mode} {name}: ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            runners[(mode, name)] = run
            workers.append(worker)
    runs = {key: [] for key in runners}
    for _ in range(args.repeats):
        for key, run in runners.items():
            runs[key].append(run()["decode_tokens_per_s"])
    out = {}
    for mode in modes:
        base = statistics.median(runs[(mode, "float32")])
        out[mode] = {name: {"median_tokens_per_s": round(statistics.median(runs[(mode, name)]), 2),
                            "best_tokens_per_s": round(max(runs[(mode, name)]), 2),
                            "over_fp32": round(statistics.median(runs[(mode, name)]) / base, 3)}
                     for name in dirs}
    for worker in workers:
        worker.shutdown()
    return out


def quant_formats(text: str) -> list[str]:
    """--formats as quantization dtypes, checked before any work (an unknown one failed in the child
    after the model was read, and after every format before it had been quantized)."""
    from shardlib.quantization import QUANT_DTYPES, normalize_quant_dtype

    try:
        formats = [normalize_quant_dtype(name) for name in text.split(",")]
    except ValueError:
        formats = []
    if not formats or len(set(formats)) != len(formats):
        raise argparse.ArgumentTypeError(f"--formats ({text!r}) must be distinct comma-separated formats of "
                                         f"{', '.join(QUANT_DTYPES)}, e.g. int8,f8e4m3")
    return formats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", type=quant_formats, default="int8,f8e4m3", help="comma-separated formats (default int8,f8e4m3)")
    parser.add_argument("--model-dir", type=model_folder("--model-dir"), help="a float32 Hugging Face checkpoint (default: the SmolLM2 demo model)")
    parser.add_argument("--random-254m", action="store_true",
                        help="the 254M random Llama of benchmarks/tp_scaling.py instead of SmolLM2")
    parser.add_argument("--repeats", type=int_at_least("--repeats", 1), default=3)
    parser.add_argument("--new-tokens", type=int_at_least("--new-tokens", 2), default=64)
    parser.add_argument("--prompt-tokens", type=int_at_least("--prompt-tokens", 1), default=128)
    parser.add_argument("--threads", type=int_at_least("--threads", 1), default=2)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-compiled", action="store_true", help="decode eagerly only (no graph builds)")
    parser.add_argument("--quantize-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_context(parser, args.prompt_tokens, args.new_tokens, "--prompt-tokens", "--new-tokens")
    if args.quantize_child:
        print(json.dumps(_quantize_child(json.loads(args.quantize_child))))
        return

    import torch

    from shardlib.demo_model import ensure_demo_model

    torch.set_num_threads(args.threads)
    if args.model_dir and args.random_254m:
        parser.error("--model-dir and --random-254m are exclusive: pick one model")
    with tempfile.TemporaryDirectory(prefix="corelaunch-quant-") as tmp:
        model_dir = (save_random_254m(Path(tmp) / "random-254m", 2 * (args.prompt_tokens + args.new_tokens))
                     if args.random_254m
                     else Path(args.model_dir) if args.model_dir else ensure_demo_model())
        report: dict = {"model": "254M random Llama fp32" if args.random_254m else str(model_dir),
                        "targets": TARGETS, "threads": args.threads,
                        "note": "timings depend on the machine's load: compare the ratios, taken in one run"}
        dirs = {"float32": model_dir}
        largest = largest_tensor_bytes(model_dir)
        report["quantize"] = {"largest_tensor_bytes": largest}
        for fmt in args.formats:
            dirs[fmt] = Path(tmp) / fmt
            result = quantize_in_child(model_dir, dirs[fmt], fmt)
            result["peak_over_largest_tensor"] = round(result["added_peak_bytes"] / largest, 3)
            report["quantize"][fmt] = result
        report["weights"] = weights_section(dirs)
        report["kv_cache"] = kv_section(model_dir)
        report["accuracy"] = accuracy_section(dirs)
        if not args.skip_decode:
            report["decode"] = decode_section(dirs, args)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
