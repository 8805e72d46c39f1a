"""`corelaunch quantize`: write a quantized copy of a Hugging Face model directory.

    corelaunch quantize --model DIR --dtype int8 --out QDIR      (per channel, the default)
    corelaunch generate --model QDIR "The capital of France is"

Only shardlib is used (no Ray): tensors are streamed one at a time (shardlib/quantize_checkpoint.py),
so host memory stays near the largest tensor whatever the model's size. Bad input (an unknown
dtype, an already quantized model, an existing --out or one inside --model) is refused with one
line before any weight is read. Exit code 0 on success, 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from launcher.cli.options import non_empty_path
from shardlib.quantization import QUANT_DTYPES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "quantize", help="write an int8 / fp8 quantized copy of a model directory",
        description="Quantize every linear layer's weight to int8 or fp8 (symmetric, per output channel or per "
                    "tensor) with its float32 scale stored beside it as <module>.scale; config.json records the "
                    "quantization and the tokenizer files are copied. generate, check and bench accept the result.")
    p.add_argument("--model", help="Hugging Face model directory (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", required=True, metavar="|".join(QUANT_DTYPES),
                   help="int8 (scale absmax/127), f8e4m3 (absmax/240, Neuron's e4m3 range) or f8e5m2")
    granularity = p.add_mutually_exclusive_group()
    granularity.add_argument("--per-channel", dest="per_channel", action="store_true", default=True,
                             help="one scale per output channel (the default)")
    granularity.add_argument("--per-tensor", dest="per_channel", action="store_false",
                             help="one scale per weight tensor")
    p.add_argument("--embedding", action="store_true",
                   help="quantize the embedding table too, one scale per token row (one for the table with "
                        "--per-tensor; with tied embeddings, the LM "
                        "head is that same table); default: embedding and LM head stay unquantized")
    p.add_argument("--lm-head", action="store_true", help="quantize an untied LM head too (refused with tied embeddings: use --embedding)")
    p.add_argument("--out", required=True, type=non_empty_path("--out"), metavar="QDIR", help="the directory to write (must not exist)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=run)


class TensorProgress:
    """The tensors written so far, on `stream`: on a terminal, one line rewritten in place with \\r;
    to a pipe or a log file, where every \\r stays in the text (the built-in model's 272 tensors made
    one line of 272 fragments), a line for the first tensor, about one per tenth of them, and the last."""

    def __init__(self, stream, enabled: bool = True):
        from shardlib.terminal import stream_is_a_terminal

        self.stream, self.enabled = stream, enabled
        self.in_place = stream_is_a_terminal(stream)
        self.line_open = False  # an in-place line lacks its end until the last tensor
        self.tenths_shown = -1

    def __call__(self, name: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        text = f"quantize: {done}/{total} tensors"
        if self.in_place:
            self.line_open = done < total
            print(f"\r{text}", end="" if self.line_open else "\n", file=self.stream)
        elif done * 10 // total > self.tenths_shown:  # the last tensor is the tenth tenth
            self.tenths_shown = done * 10 // total
            print(text, file=self.stream, flush=True)

    def end_line(self) -> None:
        """End an unfinished in-place line, so that what is printed next starts a line of its own."""
        if self.line_open:
            print(file=self.stream)
            self.line_open = False


def run(args: argparse.Namespace) -> int:
    from shardlib.quantize_checkpoint import check_quantize_options, check_quantize_request, quantize_checkpoint

    model = args.model
    try:
        if model is None:  # the built-in model, converted on first use: the options are refused first
            from shardlib.demo_model import DEMO_MODEL_NAME, default_cache_dir, ensure_demo_model

            check_quantize_options(args.dtype, args.out, default_cache_dir() / DEMO_MODEL_NAME)
            model = str(ensure_demo_model())
        check_quantize_request(model, args.dtype, args.out, args.lm_head)  # every refusal before any weight is read
    # OSError: the demo model's conversion lock waited too long (TimeoutError), or its cache failed
    except (ValueError, OSError) as err:
        print(f"corelaunch quantize: {err}", file=sys.stderr)
        return 2
    start = time.monotonic()
    progress = TensorProgress(sys.stderr, enabled=not args.quiet)

    def failed(text: str) -> int:
        progress.end_line()
        print(f"corelaunch quantize: {text}", file=sys.stderr)
        return 2

    try:
        out = quantize_checkpoint(model, args.out, args.dtype, args.per_channel, args.lm_head, args.embedding,
                                  progress=progress)
    except ValueError as err:  # a checkpoint that fails to read (the message names the file)
        return failed(str(err))
    except OSError as err:
        from shardlib.atomic_dir import out_dir_failure

        # --out itself, inside it, the partial directory written beside it, or a missing parent
        # folder of it (shardlib/atomic_dir.py)
        failure = out_dir_failure(args.out, err)
        if failure is not None:
            failure = _in_the_users_words(args.out, err, failure)
            return failed(f"could not write --out {args.out} ({failure}); pass a new path in a directory you can "
                          f"write to")
        return failed(str(err))  # reading the checkpoint failed
    except BaseException:  # Ctrl-C, SIGTERM: main's "corelaunch: interrupted" on a line of its own
        progress.end_line()
        raise
    if not args.quiet:
        print(f"quantize: wrote {out} in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return 0


def _in_the_users_words(out: str, err: OSError, failure: str) -> str:
    """out_dir_failure's text, without the hidden folder written beside --out (.NAME.partial-...,
    shardlib/atomic_dir.py) that the user never chose: "No such file or directory:
    '/proc/.q3.partial-...'" read as if that folder should have existed."""
    if not isinstance(err.filename, (str, bytes, os.PathLike)):
        return failure
    target, failed = Path(out).absolute(), Path(os.fsdecode(err.filename)).absolute()
    hidden = next((p for p in (failed, *failed.parents)
                   if p.parent == target.parent and p.name.startswith(f".{target.name}.")), None)
    reason = err.strerror or str(err)
    if hidden is None:
        return failure
    if hidden == failed:  # the folder itself could not be made
        return f"its parent folder {target.parent} cannot hold new folders: {reason}"
    return f"{reason}, writing {failed.relative_to(hidden)}"
