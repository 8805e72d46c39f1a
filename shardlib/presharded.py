"""Pre-sharded checkpoints: each rank's slices written once, so a later load is one plain file read.

Layout of a pre-sharded directory:
  rank-00000-of-00003.safetensors ...  one file per rank, Hugging Face tensor names unchanged, each
                                       tensor already sliced (and padded) for that rank
  manifest.json                        what the files were cut for and by: the slicing version
                                       (shardlib.sharding.SLICING_VERSION), the model's config hash, TP
                                       degree, KV strategy, dtype (what a cast made of the tensors:
                                       quantized codes and their scales keep their own, copy_dtype),
                                       the source weights' fingerprint
                                       (shardlib.weights_fingerprint); each file's size, sha256 and
                                       tensors (dtype and shape of each)
  .rank-...safetensors.verified        written by the first load that hashed the file: its sha256
                                       matched while the file had this size, mtime, ctime and inode

A pre-sharded directory only fits the exact settings it was written for, so loading compares the
manifest with what is asked and refuses any difference instead of returning wrong slices. That
includes the slicing version: a copy cut by another version of shardlib.sharding may hold other
contents in slices of the same shapes (a manifest written before the version was recorded was cut by
version 1).

Every load also checks the rank's file against the manifest: its name stays inside the directory
(no absolute path, no "..", no symlink out), its tensors' names, dtypes and shapes (from the
safetensors header) and its size; the sha256 is checked when no valid `.verified` marker exists,
so each file is hashed once, not on every load. The directory is written atomically
(shardlib.atomic_dir).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import secrets
import stat
from dataclasses import fields as config_fields
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors.torch import save_file

from shardlib import sharding  # SLICING_VERSION read at each use: a test may bump it
from shardlib.atomic_dir import atomic_dir, linking_out_dir
from shardlib.checkpoint import Progress, SafetensorsFile, check_layout, load_rank_shard, shard_shapes
from shardlib.expert_sharding import MOE_SHARDINGS
from shardlib.file_modes import as_umask_allows, process_umask
from shardlib.manifest import MANIFEST, check_field, read_manifest_json, write_manifest_json
from shardlib.model_config import UNHASHED_FIELDS, ModelConfig, load_model_config, normalize_dtype
from shardlib.param_shapes import expected_shapes
from shardlib.quantization import keeps_dtype_of
from shardlib.sharding import KVStrategy, ShardLayout, TensorSlice
from shardlib.weights_fingerprint import FIELD as FINGERPRINT, weights_fingerprint

FORMAT_VERSION = 1
UNRECORDED_SLICING_VERSION = 1
"""The slicing version of a copy whose manifest records none: written before it was recorded, cut by
version 1 (the first), so those copies keep loading until the slicing changes."""
KIND = "a pre-sharded checkpoint"
"""What these directories are called in messages."""
VERIFIED = ".verified"
"""Suffix of the marker a load writes after the file's sha256 matched: .{file}.verified"""
_WRITE_HINT = ("write it with shardlib.presharded.save_presharded (or `corelaunch compile`), or load the original "
               "Hugging Face checkpoint instead")
_REQUIRED = ("format_version", "config_hash", "model_type", "tp_degree", "kv_strategy", "dtype", "files")
_FIELDS = {"format_version": int, "config_hash": str, "model_type": str, "tp_degree": int, "kv_strategy": str,
           "dtype": str, "files": list, "source": str, "slicing_version": int, "corelaunch_version": str,
           FINGERPRINT: str, "pad_q_heads": bool}
_FILE_FIELDS = {"rank": int, "file": str, "bytes": int, "sha256": str}
_WHOLE = TensorSlice(dim=None)


def rank_file_name(rank: int, tp_degree: int) -> str:
    return f"rank-{rank:05d}-of-{tp_degree:05d}.safetensors"


