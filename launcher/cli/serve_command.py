"""`corelaunch serve`: an OpenAI-compatible HTTP server (Ray Serve) on a private local Ray.

Every option is checked (and the layout planned) before Ray starts; then Serve starts, each Serve
replica loads the model into its own TP group, and HTTP on --host:--port is answered by the one
replica's own server or by Serve's proxy (--ingress; launcher/serving/ingress.py). The command prints
`corelaunch: serving NAME at http://HOST:PORT/v1` once GET /health answers 200. SIGINT or SIGTERM
shuts Serve down and stops Ray; a second signal stops waiting for Serve's graceful shutdown.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from launcher.cli.options import (add_max_num_seqs, add_max_prefill_tokens, add_model_and_placement_arguments,
                                  add_prefix_caching, int_at_least, max_num_seqs_option, model_and_placement_options,
                                  with_flag_name)
from launcher.serving.chat_template import chat_template_warning, has_default_chat_template
from launcher.serving.ingress import MODES, IdleProxyAddressHidden, IngressPlan, choose_mode, plan_ingress
from launcher.serving.reasoning import REASONING_PARSERS
from launcher.serving.server_settings import TOOL_CALL_PARSERS, api_key_from_environment, described

SERVE_MAX_NUM_SEQS = 16
"""serve's --max-num-seqs when neither it nor a --compiled directory gives one (generate's is 8: a
server meets more requests at once)."""
APP_NAME = "corelaunch"
"""The Serve application's name (`serve status` shows it)."""
ON_A_CLUSTER = ("to serve on a Ray cluster, deploy launcher.serving.openai_app:build_app there with `serve run` or "
                "`serve deploy` (README: On a Ray cluster of your own)")
