"""Decode speed, side by side in one run: transformers generate(), corelaunch in-process, corelaunch via Ray.

SmolLM2-135M-Instruct, float32, batch 1, greedy, a fixed prompt and a fixed number of new tokens
(EOS ignored so every run decodes the same count). Each variant runs `--repeats` times, interleaved
so machine noise hits all of them alike; the median is reported. Prints one JSON object.

    python benchmarks/decode.py [--new-tokens 128] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "The capital of France is"


def hf_runner(model_dir: Path, prompt_ids: list[int], new_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] == len(prompt_ids) + n
        return time.perf_counter() - start

    def run() -> dict:
        ttft = timed(1)
        total = timed(new_tokens)
        return {"time_to_first_token_s": ttft, "decode_tokens_per_s": (new_tokens - 1) / (total - ttft),
                "e2e_s": total}

    return run


def in_process_runner(model_dir: Path, prompt_ids: list[int], new_tokens: int, threads: int):
    """The worker code corelaunch runs inside each Ray actor, driven directly (no Ray)."""
    from shardlib.model_config import load_model_config
    from shardlib.sharding import ShardLayout
    from workers.rank_worker import GenerateRequest, LoadSpec, RankWorker, WorkerSpec
    from workers.sampling import SamplingParams

    config = load_model_config(model_dir)
    worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend="cpu", threads=threads))
    worker.init_backend("127.0.0.1", 0, timeout_s=60)
    worker.load(LoadSpec(config=config, layout=ShardLayout.for_model(config, 1), dtype="float32",
                         model_dir=str(model_dir)))
    request = GenerateRequest(prompts=[prompt_ids], params=[SamplingParams()], max_new_tokens=new_tokens)

    def run() -> dict:
        start = time.perf_counter()
        [out] = worker.generate(request)
        e2e = time.perf_counter() - start
        assert len(out.token_ids) == new_tokens
        return {"time_to_first_token_s": out.time_to_first_token_s,
                "decode_tokens_per_s": out.decode_tokens_per_s, "e2e_s": e2e}

    return run, worker


def ray_runner(model_dir: Path, prompt_ids: list[int], new_tokens: int):
    from launcher.api import Launcher

    launcher = Launcher(model=str(model_dir), tp=1, progress=False).start()

    def run() -> dict:
        start = time.perf_counter()
        [out] = launcher.generate([prompt_ids], max_new_tokens=new_tokens, ignore_eos=True)
        e2e = time.perf_counter() - start
        assert len(out.token_ids) == new_tokens
        return {"time_to_first_token_s": out.time_to_first_token_s,
                "decode_tokens_per_s": out.decode_tokens_per_s, "e2e_s": e2e}

    return run, launcher


def median_of(runs: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in runs), 4) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from shardlib.demo_model import ensure_demo_model

    torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model()
    prompt_ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]

    runners = {"transformers_generate": hf_runner(model_dir, prompt_ids, args.new_tokens)}
    runners["corelaunch_in_process"], worker = in_process_runner(model_dir, prompt_ids, args.new_tokens,
                                                                 args.threads)
    runners["corelaunch_ray_tp1"], launcher = ray_runner(model_dir, prompt_ids, args.new_tokens)
    try:
        for run in runners.values():  # warm-up: first-call allocations, lazy inits
            run()
        samples: dict[str, list[dict]] = {name: [] for name in runners}
        for _ in range(args.repeats):
            for name, run in runners.items():
                samples[name].append(run())
    finally:
        launcher.shutdown()
        worker.shutdown()

    results = {name: median_of(runs) for name, runs in samples.items()}
    ray_r, local_r, hf_r = (results[k] for k in ("corelaunch_ray_tp1", "corelaunch_in_process",
                                                  "transformers_generate"))
    report = {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "batch": 1, "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens, "threads": args.threads, "repeats": args.repeats, "results": results,
        "ratios": {
            # decode rate measured inside the worker: Ray is not in the loop at all
            "ray_over_in_process_decode": round(ray_r["decode_tokens_per_s"] / local_r["decode_tokens_per_s"], 4),
            # whole request as the driver sees it: includes Ray's call and result transfer
            "ray_over_in_process_e2e_throughput": round(local_r["e2e_s"] / ray_r["e2e_s"], 4),
            "ray_share_of_request_time": round(max(0.0, ray_r["e2e_s"] - local_r["e2e_s"]) / ray_r["e2e_s"], 4),
            "corelaunch_tp1_over_transformers_decode": round(
                local_r["decode_tokens_per_s"] / hf_r["decode_tokens_per_s"], 4),
        },
        "targets": {"ray_over_in_process_e2e_throughput": ">= 0.97"},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
