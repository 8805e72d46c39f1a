"""The driver API: plan, start the workers, load, generate, shut down.

    from launcher import Launcher
    with Launcher(tp=3) as llm:                       # SmolLM2-135M-Instruct by default
        [out] = llm.generate("The capital of France is", max_new_tokens=8)
        print(out.text, out.finish_reason, out.decode_tokens_per_s)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import operator
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Set as AbstractSet
from concurrent.futures import wait as wait_for_futures
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from launcher.background_load import BackgroundLoad
from launcher.cluster.restart_policy import RestartPolicy
from launcher.errors import (LaunchError, NoDeviceResource, NoDeviceResourceHere, PlacementTimeout,
                             RequestTimeout)
from launcher.progress import Progress
from shardlib.config_fields import finite, show
from shardlib.expert_sharding import check_moe_sharding_name
from shardlib.generation_config import generation_eos_ids
from shardlib.model_config import ModelConfig, normalize_dtype
from shardlib.quantized_sizes import kv_dtype_name
from shardlib.instances import INSTANCE_NAMES
from shardlib.planner import KV_STRATEGIES
from shardlib.positive_int import (integer_of_any_kind, is_non_negative_int, is_positive_int, positive_int,
                                   real_of_any_kind)
from shardlib.request_checks import check_fits, check_request, check_stop_token_ids, is_token_index
from shardlib.sampling_params import SamplingParams, check_allowed_beyond_stops
from shardlib.serving_shapes import DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_PREFILL_TOKENS
from workers.backends import backend_entry
from workers.granularities import GRANULARITIES

DEFAULT_BURST_WAIT_S = 0.01
"""LaunchConfig.burst_wait_s unless asked otherwise: on one 2-core machine the requests of 16
concurrent HTTP clients reached the group up to 6 ms apart."""
MAX_BURST_WAIT_S = 1.0
MAX_QUEUED_REQUESTS = 1_000_000
"""A queue limit beyond any real server; also keeps Serve's per-replica request cap within its 32-bit field."""


@dataclass
class LaunchConfig:
    """How to serve one model; every field is checked when the object is built."""

    model: str | None = None
    """Hugging Face model directory; None for the built-in SmolLM2-135M-Instruct."""
    tp: int | str = "auto"
    """Tensor-parallel degree, or "auto" for the smallest degree the planner accepts."""
    backend: str | None = None
    """A name from workers.backends.BACKENDS (cpu, neuron, cuda); None: the first whose device this
    host has, else cpu."""
    instance: str | None = None
    """Planner target for the cpu and neuron backends (e.g. trn1.32xlarge); None means this host
    ("cpu") on the cpu backend."""
    device_memory_gib: float | None = None
    """cuda backend: the memory of one GPU, for planning; None measures this host's GPUs."""
    nodes: int = 1
    """Nodes one TP group may span: 1 keeps a group on one node; more let a cpu group's ranks spill
    over to at most that many, and put a device group's on exactly that many, TP / nodes on each,
    where nodes divides TP (the planner counts cores and memory over this many nodes)."""
    replicas: int | str = 1
    """Independent TP groups serving the model; "auto": as many as the cluster's free resources hold."""
    max_restarts: int = 3
    """Restarts of a failed replica's group allowed within restart_window_s; 0 disables restarts."""
    restart_window_s: float = 600.0
    health_check_interval_s: float = 2.0
    """How often an idle replica checks that its ranks are alive (so a dead one is replaced early)."""
    presharded_cache: bool = False
    """After the first load, write a pre-sharded copy of this layout into presharded_cache_dir and
    load restarted groups (and later launches) from it. The directory must be visible at the same
    path on every node (as the model directory must)."""
    presharded_cache_dir: str | None = None
    """Default: $CORELAUNCH_CACHE/presharded-uid<uid> (~/.cache/corelaunch/presharded-uid<uid>), this user's own.
    Given without presharded_cache, refused (it was ignored)."""
    lnc: int | None = None
    dtype: str | None = None
    """Compute dtype; None keeps the checkpoint's."""
    kv_cache_dtype: str | None = None
    """"f8e4m3": the KV cache stored in fp8 with a scale (workers/kv_quant.py); None: the compute dtype."""
    kv_strategy: str | None = None
    pad_q_heads: bool = False
    """Pad Q heads with zero heads to a multiple of tp (NxD Inference's layout, shardlib/sharding.py):
    a degree that does not divide the heads runs, with outputs equal to the unpadded model's."""
    moe_sharding: str | None = None
    """Mixture-of-experts models: "tensor_parallel" or "expert_parallel" experts; None: the planner's choice."""
    fused_projections: bool | None = None
    """Fuse each rank's q/k/v matrices into one and gate/up into one after loading
    (workers/fused_projections.py). None: as compiled_dir was compiled (its graphs are traced
    through the fused or the separate matrices), else off."""
    sequence_parallel: bool = False
    """Prefills (every step of more than one token per row) keep the residual stream split along the
    sequence between blocks: all-gather before attention and the MLP, reduce-scatter after
    (workers/sequence_parallel.py). Same tokens; nothing changes at TP 1 or for decode steps."""
    seq_len: int | None = None
    """KV-cache length per sequence; None sizes it per request (longest prompt + new tokens)."""
    max_batch_size: int = 8
    """Static batches (generate(..., batching="static")): prompts per worker call; more are split.
    The planner counts this many KV cache rows of seq_len beside the serving rows. 0: no static
    batches, continuous batching alone (`corelaunch serve`, `generate`, `check` and `bench` launch so): the
    planner counts the serving rows alone, no static graph is warmed up (warm_up_static is then
    False), and generate(..., batching="static") is refused."""
    max_num_seqs: int | None = None
    """Continuous batching: requests each TP group runs at once (its serving KV cache holds this many
    sequences of seq_len tokens, allocated at start-up; the planner counts it). More wait for a row.
    None: the value compiled_dir was compiled with (its serving graphs are shaped by it: any other
    value builds them all again), else DEFAULT_MAX_NUM_SEQS."""
    max_prefill_tokens: int | None = None
    """Prompt tokens a group prefills per iteration (in chunks), between two decode steps. None: the
    value compiled_dir was compiled with (it shapes the prefill chunks' graphs), else
    DEFAULT_MAX_PREFILL_TOKENS (2048)."""
    burst_wait_s: float = DEFAULT_BURST_WAIT_S
    """Continuous batching: an idle group that receives a request waits this long for the next one
    (again after each, at most workers.serving.burst.BURST_WAIT_CAP times this in all) so that a
    burst of requests is prefilled together. A lone request's first token comes this much later.
    0: no wait."""
    prefix_caching: bool = True
    """Continuous batching: a finished request's cache row keeps its tokens' keys and values, and a
    later prompt that starts with at least 16 of the same tokens (as a finished or a running
    request's) is seated there, or has them copied into its own row, and is prefilled only from
    where they part (workers/serving/prefix_reuse.py). False: every prompt is prefilled whole."""
    max_queued_requests: int | None = None
    """Streaming requests allowed to wait for a row over all this Launcher's replicas (under
    `corelaunch serve`, each Serve replica is a Launcher of its own, so the limit is per Serve
    replica): a request that would wait while this many already do is refused with QueueFull
    (0: only requests that get a row at once). None: no limit."""
    presharded_dir: str | None = None
    """A directory written by shardlib.presharded.save_presharded for this exact layout."""
    compile: bool = True
    """Run each rank through one static-shape compiled graph per bucket (CPU: torch.compile, see
    workers/compiled.py); False runs eagerly at exact shapes (for debugging)."""
    compile_granularity: str | None = None
    """What one compiled graph covers: "layer", "model", "model-decode" or "collective"
    (workers/granularities.py; what each means is in workers/compiled.py); None: the backend's default ("layer")."""
    compiled_dir: str | None = None
    """A directory written by `corelaunch compile`: start from its weights, graphs and settings
    (see launcher/artifacts/compiled_dir.py); options that contradict it are refused."""
    max_context_length: int | None = None
    """Longest prompt (largest context-encoding bucket); None: seq_len. One past seq_len (given, or the
    plan's default) is refused: the buckets stopped at seq_len."""
    context_buckets: tuple[int, ...] | None = None
    """Context-encoding (prefill) lengths; None: powers of two from 128 up to max_context_length."""
    token_buckets: tuple[int, ...] | None = None
    """Token-generation (KV-cache) lengths; None: powers of two from 128 up to seq_len (default: the
    plan's, min(max_position_embeddings, 4096))."""
    warm_up: bool = False
    """Build every bucket's graph while starting (predictable first requests); otherwise each graph
    is built the first time a request needs it."""
    warm_up_static: bool = True
    """With warm_up: build the static batches' graphs too (generate(..., batching="static")), not only
    the serving loop's. `corelaunch generate` and `corelaunch serve`, which run continuous batching
    alone, leave them out: with defaults 48 graphs, the larger prefills among them, never used.
    Always False at max_batch_size 0, where there are no static batches."""
    ray_address: str | None = None
    """None: RAY_ADDRESS, else the cluster `ray start` recorded on this host, else a private local
    one; "local" (always a private one) or "host:port". "auto" is refused (launcher/cluster/ray_cluster.py)."""
    cpus_per_rank: float | None = None
    """CPU backend: CPUs per rank bundle; None divides the cluster's CPUs evenly."""
    placement_timeout_s: float = 60.0
    startup_timeout_s: float = 120.0
    """Starting the rank processes (a Python worker each) and importing their backend, torch with it."""
    rendezvous_timeout_s: float = 30.0
    """Once every rank runs: joining the process group (a rank that never arrives fails here)."""
    load_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    progress: bool = True
    """Print start-up steps on stderr."""

    def __post_init__(self) -> None:
        # flags first: "nope" from a `serve run key=value` argument would read as True
        for name in ("presharded_cache", "pad_q_heads", "sequence_parallel", "compile", "warm_up",
                     "warm_up_static", "progress"):
            _check_flag(name, getattr(self, name))
        if self.fused_projections is not None:  # None: resolved below, with the other recorded settings
            _check_flag("fused_projections", self.fused_projections)
        for name in ("model", "compiled_dir", "presharded_dir", "presharded_cache_dir"):
            _check_path(name, getattr(self, name))
        if self.presharded_cache_dir is not None and not self.presharded_cache:  # it was ignored without a word
            raise ValueError(f"presharded_cache_dir ({str(self.presharded_cache_dir)!r}) is where presharded_cache "
                             f"writes its copy, and presharded_cache is False; pass presharded_cache=True "
                             f"(--presharded-cache), or drop it")
        for name in ("context_buckets", "token_buckets"):
            # each length as a Python int, as the request counts take them: [np.int64(128)] and
            # np.array([128, 256]) were refused with a rule their values met
            given = getattr(self, name)
            if given is not None and not isinstance(given, (str, bytes)) and hasattr(given, "__iter__"):
                setattr(self, name, [_plain_integer(value) for value in given])
        # numpy's and torch's scalars as Python's, as the request counts take them (tp=np.int64(2)
        # was refused with a rule the value met)
        for entry in dataclasses.fields(self):
            value = getattr(self, entry.name)
            if not isinstance(value, (str, bool, list, tuple)):
                setattr(self, entry.name, _plain_number(value))
        self.tp = _positive_or_auto("tp", self.tp)
        if self.backend is not None:
            backend_entry(self.backend)  # ValueError naming the known backends
        if self.instance is not None and (not isinstance(self.instance, str) or self.instance not in INSTANCE_NAMES):
            raise ValueError(f"instance ({self.instance!r}) must be one of {', '.join(INSTANCE_NAMES)}, or None "
                             f"for this host")
        g = self.device_memory_gib
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not finite(g) or g <= 0):
            raise ValueError(f"device_memory_gib ({g!r}) must be a positive number (GiB of one device)")
        if self.kv_strategy is not None and self.kv_strategy not in KV_STRATEGIES:
            raise ValueError(f"kv_strategy ({self.kv_strategy!r}) must be one of {', '.join(KV_STRATEGIES)}, or "
                             f"None for the planner's choice")
        if self.lnc is not None and (isinstance(self.lnc, bool) or not isinstance(self.lnc, int) or self.lnc not in (1, 2)):
            raise ValueError(f"lnc ({self.lnc!r}) must be 1 or 2 (logical NeuronCore config), or None for the "
                             f"instance's default")
        if self.compile_granularity is not None:
            if self.compile_granularity not in GRANULARITIES:
                raise ValueError(f"compile_granularity ({self.compile_granularity!r}) must be one of "
                                 f"{', '.join(GRANULARITIES)}")
            if not self.compile:
                raise ValueError(f"compile_granularity ({self.compile_granularity!r}) applies to compiled graphs "
                                 f"and compile is False (--no-compile): drop one of them")
        if self.presharded_cache and (self.presharded_dir is not None or self.compiled_dir is not None):
            given = "compiled_dir" if self.compiled_dir is not None else "presharded_dir"
            raise ValueError(f"presharded_cache (True) writes a pre-sharded copy of the checkpoint for later loads, "
                             f"and {given} ({getattr(self, given)!r}) already loads pre-sharded weights: drop one "
                             f"of them")  # it was ignored without a word
        if not self.compile:  # settings of the compiled graphs alone, which an eager run never reads
            if self.warm_up:
                raise ValueError("warm_up (True) builds every compiled graph while starting, and compile is False "
                                 "(--no-compile), which runs eagerly and builds none: drop one of them")
            if self.max_context_length is not None and self.context_buckets is None and self.token_buckets is None:
                raise ValueError(f"max_context_length ({self.max_context_length!r}) sets the largest context-encoding "
                                 f"bucket, and compile is False (--no-compile) with no bucket list, which runs each "
                                 f"prompt at its exact length: drop one of them, or give a bucket list "
                                 f"(context_buckets, token_buckets) to run eagerly at bucket lengths")
        positive_int("nodes", self.nodes)
        check_moe_sharding_name(self.moe_sharding)
        self.replicas = _positive_or_auto("replicas", self.replicas)
        RestartPolicy(self.max_restarts, self.restart_window_s)  # checks both, as every replica will
        _positive_seconds("health_check_interval_s", self.health_check_interval_s)
        _check_max_batch_size(self.max_batch_size)
        if self.max_batch_size == 0:  # no static batch runs: its graphs would be built and never used
            self.warm_up_static = False
        # Settings that shape a compiled directory's graphs: left out, the directory's own values
        # (any other builds those graphs again), else the defaults.
        from launcher.artifacts.compiled_dir import recorded_settings

        recorded = recorded_settings(self.compiled_dir)
        if self.fused_projections is None:
            self.fused_projections = recorded.get("fused_projections", False)
        if self.max_num_seqs is None:
            self.max_num_seqs = recorded.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_prefill_tokens is None:
            self.max_prefill_tokens = recorded.get("max_prefill_tokens", DEFAULT_MAX_PREFILL_TOKENS)
        positive_int("max_prefill_tokens", self.max_prefill_tokens)
        if (isinstance(self.burst_wait_s, bool) or not isinstance(self.burst_wait_s, (int, float))
                or not 0 <= self.burst_wait_s <= MAX_BURST_WAIT_S):
            raise ValueError(f"burst_wait_s ({self.burst_wait_s!r}) must be between 0 and {MAX_BURST_WAIT_S:g} "
                             f"seconds (0: prefill a request the moment it arrives)")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching ({self.prefix_caching!r}) must be True or False")
        if self.max_queued_requests is not None and (isinstance(self.max_queued_requests, bool) or not isinstance(
                self.max_queued_requests, int) or not 0 <= self.max_queued_requests <= MAX_QUEUED_REQUESTS):
            # the bound: Ray Serve refuses a replica's max_ongoing_requests past a 32-bit integer, after it started
            raise ValueError(f"max_queued_requests ({self.max_queued_requests!r}) must be an integer from 0 to "
                             f"{MAX_QUEUED_REQUESTS}, or None for no limit")
        if self.seq_len is not None and (isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int)
                                         or self.seq_len < 2):
            raise ValueError(f"seq_len ({self.seq_len!r}) must be an integer of at least 2 (positions per sequence)")
        if self.max_context_length is not None:
            positive_int("max_context_length", self.max_context_length)
        c = self.cpus_per_rank
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not finite(c)
                              or c < MIN_CPUS_PER_RANK):
            raise ValueError(f"cpus_per_rank ({c!r}) must be a finite number of CPUs of at least {MIN_CPUS_PER_RANK:g} "
                             f"(Ray's resource precision), or None to share the node's CPUs among the ranks")
        if self.dtype is not None:
            self.dtype = normalize_dtype(self.dtype)
        if kv_dtype_name(self.kv_cache_dtype) is not None:  # ValueError naming the choices
            # the one spelling the ranks and compiled directories take: "float8_e4m3" and "F8E4M3"
            # passed this check, were planned as an fp8 cache, and failed each rank's load
            self.kv_cache_dtype = "f8e4m3"
        for name in ("placement_timeout_s", "startup_timeout_s", "rendezvous_timeout_s", "load_timeout_s",
                     "request_timeout_s"):
            _positive_seconds(name, getattr(self, name))
        from workers.serving.burst import BURST_WAIT_CAP

        gather_s = BURST_WAIT_CAP * self.burst_wait_s
        if gather_s >= self.rendezvous_timeout_s:
            # An idle leader gathering a burst keeps its followers waiting in a collective that
            # long, and a follower's collectives give up after the rendezvous timeout (and a margin).
            raise ValueError(f"burst_wait_s ({self.burst_wait_s:g}) gathers a burst for up to {gather_s:g} s "
                             f"({BURST_WAIT_CAP} waits), which reaches rendezvous_timeout_s "
                             f"({self.rendezvous_timeout_s:g}), the time a follower rank's collective waits for "
                             f"the leader's next plan; lower burst_wait_s or raise rendezvous_timeout_s")
        if self.ray_address is not None:
            from launcher.cluster.ray_cluster import malformed_address

            if not isinstance(self.ray_address, str):
                raise ValueError(f"ray_address ({self.ray_address!r}) must be a string")
            if (malformed := malformed_address(self.ray_address)) is not None:
                raise ValueError(malformed)
        if self.ray_address == "auto":
            raise ValueError("ray_address 'auto' joins any Ray found running on this host, another user's private "
                             "cluster included; pass host:port (or set RAY_ADDRESS), start one with `ray start "
                             "--head` and omit the address, or pass 'local' for a private one")
        if self.presharded_dir is not None and not Path(self.presharded_dir).is_dir():
            _not_a_directory(self.presharded_dir, "pre-sharded directory",
                             "write it with shardlib.presharded.save_presharded (or use a compiled directory's "
                             "weights/), or drop --presharded")
        for name in ("context_buckets", "token_buckets"):
            if getattr(self, name) is not None:
                from shardlib.buckets import normalize_buckets

                what = {"context_buckets": "context-encoding", "token_buckets": "token-generation"}[name]
                try:
                    setattr(self, name, normalize_buckets(getattr(self, name), what))
                except ValueError as err:  # "token-generation bucket 0 ..." named neither field nor option
                    given = getattr(self, name)
                    shown = _listed(given) if isinstance(given, (list, tuple)) else show(given)
                    raise ValueError(f"{name} ({shown}): {err}") from None
        # Each refusal leads with the list (the CLI names it by the option that gave it: --buckets,
        # --context-buckets or --token-buckets) and names the other fields as fields (their options there).
        if (self.context_buckets is not None and self.max_context_length is not None
                and self.context_buckets[-1] > self.max_context_length):  # the list won, silently
            raise ValueError(f"context_buckets ({_listed(self.context_buckets)}): the largest, "
                             f"{self.context_buckets[-1]}, exceeds max_context_length ({self.max_context_length}), "
                             f"the longest prompt taken; lower the bucket or raise max_context_length, or give only "
                             f"one of them")
        if (self.max_context_length is not None and self.seq_len is not None
                and self.max_context_length > self.seq_len):  # the buckets stopped at seq_len, silently
            raise ValueError(f"max_context_length ({self.max_context_length}) exceeds seq_len ({self.seq_len}), the "
                             f"most positions a sequence holds, its prompt included: lower max_context_length or "
                             f"raise seq_len")
        if self.token_buckets is not None:  # the largest token bucket is each KV cache row's length
            listed, largest = _listed(self.token_buckets), self.token_buckets[-1]
            if self.seq_len is None:
                if largest < 2:  # named here: the seq_len it becomes was never given
                    raise ValueError(f"token_buckets ({listed}): the largest is each sequence's positions "
                                     f"(seq_len) and must be at least 2, a prompt token and a new one")
                self.seq_len = largest  # so the planner sizes the cache the buckets make
            elif largest > self.seq_len:
                raise ValueError(f"token_buckets ({listed}): the largest, {largest}, exceeds seq_len "
                                 f"({self.seq_len}), the positions the planner sizes each KV cache row for; lower "
                                 f"the bucket or raise seq_len to {largest}")
            elif largest < self.seq_len:  # the rows were the bucket's: seq_len was dropped
                raise ValueError(f"token_buckets ({listed}): the largest, {largest}, is below seq_len "
                                 f"({self.seq_len}), and it is each KV cache row's length: positions past it are "
                                 f"never used, and a compiled directory records the bucket; raise the largest "
                                 f"token bucket to {self.seq_len}, lower seq_len to {largest}, or give only one "
                                 f"of them")
        if self.compiled_dir is not None and not Path(self.compiled_dir).is_dir():
            _not_a_directory(self.compiled_dir, "compiled-model directory",
                             "write one with `corelaunch compile --out DIR`")
        if self.compiled_dir is not None:
            from launcher.artifacts.compiled_dir import refuse_unusable_cache

            refuse_unusable_cache(self.compiled_dir)
        if self.model is not None and not Path(self.model).exists():
            from shardlib.model_path_hints import missing_model_hint

            raise FileNotFoundError(
                f"model path {self.model} does not exist; pass a Hugging Face model directory, or "
                f"pass no model for the built-in SmolLM2-135M-Instruct{missing_model_hint(self.model)}"
            )
        if self.model is not None and not Path(self.model).is_dir():
            from shardlib.model_path_hints import file_given_for_directory

            raise ValueError(file_given_for_directory(self.model))


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):  # "no" would read as True
        raise ValueError(f"{name} ({value!r}) must be True or False")


