"""The cuda backend on one GPU, through one rank's own code (no Ray, no NCCL); prints one JSON object.

What it checks and measures, side by side in one process on one GPU, for checkpoints of real
model shapes filled with random weights (transformers writes them; no download, no tokenizer):
- accuracy: greedy tokens of prompts of several lengths from corelaunch's worker code (eager, the
  compiled per-bucket graphs, and the continuous-batching serving loop with 16 requests at once)
  against transformers' generate() of each prompt alone on the same GPU; the logits of four tokens
  (one prefill, three decode steps) against transformers' (largest absolute difference), and, for
  a bfloat16 shape, both sides' against transformers' float32 run of the same weights. Where a
  token differs, the report gives transformers' logit gap between its choice and corelaunch's
  there: a near-tie, or a real error.
- speed, `--repeats` interleaved rounds after a warm-up round: one stream (a `--prompt-tokens`
  prompt, `--new-tokens` greedy tokens, EOS ignored) and `--batch` streams at once, for
  transformers generate(), corelaunch eager and compiled static batches, and the serving loop
  (eager and compiled). Decode tokens/s is (new tokens - 1) / (time of N tokens - time of 1), the
  same for every variant; aggregate tokens/s is all rows' new tokens over the wall time. Beside
  the single stream's rates, `fraction_of_bound`: the rate over the weights-over-bandwidth bound
  (the bytes a decode step reads over the device's read bandwidth, the best of five sums of a 4 GiB
  buffer, measured at the start; with --backend cpu, benchmarks/bandwidth.py's measure).

Rank 0 of a TP-1 group is built exactly as a Ray actor builds it (workers.rank_worker.RankWorker
with backend "cuda"); Ray's placement, NCCL between ranks and the driver are not exercised.

    python benchmarks/gpu_rank.py [--shapes smollm2-135m,llama-1b] [--new-tokens 128]
                                  [--prompt-tokens 128] [--batch 16] [--repeats 3]
                                  [--budget-s 420] [--out FILE] [--backend cuda|cpu] [--accuracy-only]

`--backend cpu` runs the same code on the CPU (to try the script where there is no GPU); `--out`
gets the report so far after every phase (what a run stopped at its time limit still leaves).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.arguments import positive_seconds  # noqa: E402
from benchmarks.bandwidth import decode_bound, measure_gbps  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402

SHAPES = {
    # name: (Llama config fields, dtype the checkpoint is written and run in)
    "tiny": (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
                  tie_word_embeddings=True), "float32"),
    "smollm2-135m": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True), "float32"),
    "llama-1b": (dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True), "bfloat16"),
    "llama-8b": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False), "bfloat16"),
}
ACCURACY_LENGTHS = (5, 37, 100, 128)
ACCURACY_NEW_TOKENS = 32


def cache_length(prompt_tokens: int, new_tokens: int) -> int:
    """The KV-cache length a shape's graphs are built for: the power of two that holds the timed
    requests and the accuracy prompts."""
    return 1 << (max(prompt_tokens + new_tokens, max(ACCURACY_LENGTHS) + ACCURACY_NEW_TOKENS) - 1).bit_length()


def refusal(args) -> str | None:
    """Why the arguments cannot run, checked before any work (the bandwidth pass, a checkpoint
    written, transformers loaded: minutes of a GPU lease), or None."""
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        return f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}"
    seq_len = cache_length(args.prompt_tokens, args.new_tokens)
    if short := [s for s in shapes if SHAPES[s][0]["max_position_embeddings"] < seq_len]:
        positions = min(SHAPES[s][0]["max_position_embeddings"] for s in short)
        return (f"--prompt-tokens ({args.prompt_tokens}) plus --new-tokens ({args.new_tokens}) needs a cache of "
                f"{seq_len} positions (the next power of two), past the {positions} of {', '.join(short)}; "
                f"lower one of them")
    if args.out:
        out = Path(args.out)
        if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            return (f"--out ({args.out}) is not a file this run can write (a folder, or in a folder that does not "
                    f"exist or is read-only); pass a path in a writable folder")
    return None


class Report:
    """The JSON report, written to --out after every phase."""

    def __init__(self, path: str | None, deadline: float):
        self.data: dict = {}
        self.path = path
        self.deadline = deadline

    def save(self) -> None:
        if self.path:
            Path(self.path).write_text(json.dumps(self.data, indent=2))

    def phase(self, where: dict, name: str, needs_s: float, fn) -> None:
        """where[name] = fn(), or why not (out of time, or the error with its traceback's end)."""
        left = self.deadline - time.monotonic()
        if left < needs_s:
            where[name] = {"skipped": f"{left:.0f} s of the budget left, {needs_s:.0f} s needed"}
        else:
            start = time.monotonic()
            try:
                where[name] = fn()
            except Exception as err:  # noqa: BLE001 - reported; the other phases still run
                where[name] = {"error": f"{type(err).__name__}: {err}"[:2000],
                               "traceback": traceback.format_exc()[-3000:]}
            if isinstance(where[name], dict):
                where[name]["phase_s"] = round(time.monotonic() - start, 2)
        self.save()


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def write_checkpoint(shape: str, folder: Path, device) -> Path:
    """A random-weight Llama checkpoint of the shape, in its dtype, written by transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields, dtype = SHAPES[shape]
    fields = dict(fields)
    theta = fields.pop("rope_theta")
    config = LlamaConfig(**fields, rope_parameters={"rope_type": "default", "rope_theta": theta},
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    target = folder / shape
    model.save_pretrained(target)
    del model
    return target


def device_read_gbps(device, repeats: int = 5) -> float:
    """Best-of-`repeats` read bandwidth in GB/s (1e9 bytes) of a 4 GiB sum on `device`."""
    import torch

    buffer = torch.ones(2**30, dtype=torch.float32, device=device)
    buffer.sum()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        sync(device)
        best = min(best, time.perf_counter() - start)
    del buffer
    return 2**32 / 1e9 / best


def random_prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- transformers -------------------------------------------------------------------------------
class HfModel:
    def __init__(self, model_dir: Path, dtype: str, device):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy, EOS ignored; prompts of one length (no padding)."""
        torch = self.torch
        assert len({len(p) for p in prompts}) == 1
        ids = torch.tensor(prompts, device=self.device)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    def logits(self, tokens: list[int]):
        """Logits (float32, on the CPU) at every position of one sequence."""
        torch = self.torch
        with torch.inference_mode():
            return self.model(torch.tensor([tokens], device=self.device)).logits[0].float().cpu()


# ---- corelaunch's rank --------------------------------------------------------------------------
def rank_worker(model_dir: Path, dtype: str, backend: str, compile_: bool, buckets=None):
    """Rank 0 of a TP-1 group, as a Ray actor builds it."""
    import torch

    from shardlib.model_config import load_model_config
    from shardlib.sharding import ShardLayout
    from workers.rank_worker import LoadSpec, RankWorker, WorkerSpec

    config = load_model_config(model_dir)
    worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend=backend, threads=torch.get_num_threads()))
    worker.init_backend("127.0.0.1", 0, timeout_s=60)
    worker.load_stats = worker.load(LoadSpec(config=config, layout=ShardLayout.for_model(config, 1), dtype=dtype,
                                             model_dir=str(model_dir), compile=compile_, buckets=buckets))
    return worker