def save_presharded(out_dir: str | Path, model_dir: str | Path, config: ModelConfig, layout: ShardLayout,
                    dtype: str | None = None, progress: Progress | None = None) -> Path:
    """Write every rank's shard of the checkpoint in `model_dir` to `out_dir`; returns out_dir.

    One rank's shard is in memory at a time. The files are written into a new hidden sibling that
    `out_dir` (a symlink) is switched to in one rename once complete and fsynced (shardlib.atomic_dir),
    so `out_dir` always names a complete directory. An existing pre-sharded directory at `out_dir` is
    replaced; any other non-empty directory there is refused.
    """
    out_dir = Path(out_dir)
    dtype_name = None if dtype is None else normalize_dtype(dtype)
    tp = layout.tp_degree
    per_rank = len(expected_shapes(config))
    umask = process_umask()
    with atomic_dir(out_dir, KIND, read_kind=read_manifest) as tmp:
        files = []
        for rank in range(tp):
            def report(name: str, done: int, total: int, rank: int = rank) -> None:
                progress(f"rank {rank}: {name}", rank * per_rank + done, tp * per_rank)

            shard = load_rank_shard(model_dir, config, layout, rank, dtype, report if progress else None)
            tensors = {name: {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)} for name, t in shard.items()}
            path = tmp / rank_file_name(rank, tp)
            _save_rank_file(shard, path, metadata={"format": "pt", "rank": str(rank), "tp_degree": str(tp)})
            as_umask_allows(path, umask)  # 0600 from safetensors: a compiled directory is shared and copied
            del shard
            files.append({"rank": rank, "file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path),
                          "tensors": tensors})
            if dtype_name is None and rank == 0:  # every rank holds the same dtypes: refused before the rest
                _refuse_mixed_dtypes(files, model_dir)
        manifest = {
            "format_version": FORMAT_VERSION,
            "slicing_version": sharding.SLICING_VERSION,
            "config_hash": config.config_hash(),
            "model_type": config.model_type,
            "tp_degree": tp,
            "kv_strategy": layout.kv_strategy.value,
            "pad_q_heads": layout.pad_q_heads,
            **({"moe_sharding": layout.moe_sharding} if layout.moe_sharding else {}),  # MoE models only
            "dtype": dtype_name or _cast_dtype(files),
            "files": files,
            "corelaunch_version": _corelaunch_version(),
            "source": str(Path(model_dir).resolve()),
            FINGERPRINT: weights_fingerprint(model_dir),
        }
        write_manifest_json(tmp, manifest)
    return out_dir


_OS_ERROR = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")
"""How safetensors' SafetensorError quotes the errno of a failed write: "File too large (os error 27)"
(0.5 and later), or its debug form `IoError(Os { code: 27, ... })` (earlier releases)."""


def _save_rank_file(shard: dict, path: Path, metadata: dict[str, str]) -> None:
    """save_file, its failed write raised as the OSError it is (naming `path`): safetensors raises a
    SafetensorError, no OSError, so a full disk or a file size limit ended `corelaunch compile` in a
    traceback instead of its "could not write --out" refusal."""
    from safetensors import SafetensorError

    try:
        save_file(shard, path, metadata=metadata)
    except SafetensorError as err:
        found = _OS_ERROR.search(str(err))
        if found is None:  # not the file system's refusal (a tensor it cannot serialize): as it was
            raise
        code = int(found.group(1) or found.group(2))
        raise OSError(code, os.strerror(code), str(path)) from err


def copy_dtype(manifest: dict[str, Any]) -> str:
    """The dtype a launch must ask for to load this copy as written: the manifest's, or for one written
    "mixed" by an earlier save (a quantized checkpoint saved with dtype=None), what its per-tensor
    records say the cast tensors are. "mixed" only where those differ among themselves."""
    return manifest["dtype"] if manifest["dtype"] != "mixed" else _cast_dtype(manifest["files"])