"""Where a user who wants the server on a cluster goes: this command's Ray is always private."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (Ray Serve)",
        description="Start a private local Ray, load the model into one TP group per Serve replica, and serve "
                    "/v1/completions, /v1/chat/completions, /v1/responses (and kept responses by id), /v1/models, "
                    "/tokenize, /detokenize, /health, "
                    "/version, /metrics and SageMaker's /ping and /invocations until SIGINT/SIGTERM.")
    add_model_and_placement_arguments(p)
    p.add_argument("--host", type=_host, default="127.0.0.1",
                   help="address the HTTP server binds (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=_port, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the `model` clients send (default: the model directory's name; built-in: smollm2-135m-instruct)")
    add_max_num_seqs(p, default=SERVE_MAX_NUM_SEQS)
    p.add_argument("--max-queued-requests", type=int_at_least("--max-queued-requests", 0), metavar="N",
                   help="requests waiting for a slot before new ones get 503 with Retry-After (default: no limit)")
    add_max_prefill_tokens(p)
    p.add_argument("--burst-wait-ms", type=_milliseconds, metavar="MS",
                   help="an idle model waits this long for more requests after one arrives (again after each, at "
                        "most 10x in all), so a burst's prompts are prefilled together; a lone request's first "
                        "token comes this much later (default 10; 0: no wait)")
    add_prefix_caching(p)
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                   help="take tool_choice \"auto\" (the default with tools) and read the model's calls from its text "
                        f"in this format: {described(TOOL_CALL_PARSERS)}; default: none, \"auto\" is refused")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="split a thinking model's chat answers: the text inside <think>...</think> goes to the "
                        f"message's `reasoning` field, the rest is the content: {described(REASONING_PARSERS)}; "
                        "default: none, all of the text is the content")
    p.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                   help="render every chat (/v1/chat/completions, /v1/responses, /tokenize's chat form) with this "
                        "Jinja template instead of the tokenizer's, so a model without one serves chat too: a "
                        "template file, or the template text itself where it names no file and holds {, } or a "
                        "newline; read and compiled before Ray starts (vLLM's --chat-template; default: the "
                        "tokenizer's own)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="take a chat request's own chat_template field (vLLM's), rendering that request with it "
                        "instead of the server's template; a template is code the server runs, so allow it only "
                        "for clients you trust (default: a request sending one is refused, 400)")
    p.add_argument("--default-chat-template-kwargs", type=json_object_option, metavar="JSON",
                   help="template variables every chat request gets unless it sends its own "
                        "chat_template_kwargs value, e.g. '{\"enable_thinking\": false}' (Qwen3 without thinking)")
    p.add_argument("--responses-store", type=int_at_least("--responses-store", 0), metavar="N",
                   help="keep N responses of /v1/responses in memory, each one turn of a conversation (the least "
                        "recently used go first), so that a request can continue one by previous_response_id and "
                        "GET/DELETE /v1/responses/ID (and GET its input_items) reach it (default 0: none kept, "
                        "previous_response_id refused)")
    p.add_argument("--stream-interval", type=int_at_least("--stream-interval"), metavar="N",
                   help="a stream sends its tokens N at a time: the first at once, then every N, and the rest "
                        "when the request ends, so fewer, larger chunks cost the server less per token; a "
                        "request's stream_interval may raise it for its own stream, a request with stop "
                        "strings is gathered by the replica rather than the rank (so that it stops where it "
                        "would have), and a whole answer (no stream) gathers its tokens after the first 64 at "
                        "a time, or N where larger (vLLM's --stream-interval; default 1: every token as it comes)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize and /invocations "
                        "(/health, /ping, /version and /metrics stay open; default: $CORELAUNCH_API_KEY, which "
                        "keeps the key out of the command line every local user reads with `ps`; unset: open)")
    p.add_argument("--replicas", type=int_at_least("--replicas"), metavar="N",
                   help="Serve replicas, each its own TP group (default 1)")
    p.add_argument("--min-replicas", type=int_at_least("--min-replicas"), metavar="N",
                   help="autoscaling: fewest Serve replicas (default 1)")
    p.add_argument("--max-replicas", type=int_at_least("--max-replicas"), metavar="N",
                   help="autoscaling: most Serve replicas, above --min-replicas (needed to autoscale: a range of one count "
                        "is refused); each rank's CPU share is sized for this many")
    p.add_argument("--target-ongoing-requests", type=_requests, metavar="R",
                   help="autoscaling: requests in flight per replica Serve scales toward (default 2)")
    p.add_argument("--ingress", choices=MODES, default="auto",
                   help="how HTTP reaches the model: `direct`, the Serve replica's own HTTP server on --port (one "
                        "replica); `proxy`, Serve's proxy on --port, spreading requests over replicas; `auto` (the "
                        "default): direct with one fixed replica (no autoscaling), else proxy")
    p.add_argument("--ready-timeout", type=_seconds, default=900.0, metavar="S",
                   help="seconds for the replicas to load the model and answer /health (default 900)")
    # generate's --ray-address is no option here: named, it was argparse's bare "unrecognized arguments"
    p.add_argument("--ray-address", type=_no_ray_address, help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def _no_ray_address(text: str) -> str:
    raise argparse.ArgumentTypeError(f"({text}) is not taken: corelaunch serve always starts a private Ray of this "
                                     f"host alone; {ON_A_CLUSTER}")


def cluster_not_joined() -> str | None:
    """The note for a cluster this command could be thought to join (RAY_ADDRESS, set inside a Ray
    job too, or one `ray start` recorded here), or None. The private Ray starts beside it, its ranks
    taking this host's CPUs unseen by that cluster's scheduler; nothing said so."""
    from launcher.cluster.ray_cluster import asked_cluster

    address, source = asked_cluster(None)
    if address is None or address == "local":
        return None
    return (f"{source} ({address}) is not joined: corelaunch serve always starts a private Ray of this host alone, beside that "
            f"cluster and unseen by its scheduler; {ON_A_CLUSTER}")


def _milliseconds(text: str) -> float:
    """--burst-wait-ms: LaunchConfig.burst_wait_s's range, in milliseconds."""
    from launcher.api import MAX_BURST_WAIT_S

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--burst-wait-ms ({text!r}) must be a number of milliseconds") from None
    if not 0 <= value <= MAX_BURST_WAIT_S * 1000:
        raise argparse.ArgumentTypeError(f"--burst-wait-ms ({text}) must be between 0 and {MAX_BURST_WAIT_S * 1000:g}")
    return value


