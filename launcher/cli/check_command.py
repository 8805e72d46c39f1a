"""`corelaunch check`: compare corelaunch's greedy output with Hugging Face transformers on CPU.

The reference is the checkpoint (or `--reference DIR`) loaded with AutoModelForCausalLM in float32
in this driver process, or expected outputs saved earlier with `--save-expected`. Modes, as in NxD
Inference: token matching (exact greedy tokens) and logit matching (top-k logit tolerances, with
teacher forcing at divergences); the rules are in shardlib/evaluation/accuracy.py. Both sides generate exactly
--num-tokens tokens: EOS stops neither.

Expected-outputs file (torch.save of a dict; read with torch.load(weights_only=True)):
    "format":          "corelaunch-expected/1"
    "input_ids":       list of prompts, each a list of token ids (a (batch, len) tensor, or one
                       flat list / 1-D tensor for one prompt, are accepted too)
    "expected_tokens": int64 tensor (batch, n), or (n,) for one prompt
    "expected_logits": float32 tensor (batch, n, vocab), or (n, vocab) for one prompt; optional,
                       needed for logit matching (tokens default to its argmax when absent)
    "reference":       free text naming what produced it (optional)

Exit codes: 0 passed, 1 failed (a request of corelaunch's that fails by itself included), 2 bad input
(nothing compared), 3 the run did not reach its end (a rank died or hung; launcher/cli/exit_codes.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.cli.options import (add_backend_arguments, add_cpus_per_rank, add_kv_cache_dtype, add_layout_choices,
                                  add_max_num_seqs, add_no_compile, add_pad_q_heads, add_sequence_parallel,
                                  add_timeout_arguments, backend_options, in_tp_flag, int_at_least, layout_choices,
                                  max_num_seqs_option, non_empty_path, timeout_options, with_flag_name,
                                  without_nodes_ways)
from shardlib.evaluation.quantized_tolerances import DEFAULT_TOL_SPEC

EXIT_PASS, EXIT_FAIL = 0, 1  # 2 (bad input) and 3 (the run failed): launcher/cli/exit_codes.py
FILE_FORMAT = "corelaunch-expected/1"
DEFAULT_PROMPT = "I believe the meaning of life is"
DEFAULT_NUM_TOKENS = 16
DEFAULT_ATOL = 1e-5
LOGIT_MATCHING_FLAGS = (("--tol-map", "tol_map"), ("--atol", "atol"),
                        ("--divergence-difference-tol", "divergence_difference_tol"))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "check", help="check corelaunch's tokens or logits against Hugging Face transformers (CPU, float32)",
        description="Run corelaunch and a reference (transformers AutoModelForCausalLM, float32, in this "
                    "process; or a file of expected outputs) on the same prompts and compare their greedy "
                    "tokens (token-matching) or logits (logit-matching, NxD Inference's tolerances, teacher "
                    "forcing at divergences). Exit 0 on pass, 1 on fail, 2 on bad input, 3 when the run "
                    "itself failed (a rank died or hung).")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (or use --prompt / --prompt-ids)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt; repeatable")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids, e.g. 5,17,42 (for models without a "
                        "tokenizer); repeatable")
    p.add_argument("--mode", "--check-accuracy-mode", dest="mode", default="logit-matching",
                   choices=["token-matching", "logit-matching"], help="default: logit-matching")
    p.add_argument("--num-tokens", "--num-tokens-to-check", dest="num_tokens", type=int, metavar="N",
                   help=f"tokens to generate and compare per prompt (default {DEFAULT_NUM_TOKENS}, or all "
                        f"of an --expected file's)")
    # an empty path was taken as none given: `--save-expected ""` ran a whole check and saved nothing,
    # `--reference ""` compared the model with itself
    p.add_argument("--model", type=non_empty_path("--model"),
                   help="Hugging Face model directory (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--reference", metavar="DIR", type=non_empty_path("--reference"),
                   help="checkpoint the transformers reference loads (default: the --model directory)")
    p.add_argument("--expected", "--expected-outputs-path", dest="expected", metavar="PATH",
                   type=non_empty_path("--expected"),
                   help="compare with outputs saved by --save-expected instead of running transformers")
    p.add_argument("--save-expected", metavar="PATH", type=non_empty_path("--save-expected"),
                   help="only run the transformers reference and save its tokens and logits to PATH "
                        "(no workers are started)")
    p.add_argument("--tp", default="auto", help="tensor-parallel degree, or auto (default)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="corelaunch's compute dtype (default: the checkpoint's); the reference stays float32")
    add_kv_cache_dtype(p)
    # the serving cache's rows and their length, which the plan's memory check counts (its refusal
    # named them as ways out that check did not take)
    add_max_num_seqs(p, compiled=False)
    p.add_argument("--seq-len", type=int_at_least("--seq-len"), metavar="N",
                   help="positions per serving cache row: each prompt plus --num-tokens must fit "
                        "(default min(max_position_embeddings, 4096))")
    add_backend_arguments(p)
    add_cpus_per_rank(p)
    add_timeout_arguments(p)
    add_pad_q_heads(p)
    add_sequence_parallel(p)
    add_layout_choices(p)
    p.add_argument("--divergence-difference-tol", type=float, metavar="TOL",
                   help="at a divergence, max(actual) - actual[expected token] must be below this, so 0 fails "
                        "every divergence (default 0.001; a quantized model's or fp8 cache's in "
                        "shardlib/evaluation/quantized_tolerances.py)")
    p.add_argument("--tol-map", metavar="K:RTOL,...",
                   help=f"top-k groups and their rtol; K an integer or 'all' (default {DEFAULT_TOL_SPEC}; a "
                        f"quantized model's or fp8 cache's in shardlib/evaluation/quantized_tolerances.py)")
    # default None, resolved in _run: a given --atol is told apart from the default, so token matching
    # (which has no tolerances) can refuse it instead of ignoring it
    p.add_argument("--atol", type=float, help=f"absolute tolerance of every top-k group (default {DEFAULT_ATOL:g})")
    add_no_compile(p)
    p.add_argument("--ray-address", help="Ray cluster host:port, or local for a private one (default: RAY_ADDRESS, else the cluster `ray start` recorded on this host, else a private one)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=run)


# ---- inputs ------------------------------------------------------------------------------------
@dataclass
class Expected:
    input_ids: list[list[int]]
    tokens: list[list[int]]
    logits: object  # torch.Tensor (batch, n, vocab) or None
    source: str


def parse_prompt_ids(text: str) -> list[int]:
    """Token ids separated by commas; spaces beside a comma are allowed, spaces between two ids are
    refused: removing them read "5 17 42" as the one id 51742."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    spaced = [t for t in items if len(t.split()) > 1]
    if spaced:
        with_commas = ",".join(text.replace(",", " ").split())
        raise ValueError(f"--prompt-ids {text!r}: {spaced[0]!r} is several ids without commas between them; "
                         f"separate token ids with commas, e.g. --prompt-ids {with_commas}")
    try:
        ids = [int(t) for t in items]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r} is not a comma-separated list of token ids, e.g. 5,17,42") from None
    if not ids:
        raise ValueError(f"--prompt-ids {text!r} holds no token ids")
    return ids