def _cast_dtype(files: list[dict]) -> str:
    """The one dtype of the tensors a dtype cast changes (load_rank_shard leaves quantized codes and
    their scales in their own dtype: shardlib.quantization.keeps_dtype), "mixed" when they differ.
    It was the dtype of every tensor, so a quantized copy (int8 codes, float32 scales and norms)
    recorded "mixed" and every launch, which asks for one dtype, refused it."""
    records = [(name, record["dtype"]) for entry in files for name, record in entry.get("tensors", {}).items()]
    cast = {dtype for name, dtype in records if not _keeps_own_dtype(name, dtype)}
    found = cast or {dtype for _, dtype in records}  # nothing but quantized tensors: what they are
    return found.pop() if len(found) == 1 else "mixed"


def _refuse_mixed_dtypes(files: list[dict], model_dir: str | Path) -> None:
    """ValueError when, saved without a dtype, the tensors a cast changes are of several dtypes: the
    copy recorded "mixed", which every launch (asking for one dtype) refused after the whole copy
    was written."""
    if _cast_dtype(files) != "mixed":
        return
    found = sorted({record["dtype"] for entry in files for name, record in entry["tensors"].items()
                    if not _keeps_own_dtype(name, record["dtype"])})
    raise ValueError(f"the weights in {model_dir} are of several dtypes ({', '.join(found)}) and save_presharded "
                     f"was given no dtype: a copy of mixed dtypes is refused by every launch, which loads one; "
                     f"pass dtype= (the --dtype the launches will use, e.g. dtype=\"{found[0]}\")")


def _keeps_own_dtype(name: str, dtype: str) -> bool:
    """shardlib.quantization.keeps_dtype from a tensor's name and dtype name (a manifest's record)."""
    return keeps_dtype_of(name, getattr(torch, dtype, None))


def read_manifest(directory: str | Path, *, shown: str | Path | None = None) -> dict[str, Any]:
    """The parsed manifest.json of a pre-sharded directory, every field of the expected type
    (ValueError naming the field otherwise). shown: the directory as messages name it."""
    manifest = read_manifest_json(
        directory, what=KIND, required=_REQUIRED, write_hint=_WRITE_HINT, types=_FIELDS, shown=shown)
    path = Path(directory if shown is None else shown) / MANIFEST
    ranks: set[int] = set()
    for i, entry in enumerate(manifest["files"]):
        check_field(entry, dict, f"files[{i}]", path, _WRITE_HINT)
        for key, kind in _FILE_FIELDS.items():
            if key not in entry:
                raise ValueError(f"{path}: field 'files[{i}].{key}' is missing; {_WRITE_HINT}")
            check_field(entry[key], kind, f"files[{i}].{key}", path, _WRITE_HINT)
        if entry["rank"] in ranks:
            raise ValueError(f"{path}: field 'files[{i}].rank' repeats rank {entry['rank']}; {_WRITE_HINT}")
        ranks.add(entry["rank"])
        if not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
            raise ValueError(f"{path}: field 'files[{i}].sha256' is not a sha256 hex digest; {_WRITE_HINT}")
        for name, record in check_field(entry.get("tensors", {}), dict, f"files[{i}].tensors", path,
                                        _WRITE_HINT).items():
            field = f"files[{i}].tensors[{name!r}]"
            check_field(record, dict, field, path, _WRITE_HINT)
            check_field(record.get("dtype"), str, f"{field}.dtype", path, _WRITE_HINT)
            for n in check_field(record.get("shape"), list, f"{field}.shape", path, _WRITE_HINT):
                check_field(n, int, f"{field}.shape", path, _WRITE_HINT)
    _check_layout_values(manifest, path)
    return manifest


def _check_layout_values(manifest: dict[str, Any], path: Path) -> None:
    """ValueError naming the field for a layout value no save writes: a launch takes these into its
    own settings (launcher/artifacts/presharded_dir.py), where a corrupt "tp_degree": 0 was refused in
    the words of a flag nobody passed (--tp (0) must be a positive integer)."""
    if manifest["tp_degree"] < 1:
        raise ValueError(f"{path}: field 'tp_degree' must be a positive integer, found {manifest['tp_degree']}; "
                         f"{_WRITE_HINT}")
    choices = {"kv_strategy": tuple(s.value for s in KVStrategy), "moe_sharding": MOE_SHARDINGS}
    for field, allowed in choices.items():
        if field in manifest and manifest[field] not in allowed:
            raise ValueError(f"{path}: field {field!r} must be one of {', '.join(allowed)}, found "
                             f"{manifest[field]!r}; {_WRITE_HINT}")


