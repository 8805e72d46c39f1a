"""Compiled-model directories: what `corelaunch compile` writes and `--compiled DIR` starts from.

Layout:
  manifest.json   what the directory was built for and with: model config hash, TP plan (degree, KV
                  strategy, LNC), dtype, backend, buckets, library versions (torch, transformers,
                  corelaunch), each graph's compile time, and for Neuron the instance family
                  (inf2, trn1, trn2) the graphs were compiled for
  model/          config.json, generation config and tokenizer files: the directory is self-contained
  weights/        every rank's pre-sharded weights (shardlib.presharded's format, its own manifest)
  cache/          the backend's persisted compiled graphs (CPU: inductor's cache directory)
  compile.log     one line per static-batch graph built by `corelaunch compile`, with its compile
                  time (the manifest's `graphs` lists the serving graphs too)

The path given to `corelaunch compile --out` is a symlink to a hidden versioned sibling, switched in
one rename once the directory is complete (shardlib.atomic_dir). The cache/ entries are pickles that
torch loads: a compiled-model directory must be trusted like code, never taken from an untrusted source.

Starting from one re-shards nothing and recompiles nothing that was persisted; asking for anything
else than what it was built for (another model, TP degree, dtype, backend, granularity, buckets or library
versions) is refused with what differs, expected against found, and how to fix it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from shardlib.atomic_dir import abandoned_version
from shardlib.buckets import Buckets
from shardlib.manifest import MANIFEST, check_field, read_manifest_json

FORMAT_VERSION = 1
KIND = "a compiled-model directory"
"""What these directories are called in messages."""
MODEL, WEIGHTS, CACHE = "model", "weights", "cache"
COMPILE_LOG = "compile.log"
"""Rank 0's warm-up record: one line per graph ("done total phase batch length seconds")."""
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "tokenizer.model", "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
               "chat_template.jinja")
"""Files copied from the Hugging Face model directory (those present); weights are not among them."""


def model_dir(root: str | Path) -> Path:
    return Path(root) / MODEL


def weights_dir(root: str | Path) -> Path:
    return Path(root) / WEIGHTS


def compiler_unsafe_path(path: str | Path) -> bool:
    """Whether `path` holds whitespace, a quote or a backslash: inductor's C++ compiler command line,
    which names files in the compile cache inside a compiled-model directory, is split shell-style,
    so such a path broke every compile into it (a raw g++ error after Ray had started, and for a
    directory copied there a crash loop at its first new graph)."""
    return any(ch.isspace() or ch in "'\"\\" for ch in str(Path(path).absolute()))


def cache_dir(root: str | Path) -> Path:
    return Path(root) / CACHE


def refuse_unusable_cache(root: str | Path) -> None:
    """ValueError when the compile cache of the directory `root` names (resolved: the version its
    link points to) cannot be used: at a path the C++ compiler's command line cannot take, or not
    writable (inductor writes lock files into it even when every graph is there)."""
    resolved = Path(root).resolve()
    if compiler_unsafe_path(resolved):
        raise ValueError(f"compiled-model directory {root} lies at a path with whitespace, a quote or a backslash "
                         f"({resolved}): a graph it lacks is compiled into its cache, which the C++ compiler's "
                         f"command line cannot take; copy it (cp -rL) to a path without them")
    cache = cache_dir(resolved)
    if cache.is_dir() and not os.access(cache, os.W_OK):  # access() sees a read-only mount, root too
        raise ValueError(f"compiled-model directory {root} cannot be written ({cache}): inductor writes lock files "
                         f"into its cache even when every graph is there, and each rank failed at load, restarted "
                         f"to the restart limit; copy it (cp -rL) to a writable path")


_REQUIRED = ("format_version", "config_hash", "tp_degree", "kv_strategy", "dtype", "backend", "buckets", "versions")
_FIELDS = {"format_version": int, "config_hash": str, "tp_degree": int, "kv_strategy": str, "dtype": str,
           "backend": str, "buckets": dict, "versions": dict, "granularity": (str, type(None)), "source": str,
           "model_type": str, "graphs": list, "compile_s": float, "sequence_parallel": bool,
           "kv_cache_dtype": (str, type(None)), "lnc": int, "pad_q_heads": bool, "moe_sharding": (str, type(None)),
           "max_num_seqs": int, "max_prefill_tokens": int, "fused_projections": bool, "instance_family": str}


