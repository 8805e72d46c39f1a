"""Decode speed by batch size through the linear kernels, side by side.

SmolLM2-135M (float32 and, with --int8, a per-channel int8 copy quantized once with `corelaunch
quantize`), TP 1, two threads, the worker code in-process (benchmarks/decode.py's runner,
compiled, default granularity). For each batch size B, one static batch of B copies of a 128-token
prompt generates `--new-tokens` greedy tokens; the figure is the batch's decode rate in tokens/s
(B x one row's decode tokens/s) and the time of one decode step. Variants, each in its own process
(the kernel's use is fixed when a graph is traced), alternating in `--rounds` rounds (the order given,
then reversed, and so on; each variant sets all three kernel switches, whatever the shell exports):

    packed      as corelaunch runs: float32 weights packed as column panels, every product through
                workers/kernels/packed_linear.py (prefill-sized ones through
                workers/kernels/prefill_gemm.py); 8-bit weights through
                workers/kernels/small_linear.py
    kernel      CORELAUNCH_PACKED_WEIGHTS=0: float32 products of 2 to max_rows() rows, and 8-bit
                weights, through workers/kernels/small_linear.py
    torch       both off: MKL's GEMM for several rows, the compiled multiply-and-sum for one row
                and for 8-bit weights
    traced_attention
                as packed, with CORELAUNCH_DECODE_ATTENTION=0: decode attention as the traced
                products and sums instead of workers/kernels/decode_attention.py

Prints one JSON object with medians, the step time, the batch's time to first token (its prefill)
and the packed / kernel, kernel / torch and packed / traced_attention ratios.

    python benchmarks/decode_batch.py [--batches 1,2,4,8,16] [--new-tokens 32] [--rounds 2] [--int8]
                                      [--variants packed,traced_attention] [--timeout-s 1800]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.arguments import check_context, int_list, positive_seconds  # noqa: E402 - refused before any work
from launcher.cli.options import int_at_least  # noqa: E402

# every variant sets every switch it is about: one left out took the shell's value, and an exported
# CORELAUNCH_DECODE_ATTENTION=0 made packed (and kernel, torch) run traced_attention's code
VARIANTS = {"packed": {"CORELAUNCH_PACKED_WEIGHTS": "1", "CORELAUNCH_SMALL_LINEAR": "1",
                       "CORELAUNCH_DECODE_ATTENTION": "1"},
            "kernel": {"CORELAUNCH_PACKED_WEIGHTS": "0", "CORELAUNCH_SMALL_LINEAR": "1",
                       "CORELAUNCH_DECODE_ATTENTION": "1"},
            "torch": {"CORELAUNCH_PACKED_WEIGHTS": "0", "CORELAUNCH_SMALL_LINEAR": "0",
                      "CORELAUNCH_DECODE_ATTENTION": "1"},
            "traced_attention": {"CORELAUNCH_PACKED_WEIGHTS": "1", "CORELAUNCH_SMALL_LINEAR": "1",
                                 "CORELAUNCH_DECODE_ATTENTION": "0"}}

PROMPT_TOKENS = 128
"""Every row's prompt: benchmarks/decode.py's text, this many tokens."""

RATIOS = {"packed_over_kernel": ("packed", "kernel"), "kernel_over_torch": ("kernel", "torch"),
          "attention_kernel_over_traced": ("packed", "traced_attention")}


def child(model_dir: str, batches: list[int], new_tokens: int) -> dict:
    from transformers import AutoTokenizer

    from benchmarks.decode import bucket_settings, prompt_ids
    from shardlib.buckets import Buckets
    from shardlib.model_config import load_model_config
    from shardlib.sharding import ShardLayout
    from workers.rank_worker import GenerateRequest, LoadSpec, RankWorker, WorkerSpec
    from workers.sampling import SamplingParams

    ids = prompt_ids(AutoTokenizer.from_pretrained(model_dir), PROMPT_TOKENS)
    config = load_model_config(model_dir)
    settings = bucket_settings(len(ids), new_tokens)
    buckets = Buckets.build(max_context_length=settings["max_context_length"], max_seq_len=settings["seq_len"],
                            max_batch_size=max(batches))
    worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend="cpu", threads=2))
    worker.init_backend("127.0.0.1", 0, timeout_s=60)
    worker.load(LoadSpec(config=config, layout=ShardLayout.for_model(config, 1), dtype="float32",
                         model_dir=model_dir, compile=True, buckets=buckets))
    result = {}
    for batch in batches:
        request = GenerateRequest(prompts=[ids] * batch, params=[SamplingParams()] * batch, max_new_tokens=new_tokens)
        worker.generate(request)  # builds this batch's graphs
        outs = worker.generate(request)
        rate = outs[0].decode_tokens_per_s
        result[batch] = {"tokens_per_s": round(batch * rate, 2), "step_ms": round(1000 / rate, 2),
                         "ttft_s": round(outs[0].time_to_first_token_s, 4), "tokens": outs[0].token_ids[:8]}
    return result


def run_variant(variant: str, model_dir: str, args) -> dict:
    env = dict(os.environ, **VARIANTS[variant])
    batches = ",".join(map(str, args.batches))
    try:  # a child that hangs (a lock, a stuck compile) stopped the whole run with no report and no end
        proc = subprocess.run([sys.executable, __file__, "--child", model_dir, "--batches", batches,
                               "--new-tokens", str(args.new_tokens)], env=env, capture_output=True, text=True,
                              timeout=args.timeout_s)
    except subprocess.TimeoutExpired as expired:
        tail = (expired.stderr or b"")[-3000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise RuntimeError(f"{variant} ran past --timeout-s ({args.timeout_s:g} s) and was stopped: raise --timeout-s, "
                           f"or lower --batches or --new-tokens; its last output:\n{tail}") from None
    if proc.returncode:
        raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def int8_copy(model_dir: str) -> str:
    """The int8 copy, quantized once and kept for later runs. quantize_checkpoint writes a hidden
    sibling and renames it into place when complete; a folder at this path that lacks what it
    writes (a copy from elsewhere, an empty folder) is refused rather than reused."""
    out = Path(tempfile.gettempdir()) / "corelaunch-bench-smollm2-int8"
    if not out.exists():
        from shardlib.quantize_checkpoint import quantize_checkpoint

        quantize_checkpoint(model_dir, out, "int8", embed=True)
    try:  # config.json, with its quantization_config, is the last file written before the rename
        complete = bool(json.loads((out / "config.json").read_text()).get("quantization_config"))
    except (OSError, ValueError, AttributeError):
        complete = False
    if not complete or not (out / "model.safetensors").is_file():
        raise RuntimeError(f"{out} is not a complete int8 copy (no model.safetensors, or no config.json with a "
                           f"quantization_config): remove it and run again to quantize it anew")
    return str(out)


def round_order(runs: list, round_index: int) -> list:
    """The (model, variant) runs of one round: in the order given in even rounds, reversed in odd ones,
    so that no variant always runs first (on a cold cache, a cooler CPU) or always after the same one."""
    return list(runs) if round_index % 2 == 0 else list(reversed(runs))


def first_tokens_equal(tokens: dict[str, dict[int, list[int]]]) -> dict[int, bool]:
    """Per batch size, whether every variant generated the same first tokens (variant -> batch -> ids)."""
    batches = next(iter(tokens.values()))
    return {b: len({tuple(by_batch[b]) for by_batch in tokens.values()}) == 1 for b in batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int_list("--batches", "1,2,4,8,16"), default="1,2,4,8,16")
    parser.add_argument("--new-tokens", type=int_at_least("--new-tokens", 2), default=32)
    parser.add_argument("--rounds", type=int_at_least("--rounds", 1), default=2)
    parser.add_argument("--int8", action="store_true", help="also the int8 per-channel copy")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--timeout-s", type=positive_seconds("--timeout-s"), default=1800.0,
                        help="the most one variant's process may run, all its batch sizes together (default 1800)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # the longest batch's buckets were looked up in the child, once the model had loaded: a bare StopIteration
    check_context(parser, PROMPT_TOKENS, args.new_tokens, "the prompt", "--new-tokens")
    batches = args.batches
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        parser.error(f"--variants {args.variants!r}: each must be one of {', '.join(VARIANTS)}")
    repeated = [v for i, v in enumerate(variants) if variants.count(v) > 1 and v not in variants[:i]]
    if repeated:  # the report keys runs by variant: a repeat's runs were pooled into the first one's medians
        parser.error(f"--variants ({args.variants}) names {', '.join(repeated)} more than once: each variant is "
                     f"reported under its name, so a repeat's runs were pooled with the first's; give each variant "
                     f"once (for more samples raise --rounds)")
    if args.child:
        sys.stdout, out = sys.stderr, sys.stdout  # library chatter off the result channel
        out.write(json.dumps(child(args.child, batches, args.new_tokens)) + "\n")
        return
    from shardlib.demo_model import ensure_demo_model

    models = {"float32": str(ensure_demo_model())}
    if args.int8:
        models["int8"] = int8_copy(models["float32"])
    runs: dict = {m: {v: {b: [] for b in batches} for v in variants} for m in models}
    tokens: dict = {}
    for round_index in range(args.rounds):
        for model, variant in round_order([(m, v) for m in models for v in variants], round_index):
            for batch, r in run_variant(variant, models[model], args).items():
                runs[model][variant][batch].append(r)
                tokens.setdefault(model, {}).setdefault(variant, {}).setdefault(batch, r["tokens"])
    report = {"model": "SmolLM2-135M", "threads": 2, "new_tokens": args.new_tokens, "rounds": args.rounds,
              "cores": len(os.sched_getaffinity(0))}
    for model in models:
        section = {}
        equal = first_tokens_equal(tokens[model])
        for batch in batches:
            med = {v: statistics.median(r["tokens_per_s"] for r in runs[model][v][batch]) for v in variants}
            step = {v: statistics.median(r["step_ms"] for r in runs[model][v][batch]) for v in variants}
            ttft = {v: statistics.median(r["ttft_s"] for r in runs[model][v][batch]) for v in variants}
            section[batch] = {"tokens_per_s": med, "step_ms": step, "ttft_s": ttft, "first_tokens_equal": equal[batch]}
            for name, (a, b) in RATIOS.items():
                if a in med and b in med:
                    section[batch][name] = round(med[a] / med[b], 3)
        section["first_tokens_equal"] = all(equal.values())  # at every batch size
        report[model] = section
    if "int8" in models and "packed" in variants:
        report["int8_over_float32_as_run"] = {
            b: round(report["int8"][b]["tokens_per_s"]["packed"] / report["float32"][b]["tokens_per_s"]["packed"], 3)
            for b in batches}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