def _seconds(text: str) -> float:
    """--ready-timeout: a finite number of seconds above 0 (0 or nan would give up at once, inf never)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ready-timeout ({text!r}) must be a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"--ready-timeout ({text}) must be a finite number of seconds above 0 "
                                         f"(default 900)")
    return value


def _requests(text: str) -> float:
    """--target-ongoing-requests: a number, worded as the other numeric flags word theirs (argparse's own
    type=float said "invalid float value"); its range is checked with the other autoscaling settings."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--target-ongoing-requests ({text!r}) must be a number (requests in "
                                         f"flight per replica that Serve scales toward; default 2)") from None


def _host(text: str) -> str:
    if not text.strip():  # "" binds every interface, as 0.0.0.0 does: say so rather than do it quietly
        raise argparse.ArgumentTypeError(f"--host ({text!r}) is empty; pass 127.0.0.1 (this machine only) or "
                                         f"0.0.0.0 (every interface)")
    return text


def _port(text: str) -> int:
    port = int_at_least("--port", 1)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"--port ({port}) must be at most 65535")
    return port


def json_object_option(text: str) -> dict:
    """--default-chat-template-kwargs: a JSON object (checked further with the other settings)."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"({text!r}) is no JSON ({err}); send an object, e.g. "
                                         f"'{{\"enable_thinking\": false}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"({text!r}) must be a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return value


def server_args(args: argparse.Namespace) -> dict:
    """The application builder's arguments (launcher.serving.server_settings) the options ask for."""
    built = {**model_and_placement_options(args), **max_num_seqs_option(args, default=SERVE_MAX_NUM_SEQS),
             "served_model_name": args.served_model_name,
             # an explicit --api-key "" is refused (checked as the argument), not read as "no key"
             "api_key": args.api_key if args.api_key is not None else api_key_from_environment(),
             "replicas": args.replicas, "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
             "target_ongoing_requests": args.target_ongoing_requests, "tool_call_parser": args.tool_call_parser,
             "reasoning_parser": args.reasoning_parser, "chat_template": args.chat_template,
             "trust_request_chat_template": args.trust_request_chat_template,
             "default_chat_template_kwargs": args.default_chat_template_kwargs,
             "responses_store": args.responses_store, "stream_interval": args.stream_interval}
    if args.max_queued_requests is not None:
        built["max_queued_requests"] = args.max_queued_requests
    if args.max_prefill_tokens is not None:
        built["max_prefill_tokens"] = args.max_prefill_tokens
    if args.burst_wait_ms is not None:
        built["burst_wait_s"] = args.burst_wait_ms / 1000
    if not args.prefix_caching:
        built["prefix_caching"] = False
    return {k: v for k, v in built.items() if v is not None or k in ("model",)}


