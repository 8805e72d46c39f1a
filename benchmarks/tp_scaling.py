"""Decode speed of tensor parallelism on one host, side by side in one run.

A random Llama of hidden 1024, 16 layers, 16 heads, 8 KV heads, intermediate 2816, vocab 32000
(~254M parameters, float32), built once with tests/model_factory.save_random_model. Batch 1, a fixed
prompt, 128 new tokens with EOS ignored. Variants (same two cores in all):

    transformers    transformers generate(), 2 torch threads; one call per run, a clock reading as
                    each token is chosen: (n - 1) / (last - first), as corelaunch times itself
    tp1             corelaunch TP 1 through the driver API: one rank, 2 threads
    tp2             corelaunch TP 2: two ranks, 1 thread each, default collectives (shared memory)
    tp2_gloo        the same with CORELAUNCH_COLLECTIVES=gloo
    tp2_regions     tp2 with the collectives left outside the compiled graphs (granularity
                    "collective": each layer cut into the code between two collectives, the way TP > 1
                    ran before the collectives became graph operators)
    tp1_eager       tp1 without compiled graphs (--no-compile); not in the default set
    tp2_eager       tp2 without compiled graphs; not in the default set

tp1, tp2, tp2_gloo and tp2_regions run compiled graphs (the default granularity, one graph per
decoder layer with the collectives inside, unless the variant says otherwise); the untimed warm-up
request builds the graphs its buckets need, so the timed runs never compile.

Each variant runs in its own process with its own local Ray (the collectives choice is read from
the workers' environment, which one Ray session shares). Only one variant's processes are alive at
a time: an idle Ray instance costs ~6% of a core in background wake-ups, and ranks that wait on
each other in a spin loop lose a whole step when either is preempted, so idle instances of the
other variants would bias the figures. The variants run in `--rounds` rounds, in the same order
each round (each start, one untimed warm-up request, `--runs` timed requests, stop), so machine
noise over time hits them alike; the compile cache is shared, so only the first round compiles.
Medians over all timed runs are reported, each next to its weights-over-bandwidth bound (weight
bytes streamed per token over the host's read bandwidth, measured by benchmarks/bandwidth.py on two
threads at the start of every round; the best pass is used) and the weight bandwidth the run
achieved. Prints one JSON object.

    python benchmarks/tp_scaling.py [--new-tokens 128] [--rounds 3] [--runs 2] [--model-dir DIR]
                                    [--variants transformers,tp1,tp2,tp2_gloo,tp1_eager,tp2_eager]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bandwidth import decode_bound, measure_gbps  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402

SHAPE = dict(hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=2816,
             vocab_size=32000, max_position_embeddings=1024)


def save_random_254m(path: Path, max_position_embeddings: int | None = None) -> Path:
    """The benchmarks' 254M random Llama (SHAPE), saved to path; a longer context when asked."""
    from tests.model_factory import save_random_model

    positions = max(SHAPE["max_position_embeddings"], max_position_embeddings or 0)
    save_random_model(Path(path), **dict(SHAPE, max_position_embeddings=positions))
    return Path(path)


def saved_model_problem(path: Path) -> str | None:
    """Why the folder at path is no complete saved model, or None. save_pretrained writes config.json
    before the weights, so a build interrupted there (Ctrl-C, a full disk, a kill) left a folder
    that looked like a model to a check of config.json alone; every later run reused it and its
    ranks failed on the missing weights. A truncated safetensors file is caught by its header."""
    from shardlib.checkpoint_files import preferred_file, safetensors_header

    if not (path / "config.json").is_file():
        return f"{path} holds no config.json"
    found = preferred_file(path)
    if found is None:
        return f"{path} holds a config.json but no weights"
    fmt, weights = found
    if fmt == "safetensors" and not weights.name.endswith(".index.json"):
        try:
            safetensors_header(weights)
        except ValueError as err:
            return str(err)
    return None


def builds_here(path: Path) -> bool:
    """Whether the model is to be built at path: nothing there yet, or an empty folder."""
    return not path.exists() or (path.is_dir() and not path.is_symlink() and not any(path.iterdir()))