def load_expected(path: str) -> Expected:
    """Read and validate an expected-outputs file (format in the module docstring)."""
    import torch

    if Path(path).is_dir():  # "does not exist" with a fix (--save-expected DIR) that is itself refused
        raise ValueError(f"expected-outputs file {path} is a directory; pass the file `corelaunch check "
                         f"--save-expected FILE` wrote")
    if not Path(path).exists():
        raise FileNotFoundError(f"expected-outputs file {path} does not exist; write one with "
                                f"`corelaunch check --save-expected {path}`")
    if not Path(path).is_file():  # /dev/null, a pipe (torch.load would wait on it for ever), a socket
        raise ValueError(f"expected-outputs file {path} is not a regular file; pass the file `corelaunch check "
                         f"--save-expected FILE` wrote")
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except PermissionError:  # not "damaged": the file may be fine, this user cannot read it
        raise ValueError(f"expected-outputs file {path} cannot be read: permission denied; run as a user who "
                         f"may read it, or copy it somewhere readable") from None
    except Exception as err:  # a pickle of anything but tensors and plain containers, or a corrupt file
        # torch's own text advises weights_only=False, which would run the file's code: not quoted.
        raise ValueError(f"{path} is not a readable expected-outputs file: torch.load(weights_only=True) "
                         f"failed ({type(err).__name__}), so it is not a torch file, is damaged, or holds "
                         f"more than tensors, numbers, strings, lists and dicts; write one with "
                         f"`corelaunch check --save-expected PATH`") from None
    if not isinstance(data, dict) or "input_ids" not in data or not (
            "expected_tokens" in data or "expected_logits" in data):
        raise ValueError(f"{path} must hold a dict with 'input_ids' and 'expected_tokens' and/or "
                         f"'expected_logits'; see `corelaunch check --help`")
    if data.get("format", FILE_FORMAT) != FILE_FORMAT:  # files written by hand may leave it out
        raise ValueError(f"{path} says format {data.get('format')!r}, not {FILE_FORMAT!r}, the one corelaunch "
                         f"check reads; write it again with `corelaunch check --save-expected PATH`")
    ids = data["input_ids"]
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if isinstance(ids, list) and ids and all(_token_id(t) for t in ids):
        ids = [ids]
    if not (isinstance(ids, list) and ids and all(isinstance(p, list) and p and all(_token_id(t) for t in p)
                                                   for p in ids)):
        raise ValueError(f"{path}: input_ids must be a non-empty list of non-empty token-id lists")
    batch = len(ids)

    logits = data.get("expected_logits")
    if logits is not None:
        if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3):
            raise ValueError(f"{path}: expected_logits must be a (batch, n, vocab) or (n, vocab) tensor")
        logits = logits.float()
        if bool((logits.isnan() | (logits == math.inf)).any()):
            raise ValueError(f"{path}: expected_logits hold NaN or +inf values, which no comparison can pass; "
                             f"save the reference again with `corelaunch check --save-expected PATH`")
        if logits.dim() == 2:
            logits = logits.unsqueeze(0)
        if logits.shape[0] != batch:
            raise ValueError(f"{path}: expected_logits has {logits.shape[0]} rows for {batch} prompts")
    tokens = data.get("expected_tokens")
    if tokens is None and logits is None:
        raise ValueError(f"{path}: neither expected_tokens nor expected_logits is given: save the reference with "
                         f"`corelaunch check --save-expected PATH`, or give at least the expected tokens")
    if tokens is None:
        if logits.shape[-1] < 1 or logits.shape[-2] < 1:  # argmax over no token raised an IndexError (exit 1)
            raise ValueError(f"{path}: expected_logits {tuple(logits.shape)} holds no token's logits; save the "
                             f"reference again with `corelaunch check --save-expected PATH`")
        tokens = logits.argmax(dim=-1)
    not_tokens = (f"{path}: expected_tokens must be an integer (batch, n) or (n,) tensor or a list of "
                  f"equal-length lists of ints")
    if isinstance(tokens, list):
        try:
            tokens = torch.tensor(tokens)
        # torch's own words named neither the file nor the key: "too many dimensions 'str'" (ValueError),
        # "expected sequence of length 2 at dim 1 (got 1)", "Could not infer dtype of NoneType" (RuntimeError)
        except (ValueError, TypeError, RuntimeError):
            raise ValueError(not_tokens) from None
    if (not isinstance(tokens, torch.Tensor) or tokens.dim() not in (1, 2) or tokens.is_floating_point()
            or tokens.dtype == torch.bool):
        raise ValueError(not_tokens)
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.shape[0] != batch or tokens.shape[1] < 1:
        raise ValueError(f"{path}: expected_tokens {tuple(tokens.shape)} must have one row per prompt ({batch}) "
                         f"and at least one token")
    if logits is not None and logits.shape[1] != tokens.shape[1]:
        raise ValueError(f"{path}: expected_tokens has {tokens.shape[1]} tokens per prompt but expected_logits "
                         f"{logits.shape[1]}")
    return Expected(ids, tokens.tolist(), logits, str(data.get("reference") or f"expected outputs in {path}"))