def check_port_free(host: str, port: int) -> None:
    """OSError naming the address when something already listens there (refused before Ray starts)."""
    if ":" in host:  # the server's addresses, its readiness probe and Serve's proxy port are IPv4 here
        raise OSError(f"--host {host} is an IPv6 address, which corelaunch serve does not bind; pass an IPv4 "
                      f"address (127.0.0.1, or 0.0.0.0 for every interface)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise OSError(f"cannot listen on {host}:{port} ({err.strerror}); {bind_error_fix(err)}") from None


def bind_error_fix(err: OSError) -> str:
    """What to change when binding --host:--port failed with `err`."""
    if err.errno == errno.EADDRINUSE:
        return "pass a free --port, or stop what holds it"
    if err.errno == errno.EACCES:  # a port below 1024 (ip_unprivileged_port_start) without the privilege
        return ("ports below 1024 need root or CAP_NET_BIND_SERVICE; pass a --port of 1024 or above, or run with "
                "that privilege")
    # not this host's address, or not an address at all
    return "pass a --host this machine has (127.0.0.1, or 0.0.0.0 for every interface)"


@dataclasses.dataclass(frozen=True)
class DeployFailure:
    """Why serve.run did not deploy the application (str() says it). `raised`: serve.run raised, a
    replica's start having failed, rather than --ready-timeout running out; `reason`: that replica's
    own error, from Serve's status (None where Serve did not say)."""

    message: str
    raised: bool
    reason: str | None = None

    def __str__(self) -> str:
        return self.message


BIND_FAILURE_WORDS = ("Failed to bind", "port already in use", "No available ports", "Address already in use",
                      "Failed to allocate and start")
"""What Ray Serve's replica raises when it cannot bind its direct-ingress port (start_asgi_http_server,
Replica._maybe_start_direct_ingress_servers, NodePortManager: the port, tried and blocked, is its
range's only one)."""


def port_taken_meanwhile(host: str, port: int, failure: DeployFailure) -> str | None:
    """After a failed deploy with direct ingress: why, when another process holds --port, else None.
    Only where serve.run raised (the replica's start failed) and Serve's reason, where it gives one,
    is the bind: past --ready-timeout the replica may hold the port itself (it binds once the model
    is loaded, shortly before serve.run returns), and a replica failing for a reason of its own (the
    model's load) is named by that reason, whoever holds the port then."""
    if not failure.raised:
        return None
    if failure.reason is not None and not any(words in failure.reason for words in BIND_FAILURE_WORDS):
        return None
    try:
        check_port_free(host, port)
    except OSError as err:
        return (f"{err} (it was free when this server started, and another process took it before the "
                f"server's replica could bind it)")
    return None


def port_shared(host: str, port: int) -> str | None:
    """With Serve's proxy on --port: why, when another socket listens there too, else None. The
    proxy binds with SO_REUSEPORT (launcher/serving/ingress.py), so a listener that sets it as well,
    bound after check_port_free, shares the port without either bind failing, and answers part of
    the clients' connections."""
    from launcher.serving.ingress import listeners_on

    if listeners_on(host, port) <= 1:
        return None
    return (f"cannot listen on {host}:{port} alone: another process listens there too (it was free when this "
            f"server started, and another process bound it with SO_REUSEPORT, sharing the port with Serve's "
            f"proxy, which would have handed it part of the connections); pass a free --port, or stop what "
            f"holds it")


def run(args: argparse.Namespace) -> int:
    from launcher.errors import LaunchError

    try:
        from launcher.api import server_tokenizer_problem
        from launcher.serving.openai_app import _template_defaults_problem
        from launcher.serving.server_settings import SERVER_ARGS, settings_from_args

        # the server's own arguments named as this command's flags (max_replicas -> --max-replicas)
        settings = settings_from_args(server_args(args), {k: "--" + k.replace("_", "-") for k in SERVER_ARGS})
        mode = choose_mode(args.ingress, settings.most_replicas, settings.autoscaling is not None)
        check_port_free(args.host, args.port)
        model_dir = _plan(settings)  # an impossible layout is refused here, not inside a Serve replica
        no_tokenizer = server_tokenizer_problem(model_dir)
        if no_tokenizer:  # as is a model the server cannot read text for
            raise ValueError(no_tokenizer)
        # Loaded here (a second or so), as each replica will load it: a broken tokenizer file failed
        # every replica's start, after Ray and Serve had started, with only Serve's words at the end.
        tokenizer = _chat_tokenizer(model_dir, settings.chat_template)
        no_chat = not has_default_chat_template(tokenizer)
        # the control tokens of --default-chat-template-kwargs, known with the tokenizer only: each
        # replica refuses them at its start too, after Ray and Serve had started
        bad_defaults = _template_defaults_problem(tokenizer, settings.default_chat_template_kwargs,
                                                  "--default-chat-template-kwargs")
        if bad_defaults:
            raise ValueError(bad_defaults)
    except (ValueError, OSError, LaunchError) as err:  # FileNotFoundError is an OSError
        print(f"corelaunch serve: {with_flag_name(err, args)}", file=sys.stderr)
        return 2
    if (not_joined := cluster_not_joined()) is not None:  # a note, not a refusal: the private server works
        print(f"corelaunch serve: {not_joined}", file=sys.stderr)
    # The private Ray's processes inherit this environment: a replica's Launcher (ray_address None)
    # read RAY_ADDRESS and planned as for that cluster, not as _plan did for this host.
    os.environ.pop("RAY_ADDRESS", None)
    if settings.chat_template is not None:  # a warning, not a refusal: some templates raise on purpose
        warning = chat_template_warning(tokenizer, args.chat_template)
        if warning is not None:
            print(f"corelaunch serve: {warning}", file=sys.stderr)
    if no_chat and args.quiet:
        # the replica says so at start, in its output, which --quiet hides: a server that refuses
        # every chat request started without a word
        print(f"corelaunch serve: the tokenizer of {model_dir} has no chat template: /v1/chat/completions "
              f"refuses every request (400), and so does /v1/responses; /v1/completions serves prompts; to "
              f"serve chat, give the server a template (--chat-template FILE)", file=sys.stderr)
    return _serve(args, settings, mode)


def has_chat_template(model_dir: Path, template: str | None = None) -> bool:
    """Whether the model's tokenizer can render chat messages, as each replica will load it, with the
    server's template (--chat-template's text) where one is given. run() asks the same through
    _chat_tokenizer itself, keeping the tokenizer for its start probe; this is the question alone."""
    return has_default_chat_template(_chat_tokenizer(model_dir, template))


def _chat_tokenizer(model_dir: Path, template: str | None = None):
    """The model's tokenizer as each replica will load it, with the server's template (--chat-template's
    text) where one is given (loaded here, a second or so: its files are checked before Ray starts, a
    look at the files alone took a legacy chat_template.json, which the tokenizer does not read, for a
    template, and the server's template is tried on it)."""
    from launcher.api import load_tokenizer
    from launcher.serving.chat_template import use_chat_template

    return use_chat_template(load_tokenizer(model_dir, token_ids_way_out=False), template)


def _plan(settings) -> Path:
    """The layout planned as each Serve replica will plan it; and every Serve replica there can be
    at once (each one TP group) must fit this host's RAM, which they share on the cpu backend: the
    Ray that `serve` starts is private, this host alone. Returns the model directory."""
    import dataclasses

    from launcher.api import LaunchConfig
    from launcher.launch_plan import (check_groups_fit, groups_this_host_holds, nodes_on_one_host, plan_launch,
                                      refuse_what_a_private_start_cannot_hold, with_artifact_settings)
    from launcher.progress import Progress
    from workers.backends.planner_targets import NO_GPU, NO_GPU_FOR_SERVE

    config = LaunchConfig(**settings.launch)
    if config.nodes > 1:  # the Ray this command starts is always private
        raise nodes_on_one_host(config.nodes, "corelaunch serve starts", (
            "to serve over several nodes, deploy the application on a multi-node cluster with `serve run "
            "launcher.serving.openai_app:build_app` or `serve deploy` (README: On a Ray cluster of your own), or "
            "drop --nodes"))
    # Planned for the private Ray the command starts: with ray_address None, RAY_ADDRESS (which the
    # command never joins) made the plan one for a cluster elsewhere, skipping this host's checks
    # (`--backend cuda` on a host without a GPU got as far as the replicas' start).
    config = with_artifact_settings(dataclasses.replace(config, ray_address="local"))  # as each replica's Launcher
    try:
        planned = plan_launch(config, Progress(False))
    except ValueError as err:
        if str(err) == NO_GPU:  # its fixes name --ray-address, which serve refuses
            raise ValueError(NO_GPU_FOR_SERVE) from None
        raise
    holds = groups_this_host_holds(config, planned.plan, planned.backend, server=True)
    name = "--replicas" if settings.autoscaling is None else "--max-replicas"
    least = None if settings.autoscaling is None else settings.autoscaling["min_replicas"]
    check_groups_fit(settings.most_replicas, name, planned.plan, holds, server=True, least=least)
    # plan_launch checked one group's CPUs (each replica's Launcher has one); Serve runs up to
    # most_replicas of them, and those the CPUs never hold waited out --ready-timeout
    refuse_what_a_private_start_cannot_hold(config, planned.plan, planned.backend, "nothing was started",
                                            serve_replicas=(settings.most_replicas, name, least))
    return Path(planned.model_dir)


class StopSignals:
    """SIGINT and SIGTERM as requests to stop. The first sets `requested` (by_sigterm says which came);
    a second raises KeyboardInterrupt wherever the main thread is, cutting short the graceful
    shutdown the first began (exit 130), and `cut_short` says so. `held()` keeps both off while Ray
    itself shuts down (interrupted half-way, its processes outlived the call), and `restore()` puts
    back the handlers found at install()."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.by_sigterm = False
        self.cut_short = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        if self.requested.is_set():
            self.cut_short = True
            raise KeyboardInterrupt
        self.by_sigterm = signum == signal.SIGTERM
        self.requested.set()

    @contextlib.contextmanager
    def held(self):
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)
        try:
            yield
        finally:
            self.restore()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace, settings, mode: str) -> int:
    from launcher.cli.command_stdout import ray_output_on_stderr

    hold_the_pinned_version(settings.launch)  # a descriptor left open: held until the command ends
    with ray_output_on_stderr() as stdout:  # the ready line is stdout's, and Ray's messages are not
        return _serve_on(args, settings, mode, stdout)


def hold_the_pinned_version(launch: dict) -> int | None:
    """A lock (atomic_dir.hold_version) on the compiled or --presharded version every replica is
    handed (server_settings pins it), held by the command while it runs. Each replica holds it too,
    but only once started: between the pin and a replica's start (the first ones, or one Serve
    starts after the others stopped), a compile or save_presharded into the same path deleted it,
    and that replica's start failed on a folder that no longer existed."""
    from shardlib.atomic_dir import hold_version, is_version

    for key in ("compiled_dir", "presharded_dir"):
        path = launch.get(key)
        if path and is_version(path):
            return hold_version(path)
    return None


