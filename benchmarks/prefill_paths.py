"""A serving prefill call through its compiled graph against the eager step at its exact shape; JSON.

The serving loop pads each prefill call to a chunk bucket and a batch bucket, and a call that
continues its sequences attends over whole cache rows, when it runs through a compiled graph; the
eager step (CompiledCausalLM.eager_serve_step) runs the call's real tokens, reading only the slots
they reach. workers/serving/loop.py picks one per call (EAGER_PREFILL_*); this measures both for
calls of --batches chunks of --lengths tokens each, starting their sequences (start 0) and
continuing them after --starts cached tokens, on one rank in this process (SmolLM2-135M-Instruct, float32, the buckets
`corelaunch serve` builds by default: chunks of 128 to --max-prefill-tokens, rows of --seq-len
slots). Each shape: a call to build its graph, then --rounds calls of each path alternated; the
median seconds of each and which the loop's rule picks. The eager step is also timed with torch's
attention in place of the prefill attention kernel (workers/kernels/prefill_attention.py;
`prefill_kernel_gain`: that time over the eager step's, 1.0 where the kernel does not take the
model), long calls by query blocks as without the kernel (workers/attention_blocks.py), and with
every attention one torch call under its whole mask (`attention_blocks_gain`: that time over the
blocks').

    python benchmarks/prefill_paths.py [--lengths 32,200,600,1100,1500] [--starts 0,512,1100,2400] [--batches 1]
                                       [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.arguments import int_list  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402


def main(out=None) -> dict:
    out = out or sys.stdout
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int_list("--lengths", "32,600"), default=[32, 200, 600, 1100, 1500])
    parser.add_argument("--starts", type=int_list("--starts", "0,1100", minimum=0), default=[0, 512, 1100, 2400])
    parser.add_argument("--batches", type=int_list("--batches", "1,16"), default=[1])
    parser.add_argument("--rounds", type=int_at_least("--rounds", 1), default=3)
    parser.add_argument("--seq-len", type=int_at_least("--seq-len", 256), default=4096)
    parser.add_argument("--max-prefill-tokens", type=int_at_least("--max-prefill-tokens", 128), default=2048)
    parser.add_argument("--threads", type=int_at_least("--threads", 1), default=2)
    args = parser.parse_args()
    too_long = [(s, n) for s in args.starts for n in args.lengths if s + n > args.seq_len]
    if too_long:
        parser.error(f"start + length past --seq-len ({args.seq_len}): {too_long}; lower them or raise --seq-len")
    too_wide = [(b, n) for b in args.batches for n in args.lengths if b * n > args.max_prefill_tokens]
    if too_wide:
        parser.error(f"batch x length past --max-prefill-tokens ({args.max_prefill_tokens}), what one serving step "
                     f"prefills: {too_wide}; lower them or raise --max-prefill-tokens")

    import torch

    from shardlib.buckets import Buckets
    from shardlib.demo_model import ensure_demo_model
    from shardlib.model_config import load_model_config
    from shardlib.sharding import ShardLayout
    from workers import attention_blocks
    from workers.kernels import prefill_attention
    from workers.rank_worker import LoadSpec, RankWorker, ServeSpec, WorkerSpec
    from workers.serving.step_inputs import prefill_inputs
    from workers.serving.step_plan import PrefillChunk

    model_dir = str(ensure_demo_model())
    config = load_model_config(model_dir)
    buckets = Buckets.build(max_context_length=args.max_prefill_tokens, max_seq_len=args.seq_len)
    worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend="cpu", threads=args.threads))
    worker.init_backend("127.0.0.1", 0, timeout_s=60)
    worker.load(LoadSpec(config=config, layout=ShardLayout.for_model(config, 1), dtype="float32",
                         model_dir=model_dir, compile=True, buckets=buckets))
    worker.prepare_serving(ServeSpec(max_num_seqs=max(args.batches), max_prefill_tokens=args.max_prefill_tokens))
    loop = worker._loop
    shapes, slots = loop.config.shapes, loop.config.cache_slots

    def torch_attention(inputs, blocks: bool = True) -> None:
        """The eager step with torch's attention instead of the kernel, by query blocks or (blocks
        False) every call one under its whole mask."""
        share, usable = attention_blocks.MAX_READ_SHARE, prefill_attention.usable
        attention_blocks.MAX_READ_SHARE = share if blocks else 0.0
        prefill_attention.usable = lambda *args: False
        try:
            loop._eager_step(inputs)
        finally:
            attention_blocks.MAX_READ_SHARE, prefill_attention.usable = share, usable

    def one_call_attention(inputs) -> None:
        torch_attention(inputs, blocks=False)

    def timed(run, inputs) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            run(inputs)
        return time.perf_counter() - start

    results = []
    for batch, start, length in [(b, s, n) for b in args.batches for s in args.starts for n in args.lengths]:
        chunk = [PrefillChunk(row, start, tuple(range(1000 + row, 1000 + row + length))) for row in range(batch)]
        graph_inputs = prefill_inputs(chunk, shapes, loop.scratch_row, slots)
        eager_inputs = prefill_inputs(chunk, None, loop.scratch_row, slots)
        timed(loop._step, graph_inputs)  # builds (or loads) its graph
        timed(loop._eager_step, eager_inputs)
        graph_s, eager_s, torch_s, one_call_s = [], [], [], []
        for _ in range(args.rounds):
            graph_s.append(timed(loop._step, graph_inputs))
            eager_s.append(timed(loop._eager_step, eager_inputs))
            torch_s.append(timed(torch_attention, eager_inputs))
            one_call_s.append(timed(one_call_attention, eager_inputs))
        g, e = statistics.median(graph_s), statistics.median(eager_s)
        t, o = statistics.median(torch_s), statistics.median(one_call_s)
        results.append({"batch": batch, "start": start, "length": length,
                        "padded_to": list(graph_inputs.input_ids.shape),
                        "graph_reads": graph_inputs.read_slots, "eager_reads": eager_inputs.read_slots,
                        "graph_s": round(g, 4), "eager_s": round(e, 4), "eager_over_graph": round(e / g, 3),
                        "eager_torch_attention_s": round(t, 4), "prefill_kernel_gain": round(t / e, 3),
                        "eager_one_call_attention_s": round(o, 4), "attention_blocks_gain": round(o / t, 3),
                        "loop_runs_eagerly": loop._prefill_eagerly(chunk)})
    report = {"model": model_dir, "seq_len": slots, "chunk_buckets": list(shapes.chunk_buckets),
              "threads": args.threads, "rounds": args.rounds,
              "prefill_attention_kernel": prefill_attention.covers(config.head_dim, torch.float32), "calls": results}
    print(json.dumps(report, indent=1), file=out)
    return report


if __name__ == "__main__":
    main()