def reference_outputs(reference_dir: Path, prompts: list[list[int]], num_tokens: int,
                      quiet: bool = False) -> Expected:
    """Greedy tokens and raw logits of transformers' model, float32 on CPU, one prompt at a time."""
    import torch
    import transformers

    if quiet:
        transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    # A blank generation config: no sampling defaults or logits processors from the checkpoint's
    # generation_config.json, so each greedy token is the argmax of the raw logits kept here.
    model.generation_config = transformers.GenerationConfig()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=num_tokens, min_new_tokens=0,
                                           eos_token_id=[], pad_token_id=0, output_logits=True,
                                           return_dict_in_generate=True)
    tokens, logits = [], []
    with torch.no_grad():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
            tokens.append(out.sequences[0, len(ids):].tolist())
            logits.append(torch.stack(out.logits)[:, 0].float())  # (n, vocab)
    source = (f"transformers {transformers.__version__} AutoModelForCausalLM float32 on CPU: {reference_dir}")
    return Expected(prompts, tokens, torch.stack(logits), source)


def check_save_expected_path(path: str) -> None:
    """ValueError naming --save-expected when a look (no write) shows PATH cannot be written: run
    before the reference, whose minutes of CPU would otherwise end in a traceback."""
    from shardlib.atomic_dir import unwritable_reason

    if Path(path).is_dir():
        raise ValueError(f"--save-expected {path} is a directory; pass a file path, e.g. {Path(path) / 'expected.pt'}")
    if Path(path).exists() and not _holds_expected_outputs(Path(path)):
        # e.g. the model's own model.safetensors, replaced without a word
        raise ValueError(f"--save-expected {path} exists and is not an expected-outputs file; corelaunch check "
                         f"replaces only its own (the model's weights were one such file): pass a new path")
    reason = unwritable_reason(path)
    if reason is not None:
        raise ValueError(f"--save-expected {path} cannot be written: {reason}; pass a path in a directory you "
                         f"can write to")


