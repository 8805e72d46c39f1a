"""What one OpenAI-compatible server runs, from the arguments of `corelaunch serve`, `serve run
launcher.serving.openai_app:build_app key=value ...` or a `serve deploy` config's `args:`.

Pure: no Ray and no model is touched, so every refusal comes before anything starts. The values are
checked by building the LaunchConfig they describe (its own checks, with its own messages) plus the
server's rules for names, keys and Serve replica counts.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import unicodedata
from dataclasses import dataclass

import yaml

from launcher.serving.responses.store import MAX_CAPACITY

SERVER_ARGS = ("served_model_name", "api_key", "replicas", "min_replicas", "max_replicas",
               "target_ongoing_requests", "tool_call_parser", "reasoning_parser", "chat_template",
               "trust_request_chat_template", "default_chat_template_kwargs", "responses_store", "stream_interval")
"""Builder arguments that configure the server and Serve; every other argument is a LaunchConfig
field (model, tp, dtype, seq_len, max_num_seqs, max_queued_requests, compiled_dir, ...)."""

TEXT_ARGS = ("model", "served_model_name", "api_key", "tool_call_parser", "reasoning_parser", "chat_template",
             "compiled_dir",
             "presharded_dir",
             "presharded_cache_dir", "backend", "instance", "dtype", "kv_cache_dtype", "kv_strategy", "moe_sharding",
             "compile_granularity")
"""Arguments kept as the text given (`serve run` passes every value as text; the others are read as
YAML scalars, so "2" is 2, "true" is True and "null" is None)."""
FREE_TEXT_ARGS = ("model", "served_model_name", "api_key", "chat_template", "compiled_dir", "presharded_dir",
                  "presharded_cache_dir")
"""The text arguments that take any text (names, keys, paths): one a config file's YAML read as a
number, a boolean or a date is refused naming its type. The others take one of a few names, and
their own refusal lists them, which says more."""

TOOL_CALL_PARSERS = {
    "hermes": "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> (Qwen2/Qwen2.5 Instruct, Hermes)",
    "llama3_json": "{\"name\": ..., \"parameters\": ...} objects, after <|python_tag|> or not (Llama 3.1/3.2/3.3 "
                   "Instruct)",
    "mistral": "[TOOL_CALLS] then [{\"name\": ..., \"arguments\": ...}] or name[ARGS]{...} (Mistral Instruct)",
    "pythonic": "a Python list of calls, [get_weather(city=\"Paris\"), get_time()] (Llama 3.2 and 4, prompted for it)",
    "qwen3_coder": "<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>, values typed "
                   "by the tool's schema (Qwen3-Coder)",
}
"""The formats tool_call_parser names (vLLM's --tool-call-parser names), each with how the model
writes a call in its free text, which tool_choice "auto" needs read back (the readers:
launcher/serving/tool_calls.py's PARSER_READERS)."""


def described(parsers: dict) -> str:
    """Each parser's name and what it reads, for help texts and errors."""
    return "; ".join(f"{name}, {form}" for name, form in parsers.items())

YAML_NULLS = ("null", "Null", "NULL", "~")
"""`serve run key=null`: the argument's default, whatever its kind (a path or name that is literally
one of these is written ./null)."""

BUCKET_ARGS = ("context_buckets", "token_buckets")
"""Lists of lengths: also taken as `corelaunch serve` writes them, "128,256" (or one length, 128)."""

NOT_UNDER_SERVE = {"ray_address": "a Serve replica runs in the Ray cluster Serve runs in; start Serve there "
                                  "(`serve run --address` or RAY_ADDRESS)",
                   "warm_up_static": "a server runs continuous batching alone: warm_up builds the serving "
                                     "loop's graphs, and static batches' would never be used",
                   "max_batch_size": "a server runs continuous batching alone, never a static batch, so its "
                                     "launch plans no static rows (max_batch_size 0); its KV cache is sized by "
                                     "max_num_seqs and seq_len"}
"""LaunchConfig fields that mean nothing inside a Serve replica: refused rather than ignored."""

_SERVE_ADDRESS = "Serve's HTTP proxy listens where the Serve config's http_options say (host, port)"
SERVE_OWNS = {"host": _SERVE_ADDRESS, "port": _SERVE_ADDRESS,
              "ingress": "under Serve's own tools the requests always come through Serve's HTTP proxy",
              "ready_timeout": "Serve waits for the replicas itself (`serve status` shows them starting)"}
"""`corelaunch serve` options that are no builder argument, and where their job is done instead."""

ROUTE_HEADROOM = 32
"""Serve's per-replica cap on ongoing requests is set this far above what the engine admits
(running + queued), so /health, /metrics and /v1/models still get through to a busy replica and a
request beyond the engine's queue reaches it and gets its 503, instead of waiting in Serve's queue.
Requests whose bodies are still arriving hold these places too (8 of them, slow small bodies, held
/health back for a minute); each now gives its place back within 10 s (openai_app.SMALL_BODY_READ_S)."""


@dataclass(frozen=True)
class ServerSettings:
    launch: dict
    """LaunchConfig keyword arguments for the one Launcher of each Serve replica (replicas=1)."""
    served_model_name: str
    """The `model` requests must name, and what GET /v1/models lists."""
    api_key: str | None
    """Required as `Authorization: Bearer <key>` on /v1/*; None: the replica reads CORELAUNCH_API_KEY
    from its own environment (unset: no key)."""
    num_replicas: int | None
    """Serve replicas (each its own Launcher and TP group); None when autoscaling decides."""
    autoscaling: dict | None
    """Serve's autoscaling_config (min_replicas, max_replicas, target_ongoing_requests), or None."""
    max_ongoing_requests: int
    """Serve's cap on requests in flight at one replica."""
    from_command_line: bool = False
    """Made by `corelaunch serve` from its options: a replica's refusals name those options, not the
    builder's arguments (launcher/serving/builder_terms.py)."""
    tool_call_parser: str | None = None
    """One of TOOL_CALL_PARSERS: tool_choice "auto" is taken and the model's calls are read from its
    text in that format; None: "auto" is refused (vLLM's rule without --enable-auto-tool-choice)."""
    reasoning_parser: str | None = None
    """One of reasoning.REASONING_PARSERS: a chat answer's thinking goes to its `reasoning` field;
    None: all of the text is the content."""
    chat_template: str | None = None
    """The Jinja text every chat is rendered with in place of the tokenizer's own (vLLM's
    --chat-template), read from its file where the settings were made; None: the tokenizer's."""
    trust_request_chat_template: bool = False
    """A chat request's own chat_template field is taken, rendering that request in place of the
    server's template (vLLM's --trust-request-chat-template: a template is code the server runs);
    False: a request sending one is refused (400)."""
    default_chat_template_kwargs: dict | None = None
    """Template variables every chat request gets unless it sends its own value (vLLM's
    --default-chat-template-kwargs): {"enable_thinking": False} serves Qwen3 without thinking."""
    responses_store: int = 0
    """Responses kept for previous_response_id and GET/DELETE /v1/responses/{id}, the least recently
    used going first (launcher/serving/responses/store.py); 0: none (previous_response_id refused)."""
    stream_interval: int = 1
    """Tokens a stream sends per chunk (vLLM's --stream-interval): the first token at once, then every
    this many, and whatever is held when the request ends; a request's own stream_interval may raise it
    for that stream, never lower it (a request with stop strings has its stream, not the leader,
    gather them: Launcher._new_stream). 1: every token as it comes."""

    @property
    def most_replicas(self) -> int:
        """Serve replicas there can be at once (each rank's CPU share is sized for this many)."""
        return self.num_replicas if self.autoscaling is None else self.autoscaling["max_replicas"]


def launch_fields() -> tuple[str, ...]:
    from launcher.api import LaunchConfig

    return tuple(f.name for f in dataclasses.fields(LaunchConfig))


def settings_from_args(args: dict, names: dict | None = None) -> ServerSettings:
    """ServerSettings from builder arguments (text or typed); ValueError (or FileNotFoundError for a
    missing model) naming the bad argument and the fix. names: how the messages name the server's
    own arguments (`corelaunch serve` passes its flags: {"max_replicas": "--max-replicas", ...}); given,
    the arguments are a command line's, already typed, whose text is taken as written: YAML's null
    words are `serve run`'s way to say "the default", and `--api-key null` (or CORELAUNCH_API_KEY=null)
    started a server with no key at all."""
    name = (names or {}).get
    from launcher.api import MAX_QUEUED_REQUESTS, LaunchConfig

    fields = launch_fields()
    # null (YAML's, or None) means the argument's default, for every argument: tp=null was refused
    # ("tp (None) must be ...") where seq_len=null was taken (None is those fields' default)
    literal = names is not None
    typed = {key: typed for key, typed in ((k, _typed(k, v, literal)) for k, v in args.items()) if typed is not None}
    for key, why in NOT_UNDER_SERVE.items():
        if typed.get(key) is not None:
            raise ValueError(f"{key} ({typed[key]!r}) does not apply to a server: {why}")
    taken = [f for f in fields if f != "replicas" and f not in NOT_UNDER_SERVE]
    unknown = sorted(set(typed) - set(SERVER_ARGS) - set(fields))
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}{_unknown_hints(unknown, SERVER_ARGS + tuple(taken))}; "
                         f"the server takes {', '.join(SERVER_ARGS)} and LaunchConfig's fields: {', '.join(taken)}")
    for key in FREE_TEXT_ARGS:
        _refuse_unquoted_scalar(key, typed.get(key), name(key, key))
    launch = {key: value for key, value in typed.items() if key in fields and key != "replicas"}
    # One Launcher (one TP group) per Serve replica: Serve, not the Launcher, adds replicas. No static
    # batches (max_batch_size 0): the planner counted 8 rows of seq_len for them that no server allocates.
    launch.update(replicas=1, progress=launch.get("progress", False), warm_up_static=False, max_batch_size=0)
    # before the model's checks: a misspelt parser is said first, not after a model folder's refusal
    parser = _tool_call_parser(typed.get("tool_call_parser"), name("tool_call_parser", "tool_call_parser"))
    reasoning = _reasoning_parser(typed.get("reasoning_parser"), name("reasoning_parser", "reasoning_parser"))
    template = _chat_template(typed.get("chat_template"), name("chat_template", "chat_template"))
    trusted = typed.get("trust_request_chat_template", False)
    if not isinstance(trusted, bool):
        raise ValueError(f"{name('trust_request_chat_template', 'trust_request_chat_template')} ({trusted!r}) must be "
                         f"true or false (true: a chat request's own chat_template is taken)")
    template_defaults = _template_defaults(typed.get("default_chat_template_kwargs"),
                                           name("default_chat_template_kwargs", "default_chat_template_kwargs"))
    kept = typed.get("responses_store", 0)
    _check_int(name("responses_store", "responses_store"), kept, 0,
               " (responses kept for previous_response_id; 0: none)")
    if kept > MAX_CAPACITY:
        raise ValueError(f"{name('responses_store', 'responses_store')} ({kept}) must be at most {MAX_CAPACITY} "
                         f"(responses kept for previous_response_id)")
    interval = typed.get("stream_interval", 1)
    _check_int(name("stream_interval", "stream_interval"), interval, 1,
               " (tokens a stream sends per chunk; 1: every token as it comes)")
    config = LaunchConfig(**launch)  # its checks, with its messages, now rather than inside a Serve replica
    if config.model is not None and config.compiled_dir is None:
        from shardlib.model_config import load_model_config

        # A folder without a (readable) config.json: refused now, as `corelaunch serve` refuses it
        # before Ray starts, not by every replica's start after Serve had placed it.
        load_model_config(config.model)
    num_replicas, autoscaling = _replica_counts(typed, lambda key: name(key, key))
    # The engine's own values, its defaults included: what one replica runs at once and queues. With
    # no queue limit the engine queues everything, so Serve must let everything through: a request
    # held in Serve's own queue held /health and /metrics behind it too.
    queued = config.max_queued_requests
    admitted = config.max_num_seqs + (queued if queued is not None else MAX_QUEUED_REQUESTS)
    served = _served_name(typed, launch, name("served_model_name", "served_model_name"))
    if launch.get("compiled_dir"):
        from launcher.artifacts.compiled_dir import apply_compiled_dir, pinned_version

        # A launch the directory was not built for is refused now, naming the path given: once
        # pinned, the refusal named the hidden version (.NAME.v-HOST-PID-RANDOM) instead.
        apply_compiled_dir(config)
        # Every replica on the version the link names now, as one Launcher keeps to it: replicas
        # Serve starts later (autoscaling, a replacement) loaded whatever a later compile linked.
        launch["compiled_dir"] = str(pinned_version(launch["compiled_dir"]))
    elif launch.get("presharded_dir"):
        from shardlib.atomic_dir import current_version

        # The same for a --presharded link (save_presharded's): each replica pinned whatever the link
        # named when it started, so a rewrite left replicas serving different weights. Each replica
        # holds the version while it runs (launcher/api.py), and `corelaunch serve` from the pin
        # (serve_command.hold_the_pinned_version).
        version = current_version(launch["presharded_dir"])
        if version is not None:
            launch["presharded_dir"] = str(version)
    return ServerSettings(
        launch=launch, served_model_name=served,
        api_key=_api_key(typed.get("api_key"), name("api_key", "api_key")),
        num_replicas=num_replicas, autoscaling=autoscaling, max_ongoing_requests=admitted + ROUTE_HEADROOM,
        from_command_line=names is not None,
        tool_call_parser=parser, reasoning_parser=reasoning, chat_template=template,
        trust_request_chat_template=trusted,
        default_chat_template_kwargs=template_defaults,
        responses_store=kept, stream_interval=interval)