def _serve_on(args: argparse.Namespace, settings, mode: str, stdout) -> int:
    from ray import serve

    from launcher.cli.exit_codes import exit_code_for
    from launcher.cluster import ray_cluster
    from launcher.errors import LaunchError
    from launcher.serving.openai_app import application

    ingress = ingress_plan(args, mode)
    # Serve's processes read these when they start: they inherit them from the private Ray started below.
    os.environ.update(ingress.environment)
    try:
        connection = ray_cluster.connect("local", worker_logs=not args.quiet)
    except (ValueError, OSError, LaunchError) as err:  # a private Ray that did not start: said as generate says it
        print(f"corelaunch serve: {err}", file=sys.stderr)
        return exit_code_for(err)
    signals = StopSignals()
    ready = False  # the ready line printed: clients may have requests in flight
    try:  # from here on the private Ray is stopped below, whatever fails
        if args.quiet:  # Serve's own INFO lines in this process (started, deployed, ready) are progress too
            logging.getLogger("ray.serve").setLevel(logging.WARNING)
        if ingress.mode == "direct":
            logging.getLogger("ray.serve").addFilter(IdleProxyAddressHidden())
        # After ray.init, which installs its own SIGTERM handler: a signal now only asks the main thread
        # to stop, so Serve and Ray are shut down below rather than killed mid-way.
        signals.install()
        stop = signals.requested
        failure = _start_serve(serve, args.host, ingress.proxy_port)
        if failure is not None:
            print(f"corelaunch serve: {failure}", file=sys.stderr)
            return 1
        if ingress.mode == "proxy" and (shared := port_shared(args.host, args.port)):
            print(f"corelaunch serve: {shared}", file=sys.stderr)
            return 2
        # One --ready-timeout for both waits: the replicas loading, then their HTTP server answering.
        ready_by = time.monotonic() + args.ready_timeout
        failure = _deploy(serve, application(settings), stop, ready_by, args.ready_timeout)
        if failure is not None and mode == "direct" and (taken := port_taken_meanwhile(args.host, args.port,
                                                                                       failure)):
            # Free at the check before Ray started, but another process (a second server started at
            # the same time, say) bound it before this server's replica could: Serve's own message
            # ("Failed to update the deployments") named no port; the bind error is in its logs.
            # (Behind the proxy, Serve's start binds --port and names it when it cannot; a listener
            # that shares it by SO_REUSEPORT is found by port_shared, above and before the ready line.)
            print(f"corelaunch serve: {taken}", file=sys.stderr)
            return 2
        if failure is None:
            failure = wait_healthy(args.host, args.port, stop, ready_by, args.ready_timeout)
        if failure is not None:
            print(f"corelaunch serve: {failure}", file=sys.stderr)
            return 1
        if stop.is_set():
            return 0
        if ingress.mode == "proxy" and (shared := port_shared(args.host, args.port)):
            print(f"corelaunch serve: {shared}", file=sys.stderr)  # one that joined while the model loaded
            return 2
        print(f"corelaunch: serving {settings.served_model_name} at {base_url(args.host, args.port)}/v1", flush=True,
              file=stdout)
        ready = True
        while not stop.wait(1.0):
            pass
        return 0
    finally:
        try:
            # A SIGTERM sent to the whole group took Ray's processes too: nothing is left to shut
            # down gracefully. (SIGINT, Ctrl-C's, is blocked in Ray's processes.) A second signal
            # asked not to wait for it.
            # (A Ray process already gone when connect() had started the cluster is no sign of it.)
            # Before the ready line no client has a request to finish, and a replica still loading
            # the model is not stopped by Serve until its graceful shutdown (20 s) runs out.
            if ready and not signals.cut_short and not (signals.by_sigterm
                                                        and ray_cluster.private_cluster_dying(within_s=0.5)):
                # The application first, while the proxy still runs: its replicas finish their
                # requests in flight (Serve's graceful shutdown) before anything stops. serve.shutdown()
                # alone stopped the proxy at once, cutting every stream behind it (--replicas 2).
                try:
                    serve.delete(APP_NAME)
                except Exception:  # noqa: BLE001 - no Serve to ask (its start failed), or replicas still
                    serve.shutdown()  # draining after Serve's 60 s: its shutdown stops them either way
                # Deleted, nothing of Serve's holds anything the private Ray's stop below does not end:
                # serve.shutdown() there printed Ray's "(raylet) Task ServeController.graceful_shutdown
                # failed ..." at every stop, --quiet included (its controller killed under its own call).
        finally:
            with signals.held():
                # The private Ray's processes stop while this process is whole; the CLI then exits
                # without Ray's teardown of it (RayConnection.close_for_exit says why).
                connection.close_for_exit()