def static_batch(worker, prompts: list[list[int]], new_tokens: int, return_logits: bool = False):
    from workers.rank_worker import GenerateRequest
    from workers.sampling import SamplingParams

    return worker.generate(GenerateRequest(prompts=prompts, params=[SamplingParams()] * len(prompts),
                                           max_new_tokens=new_tokens, return_logits=return_logits))


class Serving:
    """The rank's continuous-batching loop on a thread, driven as rank 0's driver-side poller does."""

    def __init__(self, worker, max_num_seqs: int, cache_slots: int):
        from workers.rank_worker import ServeSpec

        self.worker = worker
        worker.prepare_serving(ServeSpec(max_num_seqs=max_num_seqs, max_prefill_tokens=2048, cache_slots=cache_slots))
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.calls = 0

    def _serve(self) -> None:
        try:
            self.worker.serve()
        except BaseException as err:  # noqa: BLE001 - raised by run()
            self.errors.append(err)

    def run(self, prompts: list[list[int]], new_tokens: int, timeout_s: float = 300.0) -> dict:
        """All prompts submitted at once; their tokens, the wall time and each one's first-token time."""
        from workers.sampling import SamplingParams
        from workers.serving.requests import StreamRequest

        self.calls += 1
        ids = [f"c{self.calls}-{i}" for i in range(len(prompts))]
        tokens = {rid: [] for rid in ids}
        first = {}
        done = set()
        start = time.perf_counter()
        self.worker.submit_requests([StreamRequest(rid, tuple(p), SamplingParams(), new_tokens)
                                     for rid, p in zip(ids, prompts)], None)
        loop = self.worker._leader_loop()
        while len(done) < len(ids):
            if self.errors:
                raise self.errors[0]
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"the serving loop finished {len(done)} of {len(ids)} requests in {timeout_s} s")
            events, _load = loop.poll(0.05)
            now = time.perf_counter()
            for event in events:
                if event.token_ids and event.request_id not in first:
                    first[event.request_id] = now - start
                tokens[event.request_id] += event.token_ids
                if event.finish_reason is not None:
                    if event.finish_reason != "length":
                        raise RuntimeError(f"request {event.request_id} ended with {event.finish_reason}: {event.error}")
                    done.add(event.request_id)
        return {"tokens": [tokens[rid] for rid in ids], "wall_s": time.perf_counter() - start,
                "ttft_s": sorted(first.values())}

    def close(self) -> None:
        self.worker.stop_serving()
        self.thread.join(30)


