"""The leader's token choice (workers/penalties.penalized, then workers/sampling.sample) for one decode step's logits, per sampling setting.

Random logits of --rows x --vocab (SmolLM2's vocabulary by default), as float32 values and as
bfloat16 values (a bfloat16 model's logits, where equal values are common); every row with the same
SamplingParams and a seeded generator of its own, as the serving engine draws; each row's history
is a random prompt of --prompt-tokens ids (an int64 tensor, as the serving loop keeps it) and
--output-tokens generated ones (what penalties read; the serving benchmark's requests are 128 + 64). Each case's
median wall time over --repeats calls, on one torch thread (what a rank's leader gives it is
what it has; one thread makes runs comparable). Besides the CASES, greedy rows whose
allowed_token_ids are the whole vocabulary and 1000 ids of it (one set shared by every row, as one
client's label list is). Prints JSON.

To compare two versions of the code side by side, run it from each checkout in one session
(e.g. a `git worktree` of the older commit): `python benchmarks/token_choice.py` in each.

    python benchmarks/token_choice.py [--rows 16] [--vocab 49152] [--repeats 30] [--prompt-tokens 128] [--output-tokens 64]
                                      [--model-logits]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from launcher.cli.options import int_at_least  # noqa: E402 - bad values refused before any work
from workers.penalties import penalized  # noqa: E402
from workers.sampling import SamplingParams, make_generator, sample  # noqa: E402

CASES = {
    "greedy": SamplingParams(),
    "temperature_only": SamplingParams(temperature=1.0, seed=1),  # OpenAI's defaults: top_p 1, no top_k
    "top_k_50_top_p_0.95": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1),
    "top_p_0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    "top_p_0.95_temperature_1": SamplingParams(temperature=1.0, top_p=0.95, seed=1),
    "min_p_0.1": SamplingParams(temperature=1.0, min_p=0.1, seed=1),
    "greedy_repetition_1.2": SamplingParams(repetition_penalty=1.2),
    "temperature_frequency_presence": SamplingParams(temperature=1.0, seed=1, frequency_penalty=0.5,
                                                     presence_penalty=0.5),
    "greedy_all_three_penalties": SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5),
}


PROSE = ("The history of the harbour begins with a few fishing boats sheltered behind a sand bar. Merchants "
         "arrived with salt, timber and wool, built warehouses along the quay, and the village grew into a busy "
         "port whose streets still follow the old shore line. ")


def model_logits(rows: int) -> torch.Tensor:
    """The built-in model's logits (float32) at the last `rows` positions of PROSE repeated."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardlib.demo_model import ensure_demo_model

    folder = ensure_demo_model()
    ids = AutoTokenizer.from_pretrained(folder)(PROSE * (1 + rows // 40), return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits[0, -rows:].float().contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int_at_least("--rows", 1), default=16)
    parser.add_argument("--vocab", type=int_at_least("--vocab", 1), default=49152)
    parser.add_argument("--repeats", type=int_at_least("--repeats", 1), default=30)
    parser.add_argument("--prompt-tokens", type=int_at_least("--prompt-tokens", 1), default=128)
    parser.add_argument("--output-tokens", type=int_at_least("--output-tokens", 0), default=64)
    parser.add_argument("--model-logits", action="store_true",
                        help="also time the built-in model's own logits (SmolLM2 at --rows positions of a prose "
                             "prompt; needs --vocab 49152): a real model's distribution is far sharper than the "
                             "random logits', which decides how many tokens top-p keeps")
    args = parser.parse_args()
    if args.model_logits and args.vocab != 49152:
        parser.error(f"--model-logits takes the built-in model's 49152 logits; leave --vocab at 49152, not {args.vocab}")
    torch.set_num_threads(1)
    float32 = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    ids = torch.Generator().manual_seed(1)
    # each prompt an int64 tensor, as the serving loop keeps it (workers/serving/token_choice.py)
    prompts = [row.clone() for row in torch.randint(args.vocab, (args.rows, args.prompt_tokens), generator=ids)]
    outputs = torch.randint(args.vocab, (args.rows, args.output_tokens), generator=ids).tolist()
    results = {}
    kinds = [("float32", float32), ("bfloat16", float32.bfloat16().float())]
    if args.model_logits:
        kinds.append(("smollm2", model_logits(args.rows)))
    # allowed_token_ids: a mask per set, found again at every step (workers/penalties.py)
    cases = {**CASES, "greedy_allowed_every_id": SamplingParams(allowed_token_ids=range(args.vocab)),
             "greedy_allowed_1000_ids": SamplingParams(allowed_token_ids=range(0, args.vocab, max(1, args.vocab // 1000)))}
    for values, logits in kinds:
        for name, params in cases.items():
            batch = [params] * args.rows
            generators = [make_generator(params) for _ in range(args.rows)]
            sample(penalized(logits, batch, prompts, outputs), batch, generators)  # warm
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                sample(penalized(logits, batch, prompts, outputs), batch, generators)
                times.append(time.perf_counter() - start)
            results[f"{name} ({values})"] = {"median_ms": round(1000 * statistics.median(times), 3),
                                             "min_ms": round(1000 * min(times), 3)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(json.dumps({"commit": commit or None, "rows": args.rows, "vocab": args.vocab, "threads": 1,
                      "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                      "repeats": args.repeats, "cases": results}, indent=1))


if __name__ == "__main__":
    main()
