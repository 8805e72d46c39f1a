"""A per-model cache of pre-sharded weights, so a restarted TP group (or a later launch with the
same layout) loads each rank's file in one read instead of slicing the original checkpoint.

The cache key covers everything a pre-sharded copy depends on: the checkpoint's resolved path, its
config.json and the weight files (and index) the checkpoint reader loads (name, size, modification
time), the model config hash, TP degree, KV strategy and dtype, and the slicing version
(shardlib.sharding.SLICING_VERSION) once it is past 1. A changed checkpoint, or slicing code that
cuts other contents, therefore never loads a stale copy; shardlib.presharded also checks its manifest
against the requested layout (and slicing version) on every load. Tokenizer and generation files are not in the key: no shard depends on them, and an edit
of one wrote another full copy of the model beside the first.

The copy is written by the driver in a background thread after the first load (one rank's shard in
memory at a time, written to a hidden versioned folder that the cache path, a symlink, is switched to
in one rename once complete: shardlib.atomic_dir; a half-written copy is never used, and one left by
a killed driver is swept by the next write). A launch that finds another one writing the same
copy leaves it to that one and never waits for it. It costs the model's size again on disk. On a multi-node cluster the cache directory
must be visible at the same path on every node, like the model directory itself.

The key is made of things any user can read, so in a cache other users can write to, a copy with
the right name could be anyone's weights. A copy is used, and written, only where the folder that
holds it, the copy's link and what it links to are this user's and writable by nobody else
(`untrusted`); the default folder is this user's own, $CORELAUNCH_CACHE/presharded-uid<uid>.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path

def cache_root(directory: str | None) -> Path:
    if directory:
        return Path(directory)
    from shardlib.demo_model import default_cache_dir

    return Path(default_cache_dir()) / f"presharded-uid{os.getuid()}"


def untrusted(path: Path) -> str | None:
    """Why the cached copy at `path` must not be used or written (None: nothing against it): the
    folder holding it, the copy's link and the version it links to must each be this user's and
    writable by nobody else. A part that does not exist yet is nothing against it."""
    from workers.native_build import untrusted as untrusted_stat  # the native libraries' own rule

    checks = ((path.parent, True, "the cache folder"), (path, False, "the cached copy"),
              (path, True, "the version the cached copy links to"))
    for where, follow, what in checks:
        try:
            st = os.stat(where, follow_symlinks=follow)
        except FileNotFoundError:
            continue
        except OSError as err:  # a file where a folder on the way should be (it raised after Ray started)
            return f"{what} ({where}) cannot be reached: {err.strerror}; remove what is in the way"
        if what == "the cache folder" and not stat.S_ISDIR(st.st_mode):
            return f"the cache folder ({where}) is not a directory; remove it or choose another folder"
        if stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid():
            continue  # a link's own mode is always 0777: only its owner counts
        why = untrusted_stat(st)
        if why is not None:
            return f"{what} ({where}): {why}; {_trust_fix(where, st)}"
    return None


def _trust_fix(where: Path, st: os.stat_result) -> str:
    """The way out of untrusted()'s refusal of `where`. A folder the user made with umask 002 (mode
    775) was never used, the note naming the mode but not what to do."""
    elsewhere = ("pass a folder only you can write (presharded_cache_dir, or CORELAUNCH_CACHE for the default; "
                 "a missing one is created 0700)")
    if st.st_uid != os.getuid():  # chmod is the owner's: only another folder helps
        return elsewhere
    return f"`chmod go-w {where}`, or {elsewhere}"


def cache_dir(root: Path, model_dir: str | Path, config, layout, dtype: str) -> Path:
    """The cache folder for this checkpoint and layout (named so a person can tell what it holds)."""
    from shardlib import sharding

    model_dir = Path(model_dir).resolve()
    files = sorted((str(p.relative_to(model_dir)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in _key_files(model_dir) if p.is_file())
    blob = json.dumps([str(model_dir), files, config.config_hash(), layout.tp_degree,
                       layout.kv_strategy.value, dtype, layout.pad_q_heads]
                      + ([layout.moe_sharding] if layout.moe_sharding else [])
                      # from version 2 on: the copies cut by version 1 keep the key they were written under
                      + ([f"slicing-{sharding.SLICING_VERSION}"] if sharding.SLICING_VERSION != 1 else [])).encode()
    key = hashlib.sha256(blob).hexdigest()[:16]
    return root / f"{_name_part(model_dir.name)}-tp{layout.tp_degree}-{layout.kv_strategy.value}-{dtype}-{key}"


NAME_PART_BYTES = 64
"""The most bytes of the model folder's name a cache name keeps. The key identifies the model; the
name is only for people. A folder name near the file system's 255-byte limit made atomic_dir's
hidden `.NAME.v-HOST-PID-RANDOM` sibling too long, so every write failed and every launch read the
checkpoint again."""


def _name_part(name: str) -> str:
    """`name` cut to NAME_PART_BYTES bytes of UTF-8, never inside a character."""
    return os.fsencode(name)[:NAME_PART_BYTES].decode("utf-8", errors="ignore")


def _key_files(model_dir: Path) -> list[Path]:
    """config.json and the files the checkpoint reader loads weights from (shardlib.checkpoint_files:
    the preferred format's file, or its index and the shard files the index names). Every top-level
    *.json was hashed: an edit of tokenizer_config.json wrote another full copy of the model."""
    from shardlib.checkpoint_files import find_checkpoint, preferred_file

    config_json = model_dir / "config.json"
    found = preferred_file(model_dir)
    if found is None:  # no checkpoint: the launch refuses it before any copy is written
        return [config_json]
    _, path = found
    if not path.name.endswith(".index.json"):
        return [config_json, path]  # (find_checkpoint would read a whole pickle to list it)
    try:
        shards = find_checkpoint(model_dir).files  # the index read, its files looked up
    except (OSError, ValueError):  # a broken index: the launch's checks name it; the index's own stat keys it
        shards = ()
    return [config_json, path, *shards]


def is_ready(path: Path) -> bool:
    from shardlib.presharded import MANIFEST

    return (path / MANIFEST).is_file()


def unusable(path: Path, model_dir: str | Path) -> str | None:
    """Why a ready copy must not be loaded (None: nothing against it), told from its manifest and
    file sizes and a sample of the checkpoint's bytes: a file missing or of another size than its
    manifest records (a truncated copy was refused at every launch, with advice to write again a
    copy the user never wrote), or weights that are not those the copy was cut from (a checkpoint
    replaced in place with the same sizes and times, which the key cannot see). Such a copy is
    loaded around and written again. So is a copy cut by another slicing version."""
    from shardlib.presharded import other_slicing, read_manifest
    from shardlib.weights_fingerprint import FIELD, weights_fingerprint

    try:
        manifest = read_manifest(path)  # every field of its type, or ValueError
        for entry in manifest["files"]:
            if (path / entry["file"]).stat().st_size != entry["bytes"]:
                return f"{path / entry['file']} is not the size its manifest records"
    except (OSError, ValueError) as err:
        return f"its manifest or files cannot be read ({type(err).__name__}: {err})"
    other_code = other_slicing(manifest)
    if other_code is not None:  # (its key holds the version: only a copy edited, or a version bumped back)
        return other_code
    recorded = manifest.get(FIELD)
    if isinstance(recorded, str) and weights_fingerprint(model_dir) not in (None, recorded):
        return f"it was cut from other weights than {model_dir} holds now"
    return None


class CacheWriter:
    """Writes the pre-sharded copy once, in a background thread; `ready` says when it can be used."""

    def __init__(self, path: Path, model_dir: str | Path, config, layout, dtype: str, force: bool = False,
                 note: Callable[[str], None] | None = None):
        """force: write even over a copy that looks usable (its load failed: a file damaged in place,
        with its size kept, is found only by the rank's sha256). note: told why a write failed (it was
        stored in `error` and never said: every later launch loaded from the checkpoint again)."""
        self.path = path
        self.error: BaseException | None = None
        self._args = (model_dir, config, layout, dtype)
        self._force = force
        self._note = note
        self._gave_way = False
        """Another launch held the copy's lock: this one wrote nothing, and the copy there may be the
        stale one that launch is replacing."""
        self._other_copy_usable = False
        self._thread = threading.Thread(target=self._write, name="corelaunch-presharded-cache", daemon=True)

    def start(self) -> "CacheWriter":
        self._thread.start()
        return self

    @property
    def ready(self) -> bool:
        """The copy can be loaded: written by this writer, or, where it gave way to another launch's,
        usable as it stands (a restart pinned the stale copy that launch was replacing, weights of
        a checkpoint replaced in place included, which the ranks' sha256 checks cannot tell)."""
        if self._thread.is_alive() or self.error is not None or not is_ready(self.path):
            return False
        if self._gave_way and not self._other_copy_usable:  # once usable, it stays so: not sampled again at each poll
            self._other_copy_usable = unusable(self.path, self._args[0]) is None
        return not self._gave_way or self._other_copy_usable

    @property
    def writing(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _write(self) -> None:
        from filelock import FileLock, Timeout

        from shardlib.presharded import save_presharded

        model_dir, config, layout, dtype = self._args
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            why = untrusted(self.path)
            if why is not None:
                raise PermissionError(f"not writing the pre-sharded cache: {why}")
            # One writer per copy, even across launchers, and never waited for: a launch that found
            # another one writing the copy waited at its shutdown (up to CACHE_WRITE_WAIT_S) for a
            # copy it was not writing. That launch writes it; this one loads it once it is there.
            lock = FileLock(str(self.path) + ".lock", timeout=0)
            try:
                lock.acquire()
            except Timeout:
                self._gave_way = True
                if self._note is not None:
                    self._note(f"another launch is writing the pre-sharded cache copy {self.path}; this one leaves "
                               f"it to that launch and loads from the checkpoint until the copy is there")
                return
            try:
                if self._force or not is_ready(self.path) or unusable(self.path, model_dir) is not None:
                    _unlink_unreadable_copy(self.path)
                    save_presharded(self.path, model_dir, config, layout, dtype=dtype)
            finally:
                lock.release()
        except BaseException as err:  # noqa: BLE001 - a cache that cannot be written is only slower
            self.error = err
            if self._note is not None:
                self._note(f"the pre-sharded cache copy {self.path} was not written ({type(err).__name__}: "
                           f"{err}); launches load from the checkpoint until it is")


def _unlink_unreadable_copy(path: Path) -> None:
    """Remove the cache's link when it names a version atomic_dir wrote whose manifest cannot be
    read (damaged in place, or deleted): save_presharded refuses to replace a directory that is not
    a pre-sharded checkpoint (refuse_foreign_dir, which guards a user's --out), so such a copy was
    refused at every launch while the launch said it would write it again. The cache is ours (the
    caller holds its lock and passed `untrusted`), and only a link atomic_dir made is removed. The
    version it named is removed too unless a launch still holds it (a later sweep removes it then)."""
    from shardlib.atomic_dir import current_version, in_use
    from shardlib.presharded import read_manifest

    version = current_version(path)
    if version is None or not version.is_dir():
        return  # nothing linked (or a dangling link, which save_presharded replaces as it is)
    try:
        read_manifest(version)
        return  # a readable manifest: save_presharded replaces the copy itself
    except (OSError, ValueError):
        pass
    path.unlink()
    if not in_use(version):
        shutil.rmtree(version, ignore_errors=True)