def load_presharded(directory: str | Path, config: ModelConfig, layout: ShardLayout, rank: int,
                    dtype: str | None = None, *, verify_sha256: bool = False,
                    fix: str | None = None) -> dict[str, torch.Tensor]:
    """This rank's shard from a pre-sharded directory: the same dict load_rank_shard returns.

    ValueError when the manifest was written for other settings than (config, layout, dtype), and
    when the rank's file does not match its manifest entry: a path outside the directory, another
    tensor name, dtype or shape, size or sha256. The sha256 is computed when no valid marker says a
    load already verified this very file (or always, with `verify_sha256`). fix: how to replace a
    file damaged in place, for those messages (default: _fixes).
    """
    shown = _shown(directory)
    missing_fix, fix = _fixes(directory, fix)
    check_layout(config, layout, rank)
    root = Path(directory).resolve()  # one version throughout, even when a writer swaps the link meanwhile
    manifest = read_manifest(root, shown=shown)
    _check_settings(manifest, shown, config, layout, dtype)
    path, shown_path, entry = _rank_file(manifest, root, shown, rank, missing_fix)
    _check_rank_of_file(path, shown_path, rank, layout.tp_degree)
    size = path.stat().st_size
    size_error = _size_error(shown_path, size, entry, fix)
    try:
        reader = SafetensorsFile(path)
    except ValueError:
        if size != entry["bytes"]:
            raise size_error from None
        raise
    _check_tensors(reader, shown_path, entry, manifest["dtype"], shard_shapes(config, layout, rank), rank, fix)
    if size != entry["bytes"]:
        raise size_error
    _check_sha256(path, shown_path, entry, force=verify_sha256, fix=fix)
    with reader:
        return {name: reader.read(name, _WHOLE) for name in sorted(reader.entries, key=lambda n: reader.entries[n].begin)}


def check_presharded_dir(directory: str | Path, config: ModelConfig, layout: ShardLayout,
                         dtype: str | None = None, *, fix: str | None = None) -> None:
    """What load_presharded checks before it reads a tensor, for every rank at once and without
    torch: the manifest, its settings against (config, layout, dtype), each rank's file present,
    inside the directory and of the recorded size. The driver runs it before any process starts
    (a broken manifest or a missing file was named only once Ray and every rank had started); the
    tensors and sha256 are still the ranks' to check."""
    shown = _shown(directory)
    root = Path(directory).resolve()
    manifest = read_manifest(root, shown=shown)
    _check_settings(manifest, shown, config, layout, dtype)
    missing_fix, damaged_fix = _fixes(directory, fix)
    for rank in range(layout.tp_degree):
        path, shown_path, entry = _rank_file(manifest, root, shown, rank, missing_fix)
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise _size_error(shown_path, size, entry, damaged_fix)


def _shown(directory: str | Path) -> Path:
    """How messages name `directory`: a launch pins the version its --presharded link named
    (launcher/api.py), named by the path the user gave while that still links there, not by the
    hidden `.NAME.v-...` folder."""
    return linking_out_dir(directory) or Path(directory)


def slicing_version_of(manifest: dict[str, Any]) -> int:
    """The shardlib.sharding.SLICING_VERSION the copy was cut by."""
    return manifest.get("slicing_version", UNRECORDED_SLICING_VERSION)


def other_slicing(manifest: dict[str, Any]) -> str | None:
    """Why the copy's slices may not be what this code cuts (None: cut by this SLICING_VERSION)."""
    found = slicing_version_of(manifest)
    if found == sharding.SLICING_VERSION:
        return None
    return (f"it was cut by slicing version {found}, but this corelaunch slices by version "
            f"{sharding.SLICING_VERSION} (shardlib.sharding.SLICING_VERSION): its slices may hold other contents "
            f"than this code cuts, even where their shapes are the same")