def _choices() -> dict[str, tuple]:
    """The values `corelaunch compile` writes for the manifest's settings."""
    from shardlib.expert_sharding import MOE_SHARDINGS
    from shardlib.instances import NEURON_FAMILIES
    from shardlib.planner import KV_STRATEGIES
    from workers.backends import backend_names
    from workers.granularities import GRANULARITIES

    return {"kv_strategy": KV_STRATEGIES, "dtype": ("float32", "bfloat16", "float16"), "backend": backend_names(),
            "granularity": (*GRANULARITIES, None), "moe_sharding": (*MOE_SHARDINGS, None), "lnc": (1, 2),
            "kv_cache_dtype": ("f8e4m3", None), "instance_family": NEURON_FAMILIES}


def read_manifest(root: str | Path, shown: str | Path | None = None) -> dict[str, Any]:
    """The parsed manifest.json of a compiled-model directory, each field read of the expected type
    (ValueError naming the field otherwise). shown: the path the user gave (a link), which the
    messages name: they named the hidden version it links to, and told to compile --out into it."""
    shown = Path(root if shown is None else shown)
    hint = f"write it with `corelaunch compile --model MODEL --tp N --out {shown}`"
    manifest = read_manifest_json(root, what=KIND, required=_REQUIRED, write_hint=hint, types=_FIELDS, shown=shown)
    path = shown / MANIFEST
    for name in ("context", "token", "batch"):
        for i, size in enumerate(check_field(manifest["buckets"].get(name), list, f"buckets.{name}", path, hint)):
            check_field(size, int, f"buckets.{name}[{i}]", path, hint)
    # Values no compile writes were refused later by the launch's own checks, in the words of a
    # flag nobody passed (--tp (-1) must be a positive integer).
    for field in ("tp_degree", "max_num_seqs", "max_prefill_tokens"):
        if manifest.get(field, 1) < 1:
            raise ValueError(f"{path}: field {field!r} must be a positive integer, found {manifest[field]}; {hint}")
    for field, allowed in _choices().items():
        if field in manifest and manifest[field] not in allowed:
            raise ValueError(f"{path}: field {field!r} must be one of {', '.join(map(str, allowed))}, found "
                             f"{manifest[field]!r}; {hint}")
    try:
        Buckets.from_dict(manifest["buckets"])
    except ValueError as err:
        raise ValueError(f"{path}: field 'buckets' is not a valid set of buckets ({err}); {hint}") from None
    return manifest


RECORDED_SETTINGS = ("max_num_seqs", "max_prefill_tokens", "fused_projections")
"""Launch settings that shape the graphs and that a launch from the directory takes when it gives
none: the serving KV cache's rows (part of every serving graph's shape), the prefill chunks' largest
width, and whether the projections are fused (other matrices, other graphs)."""


def recorded_settings(root: str | Path | None) -> dict[str, Any]:
    """Those of RECORDED_SETTINGS a compiled-model directory records, by name: none for no directory,
    one compiled before they were recorded, or one the launch's own checks will refuse."""
    manifest = _readable_manifest(root)
    return {name: manifest[name] for name in RECORDED_SETTINGS if name in manifest}


def compiled_from(root: str | Path) -> str | None:
    """The model a compiled-model directory was compiled from, as its manifest records it (None
    where it cannot be read or records none)."""
    return _readable_manifest(root).get("source")


def pads_q_heads_at(model: str | Path, tp_degree: int) -> bool:
    """Whether --pad-q-heads adds zero heads to `model` at tp_degree (True when its config cannot be
    read: the flag is then compared as recorded). A layout records the padding it applied, so a
    directory written with the flag at a degree that divides the heads says false, and a launch
    with the same flags was refused."""
    from shardlib.model_config import load_model_config

    try:
        return load_model_config(model).num_attention_heads % tp_degree != 0
    except (OSError, ValueError):
        return True


def instance_family_field(backend: str, instance: str) -> dict[str, str]:
    """The manifest's record of the instance family a Neuron compile was for: {"instance_family":
    "inf2" | "trn1" | "trn2"}, from the planned --instance; nothing for other backends. neuronx-cc
    builds for one platform (NxD compiles for the host's), and a NEFF built for one family does not
    run on another; the rank compiles on a host of the family --instance names (the planner sized the
    cores for it), which this records."""
    if backend != "neuron":
        return {}
    from shardlib.instances import get_instance

    return {"instance_family": get_instance(instance).family}