# ---- accuracy -----------------------------------------------------------------------------------
def compare(got: list[list[int]], want: list[list[int]], prompts, hf: HfModel) -> dict:
    """Tokens equal per prompt; where not, transformers' logit gap at the first differing token."""
    out = {"equal": sum(g == w for g, w in zip(got, want)), "of": len(want)}
    gaps = []
    for prompt, g, w in zip(prompts, got, want):
        if g == w:
            continue
        j = next(i for i, (a, b) in enumerate(zip(g, w)) if a != b) if len(g) == len(w) else min(len(g), len(w))
        if j >= min(len(g), len(w)):
            gaps.append({"prompt_len": len(prompt), "first_diff": j, "note": "lengths differ"})
            continue
        logits = hf.logits(prompt + w[:j])[-1]
        gaps.append({"prompt_len": len(prompt), "first_diff": j,
                     "hf_logit_gap": round(float(logits[w[j]] - logits[g[j]]), 6),
                     "hf_logit_std": round(float(logits.std()), 4)})
    if gaps:
        out["differences"] = gaps
    return out


def accuracy(model_dir: Path, dtype: str, device, hf: HfModel, workers: dict) -> dict:
    import torch

    from shardlib.model_config import load_model_config

    vocab = load_model_config(model_dir).vocab_size
    prompts = random_prompts(vocab, ACCURACY_LENGTHS, seed=1)
    want = [hf.generate([p], ACCURACY_NEW_TOKENS)[0] for p in prompts]
    report = {"prompt_lengths": list(ACCURACY_LENGTHS), "new_tokens": ACCURACY_NEW_TOKENS}
    eager = workers["eager"]
    report["eager_static_batch"] = compare([o.token_ids for o in static_batch(eager, prompts, ACCURACY_NEW_TOKENS)],
                                           want, prompts, hf)
    # The first token's logits (prefill) and the next three's (decode), against transformers' on
    # the same tokens.
    [one] = static_batch(eager, [prompts[-1]], 4, return_logits=True)
    ref = hf.logits(prompts[-1] + one.token_ids[:-1])[len(prompts[-1]) - 1:]
    ours = torch.stack([t.float().cpu() for t in one.logits]) if isinstance(one.logits, list) else one.logits.float().cpu()
    report["logits_max_abs_diff"] = float(f"{float((ours - ref).abs().max()):.3g}")
    report["logits_ref_std"] = round(float(ref.std()), 4)
    if dtype != "float32":  # both sides' rounding error, each against the same model in float32
        exact = HfModel(model_dir, "float32", device).logits(prompts[-1] + one.token_ids[:-1])[len(prompts[-1]) - 1:]
        report["float32_reference"] = {"corelaunch_max_abs_diff": float(f"{float((ours - exact).abs().max()):.3g}"),
                                       "transformers_max_abs_diff": float(f"{float((ref - exact).abs().max()):.3g}")}
        del exact
    if "compiled" in workers:
        report["compiled_static_batch"] = compare(
            [o.token_ids for o in static_batch(workers["compiled"], prompts, ACCURACY_NEW_TOKENS)],
            want, prompts, hf)
    serving = Serving(eager, max_num_seqs=16, cache_slots=256)
    try:
        extra = random_prompts(vocab, [17 + 9 * i for i in range(12)], seed=2)
        got = serving.run(prompts + extra, ACCURACY_NEW_TOKENS)["tokens"][:len(prompts)]
    finally:
        serving.close()
    report["serving_loop_16_requests"] = compare(got, want, prompts, hf)
    sync(device)
    return report


