"""The folders a cpu rank's first compile uses, checked on the driver before Ray starts.

Inductor builds each graph with a C++ compiler whose command line it splits shell-style, and it
probes the CPU in a temporary folder first: a TMPDIR, CORELAUNCH_CACHE (where the ranks keep
inductor's cache, workers/inductor_cache.py) or TORCHINDUCTOR_CACHE_DIR with whitespace, a quote or
a backslash broke every rank's first compile, and a cache folder that cannot be made failed every
rank's load; either way after Ray had started, the group restarted three times and was given up
(a server answered /health and then 503 to every request). A private Ray's ranks run on this host
with this process's environment, so the same folders are checked here, where a bad one costs a
fraction of a second.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from launcher.artifacts.compiled_dir import compiler_unsafe_path

NO_COMPILE = "or run without compiling: --no-compile"


def check_compile_folders(config, backend: str, into_out: bool = False) -> None:
    """ValueError naming the variable, its value and the fix, for a compiled cpu launch whose ranks
    run on a private Ray of this host; nothing elsewhere (a joined cluster's nodes have their own
    environment, and a compiled-model directory's own cache is checked by compiled_dir). into_out:
    `corelaunch compile`, whose ranks compile into its --out directory's cache (checked there), and
    which has no --no-compile to offer."""
    from launcher.cluster.ray_cluster import private_cluster

    if not config.compile or backend != "cpu" or not private_cluster(config.ray_address):
        return
    tmp = tempfile.gettempdir()
    if compiler_unsafe_path(tmp):
        raise ValueError(f"TMPDIR ({tmp}) holds whitespace, a quote or a backslash: inductor compiles each graph "
                         f"with a C++ compiler command line that cannot take such a path, and probes the CPU in a "
                         f"temporary folder first; point TMPDIR at a path without them"
                         + ("" if into_out else f", {NO_COMPILE}"))
    if config.compiled_dir is not None or into_out:
        return
    from workers.inductor_cache import named_by_user, torchs_default_folder

    # torch writes its own default into the variable at its first cache lookup in a process (not the
    # user's choice), which a child inherits; asked of inductor only where it is loaded already, as
    # importing it takes seconds (each rank replaces that default where it cannot be used)
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named and "torch._inductor" in sys.modules and not named_by_user():
        named = None
    if named and os.path.abspath(named) == os.path.abspath(torchs_default_folder()):
        named = None
    if named:
        if compiler_unsafe_path(named):
            raise ValueError(f"TORCHINDUCTOR_CACHE_DIR ({named}) holds whitespace, a quote or a backslash, which "
                             f"inductor's C++ compiler command line cannot take; name a path without them, or unset it "
                             f"(corelaunch then uses its own folder under CORELAUNCH_CACHE), {NO_COMPILE}")
        _check_named_cache(named, config)
        return
    from workers.inductor_cache import default_inductor_cache
    from workers.native_build import NativeUnavailable, trusted_dir

    cache = default_inductor_cache()
    if compiler_unsafe_path(cache):
        raise ValueError(f"CORELAUNCH_CACHE: the ranks keep inductor's compiled graphs in {cache}, a path with "
                         f"whitespace, a quote or a backslash, which inductor's C++ compiler command line cannot "
                         f"take; set CORELAUNCH_CACHE to a directory whose path has none, {NO_COMPILE}")
    try:
        os.close(trusted_dir(cache, holding="inductor's compiled graphs"))  # made now, as each rank would
    except NativeUnavailable as err:
        text = str(err)
        fix = "" if "CORELAUNCH_CACHE" in text else "; set CORELAUNCH_CACHE to a directory this user can write"
        raise ValueError(f"{_named(cache.parent)} cannot hold inductor's compiled graphs: {text}{fix}, "
                         f"{_no_compile_for(config)}") from None


def _check_named_cache(named: str, config) -> None:
    """A TORCHINDUCTOR_CACHE_DIR that cannot be made or written (under a file, a read-only mount, a
    typo) failed every rank's load with "Artifact of type=precompile already registered", naming
    neither the variable nor the folder; made here as each rank would make it."""
    from workers.inductor_cache import unusable_named_folder, unusable_named_folder_refusal

    why = unusable_named_folder(named)
    if why is not None:
        raise ValueError(unusable_named_folder_refusal(named, why, _no_compile_for(config)))


def _named(cache_root: Path) -> str:
    """The cache folder as the user can find it: under the variable's name only where it is set (it
    said "CORELAUNCH_CACHE (/root/.cache/corelaunch)" of a variable nobody set)."""
    if os.environ.get("CORELAUNCH_CACHE"):
        return f"CORELAUNCH_CACHE ({cache_root})"
    return f"the corelaunch cache (CORELAUNCH_CACHE unset: {cache_root})"


def _no_compile_for(config) -> str:
    """--no-compile as a way out, where it is one: the built-in model not converted yet is converted
    into the same cache, so for it a bare --no-compile led straight to a second refusal."""
    if config.model is not None:
        return NO_COMPILE
    from shardlib.demo_model import PACKAGED_CONFIG, demo_config_path

    if demo_config_path() != PACKAGED_CONFIG:  # converted already: read as it is, nothing written
        return NO_COMPILE
    return ("or run without compiling a model of your own: --no-compile --model DIR (the built-in one is "
            "converted into this cache too)")