def build_in_place(path: Path, build: Callable[[Path], object]) -> Path:
    """build(folder) into a hidden sibling of path, renamed to path once complete (as `corelaunch
    quantize` writes its copy): an interrupted build leaves only the sibling, which the next build
    sweeps once its writer is gone, never a half-built folder at path. An empty folder at path (the
    temporary one made for it) is replaced."""
    import shutil

    from shardlib.atomic_dir import make_parents, owned_sibling, rename_no_replace, sweep_stale

    path = Path(path)
    sweep_stale(path)  # the siblings of builds that were killed (no clean-up ran): the model's size each
    partial = owned_sibling(path, "partial")
    make_parents(path)
    try:
        build(partial)
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()
        if not rename_no_replace(partial, path):  # a file system without it: rename(2) as it can
            _rename_onto_empty(partial, path)
    except FileExistsError:  # another run built it meanwhile: theirs serves as well
        shutil.rmtree(partial, ignore_errors=True)
        if saved_model_problem(path) is not None:
            raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return path


def _rename_onto_empty(partial: Path, path: Path) -> None:
    """rename(2) of the built folder onto path, which replaces only an empty folder: one another run
    filled meanwhile is its ENOTEMPTY (or EEXIST), raised as the FileExistsError the caller reads."""
    import errno

    try:
        partial.rename(path)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(err.errno, err.strerror, str(path)) from err
        raise


def build_random_254m_in_place(path: Path, max_position_embeddings: int | None = None) -> Path:
    """save_random_254m, through build_in_place."""
    return build_in_place(path, lambda folder: save_random_254m(folder, max_position_embeddings))


def model_description(model_dir: str) -> dict:
    """The report's "model": the shape, parameter count and dtype of the model the variants ran,
    read from its config.json (SHAPE's figures were reported for any --model-dir's model)."""
    from shardlib.model_config import load_model_config
    from shardlib.param_shapes import expected_shapes

    config = load_model_config(model_dir)
    params = sum(math.prod(shape) for shape in expected_shapes(config).values())
    return {"params_millions": round(params / 1e6, 1), "hidden_size": config.hidden_size,
            "num_layers": config.num_hidden_layers, "num_heads": config.num_attention_heads,
            "num_kv_heads": config.num_key_value_heads, "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size, "max_position_embeddings": config.max_position_embeddings,
            "dtype": config.torch_dtype}


def repeated_names(names: list[str]) -> list[str]:
    """The names given more than once, in order of first appearance."""
    return [name for i, name in enumerate(names) if names.count(name) > 1 and name not in names[:i]]


def model_positions(model_dir: str | None) -> int:
    """The positions of the model the run will use: --model-dir's own when it holds one, else SHAPE's."""
    config = Path(model_dir) / "config.json" if model_dir else None
    if config is not None and config.is_file():
        return int(json.loads(config.read_text()).get("max_position_embeddings", SHAPE["max_position_embeddings"]))
    return SHAPE["max_position_embeddings"]


PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889, 13, 1576, 3444, 338]
VARIANTS = ("transformers", "tp1", "tp2", "tp2_gloo", "tp2_regions", "tp1_eager", "tp2_eager")
DEFAULT_VARIANTS = VARIANTS[:5]


