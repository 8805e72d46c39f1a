"""Fused projections (workers/fused_projections.py) against separate matrices: decode time per token.

One random Llama-shaped model at TP 1, float32, built twice from the same weights (separate q/k/v
and gate/up matrices; fused [Q | K | V] and [gate | up]); each generates the same greedy tokens
(checked), eagerly and through the compiled graphs (one context and one token bucket), variants
alternating in blocks. Time per generated token is the generate call's wall time over its new
tokens (the prompt is short: decode dominates). Prints one JSON object; speedup is separate over
fused time (above 1: fused is faster).

    python benchmarks/fused_projections.py [--hidden 1024] [--layers 4] [--new-tokens 48] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from launcher.cli.options import int_at_least  # noqa: E402 - bad values refused before any work
from shardlib.buckets import Buckets  # noqa: E402
from shardlib.model_config import ModelConfig  # noqa: E402
from tests.model_factory import build_random_model  # noqa: E402
from tests.tp_harness import build_rank_model, hf_state_dict  # noqa: E402
from workers.collectives import SingleRank  # noqa: E402
from workers.engine import generate  # noqa: E402
from workers.fused_projections import fuse_projections  # noqa: E402
from workers.sampling import SamplingParams  # noqa: E402

PROMPT = [5, 9, 33, 17, 80, 3, 44, 12]
HEADS = 16
POSITIONS = 512
"""The random model's max_position_embeddings (build_random_model's default): prompt plus new tokens."""
SMALLEST_TOKEN_BUCKET = 64
"""The compiled variants' token bucket for the default --new-tokens, as it always was."""


def token_bucket(new_tokens: int) -> int:
    """The compiled variants' one token-generation bucket: the smallest power of two from
    SMALLEST_TOKEN_BUCKET up that holds the prompt and the new tokens, at most POSITIONS (a fixed 64
    failed any --new-tokens past 56 once the models were built, naming a --seq-len this script lacks)."""
    bucket = SMALLEST_TOKEN_BUCKET
    while bucket < len(PROMPT) + new_tokens:
        bucket *= 2
    return min(bucket, POSITIONS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int_at_least("--hidden", 2 * HEADS), default=1024)
    parser.add_argument("--layers", type=int_at_least("--layers", 1), default=4)
    # two at least: the time per token is the call's over its new tokens, and with one it was the prefill's
    parser.add_argument("--new-tokens", type=int_at_least("--new-tokens", 2), default=48)
    parser.add_argument("--blocks", type=int_at_least("--blocks", 1), default=3)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    if args.hidden % (2 * HEADS):  # HEADS heads of hidden / HEADS, an even size (rotary embeddings turn pairs)
        parser.error(f"--hidden ({args.hidden}) must be a multiple of {2 * HEADS}, e.g. 1024")
    if len(PROMPT) + args.new_tokens > POSITIONS:  # before the model is built
        parser.error(f"--new-tokens ({args.new_tokens}) plus the {len(PROMPT)}-token prompt is past the random "
                     f"model's {POSITIONS} positions; lower --new-tokens to at most {POSITIONS - len(PROMPT)}")
    hf = build_random_model(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_layers=args.layers,
                            num_heads=HEADS, num_kv_heads=4, vocab_size=4096, initializer_range=0.05,
                            max_position_embeddings=POSITIONS)
    config, weights = ModelConfig.from_dict(hf.config.to_dict()), hf_state_dict(hf)
    del hf
    models = {}
    for name in ("separate", "fused"):
        model = build_rank_model(config, weights, 0, 1, SingleRank())
        if name == "fused":
            fuse_projections(model)
        models[f"{name}_eager"] = model
    if not args.no_compile:
        from workers.compiled import CompiledCausalLM

        buckets = Buckets.build(context=[len(PROMPT)], token=[token_bucket(args.new_tokens)], batch=[1])
        for name in ("separate", "fused"):
            models[f"{name}_compiled"] = CompiledCausalLM(models[f"{name}_eager"], buckets)

    def run(model) -> tuple[list[int], float]:
        start = time.perf_counter()
        [out] = generate(model, [PROMPT], [SamplingParams()], args.new_tokens, [])
        return out.token_ids, (time.perf_counter() - start) / args.new_tokens

    compile_s, tokens = {}, {}
    with torch.inference_mode():
        for name, model in models.items():  # warm (and, compiled, build the graphs)
            start = time.perf_counter()
            tokens[name], _ = run(model)
            compile_s[name] = round(time.perf_counter() - start, 1)
        assert all(t == tokens["separate_eager"] for t in tokens.values()), tokens
        samples = {name: [] for name in models}
        for _ in range(args.blocks):
            for name, model in models.items():
                samples[name].append(run(model)[1])
    ms = {name: round(statistics.median(s) * 1e3, 3) for name, s in samples.items()}
    speedup = {mode: round(ms[f"separate_{mode}"] / ms[f"fused_{mode}"], 3)
               for mode in ("eager", "compiled") if f"fused_{mode}" in ms}
    print(json.dumps({"hidden": args.hidden, "layers": args.layers, "threads": torch.get_num_threads(),
                      "ms_per_token": ms, "speedup_fused": speedup, "first_call_s": compile_s}, indent=1))


if __name__ == "__main__":
    main()
