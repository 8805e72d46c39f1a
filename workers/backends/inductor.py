"""Per-bucket torch.compile (inductor) graphs: what the cpu and cuda backends compile with.

workers/compiled.py's CompiledCausalLM runs on whichever device the model is on, so both backends
share this; only where the model lives differs.
"""

from __future__ import annotations

import importlib
import threading

from workers.backends.base import CompileOptions


def prefetch_compiler() -> threading.Thread:
    """Import inductor's modules (~2 s) on a background thread, while the shard is being read."""
    thread = threading.Thread(target=_import_compiler, daemon=True)
    thread.start()
    return thread


def _import_compiler() -> None:
    """This user's own inductor cache first (workers/inductor_cache.py): importing inductor looks up
    its cache folder, and torch's default, $TMPDIR/torchinductor_<user>, was made (or found: a file
    another user placed there failed every compiled launch of this user's) before the first compile
    pointed the variable elsewhere."""
    from workers.inductor_cache import ensure_private_inductor_cache, record_failed_import
    from workers.native_build import NativeUnavailable

    try:
        ensure_private_inductor_cache()
        importlib.import_module("torch._inductor.compile_fx")
    except NativeUnavailable:  # a refusal made before importing anything: the first compile, which
        return  # calls it again (workers/compiled.py), says it
    except Exception as err:  # noqa: BLE001
        # A module whose import failed half-way leaves what it registered behind: the compile's own
        # import of it failed with some unrelated assertion, so the first compile raises this instead.
        record_failed_import(err)


def compile_per_bucket(model, compile: CompileOptions):
    """A CompiledCausalLM of `model` whose compiled code is cached in compile.cache_dir (see
    workers/compiled.py for why this and not AOTInductor); every bucket's graph built now when
    compile.warm_up, else each on first use."""
    from workers.compiled import CompiledCausalLM, use_cache_dir

    if compile.cache_dir is not None:
        use_cache_dir(compile.cache_dir)
    compiled = CompiledCausalLM(model, compile.buckets, granularity=compile.granularity, announce=compile.announce)
    if compile.warm_up:
        compiled.warm_up(progress=compile.progress)
    return compiled