def _unknown_hints(unknown: list[str], known: tuple[str, ...]) -> str:
    """Where an unknown argument's job is done instead, or the known one it is likely a misspelling of."""
    import difflib

    hints = []
    for key in unknown:
        if key in SERVE_OWNS:
            hints.append(f"{key}: {SERVE_OWNS[key]}")
        elif close := difflib.get_close_matches(key, known, n=1, cutoff=0.75):
            hints.append(f"{key}: did you mean {close[0]}?")
    return f" ({'; '.join(hints)})" if hints else ""


def _typed(key: str, value, literal: bool = False):
    """literal: a command line's value, whose names, paths and keys are taken as written."""
    if value in YAML_NULLS and not (literal and key in TEXT_ARGS):
        return None  # the default, for text arguments too (it was the text "null": kv_strategy='null' refused)
    if isinstance(value, str) and key not in TEXT_ARGS:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            pass
    if key in BUCKET_ARGS and isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if key in BUCKET_ARGS and isinstance(value, str):  # YAML left "128,256" as text
        from shardlib.buckets import parse_buckets

        try:
            return list(parse_buckets(value))
        except ValueError as err:
            raise ValueError(f"{key}: {err}") from None
    return value


def _refuse_unquoted_scalar(key: str, value, shown: str) -> None:
    """A text argument that YAML read as a number, a truth value or a date (`api_key: 12345` unquoted
    in a serve deploy config, 012 read as 10) is refused naming its type: the argument's own check
    said only "must be a string", and for the key, whose value is never shown, nothing more."""
    if not isinstance(value, (bool, int, float, datetime.date)):
        return
    kind = type(value).__name__
    article = "an" if kind[0] in "aeiou" else "a"
    given = "" if key == "api_key" else f" ({value!r})"
    why = ", which reads an unquoted true, false, yes, no, on or off as one" if isinstance(value, bool) else ""
    raise ValueError(f"{shown}{given} must be text (got {article} {kind}: quote it in the YAML{why})")