def ingress_plan(args: argparse.Namespace, mode: str) -> IngressPlan:
    """The ingress plan for --host, --port and `mode`. In direct mode the idle proxy's port is
    picked now and bound only after the private Ray has started, seconds later: a port from below
    the OS's ephemeral range, which Ray's start-up connections cannot take meanwhile (one from that
    range once failed Serve's start with "Failed to bind to address 127.0.0.1:40525")."""
    from workers.net import free_port_for_a_late_bind

    return plan_ingress(mode, args.port, lambda: free_port_for_a_late_bind(args.host), dict(os.environ))


def _start_serve(serve, host: str, proxy_port: int) -> str | None:
    """serve.start with its proxy on host:proxy_port; None once started, else why not in one line
    (Serve raises a task error whose text is the proxy actor's whole traceback)."""
    try:
        serve.start(http_options={"host": host, "port": proxy_port})
    except Exception as err:  # noqa: BLE001 - reported, and the command exits 1
        cause = getattr(err, "cause", None) or err  # a RayTaskError carries the actor's own exception
        return f"Ray Serve did not start (its proxy on {host}:{proxy_port}): {type(cause).__name__}: {cause}"
    return None


def _deploy(serve, app, stop: threading.Event, deadline: float, timeout_s: float) -> DeployFailure | None:
    """serve.run in a thread (it waits, without a limit, for every replica to load the model), bounded
    by `deadline` (time.monotonic(); the end of --ready-timeout, timeout_s) and by a signal; None once
    deployed, else why not."""
    outcome: dict = {}

    def deploy() -> None:
        try:
            serve.run(app, blocking=False, name=APP_NAME, route_prefix="/")
        except BaseException as err:  # noqa: BLE001 - reported by the waiting thread
            outcome["error"] = err
        outcome["done"] = True

    thread = threading.Thread(target=deploy, name="serve-run", daemon=True)
    thread.start()
    while "done" not in outcome and not stop.is_set() and time.monotonic() < deadline:
        thread.join(timeout=0.5)
    if "error" in outcome:
        from launcher.cli.serve_failure import replica_failure

        # Serve's own error names only the deployment; the replica's exception is in its status
        reason = replica_failure(serve, APP_NAME)
        if reason is None:
            return DeployFailure(f"the server failed to start: {outcome['error']}", raised=True)
        return DeployFailure(f"the server failed to start: {reason} (the whole traceback: the ServeController's "
                             f"log under {_serve_logs()})", raised=True, reason=reason)
    if "done" not in outcome and not stop.is_set():
        return DeployFailure(f"the model was not loaded within --ready-timeout {timeout_s:g} s; raise "
                             f"--ready-timeout, or check the replica's log under {_serve_logs()}", raised=False)
    return None