def _holds_expected_outputs(path: Path) -> bool:
    """Whether an existing file is one `--save-expected` may replace: a torch file of the expected
    outputs' keys. Read with weights_only and mmap (a multi-GB pytorch_model.bin is not read in)."""
    import torch

    try:
        data = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - not a torch zip file at all (safetensors, text, a legacy pickle)
        return False
    return isinstance(data, dict) and "input_ids" in data and ("expected_tokens" in data or "expected_logits" in data)


def save_expected(expected: Expected, path: str) -> None:
    """Write the file beside its place and move it there: a run that fails or is killed midway
    leaves the previous file whole."""
    final = Path(path)
    partial = final.with_name(f".{final.name}.partial-{os.getpid()}")
    try:
        _write_then_move(expected, partial, final)
    # torch.save reports an unopenable file as RuntimeError; the look beforehand passed, so the
    # filesystem refused (/proc, /sys, a read-only mount, a full disk)
    except (OSError, RuntimeError) as err:
        partial.unlink(missing_ok=True)
        detail = str(err).split("strerror: ")[-1].strip()  # torch's text ends "... open file failed with strerror: X"
        raise ValueError(f"could not write --save-expected {path} ({detail}); pass a path in a directory you can "
                         f"write to") from None
    except BaseException:  # Ctrl-C, SIGTERM (raised as an exception by the CLI), a bug: no hidden file left behind
        partial.unlink(missing_ok=True)
        raise


def _write_then_move(expected: Expected, partial: Path, final: Path) -> None:
    import torch

    final.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": FILE_FORMAT, "input_ids": expected.input_ids,
                "expected_tokens": torch.tensor(expected.tokens, dtype=torch.int64),
                "expected_logits": expected.logits, "reference": expected.source}, partial)
    os.replace(partial, final)


def _model_dir(model: str | None, option: str = "--model") -> Path:
    if model is None:
        from shardlib.demo_model import ensure_demo_model

        return Path(ensure_demo_model())
    if not Path(model).exists():
        from shardlib.model_path_hints import missing_model_hint

        fix = " or omit --model for the built-in SmolLM2-135M-Instruct" if option == "--model" else ""
        raise FileNotFoundError(f"{option} path {model} does not exist; pass a Hugging Face model directory{fix}"
                                f"{missing_model_hint(model, option)}")
    if not Path(model).is_dir():  # a config.json given for its folder: transformers failed with a traceback
        raise ValueError(f"{option} {model} is a file, not a model directory; pass the Hugging Face model "
                         f"directory that holds it ({Path(model).parent})")
    return Path(model)


def _prompts(args, model_dir: Path):
    """(texts, token-id lists, tokenizer) from the command line; the default prompt when none."""
    from launcher.api import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    texts = list(args.prompts) + list(args.prompt)
    if not texts and not args.prompt_ids:
        texts = [DEFAULT_PROMPT]
    if texts and tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer, so text prompts cannot be encoded; give prompts as "
                         f"token ids with --prompt-ids 5,17,42")
    ids = [list(tokenizer(t)["input_ids"]) for t in texts] + [parse_prompt_ids(s) for s in args.prompt_ids]
    return texts + [None] * len(args.prompt_ids), ids, tokenizer


def _check_prompts(prompts: list[list[int]], num_tokens: int, model_dir: Path) -> int:
    """ValueError for prompts the model cannot take; returns its vocabulary size."""
    from shardlib.model_config import load_model_config
    from shardlib.request_checks import check_fits, check_prompts

    config = load_model_config(model_dir)
    check_prompts(prompts, config.vocab_size)
    check_fits(prompts, num_tokens, config.max_position_embeddings, "the model's max_position_embeddings",
               new_tokens_name="--num-tokens")
    return config.vocab_size