def _not_a_directory(path: str, what: str, fix: str):
    """Raise for a directory option naming something else: FileNotFoundError when nothing is there,
    ValueError when it is a file (the "does not exist" message was wrong for one)."""
    if Path(path).exists():
        raise ValueError(f"{what} {path} is a file, not a directory; pass the directory itself, or {fix}")
    if Path(path).is_symlink():  # `corelaunch compile` leaves a link to a hidden version beside it
        raise FileNotFoundError(f"{what} {path} is a link to {os.readlink(path)}, which does not exist (copied "
                                f"without what it points to: copy with `cp -rL`); {fix}")
    raise FileNotFoundError(f"{what} {path} does not exist; {fix}")


def _check_path(name: str, value) -> None:
    """None, or a non-empty path (an empty one is the current directory, which passed every check)."""
    if value is None:
        return
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"{name} ({value!r}) must be a non-empty path, or None (left out)")


def _check_batching(batching) -> None:
    if batching not in ("continuous", "static"):
        raise ValueError(f"batching ({batching!r}) must be 'continuous' or 'static'")


def _check_max_batch_size(value) -> None:
    """0 or a positive integer (0: no static batches, whose KV rows the planner then leaves out)."""
    if not is_non_negative_int(value):
        raise ValueError(f"max_batch_size ({value!r}) must be an integer >= 0 (prompts per static batch; 0: no "
                         f"static batches, continuous batching alone)")


def _refuse_static_without_rows(batching: str, max_batch_size: int) -> None:
    """A static batch at max_batch_size 0: the planner counted no KV rows for it, so it is refused at
    the call, before any worker allocates a cache the memory check never saw."""
    if batching == "static" and max_batch_size == 0:
        raise ValueError("batching='static' runs batches of at most max_batch_size prompts, and this launch's "
                         "max_batch_size is 0 (no static batches: continuous batching alone, and the planner counted "
                         "no KV cache rows for them); leave batching at its default ('continuous'), or launch with "
                         "max_batch_size 1 or more")


def _listed(buckets) -> str:
    """A bucket list as its option takes it (64,128)."""
    return ",".join(map(str, buckets))


def refuse_non_utf8_prompts(prompts: Sequence[str]) -> None:
    """ValueError naming the first prompt that is not UTF-8 text (a command-line argument in another
    encoding reaches Python with surrogates, on which the tokenizer fails with a TypeError)."""
    for i, text in enumerate(prompts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"prompt {i} is not valid UTF-8 text ({text!r}: {err.reason} at position "
                             f"{err.start}); pass UTF-8 text") from None


@contextlib.contextmanager
def _in_one_prompts_words():
    """A refusal of a call that takes one prompt (stream, astream) without an index: the checks it
    shares with generate number their prompts ("prompt 0 is empty"), an index its caller never gave
    (the length checks leave it out for one prompt already)."""
    try:
        yield
    except ValueError as err:
        numbered = str(err)
        if not numbered.startswith("prompt 0 "):
            raise
        raise ValueError("the prompt " + numbered.removeprefix("prompt 0 ")) from None


def _token_id_list(prompt) -> list[int] | None:
    """A prompt given as token ids, as a list of ints: any sized sequence of integers (a list, a
    tuple, a range, a 1-D numpy array or torch tensor, an array.array, ...), not of bools; None for
    anything else (text, bytes, a mapping or a set, whose order is not the prompt's)."""
    if isinstance(prompt, (str, bytes, bytearray, Mapping, AbstractSet)) or not hasattr(prompt, "__len__"):
        return None
    if getattr(prompt, "ndim", 1) != 1:
        return None
    if not all(map(is_token_index, prompt)):
        return None
    return [operator.index(t) for t in prompt]


WATCHDOG_GRACE_S = 30.0
"""A static generate() gives up on its batches after every timeout and restart it allows, plus this."""
INTERRUPT_GRACE_S = 1.0
"""After Ctrl-C, how long the groups get to stop cleanly before they are killed."""
CACHE_WRITE_WAIT_S = 600.0
"""How long shutdown() waits for a --presharded-cache copy still being written."""
HURRIED_CACHE_WAIT_S = 30.0
"""The same after Ctrl-C or at exit: the user is waiting."""
START_STOP_WAIT_S = 120.0
"""How long shutdown() from another thread waits for a start() in progress to stop (it stops at its
next step: planning, connecting to Ray and loading are not cut short)."""


def _presharded_version_now(config) -> str | None:
    """The version a --presharded directory written by save_presharded (a link to a hidden
    versioned sibling) names now, or the version itself when given one (a Serve replica, handed
    the pin its server made); None for a plain directory, or a compiled directory's weights."""
    if config.presharded_dir is None or config.compiled_dir is not None:
        return None
    from shardlib.atomic_dir import current_version, is_version

    version = current_version(config.presharded_dir)
    if version is not None:
        return str(version)
    return config.presharded_dir if is_version(config.presharded_dir) else None


RANK_PATH_FIELDS = ("model_dir", "presharded_dir", "compile_cache_dir", "progress_file")
"""The LoadSpec fields a rank opens as paths."""


def _with_absolute_paths(spec):
    """`spec` with the paths a rank opens made absolute against this process's working directory.
    A rank runs in its raylet's directory: on a cluster joined with --ray-address (or started by
    `ray start` elsewhere), a relative --model or --out named nothing there ("... is not a
    pre-sharded checkpoint"). os.path.abspath, not resolve(): a pinned version keeps the name it
    was pinned by (the link's target is not followed)."""
    absolute = {name: os.path.abspath(getattr(spec, name)) for name in RANK_PATH_FIELDS if getattr(spec, name)}
    return dataclasses.replace(spec, **absolute)


def static_watchdog_s(cfg: LaunchConfig, parts: int) -> float:
    """How long a static generate() waits for its `parts` batches: a watchdog, not the request
    timeout (the replicas enforce that, per attempt). Every part could wait for all the others, and
    each restart (every one the policy allows) may take each of a new group's waits before the part
    runs again: placement, start-up, rendezvous, the load and the serving loop's preparation (each up
    to the load timeout), then the request. With only the load and request timeouts a restart, it
    gave up (RequestTimeout) while a replica was still restarting within its timeouts."""
    restart_s = (cfg.placement_timeout_s + cfg.startup_timeout_s + cfg.rendezvous_timeout_s
                 + 2 * cfg.load_timeout_s + cfg.request_timeout_s)
    return (cfg.request_timeout_s + cfg.load_timeout_s) * parts + restart_s * cfg.max_restarts + WATCHDOG_GRACE_S


