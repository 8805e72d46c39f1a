"""What the static MoE formulation costs: workers/moe.py's dense routing (every local expert runs
on every token, scaled by a (tokens, experts) routing matrix with zeros) against a sparse dispatch
(each expert runs only on the tokens routed to it: transformers' loop, with data-dependent shapes,
so it cannot be one static graph). One MoE layer at TP 1, float32, side by side in one run,
variants alternating in blocks; also the dense layer through torch.compile at decode (one token),
the form the compiled decode graphs run.

Both give the same output (checked before timing). Prints one JSON object; ratios are dense over
sparse time (above 1: the static form is slower).

    python benchmarks/moe_dense_routing.py [--hidden 512] [--intermediate 1408] [--experts 8] [--top-k 2]
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
import torch.nn.functional as F  # noqa: E402

from benchmarks.arguments import int_list  # noqa: E402 - bad values refused before any work
from benchmarks.serving_stats import ratio  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402
from workers.collectives import SingleRank  # noqa: E402
from workers.kernels import small_linear  # noqa: E402
from workers.moe import MoEBlock  # noqa: E402


def sparse_moe(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """transformers' dispatch: per expert hit, gather its tokens, run it, scatter-add back."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(F.linear(flat, block.router_weight).float(), dim=-1)
    top, chosen = torch.topk(probs, block.top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for e in chosen.unique().tolist():
        token, slot = torch.where(chosen == e)
        h = F.silu(F.linear(flat[token], block.gates[e])) * F.linear(flat[token], block.ups[e])
        out.index_add_(0, token, (F.linear(h, block.downs[e]) * top[token, slot, None]).to(out.dtype))
    return out.view_as(x)


def timed(fn, x, calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(x)
        samples.append(time.perf_counter() - start)
    return samples


def over_sparse(median_ms: dict[str, float]) -> dict[str, float | None]:
    """Each dense variant's median time over the sparse dispatch's (dense_over_sparse, ...), to 4
    decimals as serving_stats.ratio rounds: at 2, 0.508 ms over 119.6 ms (0.0042) read 0.0."""
    return {f"{name}_over_sparse": ratio(ms, median_ms["sparse"]) for name, ms in median_ms.items() if name != "sparse"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int_at_least("--hidden", 1), default=512)
    parser.add_argument("--intermediate", type=int_at_least("--intermediate", 1), default=1408)
    parser.add_argument("--experts", type=int_at_least("--experts", 1), default=8)
    parser.add_argument("--top-k", type=int_at_least("--top-k", 1), default=2)
    parser.add_argument("--tokens", type=int_list("--tokens", "1,8,128"), default="1,8,128",
                        help="tokens per call (batch x seq)")
    parser.add_argument("--calls", type=int_at_least("--calls", 1), default=10)
    parser.add_argument("--blocks", type=int_at_least("--blocks", 1), default=3)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    if args.top_k > args.experts:  # each token picks top-k distinct experts
        parser.error(f"--top-k ({args.top_k}) must be at most --experts ({args.experts})")
    torch.manual_seed(0)
    h, i, e = args.hidden, args.intermediate, args.experts
    experts = [(torch.randn(i, h) * h ** -0.5, torch.randn(i, h) * h ** -0.5, torch.randn(h, i) * i ** -0.5)
               for _ in range(e)]
    block = MoEBlock(torch.randn(e, h), experts, 0, args.top_k, 1.0, False, torch.float32, SingleRank()).eval()
    if not args.no_compile:  # the experts' linears ask the small-batch kernel's limits while traced
        small_linear.mark_constants_for_tracing()
    compiled = None if args.no_compile else torch.compile(block, fullgraph=True, dynamic=False)
    results = []
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(1, tokens, h)
            torch.testing.assert_close(block(x), sparse_moe(block, x), rtol=1e-4, atol=1e-4)
            variants = {"dense": block, "sparse": lambda t: sparse_moe(block, t)}
            if compiled is not None and tokens == 1:
                compile_start = time.perf_counter()
                compiled(x)
                compile_s = time.perf_counter() - compile_start
                torch.testing.assert_close(compiled(x), block(x), rtol=1e-4, atol=1e-4)
                variants["dense_compiled"] = compiled
            samples = {name: [] for name in variants}
            for _ in range(args.blocks):
                for name, fn in variants.items():
                    fn(x)  # warm
                    samples[name] += timed(fn, x, args.calls)
            median = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
            row = {"tokens": tokens, "median_ms": {k: round(v, 3) for k, v in median.items()},
                   **over_sparse(median)}
            if "dense_compiled" in median:
                row["compile_s"] = round(compile_s, 1)
            results.append(row)
    print(json.dumps({"hidden": h, "intermediate": i, "experts": e, "top_k": args.top_k,
                      "threads": torch.get_num_threads(), "expected_flop_ratio": e / args.top_k,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