def _check_serving_fits(prompts: list[list[int]], num_tokens: int, launcher) -> None:
    """ValueError, before the reference runs, for a prompt the serving cache's rows cannot hold
    with --num-tokens more (check runs through the serving engine, whose rows hold
    min(max_position_embeddings, 4096) positions)."""
    from shardlib.request_checks import check_fits

    check_fits(prompts, num_tokens, launcher.serving_seq_len, "the serving cache's row (--seq-len, default "
               "min(max_position_embeddings, 4096) positions)", new_tokens_name="--num-tokens")


def _check_expected_fits(expected: Expected, path: str, model_dir: Path, vocab: int) -> None:
    """ValueError when an expected-outputs file cannot belong to this model: a token outside its
    vocabulary (a negative one would index the logits from the end) or logits of another width.
    Checked before anything starts; the comparison would otherwise fail only after the load."""
    from shardlib.request_checks import check_prompts

    fix = f"it was saved for another model: save it again with `corelaunch check --save-expected {path}`"
    try:
        check_prompts(expected.tokens, vocab)  # "prompt 0 holds token ids [999] outside the vocabulary [0, 128)"
    except ValueError as err:
        raise ValueError(f"{path}: expected_tokens: {str(err).split('; ')[0]} of {model_dir}; {fix}") from None
    if expected.logits is not None and expected.logits.shape[-1] != vocab:
        raise ValueError(f"{path}: expected_logits are {expected.logits.shape[-1]} wide but {model_dir}'s "
                         f"vocabulary has {vocab} tokens; {fix}")


def _reference_dir(args, model_dir: Path) -> Path:
    """The checkpoint transformers loads as the reference: --reference DIR, else the model itself;
    refused when it is quantized (transformers would read corelaunch's int8 tensors and scales as
    some other model, and every comparison would fail for no fault of the model under test)."""
    from shardlib.checkpoint_files import check_checkpoint
    from shardlib.model_config import load_model_config

    option = "--reference" if args.reference else "--model"
    reference_dir = _model_dir(args.reference, option) if args.reference else model_dir
    reference = load_model_config(reference_dir)
    quant = reference.quantization
    if quant is not None:
        named = f"--reference {reference_dir}" if args.reference else str(reference_dir)
        raise ValueError(f"{named} is quantized ({quant.dtype}, {quant.granularity}): transformers cannot load it "
                         f"as the reference; pass the unquantized checkpoint it was made from with --reference DIR")
    model_vocab = reference.vocab_size if reference_dir == model_dir else load_model_config(model_dir).vocab_size
    if reference.vocab_size != model_vocab:
        # Found only once the reference had run and the workers started (or, with a prompt id only
        # the model's vocabulary holds, as a traceback from inside transformers).
        raise ValueError(f"--reference {reference_dir} has a vocabulary of {reference.vocab_size} tokens and "
                         f"--model {model_dir} one of {model_vocab}: it is not the same model; pass the checkpoint "
                         f"--model was made from")
    # Its files as the ranks' loader checks them, before transformers reads them: a corrupt or
    # missing weights file was a traceback from inside the reference (exit 1, a failed check's code)
    # or transformers' own words, naming no option.
    try:
        # the ranks read --model's files, not another reference's (transformers reads those)
        check_checkpoint(reference_dir, reference, ranks_read=reference_dir == model_dir)
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"{option} {reference_dir}: {err}") from None
    return reference_dir


def _tolerances(args, model_dir: Path) -> tuple[str, float]:
    """(--tol-map, --divergence-difference-tol): as given, else the defaults for the model's format
    (shardlib/evaluation/quantized_tolerances.py)."""
    from shardlib.evaluation.quantized_tolerances import default_tolerances
    from shardlib.model_config import load_model_config

    tol_map, divergence = default_tolerances(load_model_config(model_dir).quantization, args.kv_cache_dtype)
    # `is None`, not `or`: a given 0 (or an empty --tol-map, refused by parse_tol_map) is the user's
    return (tol_map if args.tol_map is None else args.tol_map,
            divergence if args.divergence_difference_tol is None else args.divergence_difference_tol)