def _check_slicing(manifest: dict[str, Any], shown: Path) -> None:
    why = other_slicing(manifest)
    if why is None:
        return
    source = manifest.get("source")
    raise ValueError(f"pre-sharded checkpoint {shown} is refused: {why}. Write the copy again with this corelaunch "
                     f"(save_presharded or `corelaunch compile`), or load the original checkpoint"
                     f"{' (' + source + ')' if source else ''} instead")


def _check_settings(manifest: dict[str, Any], shown: Path, config: ModelConfig, layout: ShardLayout,
                    dtype: str | None) -> None:
    _check_slicing(manifest, shown)  # first: a copy cut by other code is refused whatever its settings
    asked = {"format_version": FORMAT_VERSION, "config_hash": config.config_hash(),
             "model_type": config.model_type, "tp_degree": layout.tp_degree,
             "kv_strategy": layout.kv_strategy.value, "pad_q_heads": layout.pad_q_heads}
    if layout.moe_sharding:
        asked["moe_sharding"] = layout.moe_sharding
    if dtype is not None:
        asked["dtype"] = normalize_dtype(dtype)
    written = {**manifest, "dtype": copy_dtype(manifest)}
    differ = [f"{key}: expected {value!r}, found {written.get(key)!r}"
              for key, value in asked.items() if written.get(key, False) != value]  # pad_q_heads: optional
    if not differ:
        return
    source = manifest.get("source")
    fields = _config_differences(source, manifest, config) if written["config_hash"] != asked["config_hash"] else []
    settings = f"tp_degree={layout.tp_degree}, kv_strategy={layout.kv_strategy.value!r}" + (
        f", moe_sharding={layout.moe_sharding!r}" if layout.moe_sharding else "") + (
        f", dtype={asked['dtype']!r}" if "dtype" in asked else "")
    if fields:  # the hashes alone told nothing a user could act on; the copy's source is the one model it fits
        differ = [d + f" (the model it was cut from, {source}, differs from --model in {'; '.join(fields)})"
                  if d.startswith("config_hash:") else d for d in differ]
        advice = (f"Pass --model {source} (the model it was cut from) to load it, or re-run save_presharded for "
                  f"this model with {settings}, or load this model's original checkpoint instead")
    else:
        advice = (f"Re-run save_presharded for this model with {settings}, or load the original checkpoint"
                  f"{' (' + source + ')' if source else ''} instead")
    raise ValueError(f"pre-sharded checkpoint {shown} was written for other settings: {'; '.join(differ)}. {advice}")


def _config_differences(source: str | None, manifest: dict[str, Any], config: ModelConfig) -> list[str]:
    """Each config field in which the model the copy was cut from (its manifest's source, read now)
    differs from `config`, as "name: X in the copy's source, Y in --model"; [] when the source's
    config cannot be read or is no longer the one the copy was cut from (its hash moved on), where
    naming its fields would describe another model than the copy's."""
    if not source:
        return []
    try:
        cut_from = load_model_config(source)
    except (OSError, ValueError):
        return []
    if cut_from.config_hash() != manifest["config_hash"]:
        return []
    ignored = {"model_type", *UNHASHED_FIELDS}  # model_type is compared, and named, on its own
    return [f"{f.name}: {getattr(cut_from, f.name)!r} in the copy's source, {getattr(config, f.name)!r} in --model"
            for f in config_fields(config) if f.name not in ignored
            and getattr(cut_from, f.name) != getattr(config, f.name)]