def _serve_logs() -> str:
    from launcher.cluster import ray_cluster

    return f"{ray_cluster.logs_dir()}/serve"


def base_url(host: str, port: int) -> str:
    # A server bound to every interface is reached from here over loopback.
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""An opener that reaches the server directly: urlopen's default honours http_proxy (and skips
127.0.0.1 only where no_proxy names it), so a host with a proxy set asked the proxy for the
server's /health, waited out --ready-timeout and shut a healthy server down."""


def wait_healthy(host: str, port: int, stop: threading.Event, deadline: float, ready_timeout_s: float) -> str | None:
    """Poll GET /health until it answers 200: at least once, then until `deadline` (time.monotonic())
    ends --ready-timeout (ready_timeout_s, which the message names). None then, else why not (the
    last answer or error)."""
    url, last = f"{base_url(host, port)}/health", "no answer yet"
    while not stop.is_set():
        try:
            with _NO_PROXY.open(url, timeout=5) as reply:
                if reply.status == 200:
                    return None
                last = f"HTTP {reply.status}"
        except urllib.error.HTTPError as err:
            last = f"HTTP {err.code}"
        except (urllib.error.URLError, OSError) as err:
            last = str(getattr(err, "reason", err))
        if time.monotonic() >= deadline:
            break
        stop.wait(0.5)
    if stop.is_set():
        return None
    return (f"{url} did not answer 200 within --ready-timeout {ready_timeout_s:g} s (last: {last}); "
            f"raise --ready-timeout, or check the replica's log under {_serve_logs()}")
