"""`corelaunch generate`: start a TP group, generate for the prompts, print the text (or JSON)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from launcher.cli.options import (add_max_num_seqs, add_model_and_placement_arguments, add_prefix_caching,
                                  int_at_least, in_generate_flags, max_num_seqs_option, model_and_placement_options,
                                  with_flag_name)
from launcher.cli.structured_flags import add_structured_flags, structured_output


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text with a tensor-parallel group of Ray workers",
        description="Plan, start one Ray worker per rank, load each rank's shard, and generate. "
                    "Greedy unless sampling flags are given.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (or use --prompt)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt; repeatable (added after the positional prompts)")
    add_model_and_placement_arguments(p)
    p.add_argument("--replicas", default="1", metavar="N|auto",
                   help="independent TP groups; prompts are spread over them; auto: as many as fit (default 1)")
    add_max_num_seqs(p)
    add_prefix_caching(p)
    p.add_argument("--max-new-tokens", type=int_at_least("--max-new-tokens"), default=32, metavar="N",
                   help="tokens to generate per prompt (default 32)")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--min-p", type=float, metavar="M",
                   help="keep tokens at least M times as likely as the most likely, in [0, 1] (0 = off)")
    p.add_argument("--seed", type=int, help="seed for reproducible sampling (each prompt is seeded with it alike; "
                                             "-1: no seed, as the API reads it)")
    p.add_argument("--min-tokens", type=int, metavar="N",
                   help="no stop token (EOS included) ends a prompt's generation before N tokens, at most "
                        "--max-new-tokens (default 0)")
    p.add_argument("--presence-penalty", type=float, metavar="P",
                   help="subtract P from every token generated so far, in [-2, 2] (default 0: off)")
    p.add_argument("--frequency-penalty", type=float, metavar="F",
                   help="subtract F per time a token was generated so far, in [-2, 2] (default 0: off)")
    p.add_argument("--repetition-penalty", type=float, metavar="R",
                   help="divide the positive logits of the prompt's and the output's tokens by R and multiply "
                        "their negative ones by R (> 0; default 1: off)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit before the choice, as OpenAI's logit_bias "
                        "(repeat the flag for more tokens; -100 all but bans a token, 100 all but forces it)")
    p.add_argument("--prompt-logprobs", type=int, metavar="N",
                   help="score each prompt: every prompt token's log-probability given those before it and the N "
                        "most likely there (0..20), in --json's outputs (prompt_logprobs) and summed on stderr")
    add_structured_flags(p)
    p.add_argument("--ray-address", help="Ray cluster host:port, or local for a private one (default: RAY_ADDRESS, else the cluster `ray start` recorded on this host, else a private one)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=run)


def _sampling(args):
    from shardlib.sampling_params import SamplingParams

    given = {k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p),
                               ("min_p", args.min_p), ("seed", args.seed)) if v is not None}
    if given.get("seed") == -1:  # no seed, as SamplingParams and the server read it: not a seed given
        del given["seed"]
    penalties = {k: v for k, v in (("presence_penalty", args.presence_penalty),
                                   ("frequency_penalty", args.frequency_penalty),
                                   ("repetition_penalty", args.repetition_penalty),
                                   ("min_tokens", args.min_tokens)) if v is not None}
    if args.min_tokens is not None and args.min_tokens > args.max_new_tokens:  # said in the flags' words
        raise ValueError(f"--min-tokens ({args.min_tokens}) must be at most --max-new-tokens ({args.max_new_tokens})")
    if args.logit_bias:
        penalties["logit_bias"] = _logit_bias(args.logit_bias)
    structure = structured_output(args)
    if structure is not None:
        penalties["structured_output"] = structure
    # Without --temperature, SamplingParams itself decides (temperature left None), so the flags read
    # as the API does: --top-k 0, --top-p 1 and --min-p 0 are off and stay greedy, as top_k=0 does.
    try:
        if "seed" in given and "temperature" not in given:
            unseeded = SamplingParams(**{k: v for k, v in given.items() if k != "seed"}, **penalties)
            if unseeded.is_greedy:  # greedy draws nothing: the API refuses the seed; say it in the flags' words
                raise ValueError(
                    f"--seed ({args.seed}) seeds sampling, and no sampling flag is given (the default is greedy, "
                    f"which takes no seed; --top-k 0, --top-p 1 and --min-p 0 turn those filters off): add "
                    f"--temperature T, or --top-k K > 0, --top-p P < 1 or --min-p M > 0 (which sample at "
                    f"temperature 1)")
        return SamplingParams(**given, **penalties)
    except ValueError as err:  # its message names the field: name the flag
        raise ValueError(_as_flags(str(err))) from None


def _logit_bias(entries: list[str]) -> dict[int, float]:
    """--logit-bias ID=BIAS entries as SamplingParams takes them (its own checks name the ranges)."""
    bias: dict[int, float] = {}
    for entry in entries:
        token, sep, value = entry.partition("=")
        try:
            token_id, number = int(token), float(value)
        except ValueError:
            token_id = number = None
        if not sep or token_id is None or token_id < 0:
            raise ValueError(f"--logit-bias {entry!r} must be ID=BIAS, a token id (an integer >= 0) and a number, "
                             f"e.g. --logit-bias 504=-100")
        if token_id in bias:
            raise ValueError(f"--logit-bias names token {token_id} twice ({bias[token_id]:g} and {number:g}); give it once")
        bias[token_id] = number
    return bias


def _as_flags(message: str) -> str:
    """SamplingParams' message ("top_p=2.0 must be ...") as the command's flags say it ("--top-p 2.0 ...")."""
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "logit_bias"):
        if message.startswith(f"{name}="):
            # Python's None is the API's "left out": a flag given has a value ("--seed 1e30 must be None or ...")
            return f"--{name.replace('_', '-')} " + message[len(name) + 1:].replace("must be None or ", "must be ", 1)
    if message.startswith("logit_bias[") and "]=" in message:  # logit_bias[5]=200.0 must be ...
        token, _, rest = message[len("logit_bias["):].partition("]=")
        return f"--logit-bias {token}={rest}"
    return message


def launch_config(args: argparse.Namespace):
    """The LaunchConfig the options ask for (ValueError or FileNotFoundError naming a bad one)."""
    from launcher.api import LaunchConfig

    # It runs continuous batching alone (each prompt is its own request in the running batch): no
    # static batches (max_batch_size 0), so the plan counts the serving rows alone, not 8 static rows
    # of --seq-len that were never allocated, and --warm-up builds the serving loop's graphs alone.
    return LaunchConfig(**model_and_placement_options(args), **max_num_seqs_option(args), replicas=args.replicas,
                        max_batch_size=0, ray_address=args.ray_address,
                        prefix_caching=args.prefix_caching)


def _shown_model(args: argparse.Namespace, launcher) -> str:
    """The model directory the report names: under --compiled the one inside the path given, not
    the pinned version the launch ran (.NAME.v-HOST-PID-RANDOM), which the next compile deletes."""
    if args.compiled:
        from launcher.artifacts.compiled_dir import model_dir

        return str(model_dir(Path(args.compiled)))
    return str(launcher.model_dir)


def run(args: argparse.Namespace) -> int:
    from launcher.api import Launcher
    from launcher.compile_report import compile_message
    from launcher.cli.command_stdout import ray_output_on_stderr
    from launcher.cli.exit_codes import EXIT_RUN_FAILED, exit_code_for
    from launcher.errors import LaunchError

    prompts = list(args.prompts) + list(args.prompt)
    if not prompts:
        print("corelaunch generate: give at least one PROMPT (or --prompt TEXT)", file=sys.stderr)
        return 2
    answered = False
    try:
        sampling = _sampling(args)
        if args.prompt_logprobs is not None and not 0 <= args.prompt_logprobs <= 20:
            raise ValueError(f"--prompt-logprobs ({args.prompt_logprobs}) must be an integer from 0 to 20")
        launcher = Launcher(launch_config(args))
        launcher.check_prompts(prompts, sampling, max_new_tokens=args.max_new_tokens)  # before Ray starts
        # The result goes to the command's own stdout as soon as it is known, before the shutdown:
        # a --presharded-cache copy still being written (minutes for a large model) held it back,
        # and Ctrl-C during that wait lost it. Ray's messages stay on stderr.
        with ray_output_on_stderr() as stdout, launcher:
            results = launcher.generate(prompts, sampling, max_new_tokens=args.max_new_tokens,
                                        prompt_logprobs=args.prompt_logprobs)
            compiled = launcher.compile_stats()  # graphs built inside the requests show up here
            report = {
                "model": _shown_model(args, launcher),
                "tp_degree": launcher.plan.tp_degree,
                "kv_strategy": str(launcher.plan.kv_strategy),
                "backend": launcher.backend,
                "replicas": launcher.replicas,
                "outputs": [output_entry(r) for r in results],
                "startup_s": round(launcher.timings["startup_s"], 3),
                "compile": compiled[0][1] if compiled else None,
            }
            message = compile_message(compiled)
            if message and not args.quiet:
                # one write, the newline in it: print's two writes let a rank's line forwarded by
                # Ray's log thread land between the text and its newline, on the same line
                sys.stderr.write(f"corelaunch: {message}\n")
            print_report(report, as_json=args.json, quiet=args.quiet, out=stdout, with_builds=message is not None)
            answered = True
    except BrokenPipeError:
        raise  # stdout's reader went away: 141 (launcher/cli/__init__.py)
    except (ValueError, OSError, LaunchError) as err:  # OSError: a file or directory it could not use, a lock
        if answered:  # the shutdown failed after the answer was printed: not a refusal of the input
            print(f"corelaunch generate: the answer above is complete; shutting down failed: {err}", file=sys.stderr)
            return EXIT_RUN_FAILED
        print(f"corelaunch generate: {in_generate_flags(with_flag_name(err, args))}", file=sys.stderr)
        return exit_code_for(err)
    return 0


def output_entry(result) -> dict:
    """One GenerationResult as the report shows it."""
    return {"prompt": result.prompt, "text": result.text, "token_ids": result.token_ids,
            "finish_reason": result.finish_reason, "replica": result.replica,
            "time_to_first_token_s": round(result.time_to_first_token_s, 4),
            # one token has no decode step to time: null, not a rate of 0
            "decode_tokens_per_s": round(result.decode_tokens_per_s, 2) if len(result.token_ids) > 1 else None,
            **({} if result.prompt_logprobs is None else {"prompt_logprobs": _prompt_logprobs(result)})}


def _prompt_logprobs(result) -> list[dict]:
    """The report's prompt log-probabilities, -inf at the server's finite floor (json.dumps wrote
    -Infinity, which no JSON parser reads). Imported here: the server's module is not needed otherwise."""
    from launcher.serving.openai_protocol import finite_logprob

    return [{"token_id": e.token_id, "logprob": finite_logprob(e.logprob), "rank": e.rank,
             "top": [[token, finite_logprob(logprob)] for token, logprob in e.top]} for e in result.prompt_logprobs]