# ---- run ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from launcher.cli.exit_codes import EXIT_RUN_FAILED, exit_code_for
    from launcher.errors import LaunchError, RequestFailed

    try:
        return _run(args)
    except RequestFailed as err:  # corelaunch's side ran and could not choose a token (NaN logits, say): a failure
        print(f"corelaunch check: FAILED: {err}", file=sys.stderr)
        if args.json:  # exit 1 comes with an object whose "passed" is false, as a failed comparison's does
            print(json.dumps({"passed": False, "error": str(err)}))
        return EXIT_FAIL
    except BrokenPipeError:
        raise  # the report's reader went away: 141, as for every command (launcher/cli/__init__.py)
    except (ValueError, OSError, LaunchError) as err:  # OSError: a file or directory it could not use
        print(f"corelaunch check: {without_nodes_ways(in_tp_flag(with_flag_name(err)), 'check')}", file=sys.stderr)
        return exit_code_for(err)
    except Exception as err:  # noqa: BLE001 - a fault of corelaunch's own: exit 1 would read as "the check failed"
        import traceback

        traceback.print_exc()
        print(f"corelaunch check: internal error ({type(err).__name__}: {err}); nothing was compared; please "
              f"report it with the traceback above", file=sys.stderr)
        return EXIT_RUN_FAILED


def _refuse_tolerances_outside_logit_matching(args: argparse.Namespace) -> None:
    """Token matching compares tokens alone: a tolerance given with it was silently ignored."""
    if args.mode == "logit-matching":
        return
    for flag, name in LOGIT_MATCHING_FLAGS:
        if getattr(args, name) is not None:  # None: not given (each one's default is resolved later)
            raise ValueError(f"{flag} applies to --mode logit-matching, not {args.mode}: drop {flag}, or pass "
                             f"--mode logit-matching")


def _check_plain_arguments(args: argparse.Namespace) -> None:
    """Checks of the arguments alone, made before any file is looked at or the demo model is set up:
    `--expected X --save-expected model.safetensors` was answered by the save path's check, whose
    advice ("delete that file first") would have deleted the model's weights, and --num-tokens 0
    was refused only once the demo model had been converted."""
    if args.num_tokens is not None and args.num_tokens < 1:
        raise ValueError(f"--num-tokens ({args.num_tokens}) must be at least 1")
    if args.expected and args.save_expected:
        raise ValueError("--expected and --save-expected exclude each other: one reads a reference file, "
                         "the other writes one")
    if args.expected and args.reference:
        raise ValueError("--expected and --reference exclude each other: the file is the reference")
    if args.expected and (args.prompts or args.prompt or args.prompt_ids):
        raise ValueError(f"{args.expected} carries its own input_ids; give no prompts with --expected")


def _run(args: argparse.Namespace) -> int:
    from launcher.api import refuse_non_utf8_prompts
    from launcher.progress import Progress
    from shardlib.evaluation.accuracy import parse_tol_map
    from shardlib.model_path_hints import refuse_unexpanded_home

    progress = Progress(not args.quiet)
    _check_plain_arguments(args)
    # checked before the tokenizer sees them: it failed with a TypeError traceback, exit 1 (a failed check's code)
    refuse_non_utf8_prompts([*args.prompts, *args.prompt])
    for option, path in (("--save-expected", args.save_expected), ("--expected", args.expected),
                         ("--reference", args.reference)):
        if path is not None:  # `--save-expected=~/x.pt` made a folder named `~` in the working directory
            refuse_unexpanded_home(option, path)
    _refuse_tolerances_outside_logit_matching(args)
    # A divergence passes when max(actual) - actual[expected] < TOL: 0 is honoured (every divergence
    # fails); inf would pass every one and nan none, silently, so both are refused with negatives.
    for option, value in (("--divergence-difference-tol", args.divergence_difference_tol), ("--atol", args.atol)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{option} ({value}) must be a finite number >= 0")
    args.atol = DEFAULT_ATOL if args.atol is None else args.atol
    if args.save_expected:
        check_save_expected_path(args.save_expected)
    model_dir = _model_dir(args.model)
    args.tol_map, args.divergence_difference_tol = _tolerances(args, model_dir)
    tol_map = parse_tol_map(args.tol_map, args.atol)

    if args.expected:
        expected = load_expected(args.expected)
        available = len(expected.tokens[0])
        num_tokens = available if args.num_tokens is None else args.num_tokens
        if num_tokens > available:
            raise ValueError(f"--num-tokens {num_tokens} but {args.expected} holds only {available} expected "
                             f"tokens per prompt; lower --num-tokens or save a longer reference")
        if args.mode == "logit-matching" and expected.logits is None:
            raise ValueError(f"{args.expected} holds no expected_logits, so logit matching cannot run; use "
                             f"--mode token-matching, or save the reference with --save-expected")
        from launcher.api import load_tokenizer

        texts, prompts, tokenizer = [None] * len(expected.input_ids), expected.input_ids, load_tokenizer(model_dir)
        try:
            vocab_size = _check_prompts(prompts, num_tokens, model_dir)
        except ValueError as err:  # its prompts are the file's: it was saved for another model
            raise ValueError(f"{args.expected} does not fit {model_dir}: its {err}; save a reference for this "
                             f"model with --save-expected") from None
        _check_expected_fits(expected, args.expected, model_dir, vocab_size)
        launcher = _launcher(args, model_dir)
        _check_serving_fits(prompts, num_tokens, launcher)
    else:
        num_tokens = DEFAULT_NUM_TOKENS if args.num_tokens is None else args.num_tokens
        reference_dir = _reference_dir(args, model_dir)  # before the prompts: checked against the model's vocabulary
        texts, prompts, tokenizer = _prompts(args, model_dir)
        _check_prompts(prompts, num_tokens, model_dir)
        # --save-expected starts no workers, so its launch options are not planned (the file may be
        # meant for another machine); otherwise they are refused before the reference runs, not after
        launcher = None if args.save_expected else _launcher(args, model_dir)
        if launcher is not None:
            _check_serving_fits(prompts, num_tokens, launcher)
        with progress.step("running the transformers reference (float32, CPU)"):
            expected = reference_outputs(reference_dir, prompts, num_tokens, quiet=args.quiet)
        if args.save_expected:
            save_expected(expected, args.save_expected)
            summary = {"saved": args.save_expected, "num_prompts": len(prompts), "num_tokens": num_tokens,
                       "reference": expected.source}
            print(json.dumps(summary) if args.json else
                  f"wrote expected tokens and logits of {len(prompts)} prompt(s) x {num_tokens} tokens to "
                  f"{args.save_expected} ({expected.source})")
            return EXIT_PASS

    report = _compare(args, launcher, model_dir, texts, prompts, expected, num_tokens, tol_map, progress)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report, tokenizer))
    return EXIT_PASS if report["passed"] else EXIT_FAIL