# ---- speed --------------------------------------------------------------------------------------
def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def speed(variants: dict, new_tokens: int, rows: int, repeats: int) -> dict:
    """variants: name -> run(n_new_tokens) (returns when done). Warm-up round, then `repeats`
    interleaved rounds; per variant the medians."""
    for run in variants.values():  # warm-up: builds graphs, fills caches
        run(1)
        run(new_tokens)
    samples = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            first = timed(lambda: run(1))
            total = timed(lambda: run(new_tokens))
            samples[name].append({"time_to_first_token_s": first, "e2e_s": total,
                                  "decode_tokens_per_s": rows * (new_tokens - 1) / max(total - first, 1e-9),
                                  "aggregate_tokens_per_s": rows * new_tokens / total})
    return {name: {key: round(statistics.median(s[key] for s in runs), 4) for key in runs[0]}
            for name, runs in samples.items()}


def shape_report(shape: str, args, report: Report, where: dict, folder: Path, device) -> None:
    import torch

    from shardlib.buckets import Buckets

    fields, dtype = SHAPES[shape]
    where["dtype"] = dtype
    where["config"] = fields
    paths: dict = {}
    report.phase(where, "checkpoint", 30, lambda: {"dir": str(paths.setdefault("dir", write_checkpoint(shape, folder, device)))})
    if "dir" not in paths:
        return
    model_dir = paths["dir"]
    hf = HfModel(model_dir, dtype, device)
    # Buckets that hold the accuracy prompts too (one graph set serves both phases).
    longest_prompt = max(args.prompt_tokens, *ACCURACY_LENGTHS)
    seq_len = cache_length(args.prompt_tokens, args.new_tokens)
    buckets = Buckets.build(max_context_length=longest_prompt, max_seq_len=seq_len,
                            max_batch_size=max(args.batch, len(ACCURACY_LENGTHS)),
                            max_positions=fields["max_position_embeddings"])
    workers: dict = {}

    def load(name: str, compile_: bool):
        start = time.perf_counter()
        workers[name] = rank_worker(model_dir, dtype, args.backend, compile_, buckets if compile_ else None)
        stats = workers[name].load_stats
        return {"load_s": round(time.perf_counter() - start, 3), "shard_bytes": stats.shard_bytes}

    report.phase(where, "load_eager", 20, lambda: load("eager", False))
    report.phase(where, "load_compiled", 20, lambda: load("compiled", True))
    if "eager" not in workers:
        return
    report.phase(where, "accuracy", 60, lambda: accuracy(model_dir, dtype, device, hf, workers))

    vocab = fields["vocab_size"]
    [one] = random_prompts(vocab, [args.prompt_tokens], seed=3)
    many = random_prompts(vocab, [args.prompt_tokens] * args.batch, seed=4)

    def single_stream():
        variants = {"transformers": lambda n: hf.generate([one], n),
                    "corelaunch_eager": lambda n: static_batch(workers["eager"], [one], n)}
        if "compiled" in workers:
            variants["corelaunch_compiled"] = lambda n: static_batch(workers["compiled"], [one], n)
        out = speed(variants, args.new_tokens, 1, args.repeats)
        hf_rate = out["transformers"]["decode_tokens_per_s"]
        out["ratios_decode_over_transformers"] = {k: round(v["decode_tokens_per_s"] / hf_rate, 3)
                                                  for k, v in out.items() if k != "transformers"}
        bound = decode_bound(workers["eager"].load_stats.decode_read_bytes, report.data["device_read_GBps"])
        out["bound_tokens_per_s"] = round(bound, 1)
        out["fraction_of_bound"] = {k: round(v["decode_tokens_per_s"] / bound, 4) for k, v in out.items()
                                    if isinstance(v, dict) and "decode_tokens_per_s" in v}
        return out

    if not args.accuracy_only:
        report.phase(where, "single_stream", 60, single_stream)

    def concurrent():
        servings = {}
        try:
            variants = {"transformers_static_batch": lambda n: hf.generate(many, n),
                        "corelaunch_eager_static_batch": lambda n: static_batch(workers["eager"], many, n)}
            if "compiled" in workers:
                variants["corelaunch_compiled_static_batch"] = lambda n: static_batch(workers["compiled"], many, n)
            out = speed(variants, args.new_tokens, args.batch, args.repeats)
            ttfts = {}
            for name in [n for n in ("eager", "compiled") if n in workers]:
                servings[name] = Serving(workers[name], max_num_seqs=args.batch, cache_slots=seq_len)
                runs = [servings[name].run(many, args.new_tokens) for _ in range(args.repeats + 1)][1:]
                walls = [r["wall_s"] for r in runs]
                out[f"corelaunch_{name}_serving_loop"] = {
                    "aggregate_tokens_per_s": round(args.batch * args.new_tokens / statistics.median(walls), 2),
                    "e2e_s": round(statistics.median(walls), 4),
                    "ttft_p50_s": round(statistics.median(t for r in runs for t in r["ttft_s"]), 4),
                    "ttft_max_s": round(max(t for r in runs for t in r["ttft_s"]), 4)}
                servings.pop(name).close()
            hf_rate = out["transformers_static_batch"]["aggregate_tokens_per_s"]
            out["ratios_aggregate_over_transformers"] = {
                k: round(v["aggregate_tokens_per_s"] / hf_rate, 3) for k, v in out.items()
                if k != "transformers_static_batch" and "aggregate_tokens_per_s" in v}
            return out
        finally:
            for s in servings.values():
                s.close()

    if not args.accuracy_only:
        report.phase(where, f"batch_{args.batch}", 90, concurrent)
    if "compiled" in workers:
        stats = workers["compiled"].compile_stats() or {}
        where["compiled_graphs_built"] = len(stats.get("graphs", []))
        where["compile_s"] = stats.get("compile_s")
    for w in workers.values():
        w.shutdown()
    del hf, workers
    if device.type == "cuda":
        where["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="smollm2-135m,llama-1b",
                        help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--new-tokens", type=int_at_least("--new-tokens", 2), default=128)
    parser.add_argument("--prompt-tokens", type=int_at_least("--prompt-tokens", 1), default=128)
    parser.add_argument("--batch", type=int_at_least("--batch", 1), default=16)
    parser.add_argument("--repeats", type=int_at_least("--repeats", 1), default=3)
    parser.add_argument("--budget-s", type=positive_seconds("--budget-s"), default=420.0,
                        help="phases that would start with less than their need left are skipped")
    parser.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", help="also write the report here after every phase")
    parser.add_argument("--accuracy-only", action="store_true", help="no speed phases")
    args = parser.parse_args()
    if (refused := refusal(args)) is not None:
        parser.error(refused)
    shapes = args.shapes.split(",")

    import torch
    import transformers

    deadline = time.monotonic() + args.budget_s
    device = torch.device("cuda", 0) if args.backend == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--backend cuda: torch sees no CUDA GPU here (use --backend cpu to try the script)")
        # Full float32 products on both sides: TF32 would make the accuracy comparison a TF32 one.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    report = Report(args.out, deadline)
    report.data.update({"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                        "torch": torch.__version__, "transformers": transformers.__version__,
                        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                        "batch": args.batch, "repeats": args.repeats})
    report.data["device_read_GBps"] = round(device_read_gbps(device) if device.type == "cuda"
                                            else measure_gbps(torch.get_num_threads()), 1)
    report.data["shapes"] = {}
    with tempfile.TemporaryDirectory(prefix="corelaunch-gpu-") as tmp:
        for shape in shapes:
            where = report.data["shapes"].setdefault(shape, {})
            shape_report(shape, args, report, where, Path(tmp), device)
    report.data["wall_s"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    report.save()
    print(json.dumps(report.data, indent=2))


if __name__ == "__main__":
    main()