def folder_name_as_given(path: str) -> str:
    """The name of the folder `path` names as the user reached it: a symlink's own name, not its
    target's (`models/llama` linked to a dated folder is served as "llama"; a compiled directory's
    link as its name, not the hidden version it points to), and for a relative path the working
    directory as the shell reached it ($PWD keeps the links a `cd` went through, where the process's
    own view of it is the resolved path: `serve --compiled .` inside a compiled directory)."""
    if not os.path.isabs(path):
        here = os.environ.get("PWD", "")
        try:
            logical = os.path.isabs(here) and os.path.samefile(here, ".")
        except OSError:
            logical = False
        path = os.path.join(here if logical else os.getcwd(), path)
    return os.path.basename(os.path.normpath(path))


def _served_name(args: dict, launch: dict, shown: str = "served_model_name") -> str:
    name = args.get("served_model_name")
    if name is not None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{shown} ({name!r}) must be a non-empty string (the `model` clients send)")
        if any(unicodedata.category(ch) in ("Cc", "Zl", "Zp") for ch in name):  # taken, and printed broken
            raise ValueError(f"{shown} ({name!r}) must hold no control characters or line breaks (a newline, a tab)")
        return name
    if launch.get("model"):
        return folder_name_as_given(launch["model"])
    if launch.get("compiled_dir"):
        # the path's own name: resolved, it is the hidden version the link points to
        # (.c1.v-HOST-PID-RANDOM), which changes at every compile
        return folder_name_as_given(launch["compiled_dir"])
    from shardlib.demo_model import DEMO_MODEL_NAME

    return DEMO_MODEL_NAME


