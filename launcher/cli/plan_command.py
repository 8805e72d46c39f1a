"""`corelaunch plan`: check a TP layout against an instance before starting anything.

Only shardlib is imported here: planning is arithmetic on config.json, so the command answers in a
fraction of a second and never starts Ray. Exit code 0 when the layout is valid, 2 when it is not
(or when the model cannot be read).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from launcher.cli.options import (add_kv_cache_dtype, add_moe_sharding, add_pad_q_heads, int_at_least,
                                  non_empty_path, with_flag_name)
from shardlib.expert_sharding import EXPERT_PARALLEL, TENSOR_PARALLEL
from shardlib.families import ignored_layer_types
from shardlib.instances import CPU_TARGET, INSTANCE_NAMES, NEURON_FAMILIES
from shardlib.model_config import ignored_expert_fields, load_model_config, read_config_json
from shardlib.planner import KV_STRATEGIES, Plan, kv_rows_text, plan
from shardlib.quantized_sizes import planned_quantization
from shardlib.serving_shapes import DEFAULT_MAX_NUM_SEQS, serving_cache_rows

EXIT_VALID, EXIT_INVALID = 0, 2


def _tp_value(text: str) -> int | str:
    if text == "auto":
        return text
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--tp must be a positive integer or 'auto', not {text!r}")
    return int(text)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="check a tensor-parallel layout (heads, KV heads, memory, cores) before launching",
        description="Check whether a model can be served at a TP degree on an instance type: every "
                    "failed rule is reported with the values involved and the ways out. Pure "
                    "arithmetic on config.json; nothing is started.")
    p.add_argument("--model", type=non_empty_path("--model"), metavar="PATH",
                   help="model directory or config.json (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--instance", choices=INSTANCE_NAMES, default=CPU_TARGET, metavar="NAME",
                   help=f"target instance type: {', '.join(INSTANCE_NAMES)} (cpu: this host; the default)")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes the TP group spans (default 1)")
    p.add_argument("--tp", type=_tp_value, default="auto", metavar="N|auto",
                   help="tensor-parallel degree, or auto for the smallest that passes (default auto)")
    p.add_argument("--lnc", type=int, metavar="1|2",
                   help="logical NeuronCore config (default: the instance's; 2 exists only on trn2)")
    p.add_argument("--batch-size", type=int, default=1, metavar="N",
                   help="sequences per static batch (default 1; 0: no static batch, the serving rows alone, as "
                        "corelaunch serve and corelaunch generate plan)")
    p.add_argument("--max-num-seqs", type=int_at_least("--max-num-seqs", 0), default=DEFAULT_MAX_NUM_SEQS, metavar="N",
                   help=f"sequence slots of the continuous-batching engine, whose KV cache rows count on top of "
                        f"the batch as they do in a launch (default {DEFAULT_MAX_NUM_SEQS}, generate's; "
                        f"corelaunch serve uses 16; 0: a static batch only)")
    p.add_argument("--seq-len", type=int, metavar="N",
                   help="KV-cache length (default: min(max_position_embeddings, 4096))")
    p.add_argument("--dtype",
                   help="weight dtype, e.g. bfloat16, float32, float8_e4m3 (default: the checkpoint's)")
    add_kv_cache_dtype(p)
    p.add_argument("--kv-strategy", choices=KV_STRATEGIES,
                   help="force a KV-head layout (default: shard, else replicate_to_tp, else convert_to_mha)")
    add_pad_q_heads(p)
    add_moe_sharding(p)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(run=run)
    _json_refusals_from_argparse(p)


def _json_refusals_from_argparse(parser: argparse.ArgumentParser) -> None:
    """argparse's own refusals of this command's options (`--tp 0`, `--seq-len abc`, an unknown
    `--instance`) print the "unplannable" object on stdout too when --json was asked for, as run()'s
    refusals do. argparse gives a sub-parser its own arguments through parse_known_args, and
    reports through error(), which exits; the dispatcher refuses unknown arguments through it too
    (launcher/cli/__init__.py)."""
    parse = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        parser.json_requested = _asks_for_json(parser, sys.argv[1:] if args is None else args)
        return parse(args, namespace)

    def error(message: str):
        if getattr(parser, "json_requested", False):
            print(json.dumps(_unplannable(message)))
        type(parser).error(parser, message)  # the class's own (one line), under this instance override

    parser.parse_known_args, parser.error = parse_known_args, error


def _asks_for_json(parser: argparse.ArgumentParser, words: list[str]) -> bool:
    """Whether the command line gives --json, as argparse reads it: spelt out or abbreviated to a
    prefix no other option shares (`--js`, which argparse takes as --json), before any `--`."""
    options = parser._option_string_actions  # every option string: what argparse matches prefixes against
    for word in words:
        if word == "--":
            return False
        if word == "--json" or (len(word) > 2 and "--json".startswith(word)
                                and [o for o in options if o.startswith(word)] == ["--json"]):
            return True
    return False


def run(args: argparse.Namespace) -> int:
    try:
        if args.model is None:
            from shardlib.demo_model import demo_config_path

            model = demo_config_path()  # sizing needs only config.json: never converts the weights
        else:
            model = args.model
        config = load_model_config(model)
        result = plan(config, instance=args.instance, tp=args.tp, nodes=args.nodes, lnc=args.lnc,
                      batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
                      serving_rows=serving_cache_rows(args.max_num_seqs) if args.max_num_seqs > 0 else 0,
                      kv_cache_dtype=args.kv_cache_dtype,
                      kv_strategy=args.kv_strategy, pad_q_heads=args.pad_q_heads,
                      moe_sharding=args.moe_sharding)
        result = _with_config_warnings(result, model)
    except (OSError, ValueError) as err:
        # a missing path or demo package, an unknown architecture, a malformed argument (named by
        # its option, as the other commands name theirs)
        return _refuse(args, _named_by_flag(err))
    except KeyError as err:
        return _refuse(args, f"the model's config.json has no {err} field; is it a Hugging Face "
                             f"causal-LM config?")
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(format_report(result))
    return EXIT_VALID if result.valid else EXIT_INVALID


def _with_config_warnings(result: Plan, model: str | Path) -> Plan:
    """The plan with what config.json says that the model ignores added to its warnings (the text
    report's `warning:` lines, --json's "warnings"): a Mixtral saved as "mistral" with
    num_local_experts 8 plans as a dense 7B model, as transformers reads it, with no word otherwise."""
    path = Path(model)
    raw = read_config_json(path / "config.json" if path.is_dir() else path)
    warnings = tuple(w for w in (ignored_expert_fields(raw), ignored_layer_types(raw)) if w is not None)
    if not warnings:
        return result
    return dataclasses.replace(result, warnings=(*result.warnings, *warnings))


def _named_by_flag(error: BaseException) -> str:
    """The planner's message with the option in place of its parameter's name ("--batch-size (0)
    must be ..." rather than "batch_size (0) ..."); plan's --batch-size is its own option."""
    field, sep, rest = str(error).partition(" (")
    if sep and field == "batch_size":
        return "--batch-size" + sep + rest
    return with_flag_name(error)


def _refuse(args: argparse.Namespace, message: str) -> int:
    """No plan could be made: the reason on stderr, and with --json also as one JSON object on
    stdout (code "unplannable"), so a script reading stdout is never left with nothing to parse."""
    print(f"corelaunch plan: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps(_unplannable(message)))
    return EXIT_INVALID


def _unplannable(message: str) -> dict:
    return {"valid": False, "errors": [{"code": "unplannable", "message": message}]}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_report(result: Plan) -> str:
    """A few lines for a person: verdict, layout, memory against capacity, degrees, each error."""
    cfg, mem = result.config, result.memory
    verdict = "VALID" if result.valid else "INVALID"
    # 8-bit weights and a KV cache in another dtype than the compute's are sized here: said, not
    # only counted (a plan of an int8 checkpoint read as a float32 one's). One form for one plan: a
    # 1-byte --dtype names the weights' format, the compute dtype is the other tensors' (an int8
    # checkpoint and `--dtype int8` read "float32, int8 weights", not "int8, KV cache float32").
    quantization, compute = planned_quantization(cfg, result.dtype, result.family in NEURON_FAMILIES)
    stored = (f", {quantization.dtype} weights" if quantization is not None else "") + (
        f", KV cache {mem.kv_cache_dtype}" if mem.kv_cache_dtype != compute else "")
    lines = [
        f"{verdict}: {cfg.model_type} ({cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV heads, "
        f"{cfg.param_count() / 1e9:.2f} B params) on {result.nodes} x {result.instance} (LNC {result.lnc}), "
        f"{compute}{stored}, {kv_rows_text(result.batch_size, result.serving_rows)}, seq_len {result.seq_len}",
        f"tp_degree {result.tp_degree} ({'auto' if result.tp_requested == 'auto' else 'requested'}), "
        f"{result.ranks_per_node} rank(s) per node, kv strategy {result.kv_strategy or '-'}, "
        f"per rank: {_or_dash(result.q_heads_per_rank)} Q heads, {_or_dash(result.kv_heads_per_rank)} KV heads"
        + (f", {_experts_per_rank(cfg.num_local_experts, result.tp_degree, result.moe_sharding)}"
           if cfg.is_moe else ""),
        f"memory per rank: {_gib(mem.total_bytes_per_rank)} ("
        + " + ".join(f"{name} {_gib(n)}" for name, n in mem.parts)
        + f") of {_gib(mem.usable_bytes_per_rank)} usable "
        f"({_gib(mem.capacity_bytes_per_rank)} less {mem.reserve_fraction:.0%} reserve)",
        f"valid tp degrees: {', '.join(map(str, result.valid_tp_degrees)) or 'none'}",
    ]
    if result.padding_waste is not None:
        waste = result.padding_waste
        lines.append(f"padding: {result.padded_q_heads} Q heads ({waste.extra_q_heads} zero heads, "
                     f"{_gib(waste.extra_qo_weight_bytes)} extra, {waste.extra_qo_fraction:.1%} of Q/O)"
                     + (f"; {waste.extra_kv_heads} zero KV heads ({_gib(waste.extra_kv_weight_bytes)} of weights, "
                        f"{_gib(waste.extra_kv_cache_bytes)} of KV cache)" if waste.extra_kv_heads else ""))
    lines += [f"error [{issue.code}]: {issue.message}" for issue in result.errors]
    lines += [f"warning: {text}" for text in result.warnings]
    return "\n".join(lines)


def _experts_per_rank(experts: int, tp: int, sharding: str | None) -> str:
    """What one rank holds of the experts: expert_parallel gives each rank experts / tp whole ones,
    tensor_parallel a 1/tp slice of every one (the total alone read as if each rank held them all)."""
    if sharding == EXPERT_PARALLEL:
        held = experts // tp
        return f"{held} whole expert{'' if held == 1 else 's'} of {experts} ({sharding})"
    if sharding == TENSOR_PARALLEL:  # at tp 1 the one rank holds them whole, not "1/1 of each"
        return f"{experts} experts, {'whole' if tp == 1 else f'1/{tp} of each'} ({sharding})"
    return f"{experts} experts (no sharding: see moe_sharding_incompatible)"


def _or_dash(value) -> str:
    return "-" if value is None else str(value)