def _launcher(args, model_dir: Path):
    """The Launcher of corelaunch's side, its options checked and its layout planned (PlanRejected,
    ValueError naming them); nothing is started."""
    from launcher.api import LaunchConfig, Launcher

    config = LaunchConfig(model=str(model_dir), tp=args.tp, **backend_options(args), **timeout_options(args), pad_q_heads=args.pad_q_heads,
                          sequence_parallel=args.sequence_parallel, **layout_choices(args),
                          dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_batch_size=0,  # continuous alone
                          seq_len=args.seq_len, **max_num_seqs_option(args),
                          ray_address=args.ray_address, cpus_per_rank=args.cpus_per_rank,
                          compile=args.compile, progress=not args.quiet)
    return Launcher(config).prepare()


def _compare(args, launcher, model_dir, texts, prompts, expected: Expected, num_tokens, tol_map, progress) -> dict:
    from shardlib.evaluation.accuracy import group_name, logit_matching, token_matching

    from launcher.cli.command_stdout import ray_output_on_stderr

    results = []
    with ray_output_on_stderr(), launcher:  # the report goes to stdout once Ray has stopped

        def run_corelaunch(ids: list[int], count: int):
            [out] = launcher.generate([ids], max_new_tokens=count, ignore_eos=True, return_logits=True)
            return out.token_ids, out.logits

        with progress.step(f"comparing {len(prompts)} prompt(s) x {num_tokens} tokens ({args.mode})"):
            for i, ids in enumerate(prompts):
                want = expected.tokens[i][:num_tokens]
                if args.mode == "token-matching":
                    tokens, logits = run_corelaunch(ids, num_tokens)
                    result = token_matching(want, tokens, logits).to_dict()
                else:
                    result = logit_matching(ids, expected.logits[i, :num_tokens], run_corelaunch,
                                            expected_tokens=want, tol_map=tol_map,
                                            divergence_difference_tol=args.divergence_difference_tol).to_dict()
                results.append({"prompt": texts[i], "input_ids": ids, **result})
        plan = launcher.plan
        report = {
            "mode": args.mode,
            "passed": all(r["passed"] for r in results),
            "model": str(model_dir),
            "reference": expected.source,
            "tp_degree": plan.tp_degree,
            "kv_strategy": str(plan.kv_strategy),
            "moe_sharding": plan.moe_sharding,  # null for a dense model
            "fused_projections": launcher.config.fused_projections,
            "backend": launcher.backend,
            "dtype": str(plan.dtype),
            "quantization": None if plan.config.quantization is None else plan.config.quantization.to_json(),
            "kv_cache_dtype": args.kv_cache_dtype,
            "compile": launcher.config.compile,
            "num_tokens": num_tokens,
            "prompts": results,
        }
    if args.mode == "logit-matching":
        report["divergence_difference_tol"] = args.divergence_difference_tol
        report["tol_map"] = {group_name(k): {"atol": a, "rtol": r} for k, (a, r) in tol_map.items()}
    return report