def refuse_another_instance_family(root: Path, manifest: dict[str, Any], instance: str | None) -> None:
    """ValueError when a Neuron directory's graphs were compiled for another instance family than
    the launch's --instance (graphs built for trn1 cannot run on trn2 or inf2, nor the reverse).
    Nothing to compare for a launch without --instance (the neuron backend refuses that itself), a
    directory of another backend, or one compiled before the family was recorded: such old
    manifests stay loadable, unchecked, as they were."""
    compiled_for = manifest.get("instance_family")
    if compiled_for is None or instance is None:
        return
    from shardlib.instances import get_instance

    launch = get_instance(instance)
    if not launch.is_neuron:  # a cpu or gpu launch: the backend check says what is wrong, and its fix
        return
    launch_family = launch.family
    if launch_family != compiled_for:
        from workers.backends import backend_entry

        # a backend whose compiled directories no launch runs (launch_plan.compiled_serving_missing)
        # is not told to compile another: that command is refused
        again = (f"Compile again on {_a(launch_family)} instance (`corelaunch compile --backend neuron --instance "
                 f"{instance} --out DIR ...`), or launch" if backend_entry("neuron").compiled_serving else "Launch")
        raise ValueError(f"compiled-model directory {root} holds Neuron graphs compiled for {compiled_for} "
                         f"(--instance {manifest.get('instance', compiled_for)}), which cannot run on {launch_family}; "
                         f"this launch is for --instance {instance}. {again} on {_a(compiled_for)} instance")


def _a(word: str) -> str:
    """The article before an instance family's name (an inf2, a trn1)."""
    return f"an {word}" if word[:1] in ("a", "e", "i", "o", "u") else f"a {word}"


def _refuse_another_kind(root: Path, shown: Path) -> None:
    """ValueError naming the flag that takes `root` when it is a Hugging Face model or a pre-sharded
    checkpoint: the advice was to `compile --out` into it, which refuses such a directory."""
    import json

    manifest = root / MANIFEST
    if not manifest.is_file() and (root / "config.json").is_file():
        raise ValueError(f"{shown} is a Hugging Face model, not a compiled-model directory: pass it as --model, "
                         f"or compile it first (`corelaunch compile --model {shown} --out DIR`, then --compiled DIR)")
    try:
        found = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return  # none, or unreadable: read_manifest_json says so
    if isinstance(found, dict) and "files" in found and "buckets" not in found:
        raise ValueError(f"{shown} is a pre-sharded checkpoint, not a compiled-model directory: pass it as "
                         f"--presharded (with --model, the model it was cut from)")


def _readable_manifest(root: str | Path | None) -> dict[str, Any]:
    """The manifest of the version `root` names, or {} for no directory or one the launch's own
    checks will refuse (they say why)."""
    if root is None:
        return {}
    try:
        return read_manifest(pinned_version(root))
    except (OSError, ValueError):
        return {}


def other_thread_count(root: str | Path, backend: str, threads: int) -> str | None:
    """What to tell a cpu launch whose ranks run another thread count than the directory's graphs
    were compiled at, or None. inductor generates its CPU kernels for a thread count, which is part
    of their cache key: `serve --replicas 2` from a directory compiled for one replica (half the
    threads each) built every graph again, silently, on its first requests."""
    if backend != "cpu":
        return None
    compiled = _readable_manifest(root).get("threads_per_rank")
    if compiled is None or compiled == threads:
        return None
    # no path: a launch holds the pinned version (.NAME.v-HOST-PID-RANDOM), not the path given
    return (f"note: the compiled directory's graphs were compiled for {compiled} thread(s) per rank and this "
            f"launch runs {threads}: inductor builds CPU kernels for a thread count, so each graph is built again when "
            f"first used (and cached for later runs); compile with --cpus-per-rank {threads} to match")


def pinned_version(root: str | Path) -> Path:
    """The version a compiled directory's link names now (the directory itself when it is no link),
    for a whole launch: every rank and every restart read the files checked at start, not whatever a
    later `corelaunch compile --out` switched the link to (a restarted group silently loaded another
    model's weights)."""
    root = Path(root)
    return root.resolve() if root.is_symlink() else root


class CompiledDirMismatch(ValueError):
    """A compiled-model directory asked for with settings it was not built for. Its message names
    LaunchConfig's fields (the driver API); `flag_message` the same by the command-line options."""

    def __init__(self, root: Path, differ: list[tuple[str | None, str]], libraries: list[str]) -> None:
        self.root, self.differ, self.libraries = root, differ, libraries
        super().__init__(self._message(flags=False))

    @property
    def flag_message(self) -> str:
        return self._message(flags=True)

    def _message(self, flags: bool) -> str:
        from launcher.cli.options import FLAG_OF_FIELD

        def named(field: str | None, text: str) -> str:
            if field is None:
                return text
            if not flags:
                return f"{field}: {text}"
            if field == "compile":  # the option that turns it off
                return "--no-compile: a compiled directory runs compiled"
            return f"{FLAG_OF_FIELD.get(field, '--' + field.replace('_', '-'))}: {text}"

        ways = []
        if self.differ:
            ways.append("drop the options that differ so the compiled ones are used" if flags else
                        "drop the LaunchConfig fields that differ so the compiled ones are used")
        if self.libraries:  # no option asks for these: the installed libraries differ
            ways.append("install the library versions it was compiled with")
        return (f"compiled-model directory {self.root} does not match this launch: "
                f"{'; '.join([named(f, t) for f, t in self.differ] + self.libraries)}. Re-run `corelaunch compile` "
                f"with the settings and libraries you want to serve with, or {' and '.join(ways)}")