def _chat_template(value, name: str = "chat_template") -> str | None:
    """The template's text, or None (the tokenizer's own), read and compiled now, before Ray starts:
    a missing file or a syntax error would otherwise only show as every chat request refused."""
    if value is None:
        return None
    from launcher.serving.chat_template import read_chat_template

    return read_chat_template(value, name)


def _template_defaults(value, name: str = "default_chat_template_kwargs") -> dict | None:
    """The default template variables, checked by the rules of a request's chat_template_kwargs
    (openai_protocol.template_kwargs_problem) before any replica starts: a bad one would otherwise
    refuse every chat request, naming a field its client never sent."""
    from launcher.serving.openai_protocol import template_kwargs_problem

    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{name} ({value!r}) must be a JSON object of template variables by name, e.g. "
                         f"{{\"enable_thinking\": false}}")
    problem = template_kwargs_problem(value, name)
    if problem is not None:
        raise ValueError(problem[0])
    return value or None


def _one_of(parser, name: str, parsers: dict, what: str) -> str | None:
    """The parser's name, or None (none asked), checked before any replica starts: a misspelt one
    would otherwise only show as every request that needs it refused."""
    if parser is not None and not (isinstance(parser, str) and parser in parsers):
        raise ValueError(f"{name} ({parser!r}) must be one of {', '.join(parsers)} ({what}: {described(parsers)}), "
                         f"or left out")
    return parser