# ---- text report -------------------------------------------------------------------------------
def _text(tokenizer, tokens) -> str:
    if tokenizer is None:
        return str(tokens)
    return json.dumps(tokenizer.decode(tokens, skip_special_tokens=False), ensure_ascii=False)


def _token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not a token


def _error_cell(value: float | None) -> str:
    """A group's error as the text report's column shows it: None is how the JSON report carries a
    value it cannot (inf: every expected logit of the group 0 and an error past atol)."""
    return f"{value:>14.4g}" if value is not None else f"{'not finite':>14}"


def format_report(report: dict, tokenizer=None) -> str:
    from launcher.cli.run_words import run_choices
    from shardlib.evaluation.accuracy import shown_difference  # torch: not at the command's import

    verdict = "PASSED" if report["passed"] else "FAILED"
    experts = f"{report['moe_sharding']} experts, " if report.get("moe_sharding") else ""
    how = ", ".join([report["backend"], report["dtype"], *run_choices(report)])
    lines = [f"{report['mode']} {verdict}: corelaunch tp {report['tp_degree']} ({report['kv_strategy']} KV heads, "
             f"{experts}{how}) on {report['model']}",
             f"reference: {report['reference']}",
             f"{report['num_tokens']} tokens per prompt, EOS ignored on both sides"]
    if report["mode"] == "logit-matching":
        groups = ", ".join(f"{name} rtol {t['rtol']:g}" for name, t in report["tol_map"].items())
        lines.append(f"tolerances: {groups}; atol {next(iter(report['tol_map'].values()))['atol']:g}; "
                     f"divergence_difference_tol {report['divergence_difference_tol']:g}")
    for i, r in enumerate(report["prompts"]):
        name = _text(tokenizer, r["input_ids"]) if r["prompt"] is None else json.dumps(r["prompt"], ensure_ascii=False)
        lines.append("")
        lines.append(f"prompt {i} {name} ({len(r['input_ids'])} ids): {'PASSED' if r['passed'] else 'FAILED'}")
        lines.append(f"  expected: {_text(tokenizer, r['expected_tokens'])}")
        if report["mode"] == "token-matching":
            lines.append(f"  actual:   {_text(tokenizer, r['actual_tokens'])}")
            d = r["first_divergence"]
            if d is None:
                lines.append(f"  all {r['num_tokens']} tokens equal")
            else:
                by = ("" if d["divergence_difference"] is None else
                      f"; max(actual) - actual[expected] = {shown_difference(d['divergence_difference'])}")
                lines.append(f"  first divergence at position {d['position']}: expected token "
                             f"{d['expected_token']}, corelaunch chose {d['actual_token']}{by}")
            continue
        lines.append(f"  actual:   {_text(tokenizer, r['first_pass_tokens'])} (from the prompt alone)")
        lines.append(f"  {r['num_tokens']} positions checked in {r['runs']} run(s); "
                     f"{len(r['divergences'])} divergence(s)")
        for d in r["divergences"]:
            ok = "passes" if d["passed"] else "FAILS"
            rerun = "; re-run from the expected prefix" if d["position"] < r["num_tokens"] - 1 else ""
            lines.append(f"  divergence at position {d['position']}: expected token {d['expected_token']}, "
                         f"corelaunch chose {d['actual_token']}; max(actual) - actual[expected] = "
                         f"{shown_difference(d['divergence_difference'])} ({ok}){rerun}")
        lines.append(f"  {'group':<8}{'atol':>8}{'rtol':>7}{'max abs err':>14}{'max rel err':>14}  worst at")
        for gname, g in r["top_k"].items():
            where = f"position {g['position']}, token {g['token_id']}"
            flag = "" if g["passed"] else f"  FAILED at positions {g['failed_positions'][:8]}"
            lines.append(f"  {gname:<8}{g['atol']:>8g}{g['rtol']:>7g}{_error_cell(g['max_abs_error'])}"
                         f"{_error_cell(g['max_rel_error'])}  {where}{flag}")
        if r["first_failure"] is not None:
            lines.append(f"  first failure at position {r['first_failure']['position']}:")
            lines += [f"    {text}" for text in r["first_failure"]["failures"]]
    return "\n".join(lines)