def apply_compiled_dir(config):
    """A LaunchConfig that starts from config.compiled_dir: its model files, pre-sharded weights,
    compile cache, TP degree, dtype, KV strategy, LNC, granularity and buckets. ValueError when config asks for
    anything the directory was not built for, naming each field with the expected and found values."""
    from shardlib.model_config import load_model_config
    from workers.compiled import version_differences

    root = Path(config.compiled_dir)
    pinned = pinned_version(root)  # messages name the path given (a Serve replica's is pinned already)
    _refuse_another_kind(pinned, root)  # here, not in read_manifest: `compile --out` has no --presharded
    manifest = read_manifest(pinned, shown=root)
    if "compile_s" not in manifest and abandoned_version(pinned):
        # named directly (the link was never switched to it): its graphs and manifest are partial
        raise ValueError(f"compiled-model directory {root} was left half-written by a `corelaunch compile` that "
                         f"did not finish (its writer is gone and no --out links to it); compile again, then "
                         f"give the --out path")
    refuse_another_instance_family(root, manifest, config.instance)
    if not (model_dir(pinned) / "config.json").is_file():  # told to pass a model directory as --model
        raise ValueError(f"compiled-model directory {root} is incomplete: it has no {model_dir(root)}/config.json; "
                         f"copy the whole directory again (cp -rL), or re-run `corelaunch compile --out {root}`")
    if config.model is None:  # its own copy of the model's config: an edit reached the ranks' load first
        own = load_model_config(model_dir(pinned)).config_hash()
        if own != manifest["config_hash"]:
            raise ValueError(f"compiled-model directory {root}: {model_dir(root)}/config.json was changed after it "
                             f"was compiled (config hash {own}, compiled {manifest['config_hash']}); restore it "
                             f"(copy the directory again, cp -rL), or re-run `corelaunch compile --out {root}` for "
                             f"the edited model")
    differ: list[tuple[str | None, str]] = []
    """(LaunchConfig field or None, what differs): named by the field in the driver API, by the
    option that sets it on the command line (CompiledDirMismatch.flag_message)."""
    if manifest["format_version"] != FORMAT_VERSION:
        differ.append((None, f"format_version: expected {FORMAT_VERSION}, found {manifest['format_version']}"))
    if config.model is not None:
        given = load_model_config(config.model).config_hash()
        if given != manifest["config_hash"]:
            differ.append(("model", f"expected config hash {manifest['config_hash']} "
                                    f"({manifest.get('source', 'the compiled model')}), found {given} ({config.model})"))
    # each difference is named by what asks for it, not by the manifest's field: `tp_degree` is
    # nothing a user typed
    for attr, field in (("tp", "tp_degree"), ("dtype", "dtype"), ("backend", "backend"),
                        ("kv_strategy", "kv_strategy"), ("moe_sharding", "moe_sharding"),
                        ("compile_granularity", "granularity"), ("kv_cache_dtype", "kv_cache_dtype"),
                        ("lnc", "lnc")):  # a Neuron graph runs only at the LNC it was compiled for
        wanted = getattr(config, attr)
        if wanted not in (None, "auto") and wanted != manifest.get(field):
            have = manifest.get(field)
            differ.append((attr, f"expected {'none' if have is None else repr(have)} (compiled), found {wanted!r} "
                                 f"(asked)"))
    for flag in ("pad_q_heads", "sequence_parallel"):  # on when asked, so the directory must have it on
        if getattr(config, flag) and not manifest.get(flag, False):
            if flag == "pad_q_heads" and not pads_q_heads_at(model_dir(pinned), manifest["tp_degree"]):
                continue  # nothing to pad at that degree: compiled with the flag, it was recorded off
            differ.append((flag, "compiled without it, asked for"))
    buckets = Buckets.from_dict(manifest["buckets"])
    for attr, have in (("token_buckets", buckets.token), ("context_buckets", buckets.context)):
        wanted = getattr(config, attr)
        if wanted is not None and tuple(sorted(set(wanted))) != have:
            differ.append((attr, f"expected {list(have)} (compiled), found {sorted(set(wanted))} (asked)"))
    if config.max_context_length is not None and config.context_buckets is None:  # a list is compared above
        # capped at the sequence length as building the buckets caps it, so the flags the directory
        # was compiled with are taken again
        effective = min(config.max_context_length, config.seq_len or buckets.max_seq_len)
        if effective != buckets.context[-1]:
            differ.append(("max_context_length", f"expected {buckets.context[-1]} (compiled: the largest context "
                                                 f"bucket), found {config.max_context_length} (asked)"))
    if config.presharded_dir is not None:
        differ.append(("presharded_dir", f"expected none (the directory's own weights, {weights_dir(root)}), found "
                                         f"{config.presharded_dir} (asked)"))
    # a seq_len that the token buckets set (LaunchConfig takes the largest) was never asked for: the
    # buckets' own difference says it
    set_by_buckets = config.token_buckets is not None and config.seq_len == config.token_buckets[-1]
    if config.seq_len is not None and config.seq_len != buckets.max_seq_len and not set_by_buckets:
        differ.append(("seq_len", f"expected {buckets.max_seq_len} (compiled), found {config.seq_len} (asked)"))
    if not config.compile:
        differ.append(("compile", "False: a compiled directory runs compiled"))
    libraries = version_differences(manifest["versions"])
    if differ or libraries:
        raise CompiledDirMismatch(root, differ, libraries)
    return dataclasses.replace(
        config, compiled_dir=str(pinned),
        model=config.model or str(model_dir(pinned)), tp=manifest["tp_degree"], dtype=manifest["dtype"],
        backend=manifest["backend"], kv_strategy=manifest["kv_strategy"], seq_len=buckets.max_seq_len,
        pad_q_heads=manifest.get("pad_q_heads", False), sequence_parallel=manifest.get("sequence_parallel", False),
        kv_cache_dtype=manifest.get("kv_cache_dtype"),
        moe_sharding=manifest.get("moe_sharding"), lnc=manifest.get("lnc") or config.lnc,
        compile_granularity=manifest.get("granularity"),
        presharded_dir=str(weights_dir(pinned)), context_buckets=buckets.context, token_buckets=buckets.token,
        # compared above and now the context buckets' to say (one past the directory's seq_len, as
        # compiled with, would be refused beside it)
        max_context_length=None,
        max_batch_size=min(config.max_batch_size, buckets.max_batch_size))  # 0 (no static batches) stays 0