def _rank_file(manifest: dict[str, Any], root: Path, shown: Path, rank: int,
               missing_fix: str) -> tuple[Path, Path, dict]:
    """(path, path as messages name it, manifest entry) of `rank`'s file; refused when the manifest
    lists none, names one outside the directory, or the file is missing (missing_fix: what to do)."""
    entry = next((f for f in manifest["files"] if f["rank"] == rank), None)
    if entry is None:
        raise ValueError(f"{shown / MANIFEST} lists no file for rank {rank}; {_WRITE_HINT}")
    path = _inside(root, shown, entry["file"])
    shown_path = shown / entry["file"]
    if not path.is_file():
        raise FileNotFoundError(f"pre-sharded file {shown_path} named in its {MANIFEST} is missing; {missing_fix}")
    return path, shown_path, entry


def _fixes(directory: str | Path, fix: str | None) -> tuple[str, str]:
    """(how to replace a rank file missing from `directory`, how to replace one damaged in place):
    the caller's `fix` for both where given, else a compiled directory's own (its weights/ were told
    to "write the pre-sharded checkpoint again", which no user of --compiled ever wrote), else the
    pre-sharded directory's, copied or written again."""
    if fix:
        return fix, fix
    compiled = _compiled_dir_fix(directory)
    return (compiled or "copy the whole directory again or write the pre-sharded checkpoint again",
            compiled or "copy it again or write the pre-sharded checkpoint again")


def _compiled_dir_fix(directory: str | Path) -> str | None:
    """The fix for a file of a compiled directory's weights/ (next to its manifest and model/);
    None for any other directory."""
    root = Path(directory)
    compiled = root.parent
    if root.name == "weights" and (compiled / MANIFEST).is_file() and (compiled / "model").is_dir():
        shown = linking_out_dir(compiled) or compiled
        return (f"copy the compiled directory {shown} again (cp -rL: links followed), or run "
                f"`corelaunch compile --out {shown}` again with the options it was compiled with")
    return None


def _size_error(shown_path: Path, size: int, entry: dict, fix: str) -> ValueError:
    return ValueError(f"{shown_path} has {size} bytes but {MANIFEST} records {entry['bytes']}: it was "
                      f"truncated or modified; {fix}")


def _check_rank_of_file(path: Path, shown_path: Path, rank: int, tp_degree: int) -> None:
    """ValueError unless the file is this rank's by its name and by the rank its header records:
    the ranks' shards all have one shape, so a manifest pointing rank 0 at rank 1's file (its
    size and sha256 moved along) passed every other check and each rank ran the other's weights."""
    from safetensors import SafetensorError, safe_open

    named = rank_file_name(rank, tp_degree)
    try:
        with safe_open(path, framework="numpy") as reader:
            recorded = reader.metadata() or {}
    except SafetensorError:
        return  # not a safetensors file: the header checks that follow name it
    found = {k: recorded[k] for k in ("rank", "tp_degree") if k in recorded}
    if path.name != named or found not in ({}, {"rank": str(rank), "tp_degree": str(tp_degree)}):
        shown_header = f"rank {found.get('rank', '-')} of {found.get('tp_degree', '-')}"
        raise ValueError(f"{shown_path} is listed in its {MANIFEST} for rank {rank} of {tp_degree}, but it is not "
                         f"that rank's file (its name {path.name}, its header {shown_header}; that rank's is "
                         f"{named}): the manifest or the files were changed; {_WRITE_HINT}")


def verified_marker(path: str | Path) -> Path:
    """Where a load records that the file at `path` matched its manifest's sha256."""
    path = Path(path)
    return path.parent / f".{path.name}{VERIFIED}"


def _inside(root: Path, shown: Path, name: str) -> Path:
    """root/name, refused (ValueError naming the file and the manifest) unless it stays inside root."""
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or Path(name).is_absolute() or ".." in pure.parts or "\\" in name:
        raise ValueError(f"{shown / MANIFEST} names the file {name!r}, which is not a path inside {shown}: "
                         f"refused (a manifest may only name files in its own directory); {_WRITE_HINT}")
    path = root / name
    real = path.resolve()
    if not real.is_relative_to(root):
        raise ValueError(f"{shown / MANIFEST} names the file {name!r}, a symlink to {real}, outside {shown}: "
                         f"refused (a manifest may only name files in its own directory); {_WRITE_HINT}")
    return path