def _reasoning_parser(parser, name: str = "reasoning_parser") -> str | None:
    from launcher.serving.reasoning import REASONING_PARSERS

    return _one_of(parser, name, REASONING_PARSERS, "how a thinking model writes its reasoning")


def _tool_call_parser(parser, name: str = "tool_call_parser") -> str | None:
    return _one_of(parser, name, TOOL_CALL_PARSERS, "the format the model writes its tool calls in")


def _api_key(key, name: str = "api_key") -> str | None:
    """The key (its value is never shown: it is a secret), or None."""
    if key is None:
        return None
    if not isinstance(key, str) or not key or not (key.isascii() and key.isprintable()) or " " in key:
        # an HTTP header carries ASCII: a key with other characters (or spaces) could never be sent
        raise ValueError(f"{name} must be a non-empty string of printable ASCII without spaces (clients send it "
                         f"as `Authorization: Bearer <key>`)")
    return key


def api_key_from_environment() -> str | None:
    """CORELAUNCH_API_KEY, checked as the api_key argument is; unset or empty: None (no key)."""
    return _api_key(os.environ.get("CORELAUNCH_API_KEY") or None, "CORELAUNCH_API_KEY")


def _replica_counts(args: dict, name=lambda key: key) -> tuple[int | None, dict | None]:
    """(fixed Serve replica count, None) or (None, autoscaling_config). name: how messages name an argument."""
    scaling = {k: args[k] for k in ("min_replicas", "max_replicas", "target_ongoing_requests")
               if args.get(k) is not None}
    if not scaling:
        replicas = args.get("replicas", 1)
        _check_int(name("replicas"), replicas, 1)
        return replicas, None
    if args.get("replicas") is not None:
        raise ValueError(f"{name('replicas')} ({args['replicas']!r}) fixes the Serve replica count, while "
                         f"{', '.join(name(k) for k in sorted(scaling))} ask Serve to scale it: give one or the other")
    low = scaling.get("min_replicas", 1)
    _check_int(name("min_replicas"), low, 1, why=" (every replica loads the model, so none may start from zero)")
    high = scaling.get("max_replicas", max(low, 1))
    _check_int(name("max_replicas"), high, low, why=f" ({name('min_replicas')} is {low})")
    target = scaling.get("target_ongoing_requests", 2.0)
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < math.inf:
        raise ValueError(f"{name('target_ongoing_requests')} ({target!r}) must be a finite positive number (requests "
                         f"in flight per replica that Serve scales toward)")
    if high == low:  # --target-ongoing-requests alone was 1 to 1: no scaling, and proxy ingress forced for it
        given = ", ".join(name(k) for k in sorted(scaling))
        raise ValueError(f"autoscaling from {name('min_replicas')} {low} to {name('max_replicas')} {high} (given: "
                         f"{given}) has nothing to scale between: give {name('max_replicas')} above {low} to "
                         f"autoscale, or {name('replicas')} {low} for a fixed count")
    return None, {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": float(target)}


def _check_int(name: str, value, minimum: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} ({value!r}) must be an integer >= {minimum}{why}")