def print_report(report: dict, as_json: bool, quiet: bool, out=None, with_builds: bool = False) -> None:
    """The answer on `out` (stdout): one JSON object, or each prompt followed by its text. Each
    prompt's figures (finish reason, tokens, first token, rate) go to stderr unless quiet.
    with_builds: graphs were built during the requests (compile_message's line says so), and the
    figures include that time: the first run's "1.0 tokens/s" for a 135M model read as its speed."""
    out = out if out is not None else sys.stdout
    if as_json:
        print(json.dumps(report), file=out, flush=True)
        return
    for output in report["outputs"]:
        print(f"{output['prompt']}{output['text']}", file=out, flush=True)
        score = _prompt_score(output)
        if not quiet:
            rate = output["decode_tokens_per_s"]
            print(f"  [{output['finish_reason']}, {len(output['token_ids'])} tokens, "
                  f"first token {output['time_to_first_token_s'] * 1000:.0f} ms"
                  + (f", {rate:.1f} tokens/s" if rate is not None else "")
                  + (f", {score}" if score is not None else "")
                  + ("; these times include the graphs built during the request" if with_builds else "") + "]",
                  file=sys.stderr)
        elif score is not None:  # asked for by --prompt-logprobs: --quiet hides the figures, not the answer asked for
            print(f"  [{score}]", file=sys.stderr)


def _prompt_score(output: dict) -> str | None:
    """The prompt's summed log-probability (--prompt-logprobs), None when it was not scored."""
    scored = output.get("prompt_logprobs")
    if scored is None:
        return None
    return f"prompt log-probability {sum(e['logprob'] for e in scored):.4f} over {len(scored)} tokens"