@contextlib.contextmanager
def _second_interrupt_held():
    """SIGINT ignored inside the block (where the calling thread can set handlers: the main thread),
    then the handler before it restored; SIGTERM too where the CLI raises it as an interrupt (a
    `timeout` or `kill` repeated while the ranks stop)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from launcher import termination

    term_too = termination.installed()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    if term_too:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        # None: a handler not set from Python, which cannot be put back; Python's own then
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
        if term_too:
            termination.reinstall()


MIN_CPUS_PER_RANK = 0.0001
"""Ray counts resources in units of 1e-4: a smaller share cannot be asked for."""


MAX_TIMEOUT_S = 1_000_000
"""The longest timeout taken (about 11.6 days). Waits take their timeout as a platform time: Python's
own lock and queue waits refuse or overflow from about 1e10 s, and only after the model has loaded."""


def _plain_integer(value):
    """An integer of any kind (np.int64, a 0-d torch integer) as a Python int, as prompts take them;
    anything else as it is, for the checks to name."""
    number = integer_of_any_kind(value)
    return value if number is None else number


def _checked_logprobs(name: str, value):
    """value (None, or how many most likely tokens to list: 0..MAX_LOGPROBS); ValueError naming it."""
    from workers.serving.requests import MAX_LOGPROBS

    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
        raise ValueError(f"{name} ({value!r}) must be an integer from 0 to {MAX_LOGPROBS}, or None")
    return value


def _checked_cache_salt(value):
    """value (None, or a non-empty str: prefix caching shares cached prefixes only between requests of
    the same salt); ValueError naming it."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"cache_salt ({value!r}) must be a non-empty string; leave it out to share prefixes "
                         f"with every unsalted request")
    return value


def _checked_stream_interval(value):
    """value (tokens a stream's deltas gather: an int of at least 1); ValueError naming it."""
    value = _plain_integer(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"stream_interval ({value!r}) must be an integer of at least 1 (1: every token as it is "
                         f"generated; n: the first token at once, then n at a time)")
    return value


def _plain_number(value):
    """An integer or a real number of any kind (np.int64, np.float32, a 0-d torch tensor) as Python's
    int or float; anything else (None, strings, bools of any kind) as it is, for the checks to name."""
    number = real_of_any_kind(value)
    return value if number is None else number


def _per_request_options(options: dict) -> str | None:
    """Why LaunchConfig refused `options` with a TypeError where they hold per-request options
    (Launcher(max_new_tokens=5) ended in that bare TypeError): where each goes, a request method's
    own parameter (read from their signatures) or a SamplingParams field; None for other keywords."""
    import inspect

    from shardlib.sampling_params import SamplingParams

    sampling = {f.name for f in dataclasses.fields(SamplingParams)}
    launch_fields = {f.name for f in dataclasses.fields(LaunchConfig)}  # a launch option is never refused here
    methods = ("generate", "stream", "agenerate", "astream")
    taken_by = {name: [m for m in methods if name in inspect.signature(getattr(Launcher, m)).parameters]
                for name in options if name not in ("prompts", "prompt", "sampling", *launch_fields)}
    places = [f"{name}: SamplingParams({name}=...)" if name in sampling
              else f"{name}: {' / '.join(m + '()' for m in taken)}"
              for name, taken in taken_by.items() if name in sampling or taken]
    if not places:
        return None
    return (f"per-request option{'s' if len(places) > 1 else ''} given to Launcher(...), which takes launch "
            f"options only; give {'each' if len(places) > 1 else 'it'} to the request: {'; '.join(places)}")


def _launch_config(options: dict) -> "LaunchConfig":
    """LaunchConfig(**options), per-request options among them named with where they go (read only
    once the keywords were refused: a working launch never reads the methods' signatures)."""
    try:
        return LaunchConfig(**options)
    except TypeError:
        problem = _per_request_options(options)
        if problem is None:
            raise
    raise ValueError(problem)


def _positive_seconds(name: str, value) -> None:
    """ValueError unless value is a positive number of seconds up to MAX_TIMEOUT_S (nan would switch
    a deadline off, a huge value overflow the first wait that uses it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value) or value <= 0:
        raise ValueError(f"{name} ({value!r}) must be a finite positive number of seconds")
    if value > MAX_TIMEOUT_S:
        raise ValueError(f"{name} ({value!r}) must be at most {MAX_TIMEOUT_S} seconds (about 11.6 days)")


def _positive_or_auto(name: str, value: int | str) -> int | str:
    """A positive int (digits accepted: the CLI passes text) or "auto"; ValueError naming the value."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if value != "auto" and not is_positive_int(value):
        raise ValueError(f"{name} ({value!r}) must be a positive integer or 'auto'")
    return value


@dataclass
class GenerationResult:
    prompt: str | None
    """The prompt text (None when token ids were given)."""
    text: str | None
    """Decoded generated text (None without a tokenizer)."""
    token_ids: list[int]
    """Generated token ids only."""
    finish_reason: str
    """"stop" (EOS or a stop token) or "length" (max_new_tokens reached)."""
    prompt_tokens: int
    time_to_first_token_s: float
    decode_tokens_per_s: float
    decode_step_latencies_s: list[float]
    """Wall time between consecutive generated tokens, measured inside rank 0: in a static batch each
    decode step (forward and sampling); with continuous batching the gap between this request's
    tokens (a whole serving step: planning, the forwards of every row and prefill chunk it held, and
    token choice)."""
    logits: object = None
    """With return_logits: a (len(token_ids), vocab) float32 tensor of the logits each token came from."""
    replica: int = 0
    """Index of the replica that answered."""
    attempts: int = 1
    """1, or more when the request was re-run after its TP group failed and was restarted."""
    token_times_s: list[float] = field(default_factory=list)
    """Rank 0's time.perf_counter() when each generated token was chosen: comparable between the
    results one replica answered within one attempt (bench picks the steps in which a whole batch
    decoded by them); a request resumed after a restart continues on the new rank 0's clock, and its
    decode rate and step latencies leave the gap across the restart out."""

    prompt_logprobs: list | None = None
    """With prompt_logprobs: a workers.serving.requests.TokenLogprob per prompt token but the first
    (token_id, logprob given the tokens before it, top: the n most likely (id, logprob) there)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens not prefilled, because the cache held them: in the request's row, or copied into
    it from another (prefix caching, continuous batching; LaunchConfig.prefix_caching)."""
    stop_reason: str | int | None = None
    """What ended a "stop" (the OpenAI routes' stop_reason): the stop string that matched, or the stop
    token id that ended the answer (one of stop_token_ids, or an end token of the model's configs other
    than the tokenizer's EOS, or that EOS under ignore_eos where stop_token_ids names it); None for the
    tokenizer's EOS (config.json's first without a tokenizer) and for "length"."""
    resumed_at: list[int] = field(default_factory=list)
    """Continuous batching: the index (in token_ids and token_times_s) of the first token of each
    attempt resumed after a restart; the gap ending at one spans the restart and two rank 0s' clocks
    (empty without a restart, and for a static batch, whose re-run starts over)."""
    submitted_at_s: float | None = None
    """Continuous batching: the driver's time.monotonic() at the request's submission (what
    time_to_first_token_s counts from), comparable between one process's results: a batch's
    context encoding runs from its earliest submission to its latest first token. None for a static
    batch."""

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("logits")
        return out


STRUCTURES_REMEMBERED = 256
"""Structured outputs whose check Launcher remembers (all forgotten at once past this many)."""

BAD_WORD_LISTS_REMEMBERED = 64
BAD_WORD_IDS_REMEMBERED = 1 << 20
"""bad_words lists whose token sequences Launcher remembers, and their token ids in all (all
forgotten at once past either): 128 words of 200 characters gave 9,500 ids (0.4 MB) in plain
English, and 67,000 (1.4 MB) in characters of four UTF-8 bytes; a list of at most 128 x 2 x 800
fits the id bound, which keeps the cache near 25 MB where 64 such lists took 90."""