# ---- one variant, served in its own process ---------------------------------------------------
def serve(variant: str, model_dir: str, new_tokens: int, out) -> None:
    """Load `variant`, then answer each line on stdin with one JSON line on `out`: the process's
    own stdout, which run_reporting saved (its sys.stdout is stderr: the replies went there, and
    the driver waited for them without end)."""
    sys.stdout = sys.stderr  # keep library chatter off the protocol channel
    if variant == "transformers":
        run, info, close = _hf(model_dir, new_tokens)
    else:
        run, info, close = _corelaunch(variant, model_dir, new_tokens)
    out.write(json.dumps({"ready": info}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            if line.strip() != "run":
                break
            out.write(json.dumps(run()) + "\n")
            out.flush()
    finally:
        close()


def _hf(model_dir: str, new_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteriaList

    from benchmarks.token_clock import decode_rate, token_clock

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:  # the lookup reads one row a token, as bounds() counts it
        embedding = model.get_input_embeddings().weight
        weight_bytes -= embedding.numel() * embedding.element_size()

    def run() -> dict:
        clock = token_clock()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 stopping_criteria=StoppingCriteriaList([clock]))
        return {"decode_tokens_per_s": decode_rate(clock.times, new_tokens),
                "token_ids": out[0, len(PROMPT):].tolist()}

    return run, {"weight_bytes_per_rank": weight_bytes, "threads": 2, "ranks": 1}, lambda: None


def _corelaunch(variant: str, model_dir: str, new_tokens: int):
    import ray

    from launcher.api import Launcher

    tp = 1 if variant.startswith("tp1") else 2
    compile_ = not variant.endswith("_eager")
    if variant == "tp2_gloo":
        os.environ["CORELAUNCH_COLLECTIVES"] = "gloo"  # before Ray starts: its workers inherit it
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    granularity = "collective" if variant == "tp2_regions" else None
    launcher = Launcher(model=model_dir, tp=tp, compile=compile_, compile_granularity=granularity,
                        progress=False, prefix_caching=False).start()  # every run prefills its prompt whole (the same prompt again would be a prefix-cache hit)
    group = launcher._group
    kinds = ray.get([a.__ray_call__.remote(lambda self: type(self._collectives).__name__) for a in group.actors])
    info = {"ranks": tp, "threads": group.resources.threads, "collectives": kinds[0],
            # what a decode step reads: an untied input embedding's lookup reads one row, not the table
            "weight_bytes_per_rank": max(s.decode_read_bytes for s in launcher.load_stats),
            "compile": launcher.config.compile, "granularity": granularity or "default"}

    def run() -> dict:
        [out] = launcher.generate([PROMPT], max_new_tokens=new_tokens, ignore_eos=True)
        assert len(out.token_ids) == new_tokens
        return {"decode_tokens_per_s": out.decode_tokens_per_s, "token_ids": out.token_ids}

    def close() -> None:
        launcher.shutdown()
        ray.shutdown()

    return run, info, close


# ---- the driver ---------------------------------------------------------------------------------
READY_TIMEOUT_S = 1800.0
"""A variant's start: loading, and compiling its graphs cold on 2 cores, takes minutes."""
RUN_TIMEOUT_S = 600.0
"""One request, the warm-up one included (it builds the graphs its buckets need)."""


class Server:
    def __init__(self, variant: str, model_dir: str, new_tokens: int) -> None:
        self.variant = variant
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", variant, "--model-dir", model_dir, "--new-tokens", str(new_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.info = self._read(READY_TIMEOUT_S, "start")["ready"]

    def _read(self, timeout_s: float, what: str) -> dict:
        """The variant's next reply line (one is outstanding at a time, so none waits in the
        pipe's read buffer while select() waits on the descriptor)."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            self.proc.kill()
            raise RuntimeError(f"variant {self.variant} did not answer its {what} within {timeout_s:g} s; "
                               f"see its stderr above")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"variant {self.variant} exited (code {self.proc.wait()}); see its stderr above")
        return json.loads(line)

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read(RUN_TIMEOUT_S, "request")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def bounds(weight_bytes_per_rank: int, ranks: int, tokens_per_s: float, gbps: float) -> dict:
    """Every rank reads all of its weights once per decoded token (the input embedding's lookup one
    row: left out of weight_bytes_per_rank unless it is also the LM head)."""
    total = weight_bytes_per_rank * ranks
    bound = decode_bound(total, gbps)
    return {"bound_tokens_per_s": round(bound, 1), "fraction_of_bound": round(tokens_per_s / bound, 3),
            "weight_stream_achieved_GBps": round(tokens_per_s * total / 1e9, 1)}


def compare_tokens(tokens: dict[str, list[int]]) -> dict:
    """Whether each variant generated the same tokens as the reference, which is named: tp1 when it
    ran, else the first variant that ran (without tp1, nothing used to be compared)."""
    reference = "tp1" if "tp1" in tokens else next(iter(tokens))
    return {"tokens_reference": reference,
            "tokens_identical": {f"{v}_vs_{reference}": t == tokens[reference] for v, t in tokens.items()
                                 if v != reference}}


def main(out=None) -> None:
    """out: where the JSON report goes (stdout when None)."""
    out = out or sys.stdout
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int_at_least("--new-tokens", 2), default=128)
    parser.add_argument("--rounds", type=int_at_least("--rounds", 1), default=3)
    parser.add_argument("--runs", type=int_at_least("--runs", 1), default=2, help="timed requests per variant per round")
    parser.add_argument("--model-dir", help="reuse (or create) the model here instead of a temporary folder")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.model_dir, args.new_tokens, out)
        return

    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:  # before the 1 GB model is built
        parser.error(f"--variants ({args.variants!r}): unknown variants {unknown} or none; choose one or more "
                     f"from {', '.join(VARIANTS)}")
    repeated = repeated_names(variants)
    if repeated:  # results are keyed by variant: a repeat pooled its runs into the first one's median
        parser.error(f"--variants ({args.variants}) names {', '.join(repeated)} more than once: each variant is "
                     f"reported under its name, so a repeat's runs were pooled with the first's; give each variant "
                     f"once (for more samples raise --runs or --rounds)")
    positions = model_positions(args.model_dir)
    if len(PROMPT) + args.new_tokens > positions:  # before the model is built and any variant starts
        parser.error(f"--new-tokens ({args.new_tokens}) plus the {len(PROMPT)}-token prompt needs "
                     f"{len(PROMPT) + args.new_tokens} positions, but the model has {positions}; lower --new-tokens "
                     f"to at most {positions - len(PROMPT)}")
    if args.model_dir is not None and not builds_here(Path(args.model_dir)):
        problem = saved_model_problem(Path(args.model_dir))
        if problem:  # before any variant starts: each one failed on it, after the bandwidth pass
            parser.error(f"--model-dir: {problem}; pass a complete model folder, or a new or empty one to build "
                         f"the benchmark's model in (a half-built one, left by an interrupted build: remove it)")
    tmp = None
    model_dir = args.model_dir
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="corelaunch-tp-scaling-")
        model_dir = tmp.name
    if builds_here(Path(model_dir)):
        start = time.perf_counter()
        build_random_254m_in_place(Path(model_dir))
        print(f"built the model in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    model = model_description(model_dir)  # before the temporary folder is removed

    samples: dict[str, list[dict]] = {v: [] for v in variants}
    infos: dict[str, dict] = {}
    load_before = os.getloadavg()
    bandwidths: list[float] = []
    cache = tempfile.TemporaryDirectory(prefix="corelaunch-tp-scaling-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name  # shared by the servers: later rounds reuse graphs
    try:
        for _ in range(args.rounds):
            bandwidths.append(measure_gbps(2))
            for v in variants:
                server = Server(v, model_dir, args.new_tokens)
                try:
                    infos[v] = server.info
                    server.run()  # warm-up: builds the graphs its buckets need, first-call allocations
                    samples[v] += [server.run() for _ in range(args.runs)]
                finally:
                    server.close()
    finally:
        cache.cleanup()
        if tmp is not None:
            tmp.cleanup()

    results = {}
    for v, runs in samples.items():
        info = infos[v]
        rates = [r["decode_tokens_per_s"] for r in runs]
        median = statistics.median(rates)
        results[v] = {"decode_tokens_per_s": round(median, 2), "all_runs": [round(x, 2) for x in rates], **info,
                      **bounds(info["weight_bytes_per_rank"], info["ranks"], median, max(bandwidths))}
    tokens = {v: runs[-1]["token_ids"] for v, runs in samples.items()}
    rate = {v: r["decode_tokens_per_s"] for v, r in results.items()}
    ratios = {}
    for a, b in (("tp2", "tp1"), ("tp2", "transformers"), ("tp1", "transformers"), ("tp2", "tp2_gloo"),
                 ("tp2", "tp2_regions"),
                 ("tp2_eager", "tp1_eager"), ("tp1", "tp1_eager"), ("tp2", "tp2_eager")):
        if a in rate and b in rate:
            ratios[f"{a}_over_{b}"] = round(rate[a] / rate[b], 3)
    report = {
        "model": {**model, **({"dir": args.model_dir} if args.model_dir else {})}, "batch": 1,
        "prompt_tokens": len(PROMPT), "new_tokens": args.new_tokens, "rounds": args.rounds,
        "runs_per_round": args.runs,
        "results": results, "ratios": ratios,
        "read_GBps_each_round": [round(b, 2) for b in bandwidths],
        "targets": {"tp2_over_tp2_regions": ">= 1.15", "tp2_over_tp1": ">= 1.3", "tp2_over_transformers": ">= 2"},
        **compare_tokens(tokens),
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "note": "noisy shared machine: re-run on a quiet one for figures to quote",
    }
    print(json.dumps(report, indent=2), file=out)


if __name__ == "__main__":
    from launcher.cli.command_stdout import run_reporting

    run_reporting(main)