def _check_tensors(reader: SafetensorsFile, shown_path: Path, entry: dict, manifest_dtype: str,
                   want: dict[str, tuple[int, ...]], rank: int, damaged_fix: str) -> None:
    """The header's tensors against the manifest's record (names, dtypes, shapes) and the config's shapes."""
    found = {name: (_dtype_name(e.dtype), e.shape) for name, e in reader.entries.items()}
    recorded = {name: (r["dtype"], tuple(r["shape"])) for name, r in entry.get("tensors", {}).items()}
    fix = f"it was re-saved or modified; {damaged_fix}"
    for name, (dtype, shape) in found.items():
        if name in recorded:
            expected = recorded[name][0]
        elif manifest_dtype == "mixed" or _keeps_own_dtype(name, dtype):
            expected = None  # no single dtype to hold it to: a quantized tensor keeps its own
        else:
            expected = manifest_dtype
        if expected is not None and dtype != expected:
            raise ValueError(f"{shown_path}: tensor {name!r} has dtype {dtype}, expected {expected} "
                             f"(as its {MANIFEST} records); {fix}")
        if name in recorded and shape != recorded[name][1]:
            raise ValueError(f"{shown_path}: tensor {name!r} has shape {shape}, expected {recorded[name][1]} "
                             f"(as its {MANIFEST} records); {fix}")
    if recorded and recorded.keys() != found.keys():
        name = min(recorded.keys() - found.keys() or found.keys() - recorded.keys())
        raise ValueError(f"{shown_path}: tensor {name!r} is {'missing' if name in recorded else 'unexpected'} "
                         f"(its {MANIFEST} records {len(recorded)} tensors); {fix}")
    missing = [n for n in want if n not in found]
    extra = [n for n in found if n not in want]
    wrong = [n for n in want if n in found and found[n][1] != want[n]]
    if missing or extra or wrong:
        detail = (f"tensor {missing[0]!r} is missing" if missing else f"tensor {extra[0]!r} is unexpected"
                  if extra else f"tensor {wrong[0]!r} has shape {found[wrong[0]][1]}, expected {want[wrong[0]]}")
        raise ValueError(f"{shown_path} does not hold rank {rank}'s shard for this config: {detail}; "
                         f"{damaged_fix}")  # a compiled directory's is copied or compiled again


def _check_sha256(path: Path, shown_path: Path, entry: dict, force: bool, fix: str) -> None:
    """Hash the file unless its marker (same sha256, size, mtime, ctime, inode) says a load did;
    record the marker after a match (where the directory is writable)."""
    marker = verified_marker(path)
    stamp = _stamp(path, entry["sha256"])
    if not force:
        try:
            if json.loads(_read_marker(marker)) == stamp:
                return
        except (OSError, ValueError):
            pass
    if _sha256(path) != entry["sha256"]:
        with contextlib.suppress(OSError):
            marker.unlink(missing_ok=True)
        raise ValueError(f"{shown_path} does not match the sha256 in {MANIFEST}: it is corrupt; {fix}")
    # A fresh name, created here (O_EXCL) and never through a symlink: a fixed name planted as a
    # symlink had the marker written into its target, any file the loading user could write.
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(stamp) + "\n")
        os.replace(tmp, marker)
    except OSError:  # a read-only directory: every load hashes
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _read_marker(marker: Path) -> str:
    """The marker's text, read only from a regular file (not through a symlink; a FIFO planted under
    its name, which a plain open waits on for ever, is not waited on). OSError otherwise."""
    fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as source:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{marker} is not a regular file")
        return source.read(1 << 16).decode()


def _stamp(path: Path, sha256: str) -> dict[str, Any]:
    st = path.stat()
    return {"sha256": sha256, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino, "device": st.st_dev}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _corelaunch_version() -> str:
    try:
        return importlib.metadata.version("corelaunch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"