def launch_buckets(config, plan, model_config, batch: tuple[int, ...] | None = None) -> Buckets:
    """The buckets a launch runs at: the custom lists given, else automatic ones up to the maximum
    context length (default: the sequence length) and the plan's sequence length; `batch`: the batch
    buckets (a compiled-model directory's), else powers of two up to the maximum batch size (at
    least 1: a launch without static batches, max_batch_size 0, has the smallest, whose graphs are
    never built, since no static call is taken and warm_up_static is False)."""
    return Buckets.build(max_context_length=config.max_context_length, max_seq_len=config.seq_len or plan.seq_len,
                         max_batch_size=max(config.max_batch_size, 1), context=config.context_buckets,
                         token=config.token_buckets, batch=batch,
                         max_positions=model_config.max_position_embeddings)


def load_spec_fields(config, plan, model_config) -> dict[str, Any]:
    """The LoadSpec fields for compiling (or bucketed eager runs) that a LaunchConfig asks for."""
    manifest = read_manifest(config.compiled_dir) if config.compiled_dir is not None else None
    batch = Buckets.from_dict(manifest["buckets"]).batch if manifest is not None else None
    bucketed = config.compile or config.context_buckets is not None or config.token_buckets is not None
    # the static batches' graphs; the serving loop's are the ServeSpec's (warm_up alone)
    fields: dict[str, Any] = {"compile": bool(config.compile),
                              "warm_up": bool(config.compile and config.warm_up and config.warm_up_static),
                              "buckets": launch_buckets(config, plan, model_config, batch) if bucketed else None,
                              "compile_granularity": config.compile_granularity}
    if manifest is not None:
        fields["compile_cache_dir"] = str(cache_dir(config.compiled_dir))
        fields["expected_versions"] = manifest["versions"]
        if fields["warm_up"] and "compile_s" not in manifest:  # still being written by `corelaunch compile`
            fields["progress_file"] = str(Path(config.compiled_dir) / COMPILE_LOG)
    return fields