class Launcher:
    """Serves one model on one or more TP groups (replicas); use as a context manager or call
    start()/shutdown(). generate() may be called from several threads at once: each call's prompts
    are split over the replicas and its parts run in parallel (see launcher/cluster/replica_pool.py)."""

    def __init__(self, config: LaunchConfig | None = None, **options):
        if config is not None and not isinstance(config, LaunchConfig):  # Launcher("/models/x"): the model path
            raise ValueError(f"config ({show(config)}) must be a LaunchConfig or None; pass options as keywords, "
                             f"e.g. Launcher(model=...)")
        if config is not None and options:
            raise ValueError("pass either a LaunchConfig or keyword options, not both")
        # A copy checked again: a field set after the config was built (cfg.compile = "false") skipped
        # every check. __post_init__ takes its own output unchanged (prepare()'s replace() relies on it too).
        self.config = dataclasses.replace(config) if config is not None else _launch_config(options)
        self.plan = None
        self.model_config: ModelConfig | None = None
        self.model_dir: Path | None = None
        self.tokenizer = None
        """The checkpoint's tokenizer once start() (or check_prompts()) has returned; None without one."""
        self._grammars = self._grammars_for = None
        """_grammar_tokenizer()'s llguidance tokenizer, and the tokenizer it was built from."""
        self._structures_checked: dict = {}
        """_check_structured's verdicts by StructuredOutput: (None where usable, else why not; its first
        step's mask), so a request's n choices and a client repeating its schema do not compile it
        again on the caller's thread."""
        self._bad_words_tokenized: dict[tuple[str, ...], tuple[tuple[int, ...], ...]] = {}
        """_bad_word_sequences' results by bad_words: the OpenAI routes open one stream per choice, each
        filling its own params, so a request of n choices tokenized its words n times on the event loop
        (128 long words: about 0.1 s each), and a client repeating its list tokenized it again."""
        self._generation_eos: tuple[int, ...] = ()
        self._tokenizer_load: BackgroundLoad | None = None
        self._tokenizer_retry = False
        """The last load failed, and its error was raised: the next prepare() starts another."""
        self._tokenizer_taken = threading.Lock()
        """Held while a waiter sets self.tokenizer from the load and lets go of it (_await_tokenizer)."""
        self._host_holds: int | None = None
        self.load_stats: list = []
        self.timings: dict[str, float] = {}
        self.backend: str | None = None
        self.replicas = 0
        """Number of replicas started (replicas="auto" resolves to the count that fit)."""
        self.thread_count_note: str | None = None
        """Set at start when the compiled directory's graphs were built for another thread count per rank."""
        self._pool = None
        self._cache_writer = None
        self._cache_path = None
        """Where the --presharded-cache copy is read and written; None when it is not (off, or untrusted)."""
        self._cache_rewrite = False
        """The copy's load failed (damaged in place): written again even though it looks complete."""
        self._cache_lock = threading.Lock()
        self._version_hold: int | None = None
        """The lock on the compiled directory's (or --presharded link's) version this launch runs
        (atomic_dir.hold_version)."""
        self._cache_holds: dict[str, int] = {}
        """The locks on the --presharded-cache copy's versions this launch's groups load, one a version
        (restarts on several threads may pin at once), all kept until shutdown (_pin_cache_version)."""
        self._presharded_version: str | None = None
        """The version a --presharded link named when prepare() checked it, which every rank and
        restart loads (None: no link, or a compiled directory's weights, pinned with it)."""
        self._lock = threading.Lock()  # tokenizers are not safe to share between threads
        self._tokenizer_wanted = threading.Event()
        """Set by a caller that found self._lock taken: the holder yields once it lets go (_encode)."""
        self._starting = threading.Lock()
        self._start_thread: threading.Thread | None = None
        """The thread inside start() now (None when none is): a shutdown from another thread leaves
        it Ray's connection to close once it has stopped."""
        self._shutting_down = threading.Lock()
        self._stops = 0
        """shutdown() calls so far; a start() that sees more than when it was called (one still
        connecting to Ray, before there is a pool for shutdown() to stop, or one waiting for another
        start) stops there instead of bringing the groups up."""
        self._stops_at_start = 0
        self._ray = None
        self._progress = Progress(self.config.progress)
        self.buckets = None
        """The shapes the workers run at (compiled, or eager with buckets); None: exact shapes."""

    # ---- life cycle --------------------------------------------------------------------------
    def __enter__(self) -> "Launcher":
        self.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._shutdown_after(exc_type)

    def _shutdown_after(self, exc_type: type[BaseException] | None) -> None:
        """shutdown() for a block (or a start cut short, whose __exit__ never runs) ended by exc_type:
        after Ctrl-C or SIGTERM a short grace with a second signal held, else the usual one."""
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            # Ctrl-C (or the CLI's SIGTERM, raised as one): the user is waiting; whatever still runs
            # is killed after a short grace. A second Ctrl-C then cut the shutdown short, and Ray's
            # agents (and once a rank) outlived the command by minutes: it waits for the shutdown's
            # few seconds instead.
            with _second_interrupt_held():
                self.shutdown(grace_s=INTERRUPT_GRACE_S)
        else:
            self.shutdown(grace_s=10.0)

    def start(self) -> "Launcher":
        """Plan (refusing impossible layouts before any process), place, rendezvous, load. A launcher
        already running is returned as it is (`with Launcher(...).start() as llm` starts once): a
        second start placed a second set of groups beside the first and lost track of the first."""
        stops_when_called = self._stops  # before the lock: a shutdown while this start waits for it counts
        with self._starting:  # two threads starting at once would each place a set of groups
            if self._pool is not None:
                return self
            self._stops_at_start = stops_when_called
            self._start_thread = threading.current_thread()
            try:
                self._start_under_lock()
            finally:
                self._start_thread = None
            return self

    def _start_under_lock(self) -> None:
        start = time.perf_counter()
        self.prepare()
        self._hold_pinned_version()  # each start: after a shutdown too (prepare() plans once)
        try:
            self._start_group(self.backend)
            self._await_tokenizer()  # it loaded while the group started (check_prompts may have taken it)
            self._unless_stop_asked()
        except BaseException as err:
            stop_asked = self._stops != self._stops_at_start
            self._shutdown_after(type(err))  # as __exit__ does, which a failed __enter__ never reaches
            if stop_asked and not isinstance(err, (LaunchError, KeyboardInterrupt)):
                raise LaunchError("the launcher was shut down while it started; nothing is left running") from err
            raise
        self.timings["startup_s"] = time.perf_counter() - start
        # After ray.init registered Ray's own exit hook, so this one runs first (atexit is LIFO)
        atexit.register(self._shutdown_at_exit)

    def _shutdown_at_exit(self) -> None:
        """A program that ends without shutdown(): its groups stop before Ray's own exit hook
        disconnects it. Afterwards, the replicas' threads calling Ray made the program exit 1 whatever
        its code, and Ray's agents outlived it by a minute or more."""
        try:
            self.shutdown(grace_s=INTERRUPT_GRACE_S)
        except Exception as err:  # noqa: BLE001 - the program is ending: say why, do not mask its exit
            print(f"corelaunch: shutting down at exit failed: {type(err).__name__}: {err}", file=sys.stderr)

    def prepare(self) -> "Launcher":
        """Everything before Ray: the plan (refusing impossible layouts) and the shapes the workers
        will run at; the driver's tokenizer starts loading on a thread, and is waited for by
        check_prompts() or at the end of start(), so that without prompts to check first it loads
        while Ray starts and the ranks load. start() calls it, once. Call check_prompts() first to
        check requests before anything is started."""
        if self.plan is not None:
            if self._tokenizer_retry:
                self._load_tokenizer()
            return self
        from launcher.artifacts.compiled_dir import load_spec_fields
        from launcher.launch_plan import plan_launch, with_artifact_settings

        linked = _presharded_version_now(self.config)
        self.config = with_artifact_settings(self.config)  # a compiled directory's or pre-sharded copy's
        planned = plan_launch(self.config, self._progress)
        self._pin_presharded_version(linked)
        self.model_dir, self.model_config = planned.model_dir, planned.model_config
        self._generation_eos = generation_eos_ids(self.model_dir)  # before Ray: a bad file is named now
        self.backend = planned.backend
        self._host_holds = planned.host_holds
        self.buckets = load_spec_fields(self.config, planned.plan, self.model_config)["buckets"]
        self._load_tokenizer()
        self.plan = planned.plan
        return self

    def _pin_presharded_version(self, checked: str | None) -> None:
        """Every rank and every restart loads the --presharded version prepare() checked (`checked`,
        read before the checks), not whatever a later save_presharded into the same directory
        switched the link to: a restarted group silently served other weights than the rest."""
        if checked is None:
            return
        now = _presharded_version_now(self.config)
        if now != checked:
            raise LaunchError(f"the pre-sharded checkpoint {self.config.presharded_dir} was written again while this "
                              f"launch checked it; create a new Launcher (or run the command again)")
        self._presharded_version = checked
        self.config = dataclasses.replace(self.config, presharded_dir=checked)

    def _hold_pinned_version(self) -> None:
        """The version prepare() pinned (a compiled directory's, or a --presharded link's) stays while
        this launch runs: a compile or save_presharded into the same directory leaves it
        (shardlib.atomic_dir.in_use) until shutdown(). Taken at start(), not at prepare(): a Launcher
        only prepared (check_prompts refusing a prompt, then dropped) kept it for the life of the
        process. A write that finished between the two has removed the version: said."""
        pinned = self.config.compiled_dir or self._presharded_version
        if pinned and self._version_hold is None:
            from shardlib.atomic_dir import hold_version

            self._version_hold = hold_version(pinned)
            if self._version_hold is None and not Path(pinned).is_dir():
                whose, writer = (("compiled directory's", "a `corelaunch compile` into the same --out")
                                 if self.config.compiled_dir else
                                 ("pre-sharded checkpoint's", "a save_presharded into the same directory"))
                raise LaunchError(f"the {whose} version {pinned} this launch pinned was removed before it started "
                                  f"({writer} finished meanwhile); create a new Launcher (or run the command "
                                  f"again), which pins the version there now")

    def _release_version_hold(self) -> None:
        """Let go of every version this launch holds: its pinned directory's and the cache copy's."""
        with self._cache_lock:  # two shutdowns at once: one closes it (a second close could hit a reused fd)
            hold, self._version_hold = self._version_hold, None
            holds = [hold, *self._cache_holds.values()]
            self._cache_holds = {}
        for fd in holds:
            if fd is not None:
                os.close(fd)

    def _release_cache_hold(self, version: Path) -> None:
        """Let go of one cache version found unusable (a later sweep may remove it)."""
        with self._cache_lock:
            hold = self._cache_holds.pop(str(version), None)
        if hold is not None:
            os.close(hold)

    def _load_tokenizer(self) -> None:
        self._tokenizer_retry = False
        self._tokenizer_load = BackgroundLoad(load_tokenizer, self.model_dir, name="corelaunch-tokenizer")

    def _await_tokenizer(self) -> None:
        """self.tokenizer from the load prepare() started (its error, if it failed). Every caller
        waits for the load (start()'s own wait and check_prompts() on other threads): the first to
        take it used to clear it, and another then returned at once without a tokenizer, and its text
        prompt was refused for "no tokenizer files". The load is let go of once its result is in."""
        load = self._tokenizer_load
        if load is None:
            return
        try:
            with self._progress.spinner("loading tokenizer"):
                tokenizer = load.result()
        except BaseException:
            if load.failed():  # the load's own error (not this waiter's interrupt): every waiter raises it
                with self._tokenizer_taken:
                    if self._tokenizer_load is load:
                        # Loaded again by the next prepare() (start(), check_prompts()): the files may
                        # have been repaired meanwhile. A launcher started again without it ran on token
                        # ids alone, and said the model had no tokenizer files.
                        self._tokenizer_load, self._tokenizer_retry = None, True
            raise
        with self._tokenizer_taken:
            if self._tokenizer_load is not load:
                return  # another waiter took it first (and set self.tokenizer before letting go)
            self.tokenizer = tokenizer  # before the load is let go: _tokenize reads the two without the lock
            self._tokenizer_load = None
        self._progress.done("loading tokenizer", load.elapsed_s)

    def check_prompts(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                      sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                      max_new_tokens: int = 64, batching: str = "continuous", stop_token_ids: Sequence[int] = (),
                      ignore_eos: bool = False, return_logits: bool = False) -> None:
        """What generate() checks before any worker call, without starting anything (prepare()
        runs first): prompts tokenized with the driver's tokenizer, none empty or past the context
        (serving_seq_len, on either engine: _check_lengths) and buckets, the sampling
        parameters, max_new_tokens, stop_token_ids and the two flags. ValueError naming the value."""
        max_new_tokens = _plain_integer(max_new_tokens)
        _check_batching(batching)
        _refuse_static_without_rows(batching, self.config.max_batch_size)
        _check_flag("ignore_eos", ignore_eos)
        _check_flag("return_logits", return_logits)
        self.prepare()
        self._await_tokenizer()
        _, token_lists = self._tokenize(prompts)
        params = self._with_bad_word_ids(self._sampling_per_prompt(sampling, len(token_lists)))
        check_request(token_lists, params, max_new_tokens, self.model_config.vocab_size)
        stop_token_ids = check_stop_token_ids(stop_token_ids, self.model_config.vocab_size)
        ending = self._ending_ids(stop_token_ids, ignore_eos)
        self._check_first_tokens(params, self._check_structured(params, batching), ending)
        self._check_lengths(token_lists, max_new_tokens)
        # allowed_token_ids that are all stop ids min_tokens holds back, or one-token bad words: generate
        # refused them only once the cluster had started and loaded
        check_allowed_beyond_stops(params, ending)

    def _start_group(self, backend: str) -> None:
        """Connect to Ray, size each rank's bundle and the replica count, start every replica."""
        from launcher.cluster import ray_cluster
        from launcher.cluster.placement import alive_nodes
        from launcher.cluster.replica_pool import ReplicaPool
        from launcher.cluster.resources import missing_resource, node_split
        from launcher.cluster.tp_group import GroupTimeouts

        cfg, plan = self.config, self.plan
        self._unless_stop_asked()  # shut down while planning: no Ray started just to be stopped
        with self._progress.step("connecting to Ray"):
            # Forwarded worker output carries rank 0's lines about graphs built during a request.
            self._ray = ray_cluster.connect(cfg.ray_address, worker_logs=cfg.progress)
        self._unless_stop_asked()
        self._unless_tokenizer_failed()
        nodes = alive_nodes()
        resource = backend_entry(backend).ray_resource
        missing = resource and missing_resource(resource, [n.total for n in nodes], [n.name for n in nodes])
        if missing:  # refused now rather than after the placement timeout
            refusal = NoDeviceResourceHere if self._ray.started_here else NoDeviceResource
            raise refusal(f"the {backend} backend's ranks need {resource}, but {missing}")
        self._rank_resources, self.replicas = self._size_replicas(backend, nodes)
        if cfg.compiled_dir and cfg.compile:
            from launcher.artifacts.compiled_dir import other_thread_count

            self.thread_count_note = other_thread_count(cfg.compiled_dir, backend, self._rank_resources.threads)
            if self.thread_count_note:
                self._progress.note(self.thread_count_note)
        if self._ray.started_here:  # no autoscaler grows a private cluster: what it cannot hold now, it never will
            self._refuse_unplaceable(nodes)
        self._timeouts = GroupTimeouts(placement_s=cfg.placement_timeout_s, startup_s=cfg.startup_timeout_s,
                                       rendezvous_s=cfg.rendezvous_timeout_s,
                                       load_s=cfg.load_timeout_s, request_s=cfg.request_timeout_s)
        self._load_spec = self._make_load_spec()
        self._pool = ReplicaPool(self.replicas, self._new_group,
                                 lambda: RestartPolicy(cfg.max_restarts, cfg.restart_window_s),
                                 cfg.health_check_interval_s, note=self._progress.note)
        self._unless_stop_asked()  # shut down as the pool was set: it may have missed the pool
        self._unless_tokenizer_failed()
        split = node_split(plan.tp_degree, cfg.nodes)  # a share on each of that many different nodes
        where = f" split over {len(split)} nodes ({' + '.join(map(str, split))} ranks)" if split else ""
        with self._progress.step(
                f"starting {self.replicas} replica(s) of {plan.tp_degree} {backend} worker(s){where}, "
                f"{self._rank_resources.threads} thread(s) each: joining their groups and loading each "
                f"rank's shard ({plan.kv_strategy} KV heads)"
                f"{', then building every graph (--warm-up)' if cfg.compile and cfg.warm_up else ''}"):
            self._pool.start()
        self.load_stats = self._pool.replicas[0].started.load_stats
        self._start_presharded_cache()

    def _unless_stop_asked(self) -> None:
        if self._stops != self._stops_at_start:
            raise LaunchError("the launcher was shut down while it started; nothing is left running")

    def _unless_tokenizer_failed(self) -> None:
        """Its error now if the tokenizer's load has already failed (it takes seconds, connecting to
        Ray longer): a broken tokenizer was named only once every rank had placed and loaded."""
        load = self._tokenizer_load
        if load is not None and load.failed():
            self._await_tokenizer()  # raises its error

    def _make_load_spec(self):
        """What every rank loads (and loads again after a restart)."""
        from workers.rank_worker import LoadSpec

        cfg, plan = self.config, self.plan
        from launcher.artifacts.compiled_dir import load_spec_fields

        spec = LoadSpec(config=self.model_config, layout=plan.layout(), dtype=plan.dtype,
                        model_dir=str(self.model_dir), presharded_dir=cfg.presharded_dir,
                        kv_cache_dtype=cfg.kv_cache_dtype, fused_projections=cfg.fused_projections,
                        sequence_parallel=cfg.sequence_parallel,
                        **load_spec_fields(cfg, plan, self.model_config))
        self.buckets = spec.buckets
        if cfg.presharded_cache and not cfg.presharded_dir:
            from launcher.artifacts import presharded_cache

            self._cache_path = presharded_cache.cache_dir(presharded_cache.cache_root(cfg.presharded_cache_dir),
                                                          self.model_dir, self.model_config, spec.layout, plan.dtype)
            why = presharded_cache.untrusted(self._cache_path)
            if why is not None:  # another user's copy under this name could be any weights
                self._progress.note(f"not using the pre-sharded cache, loading from {self.model_dir}: {why}")
                self._cache_path = None  # nor writing it: the writer would refuse for the same reason
            elif presharded_cache.is_ready(self._cache_path):
                pinned = self._pin_cache_version(self._cache_path)
                why = ("it was written again while this launch looked at it" if pinned is None
                       else presharded_cache.unusable(pinned, self.model_dir))
                if why is None:  # said: it loaded silently, as if from --model
                    spec = dataclasses.replace(spec, presharded_dir=str(pinned))
                    self._progress.note(f"loading the ranks' shards from the pre-sharded cache {self._cache_path} "
                                        f"(a copy of {self.model_dir} an earlier launch wrote)")
                else:  # loaded around, and written again once this load is done
                    if pinned is not None:
                        self._release_cache_hold(pinned)
                    self._progress.note(f"not using the pre-sharded cache {self._cache_path} ({why}); loading "
                                        f"from {self.model_dir} and writing the copy again")
        return _with_absolute_paths(spec)  # now: a caller changing directory later moves no restart's load

    def _pin_cache_version(self, cache_path: Path) -> Path | None:
        """The version the cache's link names now, held until shutdown() (as _hold_pinned_version
        holds a --presharded one), which every rank of every group loads: handed the link, two ranks
        of one group loaded two versions when another launcher wrote the copy again between their
        loads, or one found the old version deleted. None when the version went before it was held.
        A plain directory (no link) is returned as it is. Each version is held once, whichever group
        pins it (restarts pin on their own threads), and every hold is kept until shutdown: a group
        restarted onto a new version must not let go of the one another group is still loading."""
        from shardlib.atomic_dir import current_version, hold_version

        version = current_version(cache_path)
        if version is None:
            return cache_path
        with self._cache_lock:
            if str(version) in self._cache_holds:
                return version
            hold = hold_version(version)
            if hold is None:  # gone, or a file system that cannot lock (the launch goes on unprotected)
                return version if version.is_dir() else None
            self._cache_holds[str(version)] = hold
        return version

    def _start_presharded_cache(self) -> None:
        if self._load_spec.presharded_dir or not self.config.presharded_cache or self._cache_path is None:
            return
        from launcher.artifacts.presharded_cache import CacheWriter

        self._cache_writer = CacheWriter(self._cache_path, self.model_dir, self.model_config,
                                         self._load_spec.layout, self.plan.dtype, force=self._cache_rewrite,
                                         note=self._progress.note).start()

    def _load_around_a_bad_cache_copy(self, spec, err: BaseException, restart: bool) -> bool:
        """True when `spec` loaded this launcher's own --presharded-cache copy and a rank refused it
        (a file damaged in place keeps its size, so only the rank's sha256 sees it): later groups
        load from the checkpoint, and the copy is written again. It failed every launch, the error
        advising to write again a copy the user never wrote. With `restart`, the copy is written again
        at once; a start's own load writes it when that load is done."""
        # ValueError only: a file a rank cannot find (a cache folder the other nodes do not see) is
        # no damage a rewrite here cures, and is refused as it always was
        if not (isinstance(err, ValueError) and spec.presharded_dir
                and not self.config.presharded_dir and self._cache_path is not None):
            return False
        self._progress.note(f"not using the pre-sharded cache {spec.presharded_dir} ({err}); loading from "
                            f"{self.model_dir} and writing the copy again")
        with self._cache_lock:  # every replica's group may fail on it at once
            self._load_spec = dataclasses.replace(self._load_spec, presharded_dir=None)
            self._cache_rewrite = True
            writer = self._cache_writer
            if restart and (writer is None or not writer.writing) and self._stops == self._stops_at_start:
                # A restart found it damaged (a copy this launch wrote, or one it started from): written
                # again now. Before, every later restart tried the damaged copy again, and it was
                # written only at the next launch. (At the start, the start writes it once loaded.)
                self._cache_writer = None  # restarts load from the checkpoint until the new copy is ready
                self._start_presharded_cache()
        return True

    def _size_replicas(self, backend: str, nodes: list):
        """(each rank's resources, replica count) for the alive `nodes` (launcher.cluster.placement.NodeInfo)."""
        from launcher.cluster.resources import explain_unplaceable, groups_that_fit, held_resources, rank_resources

        cfg, tp = self.config, self.plan.tp_degree
        device = backend_entry(backend).ray_resource
        share = dict(ray_resource=device, tp=tp,
                     node_cpus=[n.total.get("CPU", 0.0) for n in nodes], nodes=cfg.nodes)
        if cfg.replicas != "auto":
            return rank_resources(**share, replicas=cfg.replicas, cpus_per_rank=cfg.cpus_per_rank), cfg.replicas
        # auto: as many groups as the free resources hold now (CPU shares: one CPU per rank by default)
        resources = rank_resources(**share, cpus_per_rank=cfg.cpus_per_rank or 1)
        count = self._auto_cap(groups_that_fit([n.free for n in nodes], resources.bundle, tp, cfg.nodes))
        idle = self._auto_cap(groups_that_fit([n.total for n in nodes], resources.bundle, tp, cfg.nodes))
        if 0 < count < idle:  # said, not silent: a launch right after another's groups left counts what they free
            held = held_resources(resources.bundle, [n.total for n in nodes], [n.free for n in nodes],
                                  [n.name for n in nodes])
            self._progress.note(f"replicas=auto: starting {count} replica(s) of the {idle} the cluster holds "
                                f"when idle; other groups or jobs hold {held or 'part of it'}")
        if count == 0 and device is None and cfg.cpus_per_rank is None:
            return rank_resources(**share), 1  # fractional CPUs: one group
        if count == 0:
            if self._ray.started_here:  # no autoscaler: what its totals can never hold is bad input (exit 2)
                from launcher.launch_plan import STARTED_HERE, refuse_unplaceable_groups

                refuse_unplaceable_groups(STARTED_HERE, resources.bundle, tp, cfg.nodes, [n.total for n in nodes],
                                          [n.name for n in nodes], how=" (replicas=auto found room for none)")
            why = explain_unplaceable(resources.bundle, tp, cfg.nodes, [n.total for n in nodes],
                                      [n.free for n in nodes], [n.name for n in nodes])
            raise PlacementTimeout(f"replicas=auto found room for no TP group: {why}")
        return resources, count

    def _auto_cap(self, count: int) -> int:
        """replicas=auto's count within what this host's RAM holds: cpu groups on a private cluster
        share it (counted before Ray started)."""
        holds = self._host_holds
        return count if holds is None else min(count, max(holds, 1))

    def _refuse_unplaceable(self, nodes: list) -> None:
        """PlacementImpossible at once, rather than after --placement-timeout, when the alive nodes
        together could never hold one group, or not every replica's group at once."""
        from launcher.launch_plan import STARTED_HERE, refuse_unplaceable_groups

        # the rules plan_launch applied before the start (refuse_what_a_private_start_cannot_hold),
        # again here for a private cluster an earlier launch of this process started and shares
        refuse_unplaceable_groups(STARTED_HERE, self._rank_resources.bundle, self.plan.tp_degree, self.config.nodes,
                                  [n.total for n in nodes], [n.name for n in nodes], replicas=self.replicas,
                                  cpus_per_rank_given=bool(self.config.cpus_per_rank))

    def _new_group(self, index: int, restart: bool, around_the_cache: bool = False):
        """Place, join and load one replica's TP group (also used to restart it)."""
        from launcher.cluster.replica_pool import StartedGroup
        from launcher.cluster.tp_group import TPGroup

        group = TPGroup(tp_degree=self.plan.tp_degree, backend=self.backend, resources=self._rank_resources,
                        timeouts=self._timeouts, lnc=self.plan.lnc, nodes=self.config.nodes,
                        name=f"corelaunch-r{index}", groups=self.replicas)
        # Against the start's count, not the count now: a shutdown landing between the start's last
        # check and this line went unseen, and waited out the whole load. At the start, another
        # replica's failed start stops it too: the others loaded and warmed up to the end before.
        pool = None if restart else self._pool
        group.stop_asked = lambda: (self._stops != self._stops_at_start
                                    or (pool is not None and pool.start_failed.is_set()))
        spec = self._load_spec
        writer = self._cache_writer  # once: a shutdown on another thread clears it
        if restart and writer is not None and writer.ready and not around_the_cache:
            pinned = self._pin_cache_version(Path(writer.path))  # a version, as _make_load_spec's
            if pinned is not None:
                spec = dataclasses.replace(spec, presharded_dir=os.path.abspath(pinned))
        loading = False
        try:
            group.start()
            loading = True
            stats = group.load(spec)
            loading = False
            prepared = group.start_serving(self._serve_spec())
        except BaseException as err:
            group.kill()
            if loading and not around_the_cache and self._load_around_a_bad_cache_copy(spec, err, restart):
                return self._new_group(index, restart, around_the_cache=True)
            raise
        group.stop_asked = None  # serving and its shutdown wait as they always have
        return StartedGroup(group=group, load_stats=stats, serving_compile=prepared[0].get("compile"))

    def _serve_spec(self):
        from workers.rank_worker import ServeSpec

        cfg = self.config
        return ServeSpec(max_num_seqs=cfg.max_num_seqs, max_prefill_tokens=cfg.max_prefill_tokens,
                         burst_wait_s=cfg.burst_wait_s, prefix_caching=cfg.prefix_caching,
                         cache_slots=cfg.seq_len or self.plan.seq_len,
                         warm_up_max_length=0 if cfg.warm_up else None)

    @property
    def threads_per_rank(self) -> int | None:
        """Compute threads each rank runs (its CPU share, whole CPUs); None before start."""
        resources = getattr(self, "_rank_resources", None)
        return resources.threads if resources is not None else None

    @property
    def presharded_cache_ready(self) -> bool:
        """True once the presharded_cache copy is complete (restarts then load from it)."""
        writer = self._cache_writer  # once: a shutdown on another thread clears it
        if writer is not None:
            return writer.ready
        return bool(self.config.presharded_cache and self._pool is not None and self._load_spec.presharded_dir
                    and not self.config.presharded_dir)

    def replica_status(self) -> list[dict]:
        """Per replica: index, state (serving, restarting, failed, ...), restarts, requests served,
        last_recovery_s, failure, load_source, its workers' describe() (rank, pid, node_id, node_ip),
        the nodes it uses and node_groups (its ranks grouped by node)."""
        pool = self._pool  # once: a shutdown on another thread clears it between a check and a call
        return pool.status() if pool is not None else []

    def compile_stats(self) -> list[tuple[dict | None, dict | None]]:
        """Per serving replica, rank 0's compile stats (workers.compiled.CompileStats.to_dict) as
        reported at load and as they are now: the graphs built since, each with its first_call_s and
        whether it was compiled or read from the compile cache (`compiled`),
        and the compile-cache counters. None where the replica runs eagerly."""
        pool = self._pool  # once: a shutdown on another thread clears it
        return pool.compile_stats() if pool is not None else []

    @property
    def _group(self):
        """Replica 0's current TP group (tests and benchmarks/tp_scaling.py reach its actors)."""
        pool = self._pool  # once: a shutdown on another thread clears it
        replica = pool.replicas[0] if pool is not None else None
        return replica.started.group if replica is not None and replica.started is not None else None

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop the workers (each group gets grace_s to leave cleanly, then is killed) and, if
        corelaunch started Ray, Ray itself. Safe to call twice."""
        # Checked before anything stops: a bad value met halfway (the pool's joins) left the
        # streams failed, the groups running and the launcher neither usable nor restartable.
        grace_s = _plain_number(grace_s)  # np.float32(1) as the other numbers are taken
        if (isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not finite(grace_s)
                or not 0 <= grace_s <= MAX_TIMEOUT_S):
            raise ValueError(f"grace_s ({grace_s!r}) must be a number of seconds from 0 to {MAX_TIMEOUT_S}; "
                             f"nothing was shut down")
        self._stops += 1  # a start() still connecting stops at its next step
        atexit.unregister(self._shutdown_at_exit)
        # One shutdown at a time: a second call (another thread) returned at once, finding the pool
        # taken, while the first was still stopping the groups and Ray; it now returns once they have.
        with self._shutting_down:
            pool = self._pool  # kept visible while it stops: a stream closed meanwhile still reaches it
            if pool is not None:
                pool.shutdown(grace_s)
                self._pool = None
            writer, self._cache_writer = self._cache_writer, None
            starter = self._start_thread
            start_elsewhere = starter is not None and starter is not threading.current_thread()
            if not start_elsewhere:
                try:
                    if pool is not None and grace_s > INTERRUPT_GRACE_S:  # not at Ctrl-C or exit: Ray goes too
                        self._wait_for_released_placements(pool)
                finally:  # a Ctrl-C in the wait still closes Ray
                    self._close_ray()
        if start_elsewhere:
            # Ray stopped under a start() still calling it (connecting, sizing the replicas, placing
            # them) crashed the process inside Ray, at times with a segfault. The start stops at its
            # next step and shuts down itself, Ray included; this call returns once it has.
            if self._starting.acquire(timeout=START_STOP_WAIT_S):
                self._starting.release()
                with self._shutting_down:
                    self._close_ray()
            else:
                print(f"corelaunch: start() had not stopped {START_STOP_WAIT_S:g} s after shutdown() was called; "
                      f"it shuts down Ray itself when it does", file=sys.stderr)
        # (after a start elsewhere has stopped) a compile into the same --out may remove the version now
        self._release_version_hold()
        if writer is not None:  # after Ray: the copy needs only this process, and Ctrl-C here leaves nothing running
            self._finish_cache_copy(writer, hurried=grace_s <= INTERRUPT_GRACE_S)

    def _wait_for_released_placements(self, pool) -> None:
        """Up to PLACEMENT_RELEASE_WAIT_S for Ray to hand back the resources of the groups the pool
        just stopped: removing a placement group returns before they are free, and a launch right
        after this one (replicas="auto" above all) counted only part of the cluster, saying nothing."""
        import ray

        from launcher.cluster.tp_group import PLACEMENT_RELEASE_WAIT_S, wait_until_released

        if not ray.is_initialized():  # the groups went with Ray's session
            return
        started = [replica.started for replica in getattr(pool, "replicas", []) if replica.started is not None]
        removed = [placement for placement in (getattr(s.group, "removed_placement", None) for s in started)
                   if placement is not None]  # a test's stand-in group has none
        if not removed:
            return
        try:
            left = wait_until_released(removed, PLACEMENT_RELEASE_WAIT_S)
        except Exception:  # noqa: BLE001 - Ray failing now must not fail the shutdown; nothing more to wait for
            return
        if left:
            self._progress.note(f"Ray had not handed back the resources of {len(left)} of the {len(removed)} stopped "
                                f"group(s) {PLACEMENT_RELEASE_WAIT_S:g} s into the shutdown; a launch right now may "
                                f"find less room")

    def _finish_cache_copy(self, writer, hurried: bool) -> None:
        """Wait for the --presharded-cache copy still being written: up to CACHE_WRITE_WAIT_S, or
        HURRIED_CACHE_WAIT_S after Ctrl-C or at exit (a shutdown given INTERRUPT_GRACE_S or less).
        A daemon thread: a copy still unfinished is abandoned when the program ends. With 30 s for
        every shutdown, `generate --presharded-cache` abandoned a large model's copy on every run,
        saying nothing."""
        if not writer.writing:
            return
        wait_s = HURRIED_CACHE_WAIT_S if hurried else CACHE_WRITE_WAIT_S
        with self._progress.spinner(f"finishing the pre-sharded cache copy {writer.path}"):
            writer.join(timeout_s=wait_s)
        if writer.writing:
            self._progress.note(f"the pre-sharded cache copy {writer.path} was still being written {wait_s:g} s "
                                f"into the shutdown; it is abandoned if this program ends, and written by a "
                                f"later launch")

    def _close_ray(self) -> None:
        connection, self._ray = self._ray, None
        if connection is not None:
            connection.close()

    # ---- requests ----------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 max_new_tokens: int = 64, stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, return_logits: bool = False,
                 batching: str = "continuous", prompt_logprobs: int | None = None,
                 cache_salt: str | None = None, skip_special_tokens: bool = True) -> list[GenerationResult]:
        """Generate for each prompt (text, or token ids); results come back in prompt order.

        batching "continuous" (default): every prompt is its own request in the groups' running
        batches (see stream()), so concurrent callers share the groups step by step.
        batching "static": the prompts run as whole batches, one batch per group at a time (the
        engine before continuous batching, kept as a baseline for benchmarks/serving.py); refused where
        max_batch_size is 0 (no static batches were planned). What follows describes the static path;
        both give the same greedy tokens.

        Generation stops at the model's EOS tokens and at `stop_token_ids` (the stop token is kept
        in token_ids, its text left out of the text, as vLLM leaves it out); `ignore_eos` keeps only
        the explicit stop tokens (fixed-length benchmarks). skip_special_tokens (vLLM's, default
        True): False keeps the special tokens the model generates (`<|im_end|>`) in the text.

        The prompts are split into parts of at most max_batch_size, and into at least as many parts
        as there are replicas serving (when there are enough prompts); each part is one worker call,
        and the parts run in parallel on whichever replicas are free. Safe to call from several
        threads at once. A part whose TP group fails is re-run on the restarted group
        (GenerationResult.attempts > 1); if its replica is given up, this call raises the
        ReplicaFailed naming what is missing, after every other part has finished.

        prompt_logprobs: n to get, in GenerationResult.prompt_logprobs, each prompt token's
        log-probability (all but the first) and the n most likely at its place (continuous batching).
        cache_salt: a non-empty string: these prompts share cached prefixes (prefix caching) only with
        requests of the same salt; None (default) shares with every request that sent none
        (continuous batching; the static batch caches nothing across calls).
        """
        from workers.rank_worker import GenerateRequest

        _refuse_static_without_rows(batching, self.config.max_batch_size)  # before the pool: said even unstarted
        pool = self._running_pool()
        max_new_tokens = _plain_integer(max_new_tokens)
        prompt_logprobs = _checked_logprobs("prompt_logprobs", _plain_integer(prompt_logprobs))
        cache_salt = _checked_cache_salt(cache_salt)
        _check_flag("skip_special_tokens", skip_special_tokens)
        if batching == "continuous":  # each stream checks its options, ignore_eos and return_logits included
            return self._generate_streams(prompts, sampling, max_new_tokens, stop_token_ids, ignore_eos, return_logits,
                                          prompt_logprobs, cache_salt, skip_special_tokens)
        _check_batching(batching)
        if prompt_logprobs is not None:
            raise ValueError(f"prompt_logprobs ({prompt_logprobs}) needs batching='continuous' (the static batch "
                             f"takes one column's logits per prompt); leave batching at its default")
        if cache_salt is not None:
            raise ValueError(f"cache_salt ({cache_salt!r}) needs batching='continuous' (the static batch shares no "
                             f"cached prefix with any other request); leave it out, or batching at its default")
        texts, token_lists = self._tokenize(prompts)
        params = self._with_bad_word_ids(self._sampling_per_prompt(sampling, len(token_lists)))
        check_request(token_lists, params, max_new_tokens, self.model_config.vocab_size)
        stop_token_ids = check_stop_token_ids(stop_token_ids, self.model_config.vocab_size)
        stops = self._ending_ids(stop_token_ids, ignore_eos)
        self._check_first_tokens(params, self._check_structured(params, batching), stops)
        self._check_lengths(token_lists, max_new_tokens)
        check_allowed_beyond_stops(params, stops)
        _check_flag("return_logits", return_logits)  # "no" would copy a vocabulary-wide row per token
        parts = []
        for first, stop in split_prompts(len(token_lists), self.config.max_batch_size, pool.serving()):
            request = GenerateRequest(prompts=token_lists[first:stop], params=params[first:stop],
                                      max_new_tokens=max_new_tokens, stop_token_ids=stops,
                                      max_seq_len=self.config.seq_len, return_logits=return_logits)
            parts.append((first, pool.submit(request)))
        results: list[GenerationResult | None] = [None] * len(token_lists)
        errors = []
        answers = []
        watchdog_s = static_watchdog_s(self.config, len(parts))
        deadline = time.monotonic() + watchdog_s
        try:
            for first, future in parts:  # every part finishes (or fails) before this call returns
                wait_s = min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX)
                # Waited for, then read: future.result(timeout=) raises the builtin TimeoutError both
                # when its wait runs out and when the part itself failed with one (or a subclass, such
                # as Ray's GetTimeoutError), so a part's own error was reported as this watchdog firing.
                if not wait_for_futures([future], timeout=wait_s).done:
                    future.cancel()
                    errors.append(RequestTimeout(f"no replica answered a batch of {len(token_lists)} prompts within "
                                                 f"{watchdog_s:g} s (the request timeout, load timeout and restarts "
                                                 f"allowed); the replicas' status: {pool.status()}"))
                    continue
                try:
                    answers.append((first, future.result()))
                except Exception as err:  # noqa: BLE001 - raised below once all parts are done
                    errors.append(err)
        except KeyboardInterrupt:  # parts not started yet never run; running ones end with shutdown
            for _, future in parts:
                future.cancel()
            raise
        from launcher.serving.text_stream import stop_token_reason

        for first, answer in answers:
            for j, out in enumerate(answer.outputs):
                i = first + j
                with self._lock:
                    text = self._decode(out.token_ids, skip_special_tokens, stops, out.finish_reason, token_lists[i])
                results[i] = GenerationResult(
                    prompt=texts[i], text=text, token_ids=list(out.token_ids),
                    finish_reason=out.finish_reason, prompt_tokens=len(token_lists[i]),
                    time_to_first_token_s=out.time_to_first_token_s,
                    decode_tokens_per_s=out.decode_tokens_per_s,
                    decode_step_latencies_s=list(out.decode_step_latencies_s), logits=out.logits,
                    replica=answer.replica, attempts=answer.attempts, token_times_s=list(out.token_times_s),
                    stop_reason=stop_token_reason(out.token_ids, out.finish_reason, stops,
                                                  None if ignore_eos else self._plain_end_id()))
        if errors:
            raise errors[0]
        return results

    # ---- streaming requests (continuous batching) ----------------------------------------------
    def stream(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None, max_new_tokens: int = 64,
               stop_token_ids: Sequence[int] = (), stop: Sequence[str] = (), ignore_eos: bool = False,
               logprobs: int | None = None, request_id: str | None = None, prompt_logprobs: int | None = None,
               cache_salt: str | None = None, include_stop_str_in_output: bool = False,
               skip_special_tokens: bool = True, stream_interval: int = 1):
        """Submit one request and return an iterator of StreamDelta (launcher/serving/stream_types.py):
        its text as it is generated, a few milliseconds after each step, never cut inside a
        character. The request joins a group's running batch at the next iteration.

        Raises at once (before anything runs) on bad input: ValueError naming the value, and
        QueueFull when it would wait for a row while max_queued_requests requests already wait. stop: strings that end the
        generation (not included in the text, unless include_stop_str_in_output: then the text ends with
        the stop string that ended it, as vLLM's option does; a stop token that ends the request leaves
        its text out likewise, its id in token_ids); logprobs:
        n to get the chosen token's log-probability and the n most likely (0..20); prompt_logprobs: n
        to get each prompt token's log-probability (all but the first) and the n most likely at its
        place, on the first delta (StreamDelta.prompt_logprobs); cache_salt: a non-empty string: the
        request shares cached prefixes (prefix caching) only with requests of the same salt (None: with
        every unsalted one); skip_special_tokens: False keeps the special tokens the model generates
        (`<|im_end|>`) in the text, and stop strings are looked for in that text, as vLLM's option does
        (token ids and logprobs are the same either way); stream_interval: n > 1 sends the first
        token alone, then n tokens a delta (vLLM's stream_interval: fewer wake-ups of every process the
        tokens pass through, each token up to n - 1 steps later; the last delta comes when the request
        ends); with stop strings, which are matched on each token as it comes, the leader sends every
        token and the stream gathers them instead. Closing the iterator early cancels the request."""
        max_new_tokens, logprobs = _plain_integer(max_new_tokens), _plain_integer(logprobs)
        prompt_logprobs = _checked_logprobs("prompt_logprobs", _plain_integer(prompt_logprobs))
        cache_salt = _checked_cache_salt(cache_salt)
        _check_flag("include_stop_str_in_output", include_stop_str_in_output)
        _check_flag("skip_special_tokens", skip_special_tokens)
        stream_interval = _checked_stream_interval(stream_interval)
        token_ids, params, stops, ending = self._check_stream(prompt, sampling, max_new_tokens, stop, logprobs,
                                                              stop_token_ids, request_id, ignore_eos)
        return self._submit_stream(token_ids, params, max_new_tokens, ending, stops, logprobs,
                                   request_id, asynchronous=False, prompt_logprobs=prompt_logprobs,
                                   cache_salt=cache_salt, include_stop=include_stop_str_in_output,
                                   skip_special_tokens=skip_special_tokens, stream_interval=stream_interval,
                                   ignore_eos=ignore_eos)

    def astream(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None, max_new_tokens: int = 64,
                stop_token_ids: Sequence[int] = (), stop: Sequence[str] = (), ignore_eos: bool = False,
                logprobs: int | None = None, request_id: str | None = None, prompt_logprobs: int | None = None,
                cache_salt: str | None = None, include_stop_str_in_output: bool = False,
                skip_special_tokens: bool = True, stream_interval: int = 1):
        """stream() for asyncio: call it inside a running event loop; it returns an async iterator
        (`async for delta in llm.astream(...)`); `aclose()` or cancelling the reading task cancels."""
        max_new_tokens, logprobs = _plain_integer(max_new_tokens), _plain_integer(logprobs)
        prompt_logprobs = _checked_logprobs("prompt_logprobs", _plain_integer(prompt_logprobs))
        cache_salt = _checked_cache_salt(cache_salt)
        _check_flag("include_stop_str_in_output", include_stop_str_in_output)
        _check_flag("skip_special_tokens", skip_special_tokens)
        stream_interval = _checked_stream_interval(stream_interval)
        token_ids, params, stops, ending = self._check_stream(prompt, sampling, max_new_tokens, stop, logprobs,
                                                              stop_token_ids, request_id, ignore_eos)
        return self._submit_stream(token_ids, params, max_new_tokens, ending, stops, logprobs,
                                   request_id, asynchronous=True, prompt_logprobs=prompt_logprobs,
                                   cache_salt=cache_salt, include_stop=include_stop_str_in_output,
                                   skip_special_tokens=skip_special_tokens, stream_interval=stream_interval,
                                   ignore_eos=ignore_eos)

    async def acheck_structured(self, sampling: SamplingParams | Sequence[SamplingParams] | None) -> None:
        """The structured-output checks of astream and agenerate (ValueError naming what is wrong),
        made on a worker thread and remembered, so that the stream call after it finds them made:
        llguidance compiles each grammar to check it, and a large one takes seconds (a JSON schema
        of 10,000 required properties 1.6-2.3 s on one 2-core host), which astream would spend on
        the event loop, holding up every other stream and request it serves. agenerate and the
        OpenAI server make their checks this way. bad_words are tokenized there too, and remembered
        (128 long words: about 0.1 s, which a client sending a new list each time cost the loop)."""
        import asyncio

        self._running_pool()  # not started: say so, not that the model has no tokenizer
        if sampling is None:
            return
        params = [sampling] if isinstance(sampling, SamplingParams) else self._sampling_per_prompt(sampling, 0)
        if any(p.structured_output is not None for p in params):
            await asyncio.to_thread(self._check_structured, params)
        if any(p.bad_words for p in params):
            await asyncio.to_thread(self._with_bad_word_ids, params)

    async def agenerate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                        max_new_tokens: int = 64, stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                        return_logits: bool = False, prompt_logprobs: int | None = None,
                        cache_salt: str | None = None, skip_special_tokens: bool = True) -> list[GenerationResult]:
        """generate() for asyncio (continuous batching): every prompt streams concurrently."""
        import asyncio

        max_new_tokens = _plain_integer(max_new_tokens)
        prompt_logprobs = _checked_logprobs("prompt_logprobs", _plain_integer(prompt_logprobs))
        cache_salt = _checked_cache_salt(cache_salt)
        _check_flag("skip_special_tokens", skip_special_tokens)
        self._running_pool()  # not started: said before any tokenizing

        # On threads: long prompts take the tokenizer seconds, and a large grammar llguidance,
        # which on the loop would stall every other coroutine (and the streams this loop reads).
        tokenized = await asyncio.to_thread(self._tokenize, prompts)
        if sampling is not None and not isinstance(sampling, SamplingParams):  # a generator is read once, here
            sampling = self._sampling_per_prompt(sampling, len(tokenized[1]))
        await self.acheck_structured(sampling)
        streams, texts, token_lists = self._open_generation(prompts, sampling, max_new_tokens, stop_token_ids,
                                                            ignore_eos, return_logits, asynchronous=True,
                                                            tokenized=tokenized, prompt_logprobs=prompt_logprobs,
                                                            cache_salt=cache_salt,
                                                            skip_special_tokens=skip_special_tokens)

        async def drain(stream):
            async for _ in stream:
                pass

        try:
            outcomes = await asyncio.gather(*(drain(s) for s in streams), return_exceptions=True)
        except BaseException:
            # Cancelled: a drain cancelled before it first ran never read its stream, so nothing
            # cancelled its request; a caller keeping the cancelled task keeps this frame and the
            # streams with it, and the requests ran on to max_new_tokens, holding their rows.
            for stream in streams:
                stream.cancel()
            raise
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise errors[0]
        return [self._result(s, texts[i], token_lists[i], skip_special_tokens) for i, s in enumerate(streams)]

    def load(self) -> dict[str, int]:
        """Streams (sequences: one per prompt and choice) running, each holding a cache row, and waiting
        for one, over all replicas."""
        return self._running_pool().load(self.config.max_num_seqs)

    def _running_pool(self):
        pool = self._pool  # once: a shutdown on another thread clears it between a check and a use
        if pool is None:
            # said "call start()" while start() ran on another thread (not this one: a step of its own)
            if self._start_thread not in (None, threading.current_thread()):
                raise LaunchError("the launcher is still starting on another thread (planning, connecting to "
                                  "Ray, placing its groups); send requests once start() returns")
            raise LaunchError("the launcher is not running: call start() or use it as a context manager")
        return pool

    def _check_stream(self, prompt, sampling, max_new_tokens, stop, logprobs, stop_token_ids, request_id,
                      ignore_eos: bool = False):
        """One streaming request's (token ids, SamplingParams, stop strings, stop token ids); ValueError
        naming a bad value."""
        from launcher.serving.stop_strings import validate_stops

        self._running_pool()  # not started: say so, before anything that needs the model
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id ({request_id!r}) must be a non-empty string, or None for a generated one")
        if isinstance(prompt, (bytes, bytearray)):
            raise ValueError(f"prompt ({bytes(prompt[:20])!r}...) is bytes; decode it to a str first "
                             f"(or pass a list of token ids)")
        if isinstance(prompt, str):
            prompt = [prompt]
        elif token_ids := _token_id_list(prompt):  # numpy's and torch's integers too
            prompt = [token_ids]
        else:
            raise ValueError(f"prompt ({show(prompt)}) must be a string or a non-empty list of token ids")
        with _in_one_prompts_words():  # what lies between names no prompt
            _, [token_ids] = self._tokenize(prompt)
            params = sampling if sampling is not None else SamplingParams()
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling ({params!r}) must be a SamplingParams")
            [params] = self._with_bad_word_ids([params])
            check_request([token_ids], [params], max_new_tokens, self.model_config.vocab_size)
        stop_token_ids = check_stop_token_ids(stop_token_ids, self.model_config.vocab_size)
        ending = self._ending_ids(stop_token_ids, ignore_eos)
        self._check_first_tokens([params], self._check_structured([params]), ending)
        self._check_lengths([token_ids], max_new_tokens)
        _checked_logprobs("logprobs", logprobs)
        stops = validate_stops(stop)
        if stops and self.tokenizer is None:  # there is no text to find them in
            raise ValueError(f"stop strings ({list(stops)!r}) need a tokenizer and {self.model_dir} has none; "
                             f"pass stop_token_ids instead")
        check_allowed_beyond_stops([params], ending)
        return token_ids, params, stops, ending

    def _submit_stream(self, token_ids, params, max_new_tokens, ending, stops, logprobs,
                       request_id, asynchronous: bool, prompt_logprobs: int | None = None,
                       cache_salt: str | None = None, include_stop: bool = False,
                       skip_special_tokens: bool = True, stream_interval: int = 1, ignore_eos: bool = False):
        """Submit one checked request (QueueFull when it would wait while max_queued_requests already
        do) and return the stream reading it. `ending`: the ids that end it (_ending_ids)."""
        stream = self._new_stream(token_ids, params, max_new_tokens, ending, stops, logprobs, request_id, asynchronous,
                                  prompt_logprobs=prompt_logprobs, cache_salt=cache_salt, include_stop=include_stop,
                                  skip_special_tokens=skip_special_tokens, stream_interval=stream_interval,
                                  ignore_eos=ignore_eos)
        self._submit_together([stream])
        return stream

    def _submit_together(self, streams, timeout_per_wave: bool = False) -> None:
        """Admit the streams' requests as one: all submitted, or none (QueueFull when the first would
        wait while max_queued_requests requests already do). timeout_per_wave: ReplicaPool.submit_streams."""
        self._running_pool().submit_streams([s.handle for s in streams], self.config.max_queued_requests,
                                             self.config.max_num_seqs, timeout_per_wave)

    def _ending_ids(self, stop_token_ids, ignore_eos) -> tuple[int, ...]:
        """The token ids that end a request: stop_token_ids, and the end-of-sequence ids unless
        ignore_eos. Once per call, not per prompt: 16,000 prompts spent a second reading them."""
        _check_flag("ignore_eos", ignore_eos)
        eos = () if ignore_eos else self._eos_ids()
        return tuple(sorted(set(stop_token_ids) | set(eos)))

    def _new_stream(self, token_ids, params, max_new_tokens, ending_ids, stops, logprobs,
                    request_id, asynchronous: bool, return_logits: bool = False, timeout_s: float | None = None,
                    prompt_logprobs: int | None = None, cache_salt: str | None = None, include_stop: bool = False,
                    skip_special_tokens: bool = True, stream_interval: int = 1, ignore_eos: bool = False):
        """A checked request's stream, not yet submitted: a RequestStream, or an AsyncRequestStream
        fed on the running event loop. ending_ids: _ending_ids(). timeout_s: its deadline from
        submission (default: the request timeout). cache_salt: checked (_checked_cache_salt).
        include_stop: the text keeps the stop string that ends it (include_stop_str_in_output).
        skip_special_tokens: False keeps the special tokens the model generates in the text.
        stream_interval: checked (_checked_stream_interval); the leader's 1 where there are stop strings."""
        import asyncio

        from launcher.cluster.stream_handle import StreamHandle
        from launcher.serving.loop_hand_over import loop_sink
        from launcher.serving.request_streams import AsyncRequestStream, RequestStream, thread_sink
        from launcher.serving.text_stream import TextStream
        from workers.serving.held_tokens import held_per_event
        from workers.serving.requests import StreamRequest

        if asynchronous:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError("astream() and agenerate() run on an asyncio event loop: call them inside "
                                   "an `async def` (or use stream() / generate() from plain code)") from None
            items = asyncio.Queue()
            sink, kind = loop_sink(items, loop), AsyncRequestStream
        else:
            items = queue.Queue()
            sink, kind = thread_sink(items), RequestStream
        # Stop strings are matched here, on the text: tokens the leader held would end the request
        # up to stream_interval - 1 steps late (vLLM matches every token whatever it sends), so the
        # leader sends each and the stream gathers them (request_streams._Stream.gather); past
        # what a leader holds (held_per_event) the stream gathers on: whatever the leader does not.
        leader_interval = 1 if stops else held_per_event(stream_interval)
        gather = 1 if leader_interval == stream_interval else stream_interval
        request = StreamRequest(request_id or uuid.uuid4().hex, tuple(token_ids), params, max_new_tokens,
                                ending_ids, logprobs, return_logits, prompt_logprobs=prompt_logprobs,
                                cache_salt=cache_salt, stream_interval=leader_interval)
        handle = StreamHandle(request, sink, self.config.request_timeout_s if timeout_s is None else timeout_s)
        text = TextStream(request.request_id, self.tokenizer, stops, len(token_ids), params.min_tokens, include_stop,
                          skip_special_tokens, ending_ids, prompt_ids=token_ids, ignore_eos=ignore_eos,
                          eos_token_id=self._plain_end_id())
        if asynchronous:
            return kind(self._cancel_stream, handle, text, items, loop, gather=gather)
        return kind(self._cancel_stream, handle, text, items, gather=gather)

    def _cancel_stream(self, handle, deferred: bool = False) -> None:
        pool = self._pool  # once: a shutdown on another thread clears it
        if pool is not None:
            pool.cancel_stream(handle, deferred)

    def _open_generation(self, prompts, sampling, max_new_tokens, stop_token_ids, ignore_eos, return_logits,
                         asynchronous: bool, tokenized: tuple | None = None, prompt_logprobs: int | None = None,
                         cache_salt: str | None = None, skip_special_tokens: bool = True):
        """Check every prompt first (nothing is submitted if one is bad), then submit them all.
        tokenized: _tokenize(prompts)'s result when the caller has it already."""
        self._running_pool()  # not started: say so, before anything that needs the model
        _check_flag("return_logits", return_logits)
        stop_token_ids = check_stop_token_ids(stop_token_ids, self.model_config.vocab_size)
        if tokenized is None:
            tokenized = self._tokenize(prompts)
        texts, token_lists = tokenized
        params = self._with_bad_word_ids(self._sampling_per_prompt(sampling, len(token_lists)))
        check_request(token_lists, params, max_new_tokens, self.model_config.vocab_size)
        ending = self._ending_ids(stop_token_ids, ignore_eos)
        self._check_first_tokens(params, self._check_structured(params), ending)
        self._check_lengths(token_lists, max_new_tokens)
        check_allowed_beyond_stops(params, ending)
        streams = [self._new_stream(ids, p, max_new_tokens, ending, (), None, None, asynchronous, return_logits,
                                    prompt_logprobs=prompt_logprobs, cache_salt=cache_salt,
                                    skip_special_tokens=skip_special_tokens, ignore_eos=ignore_eos)
                   for ids, p in zip(token_lists, params)]
        # one call, admitted as one (none of its prompts is left running alone); the prompts beyond
        # their replica's rows wait for one, a request timeout per wave of rows ahead of them
        self._submit_together(streams, timeout_per_wave=True)
        return streams, texts, token_lists

    def _generate_streams(self, prompts, sampling, max_new_tokens, stop_token_ids, ignore_eos,
                          return_logits, prompt_logprobs=None, cache_salt=None,
                          skip_special_tokens: bool = True) -> list[GenerationResult]:
        streams, texts, token_lists = self._open_generation(prompts, sampling, max_new_tokens, stop_token_ids,
                                                            ignore_eos, return_logits, asynchronous=False,
                                                            prompt_logprobs=prompt_logprobs, cache_salt=cache_salt,
                                                            skip_special_tokens=skip_special_tokens)
        errors = []
        try:
            for stream in streams:  # they run concurrently; reading them in turn waits for the slowest
                try:
                    for _ in stream:
                        pass
                except Exception as err:  # noqa: BLE001 - raised below once every request has ended
                    errors.append(err)
        except KeyboardInterrupt:
            for stream in streams:
                stream.close()  # cancels the request where it still runs
            raise
        if errors:
            raise errors[0]
        return [self._result(s, texts[i], token_lists[i], skip_special_tokens) for i, s in enumerate(streams)]

    def _result(self, stream, prompt_text, token_ids, skip_special_tokens: bool = True) -> GenerationResult:
        events = stream.events
        tokens = [t for e in events for t in e.token_ids]
        with self._lock:
            text = self._decode(tokens, skip_special_tokens, stream.handle.request.stop_token_ids,
                                stream.text.finish_reason, token_ids)
        # One token an event (generate() asks for no stream_interval); rates and gaps on the leader's
        # clock, as the static engine measures its own. A gap into a resumed attempt's first token is
        # the restart, across two leaders' clocks.
        times = [e.at_s for e in events if e.token_ids]
        restarts = set(stream.handle.resumed_at)
        steps = [times[i] - times[i - 1] for i in range(1, len(times)) if i not in restarts]
        decoded_s = sum(steps)
        logits = None
        if any(e.logits for e in events):
            import torch

            logits = torch.stack([row for e in events for row in (e.logits or [])])
        return GenerationResult(
            prompt=prompt_text, text=text, token_ids=tokens, finish_reason=stream.text.finish_reason or "length",
            prompt_tokens=len(token_ids),
            time_to_first_token_s=stream.handle.time_to_first_token_s or 0.0,
            decode_tokens_per_s=len(steps) / decoded_s if steps and decoded_s > 0 else 0.0,
            decode_step_latencies_s=steps, logits=logits, replica=stream.handle.replica or 0,
            attempts=stream.handle.attempts, token_times_s=times,
            prompt_logprobs=next((e.prompt_logprobs for e in events if e.prompt_logprobs is not None), None),
            cached_prompt_tokens=next((e.cached_tokens for e in events if e.cached_tokens is not None), 0),
            stop_reason=stream.text.stop_reason, resumed_at=list(stream.handle.resumed_at),
            submitted_at_s=stream.handle.submitted)

    def _encode(self, text: str, special_tokens: bool = True) -> list[int]:
        # The lock per prompt, not per call: a call of 20,000 prompts held it for a second, and an
        # astream() on the event loop waited for it there, stalling every coroutine of the loop. And
        # handed over: Python's lock is not fair, so a bulk call took it back at once, prompt after
        # prompt, and the waiter still waited for dozens of them. A caller that finds it taken says
        # so; the holder then yields once. Uncontended, that costs a non-blocking try: a yield after
        # every prompt made a bulk call 1.55x slower.
        if not self._lock.acquire(blocking=False):
            self._tokenizer_wanted.set()
            self._lock.acquire()
        try:
            # the keyword only where asked: a prompt's call stays the tokenizer's plain one
            encoded = self.tokenizer(text) if special_tokens else self.tokenizer(text, add_special_tokens=False)
            ids = list(encoded["input_ids"])
        finally:
            self._lock.release()
        if self._tokenizer_wanted.is_set():
            self._tokenizer_wanted.clear()
            time.sleep(0)  # lets the waiter, woken by the release, take the lock first
        return ids

    def _tokenize(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        """(texts, token-id lists) of the prompts; the tokenizer taken under self._lock, a prompt at a time."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
            raise ValueError(f"prompts ({show(prompts)}) must be a string, a list of strings, or a list of "
                             f"token-id lists")
        if isinstance(prompts, (Mapping, AbstractSet)):  # results come back in prompt order: these have none
            raise ValueError(f"prompts ({show(prompts)}) must be a list (or tuple) of prompts: a "
                             f"{type(prompts).__name__} has no order to return the results in")
        prompts = list(prompts)
        if prompts and all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None and self._tokenizer_load is not None:
                # a stream from another thread while start() loads: the tokenizer is start()'s to
                # take (its error too), and the model may well have one
                raise LaunchError("the launcher is still starting (its tokenizer is loading); send text prompts "
                                  "once start() has returned, or pass the prompt as a list of token ids")
            if self.tokenizer is None:
                raise ValueError(f"{no_tokenizer_files(self.model_dir)}: copy the model's tokenizer into it, or pass "
                                 f"prompts as token-id lists through the Python API (`corelaunch generate` takes text "
                                 f"only)")
            refuse_non_utf8_prompts(prompts)
            token_lists = [self._encode(p) for p in prompts]
            texts: list[str | None] = list(prompts)
        elif None not in (token_lists := [_token_id_list(p) for p in prompts]):
            texts = [None] * len(prompts)
        elif prompts and (ids := _token_id_list(prompts)) is not None:  # generate([1, 504, 3458])
            # shown as plain ints: a numpy array's read [np.int64(1), ...] in the fix to paste
            raise ValueError(f"prompts ({show(ids)}) is one token-id list; pass a list of prompts: [{show(ids)}]")
        else:
            kinds = ["a string" if isinstance(p, str) else None if token_ids is None else "a token-id list"
                     for p, token_ids in zip(prompts, token_lists)]
            if None in kinds:
                bad = kinds.index(None)
                raise ValueError(f"prompts must be all strings or all lists of token ids; prompt {bad} "
                                 f"({show(prompts[bad])}) is neither")
            odd = next(i for i, kind in enumerate(kinds) if kind != kinds[0])
            raise ValueError(f"prompts must be all strings or all lists of token ids; prompt 0 is {kinds[0]} "
                             f"but prompt {odd} is {kinds[odd]}")
        return texts, token_lists  # checked by check_request

    @staticmethod
    def _sampling_per_prompt(sampling, count: int) -> list[SamplingParams]:
        if sampling is None:
            return [SamplingParams()] * count
        if isinstance(sampling, SamplingParams):
            return [sampling] * count
        if isinstance(sampling, (str, bytes, dict)) or not hasattr(sampling, "__iter__"):
            raise ValueError(f"sampling ({sampling!r}) must be a SamplingParams, a list of one per prompt, or None")
        if isinstance(sampling, AbstractSet):  # handed out in hash order (and equal ones merged): silently wrong
            raise ValueError(f"sampling ({sampling!r}) must be a list (or tuple) of one SamplingParams per prompt: a "
                             f"{type(sampling).__name__} has no order to match them to the prompts")
        params = list(sampling)  # their count is checked by check_request
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling[{i}] ({p!r}) must be a SamplingParams")
        return params

    def _with_bad_word_ids(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """The params with their bad_words tokenized into bad_words_token_ids (replaced, whatever the
        caller put there: the ranks ban these ids), the one place every request's params pass before
        check_request; params without bad words as they are. The same words (one SamplingParams for
        many prompts, or a request's n choices) are tokenized once, and no other field is checked again
        (with_derived: a request's seeded choices are copies of one checked params)."""
        sequences: dict[tuple[str, ...], tuple[tuple[int, ...], ...]] = {}
        done: dict[int, SamplingParams] = {}
        filled = []
        for p in params:  # SamplingParams each: every caller has checked them
            if not p.bad_words:
                filled.append(p)
                continue
            if id(p) not in done:
                if p.bad_words not in sequences:
                    sequences[p.bad_words] = self._remembered_bad_word_sequences(p.bad_words)
                done[id(p)] = p.with_derived(bad_words_token_ids=sequences[p.bad_words])
            filled.append(done[id(p)])
        return filled

    def _remembered_bad_word_sequences(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """_bad_word_sequences(words), tokenized once per Launcher while remembered. A refused list is
        not remembered (its error is raised each time). Threads and the event loop share the dict:
        each get, set and clear is one step under the GIL, and two callers that miss together
        tokenize the words twice, the same ids either way (the tokenizer never changes)."""
        sequences = self._bad_words_tokenized.get(words)
        if sequences is None:
            sequences = self._bad_word_sequences(words)
            # counted on a miss only, which costs a tokenizing anyway (list(): one step under the GIL)
            held = sum(len(s) for listed in list(self._bad_words_tokenized.values()) for s in listed)
            if (len(self._bad_words_tokenized) >= BAD_WORD_LISTS_REMEMBERED
                    or held + sum(map(len, sequences)) > BAD_WORD_IDS_REMEMBERED):
                self._bad_words_tokenized.clear()
            self._bad_words_tokenized[words] = sequences
        return sequences

    def _bad_word_sequences(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's token sequences of bad words: each word (its leading spaces dropped) tokenized without
        special tokens, and again after a space where that gives another first token and as many
        tokens (the word inside a text, where tokenizers such as GPT-2's and SmolLM2's join the space
        to it; a tokenizer that adds a space to every text gives the same ids, kept once)."""
        if self.tokenizer is None:
            raise ValueError(f"bad_words ({list(words[:5])!r}) need a tokenizer and {self.model_dir} has none; "
                             f"ban token ids with logit_bias (-100) instead")
        sequences = []
        for i, word in enumerate(words):
            alone = self._encode(word.lstrip(), special_tokens=False)
            if not alone:
                raise ValueError(f"bad_words[{i}] ({word!r}) gives no tokens; remove it")
            sequences.append(tuple(alone))
            spaced = self._encode(" " + word.lstrip(), special_tokens=False)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(tuple(spaced))
        return tuple(sequences)

    def _check_structured(self, params: list[SamplingParams], batching: str = "continuous") -> dict:
        """Structured output's checks, before anything is submitted: the serving engine runs it, the
        model has a tokenizer (the group's leader loads its own from the same folder to match the
        grammar against), and llguidance can compile each grammar and take its first step (its
        reason otherwise). Returns each StructuredOutput's first-step mask, for _check_first_tokens,
        which the submitting calls make with the ids the requests end at (acheck_structured is not
        told them: the stream call after it checks them)."""
        from workers.structured.grammars import check_structured_output

        specs = {p.structured_output for p in params if p.structured_output is not None}
        if not specs:
            return {}
        if batching != "continuous":
            raise ValueError(f"structured output ({next(iter(specs)).describe()}) needs batching='continuous' (the "
                             f"static batch chooses its tokens without a grammar); leave batching at its default")
        if self.tokenizer is None:
            raise ValueError(f"structured output needs the model's tokenizer, and {self.model_dir} has none")
        vocab = self.model_config.vocab_size if self.model_config is not None else None
        checked = {}  # this call's verdicts: the shared cache may be cleared meanwhile (its bound, another thread)
        for spec in specs:
            if spec.after_token is not None and vocab is not None and spec.after_token >= vocab:  # never generated: no constraint ever
                raise ValueError(f"structured output's after_token ({spec.after_token}) is no token of the model "
                                 f"(its vocabulary has {vocab}); give the id of the token the constraint starts after")
            verdict = self._structures_checked.get(spec)
            if verdict is None:
                try:
                    verdict = None, check_structured_output(spec, tokenizer=self._grammar_tokenizer())
                except ValueError as err:
                    verdict = str(err), None
                if len(self._structures_checked) >= STRUCTURES_REMEMBERED:
                    self._structures_checked.clear()
                self._structures_checked[spec] = verdict
            if verdict[0] is not None:
                raise ValueError(verdict[0])
            checked[spec] = verdict[1]
        return checked

    def _check_first_tokens(self, params: list[SamplingParams], firsts: dict, ending_ids: Sequence[int]) -> None:
        """_check_first_token for each structured request; firsts: _check_structured's masks;
        ending_ids: _ending_ids() (the request's stop_token_ids, and EOS unless ignore_eos): the
        model's EOS alone missed a stop token the grammar needs, and counted EOS under ignore_eos."""
        for p in params:
            if p.structured_output is not None and p.structured_output.after_token is None:
                self._check_first_token(p, firsts[p.structured_output], ending_ids)

    def _check_first_token(self, params: SamplingParams, first, ending_ids: Sequence[int]) -> None:
        """ValueError where the request's own limits leave no token its structured output's first step
        allows (`first`, that step's mask), which failed the request at that step (a 500 over HTTP):
        allowed_token_ids holding none of them, bad_words of one token banning all of them, or
        min_tokens holding back the only ones left, the ends (ending_ids: its stop_token_ids, and EOS
        unless ignore_eos). The steps after it are not looked at."""
        from workers.structured.grammars import allows, lowest_allowed

        spec, ends = params.structured_output.describe(), set(ending_ids)
        banned = {seq[0] for seq in params.bad_words_token_ids or () if len(seq) == 1}  # at every step
        besides = f" that bad_words leave (they ban {show(sorted(banned))} at every step)" if banned else ""
        left = None  # the allowed ids the first step allows, where they are limited
        if params.allowed_token_ids:
            left = [token for token in params.allowed_token_ids if allows(first, token) and token not in banned]
            if not left:
                raise ValueError(f"allowed_token_ids ({show(list(params.allowed_token_ids))}) hold no token the "
                                 f"structured output ({spec}) allows first{besides}; allow the "
                                 f"tokens its text can start with")
        elif banned and lowest_allowed(first, but=banned) is None:
            raise ValueError(f"bad_words ban every token the structured output ({spec}) allows first (token ids "
                             f"{show(sorted(banned))}); remove those bad words")
        if params.min_tokens and (lowest_allowed(first, but=ends | banned) is None if left is None
                                  else all(token in ends for token in left)):
            only = "" if not params.allowed_token_ids else " among allowed_token_ids"
            raise ValueError(f"min_tokens ({params.min_tokens}) holds back the end, and the structured output "
                             f"({spec}) allows nothing else first{only}{besides} (the end: its "
                             f"ending ids {show(sorted(ends))}, stop_token_ids and EOS unless ignore_eos); leave "
                             f"min_tokens at 0, or allow a token its text can start with")

    def _grammar_tokenizer(self):
        """llguidance's view of the driver's tokenizer, built at the first structured request (about
        0.4 s for SmolLM2's vocabulary), for the first-step check of each grammar."""
        from workers.structured.matchers import GrammarTokenizer

        if self._grammars_for is not self.tokenizer:
            tokenizer = self.tokenizer
            self._grammars = GrammarTokenizer(lambda: tokenizer, self.model_config.vocab_size)
            self._grammars_for = tokenizer
        return self._grammars

    @property
    def serving_seq_len(self) -> int:
        """Positions (prompt plus new tokens) one streamed request may hold: the serving engine's KV
        cache rows have this many slots (seq_len, else the plan's: min(max_position_embeddings, 4096))."""
        self.prepare()
        return self.config.seq_len or self.plan.seq_len

    def _check_lengths(self, token_lists: list[list[int]], max_new_tokens: int) -> None:
        """Each request within serving_seq_len positions, on either engine: the serving engine's cache
        rows hold that many, and the plan's memory check counted that many for each row of a static
        batch too (which sizes its cache per request, up to the model's max_position_embeddings
        without a limit: an eager batch without --seq-len grew its cache past what the plan had
        proved, up to 32 times for a model of 131072 positions)."""
        limit = self.model_config.max_position_embeddings
        seq_len = self.serving_seq_len
        if seq_len is not None and seq_len < limit:
            if self.config.compiled_dir is not None:  # its buckets are fixed: only a new directory holds more
                longer = "compile the directory again with a larger --seq-len"
            elif self.buckets is not None and self.config.token_buckets is not None:
                longer = ("raise the largest token-generation bucket (--token-buckets or --buckets), and --seq-len "
                          "with it if given")
            else:
                longer = "raise seq_len (--seq-len)"
            check_fits(token_lists, max_new_tokens, seq_len, "seq_len",
                       fix=f"shorten the prompt, lower max_new_tokens, or {longer}")
        else:
            check_fits(token_lists, max_new_tokens, limit, "the model's max_position_embeddings")
        if self.buckets is not None:  # the largest buckets, checked here before any worker call
            from shardlib.buckets import request_shape

            longest = self.buckets.context[-1]
            for i, ids in enumerate(token_lists):
                which = f"prompt {i}: " if len(token_lists) > 1 else ""  # one prompt: no index to tell it by
                if len(ids) > longest and self.config.compiled_dir is not None:  # its buckets are fixed
                    raise ValueError(f"{which}prompt length ({len(ids)}) is longer than the largest "
                                     f"context-encoding bucket ({longest}) of the compiled directory; shorten the "
                                     f"prompt, or compile the directory again with a larger --max-context-length "
                                     f"(or --context-buckets)")
                try:
                    request_shape(self.buckets, [len(ids)], max_new_tokens)
                except ValueError as err:
                    raise ValueError(f"{which}{err}") from None

    def _eos_ids(self) -> list[int]:
        """The ids that end a request unless ignore_eos: config.json's, generation_config.json's and
        the tokenizer's end-of-sequence token."""
        ids = list(self.model_config.eos_token_id) + list(self._generation_eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        # One past the vocabulary (a token the files name that the embedding lacks) is never chosen,
        # so it never ends anything; left in, it failed every request with min_tokens.
        return [i for i in ids if 0 <= i < self.model_config.vocab_size]

    def _plain_end_id(self) -> int | None:
        """The end of an answer that names no stop (stop_reason None): the tokenizer's EOS, else (a
        launch without a tokenizer) config.json's first."""
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        return next(iter(self.model_config.eos_token_id), None)

    def _decode(self, token_ids, skip_special_tokens: bool, ending_ids, finish_reason: str | None,
                prompt_ids=()) -> str | None:
        """A generate() result's text: the whole output decoded at once after the prompt, as
        transformers decodes it (a stop token that ended it left out, as vLLM leaves it out:
        TextStream). A stream's text is the same but where a byte-fallback tokenizer meets bytes
        that are not valid UTF-8 (README, Continuous batching and streaming: Text)."""
        if self.tokenizer is None:
            return None
        from launcher.serving.detokenizer import decode_after_prompt
        from launcher.serving.text_stream import shown_tokens

        shown = shown_tokens(list(token_ids), finish_reason, ending_ids)
        return decode_after_prompt(self.tokenizer, shown, prompt_ids, skip_special_tokens)


def split_prompts(count: int, max_batch_size: int, replicas: int) -> list[tuple[int, int]]:
    """[first, stop) ranges covering `count` prompts: parts of at most max_batch_size, at least one
    per replica when there are enough prompts, sizes as even as possible, in prompt order.

    >>> split_prompts(5, 2, 1)
    [(0, 2), (2, 4), (4, 5)]
    >>> split_prompts(4, 8, 2)
    [(0, 2), (2, 4)]
    """
    positive_int("max_batch_size", max_batch_size)  # 0 (no static batches) is refused before the split
    parts = max(math.ceil(count / max_batch_size), min(count, max(replicas, 1)))
    base, extra = divmod(count, parts)
    bounds, first = [], 0
    for k in range(parts):
        stop = first + base + (1 if k < extra else 0)
        bounds.append((first, stop))
        first = stop
    return bounds


_TOKENIZER_LOAD_LOCK = threading.Lock()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def no_tokenizer_files(model_dir: str | Path) -> str:
    return f"{model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]})"


def has_tokenizer_files(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / f).exists() for f in TOKENIZER_FILES)


def server_tokenizer_problem(model_dir: str | Path) -> str | None:
    """Why the OpenAI server cannot serve `model_dir`, or None: it reads every prompt and chat message
    as text, so a model without tokenizer files (random test checkpoints) started, then failed inside
    each Serve replica with an AttributeError that `corelaunch serve` reported as a failed deployment."""
    if has_tokenizer_files(model_dir):
        return None
    return (f"{no_tokenizer_files(model_dir)}: the server reads prompts and chat messages as text; copy the "
            f"model's tokenizer into it (token-id prompts without a tokenizer run through the Python API)")


def load_tokenizer(model_dir: Path, token_ids_way_out: bool = True):
    """The checkpoint's tokenizer, or None when the directory has none (random test checkpoints).
    token_ids_way_out: a tokenizer that cannot be loaded may be removed, prompts then given as token
    ids (the driver API); False where text is all there is (the OpenAI server)."""
    if not has_tokenizer_files(model_dir):
        return None
    # One load at a time in a process: tokenizers load on threads (Launcher.prepare, the Serve
    # replica), and transformers' lazily imported modules are not safe to import from two threads at
    # once (seen: "cannot import name 'AutoTokenizer' from 'transformers'").
    with _TOKENIZER_LOAD_LOCK:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(model_dir)
        except ImportError as error:  # a tokenizer type whose library is not installed (sentencepiece, tiktoken)
            raise ValueError(f"the tokenizer in {model_dir} needs a package that is not installed ({error}); "
                             f"install it into this environment, or give the model a tokenizer.json (which "
                             f"needs none)") from error
        except Exception as error:  # noqa: BLE001 - tokenizers raises plain Exception; KeyError from a bad file
            # transformers' and tokenizers' own messages rarely name the folder
            way_out = (", or remove them and pass prompts as token-id lists through the Python API (`corelaunch "
                       "generate` takes text only)") if token_ids_way_out else " (the server reads prompts as text)"
            raise ValueError(f"the tokenizer in {model_dir} cannot be loaded ({type(error).__name__}: {error}); "
                             f"repair or replace its tokenizer files (tokenizer.json, tokenizer_config.json)"
                             f"{way_out}") from error
