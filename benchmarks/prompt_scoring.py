"""Scoring a prompt (prompt_logprobs, what completions' `echo` with `logprobs` asks for) against
prefilling it plainly, through the driver API on one TP group (the built-in model by default).

For each --prompt-tokens length, one request at a time of a distinct prompt of exactly that many
token ids, max_new_tokens 1: its wall time plainly and with prompt_logprobs=0 (and with --top-n),
alternated request by request in one process, so a drifting machine moves both alike. Reports the
median seconds of each and their ratio (scored over plain), and transformers' own forward of the
same prompt with every position's log-softmax, the peer an evaluation harness runs locally. Each
scored request's values are checked against that forward (the largest difference is reported).
Prints JSON.

    python benchmarks/prompt_scoring.py [--prompt-tokens 128,512,2048] [--rounds 5] [--top-n 5] [--compile]
                                        [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.arguments import int_list, model_folder  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402


def prompt_of(length: int, index: int, vocab: int) -> list[int]:
    """A distinct prompt of exactly `length` ids, clear of the first 100 ids (special tokens)."""
    return [100 + (index * 7919 + i * 104729) % (vocab - 100) for i in range(length)]


def transformers_scores(model, prompt: list[int]):
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        table = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    chosen = table[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    return time.perf_counter() - start, chosen


def main(out=None) -> dict:
    """out: where the JSON report goes (stdout when None)."""
    out = out or sys.stdout
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int_list("--prompt-tokens", "128,512", minimum=2),
                        default=[128, 512, 2048])
    parser.add_argument("--rounds", type=int_at_least("--rounds", 1), default=5)
    parser.add_argument("--top-n", type=int_at_least("--top-n", 0), default=5)
    parser.add_argument("--model-dir", type=model_folder("--model-dir"), default=None,
                        help="a Hugging Face model folder (default: the built-in model)")
    parser.add_argument("--compile", action="store_true", help="the compiled serving graphs (default: eager)")
    args = parser.parse_args()
    if args.top_n > 20:
        parser.error(f"--top-n ({args.top_n}) must be at most 20")

    import torch
    from transformers import AutoModelForCausalLM

    from launcher.api import Launcher
    from shardlib.demo_model import ensure_demo_model
    from shardlib.model_config import load_model_config

    model_dir = str(args.model_dir or ensure_demo_model())
    longest = max(args.prompt_tokens)
    positions = load_model_config(model_dir).max_position_embeddings
    if longest + 1 > positions:  # the prompt and its one new token
        parser.error(f"--prompt-tokens ({longest}) plus the one new token is past the model's {positions} positions; "
                     f"lower it to at most {positions - 1}")
    report: dict = {"prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "top_n": args.top_n,
                    "compile": args.compile, "torch_threads": torch.get_num_threads(), "lengths": {}}
    # every length's prompt starts with the same ids: without prefix caching no request reuses another's
    # prefill, so each timing is a whole prompt's
    with Launcher(model=model_dir, tp=1, seq_len=longest + 8, compile=args.compile, max_num_seqs=2,
                  warm_up=args.compile, progress=False, prefix_caching=False) as llm:
        reference = AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=torch.float32).eval()
        vocab = llm.model_config.vocab_size
        report["model"] = model_dir
        for length in args.prompt_tokens:
            times: dict[str, list[float]] = {"plain": [], "scored": [], "scored_top_n": [], "transformers": []}
            worst = 0.0
            for r in range(args.rounds + 1):  # the first round warms up and is not counted
                prompt = prompt_of(length, r, vocab)
                for way, asked in (("plain", None), ("scored", 0), ("scored_top_n", args.top_n)):
                    start = time.perf_counter()
                    [result] = llm.generate([prompt], max_new_tokens=1, ignore_eos=True, prompt_logprobs=asked)
                    if r:
                        times[way].append(time.perf_counter() - start)
                    if asked is not None and r:
                        got = torch.tensor([e.logprob for e in result.prompt_logprobs])
                        seconds, want = transformers_scores(reference, prompt)
                        worst = max(worst, float((got - want).abs().max()))
                seconds, _ = transformers_scores(reference, prompt)
                if r:
                    times["transformers"].append(seconds)
            medians = {way: statistics.median(values) for way, values in times.items()}
            report["lengths"][str(length)] = {
                "median_s": {way: round(v, 4) for way, v in medians.items()},
                "scored_over_plain": round(medians["scored"] / medians["plain"], 3),
                "scored_top_n_over_plain": round(medians["scored_top_n"] / medians["plain"], 3),
                "scored_over_transformers": round(medians["scored"] / medians["transformers"], 3),
                "largest_logprob_difference_vs_transformers": round(worst, 6)}
    print(json.dumps(report, indent=1), file=out)
    return report


if __name__ == "__main__":
    from launcher.cli.command_stdout import run_reporting

    run_reporting(main)
