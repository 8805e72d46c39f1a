"""One node's shared-memory segment and the three exchanges built on it: reduce, broadcast, gather.

Reduce-scatter is a reduce in which each rank sums only its own block of the slots.

Layout of the segment of a node with n local ranks (offsets in bytes):

    0                     token: b"corelaunch-shm:" + the group's unique id (checked on attach)
    128 + 128 * i         local rank i's block: uint64 sequence counter, int32 pid, then at byte
                          16 + 8 * b the signature (operation, the call's element count, dtype) of its last step in
                          buffer b (one cache line pair each, so counters written by different
                          ranks never share one)
    header                data: buffer 0 slots for local ranks 0 .. n-1, then buffer 1 slots
                          (each slot `slot_bytes`, a multiple of 4096)

Protocol. Every exchange is one step with a sequence number k (1, 2, ...), the same on every local
rank; step k uses buffer k % 2. A rank that has written its slot for step k publishes k in its
counter (release order); a rank that needs a peer's data waits until that peer's counter is >= k
(acquire order) and then reads. Counters only grow.

Reuse is race-free: a rank about to write its slot for step k first makes sure every peer has
published k - 1 or more. A peer publishes k - 1 only after it has finished step k - 2, the last
step that read this buffer, so nobody is still reading the slot being overwritten (double
buffering plus that check). After a reduce or gather the check is already known to hold (that step
waited for every peer), so it costs nothing in the common case; only after a broadcast, where the
root waits for nobody, is it a real wait.

Sums are taken in local-rank order on every rank (slot 0 + slot 1 + ...), so all ranks get
bit-identical results.

Agreement. With its slot each rank publishes the step's signature in its block's word for that
buffer: the operation, the dtype and the element count of the whole call the step is a chunk of
(every rank cuts the same call into the same slot-sized chunks), and a rank that waits for peers'
data compares theirs with its own: ranks whose calls differ fail the step at once rather than
summing stale slot bytes into a longer tensor. The count is the call's, not the chunk's: a call
one slot long beside one two slots long matched chunk for chunk, and the shorter rank's next call
was summed into the longer one's second half, silently. The word for step k's buffer stays until step k + 2, which no peer
can post before this rank has published k + 1.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import re
import threading
import time
from dataclasses import dataclass

import torch

from shardlib.process_alive import process_alive

from workers.collectives import sum_in_rank_order_
from workers.own_files import OPEN_FLAGS, UntrustedEntry, open_own_entry
from workers.shm.native import Native

TOKEN_PREFIX = b"corelaunch-shm:"
SET_UP_GRACE_S = 60.0
"""A segment still without its token is being set up (its creator writes it milliseconds after
creating the file); one older than this that no process holds lost its creator during set-up."""
SEGMENT_PREFIX = "corelaunch-"
SEGMENT_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"[0-9a-f]+-node\d+")
"""The names segment_name gives: only these are taken for segments without a token."""


def segment_name(group_id: str, node: int) -> str:
    """A node's segment of a group (group_id: a uuid's hex), as SEGMENT_NAME matches it."""
    return f"{SEGMENT_PREFIX}{group_id}-node{node}"
_BLOCK = 128  # bytes per rank's header block; counters sit at its start
_PAGE = 4096


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class SegmentLayout:
    local_size: int
    slot_bytes: int

    @property
    def header_bytes(self) -> int:
        return _round_up(_BLOCK * (1 + self.local_size), _PAGE)

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + 2 * self.local_size * self.slot_bytes

    def counter_offset(self, local_rank: int) -> int:
        return _BLOCK * (1 + local_rank)

    def pid_offset(self, local_rank: int) -> int:
        """The int32 pid a local rank writes into its block when it attaches (after its counter)."""
        return self.counter_offset(local_rank) + 8

    def slot_offset(self, buffer: int, local_rank: int) -> int:
        return self.header_bytes + (buffer * self.local_size + local_rank) * self.slot_bytes


class Segment:
    """A mapped shared-memory file: created (and later unlinked) by the node's leader, attached by
    the others. Unlinking only removes the name; the memory lives until every rank unmaps it."""

    def __init__(self, path: str, layout: SegmentLayout, create: bool, token: bytes) -> None:
        self._release_lock = threading.Lock()
        self.path, self.layout = path, layout
        self._held: int | None = None
        if create:
            # O_EXCL: never reuse an entry someone else made (it also refuses a symlink there).
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600)
            # Held (shared) until the name is unlinked: a sweep removes only a segment no process
            # holds (remove_orphans), which a bare pid could not tell across pid namespaces
            # sharing /dev/shm, nor after the pid was reused. On an open file of its own (the same
            # file reopened through /proc): the map's duplicate of `fd` would hold a lock taken
            # on `fd` until the map is closed.
            try:
                self._held = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._held = os.dup(fd)  # no /proc: the lock then lasts as long as the mapping
            fcntl.flock(self._held, fcntl.LOCK_SH)
            try:
                # Reserve the pages now: tmpfs would otherwise grant a sparse file and the first
                # write past /dev/shm's capacity would kill the process with SIGBUS.
                os.posix_fallocate(fd, 0, layout.total_bytes)
                self._map = mmap.mmap(fd, layout.total_bytes)
            except BaseException:
                os.close(fd)
                self.unlink()
                raise
            os.close(fd)
            self._map[: len(token)] = token  # after the lock: a sweep passes over a segment without one
            # The creator's pid, so a later group can tell a segment orphaned by a killed leader.
            pid_at = layout.pid_offset(0)
            self._map[pid_at: pid_at + 4] = os.getpid().to_bytes(4, "little", signed=True)
        else:
            fd = open_own_entry(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                if size != layout.total_bytes:
                    raise RuntimeError(f"{path} holds {size} bytes, expected {layout.total_bytes}")
                self._map = mmap.mmap(fd, layout.total_bytes)
            finally:
                os.close(fd)
            if self._map[: len(token)] != token:
                self._map.close()
                raise RuntimeError(f"{path} does not carry this group's token: not the segment its "
                                   f"node leader created (ranks grouped as one node that are not)")
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # the whole segment
        self.address = self.bytes.data_ptr()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._release()

    def _release(self) -> None:
        # under a lock: the leader's watcher thread (group.py) and its own thread may both get here,
        # and a descriptor closed twice could close another file that reused its number
        with self._release_lock:
            held, self._held = self._held, None
        if held is not None:
            os.close(held)  # the lock goes with it

    def close(self) -> None:
        """Unmap. mmap.close() succeeds even while torch views into the segment are alive
        (torch.frombuffer keeps a reference to the map but not its buffer export), and a view used
        afterwards reads freed memory (a segfault): the caller must make sure nobody touches the
        segment any more (NodeExchange.close waits for the calls in flight)."""
        self._release()
        self.bytes = None
        self._map.close()


def remove_orphans(shm_dir: str) -> list[str]:
    """Unlink segments whose creator has exited: left only if a leader was killed during set-up,
    between creating its segment and unlinking it once all ranks had attached. Returns them.

    A creator holds a shared flock on its segment until it unlinks it; a segment is removed only
    when an exclusive one can be taken (no process holds it), whatever its recorded pid says: from
    another pid namespace sharing /dev/shm a live creator's pid is not visible (its segment was
    removed during its set-up), and a dead creator's pid may have been reused (never removed).

    Only regular files of this user's are read or removed; anything else under the prefix (another
    user's segment, a FIFO or symlink planted to stall or redirect the sweep) is skipped, and no
    open blocks."""
    removed = []
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(SEGMENT_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(shm_dir, name)
        try:
            fd = open_own_entry(path, os.O_RDONLY)
        except (OSError, UntrustedEntry):
            continue  # gone, or not ours (FIFO, symlink, another user's): never touched
        try:
            head = os.pread(fd, _BLOCK * 2, 0)
            own = os.fstat(fd)
            if (not head.startswith(TOKEN_PREFIX) or len(head) < _BLOCK + 12) and not _set_up_abandoned(name, own):
                continue  # still being set up (the token comes after the creator's lock), or not a segment
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its creator holds it: in use
            now = os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (own.st_dev, own.st_ino):  # still the file checked
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _set_up_abandoned(name: str, stat: os.stat_result) -> bool:
    """A segment's name without a token for SET_UP_GRACE_S: a creator killed between creating it and
    writing its token (a full-size segment, or an empty file) left it, and the token check kept it
    until the next reboot. (Removed only if no process holds its lock, as every other.)"""
    return SEGMENT_NAME.fullmatch(name) is not None and time.time() - stat.st_mtime > SET_UP_GRACE_S


class CollectiveTimeout(TimeoutError):
    """A peer did not arrive in time (or its process is gone); the group cannot be used again."""


def timeout_advice(timeout_s: float) -> str:
    """What to do about a collective that waited `timeout_s` for a peer (shared memory or gloo)."""
    return (f"Restart the group. The {timeout_s:g} s is the process group's timeout, which a launched group "
            f"sets to its --rendezvous-timeout plus 5 s: where a rank is legitimately busy longer than that "
            f"between two collectives (a long shard read, say), raise --rendezvous-timeout; otherwise a rank "
            f"is stuck, or its node frozen. To tell the shared-memory path apart "
            f"from the ranks themselves, run the group with CORELAUNCH_COLLECTIVES=gloo (it waits as long)")


class CollectivesClosed(RuntimeError):
    """A collective called on (or still waiting in) an exchange that was closed."""


CLOSE_WAIT_S = 2.0
"""How long close() waits for calls in flight to leave (a waiter notices the close on its next
liveness check, within ~0.2 s) before leaving the unmapping to the last of them."""
_GONE_PID = 2**31 - 1
"""A pid no process can have (Linux pids stay below 2**22): cl_wait's liveness check, every ~0.2 s,
reads the pids array from this process's memory, so writing this there makes every waiter give up
as if its peers had exited; NodeExchange._wait then reports the close instead."""


class NodeExchange:
    """Local rank `local_rank` of the `layout.local_size` ranks sharing `segment`."""

    def __init__(self, segment: Segment, local_rank: int, global_ranks: list[int], native: Native,
                 timeout_s: float, spin_s: float, yield_s: float) -> None:
        self.segment, self.layout = segment, segment.layout
        self.local_rank, self.global_ranks = local_rank, list(global_ranks)
        self.size = self.layout.local_size
        self._native = native
        self.timeout_s, self.spin_s, self.yield_s = timeout_s, spin_s, yield_s
        n = self.size
        self._counters = segment.address + self.layout.counter_offset(0)
        self._my_counter = segment.address + self.layout.counter_offset(local_rank)
        self._stride = _BLOCK // 8
        self._pids = (ctypes.c_int32 * n)()
        self._missing = (ctypes.c_int32 * n)()
        self._others = (ctypes.c_int32 * n)(*[int(i != local_rank) for i in range(n)])
        self._only = [(ctypes.c_int32 * n)(*[int(i == j) for i in range(n)]) for j in range(n)]
        self._seq = 0
        self._step_sig = 0  # signature() of the step last posted
        self._all_reached = 0  # every peer is known to have published at least this step
        self._broken: str | None = None
        self._views: dict = {}
        # Calls in flight, so that close() never unmaps under one (a thread waiting in cl_wait or
        # copying from a slot would touch freed memory: a segfault, not an error).
        self._flight = threading.Lock()  # a plain lock: taken twice a step, on the decode path
        self._in_flight = 0
        self._closed = False
        self._unmapped = False
        torch.frombuffer(segment._map, dtype=torch.int32, count=1,
                         offset=self.layout.pid_offset(local_rank))[0] = os.getpid()

    # ---- set-up ----------------------------------------------------------------------------
    def read_peer_pids(self) -> None:
        """Remember each peer's pid (written at attach) for the dead-peer check while waiting; a
        pid this process cannot see (another pid namespace) is not checked."""
        for i in range(self.size):
            off = self.layout.pid_offset(i)
            pid = int(torch.frombuffer(self.segment._map, dtype=torch.int32, count=1, offset=off)[0])
            visible = pid > 0 and i != self.local_rank and process_alive(pid)
            self._pids[i] = pid if visible else 0

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """End the group on this rank: later calls raise CollectivesClosed, a call waiting for a peer
        raises it within ~0.2 s, and the segment is unmapped once no call is in flight (here, or by
        the last call to leave when one is still inside after `wait_s`)."""
        with self._flight:
            if self._closed:
                return
            self._closed = True
            for i in range(self.size):
                self._pids[i] = _GONE_PID  # wakes every waiter on its next liveness check
        deadline = time.monotonic() + wait_s
        while True:
            with self._flight:
                if self._in_flight == 0 or time.monotonic() > deadline:
                    self._unmap_if_idle()  # else the last call to leave unmaps
                    return
            time.sleep(0.01)

    def _unmap_if_idle(self) -> None:
        """Under self._flight, once closed."""
        if self._in_flight == 0 and not self._unmapped:
            self._unmapped = True
            self._views.clear()
            self.segment.close()

    def _enter(self) -> None:
        with self._flight:
            if self._closed:
                raise CollectivesClosed(self._closed_message("was called after"))
            self._in_flight += 1

    def _leave(self) -> None:
        with self._flight:
            self._in_flight -= 1
            if self._closed:
                self._unmap_if_idle()

    def _closed_message(self, when: str) -> str:
        return (f"shared-memory collective on rank {self.global_ranks[self.local_rank]} {when} this rank's "
                f"collectives were closed (the worker is shutting down); no collective can run on them any more")

    # ---- the steps ---------------------------------------------------------------------------
    def max_numel(self, dtype: torch.dtype) -> int:
        """Elements of `dtype` one step moves per rank."""
        return self.layout.slot_bytes // _itemsize(dtype)

    def reduce_(self, flat: torch.Tensor, total: int | None = None) -> None:
        """flat <- sum over local ranks of their `flat` (local-rank order); fits one slot. total:
        the element count of the call `flat` is a chunk of (default: flat's own)."""
        self._enter()
        try:
            slots = self._post(flat, signature(flat, REDUCE, total))
            self._wait(self._seq, self._others, self._step_sig)
            self._all_reached = self._seq
            sum_in_rank_order_(flat, slots)
        finally:
            self._leave()

    def broadcast_(self, flat: torch.Tensor, root: int = 0, total: int | None = None,
                   root_waits_for: str = "") -> None:
        """flat <- local rank `root`'s flat. root_waits_for: what the root waits on before it posts
        (", which itself waits for ..."), named if this rank times out: else the message blames a
        root that is only the messenger of a rank stuck elsewhere."""
        self._enter()
        try:
            if self.local_rank == root:
                self._post(flat, signature(flat, BROADCAST, total))
                return
            if self._broken:
                raise CollectiveTimeout(self._broken)
            self._seq += 1
            slots = self._slots(self._seq & 1, flat.dtype, flat.numel())
            self._wait(self._seq, self._only[root], signature(flat, BROADCAST, total), root_waits_for)
            flat.copy_(slots[root])
            self._native.publish(self._my_counter, self._seq, 0)  # "done reading" for the root's next write
        finally:
            self._leave()

    def reduce_scatter(self, blocks: torch.Tensor, out: torch.Tensor, total: int | None = None) -> None:
        """out <- sum over local ranks of their blocks[local_rank] (local-rank order); blocks is
        (size, m), contiguous, and fits one slot; out is (m,)."""
        self._enter()
        try:
            slots = self._post(blocks.view(-1), signature(blocks, REDUCE_SCATTER, total))
            self._wait(self._seq, self._others, self._step_sig)
            self._all_reached = self._seq
            m = out.numel()
            mine = [slot[self.local_rank * m: (self.local_rank + 1) * m] for slot in slots]
            sum_in_rank_order_(out, mine)
        finally:
            self._leave()

    def gather(self, flat: torch.Tensor, out: torch.Tensor, total: int | None = None) -> None:
        """out[i] <- local rank i's flat; out is (size, numel)."""
        self._enter()
        try:
            slots = self._post(flat, signature(flat, GATHER, total))
            self._wait(self._seq, self._others, self._step_sig)
            self._all_reached = self._seq
            for i, slot in enumerate(slots):
                out[i].copy_(slot)
        finally:
            self._leave()

    # ---- internals -------------------------------------------------------------------------
    def _peer_sig(self, local_rank: int, step: int) -> int:
        """The signature local rank `local_rank` published for `step` (cl_publish's word for its buffer)."""
        offset = self.layout.counter_offset(local_rank) + 8 * (2 + (step & 1))
        return int(torch.frombuffer(self.segment._map, dtype=torch.int64, count=1, offset=offset)[0])

    def _post(self, flat: torch.Tensor, sig: int) -> list[torch.Tensor]:
        """Start step seq + 1: write this rank's slot and publish it with `sig` (signature());
        returns the step's slots."""
        if self._broken:
            raise CollectiveTimeout(self._broken)
        seq = self._seq + 1
        if self._all_reached < seq - 1:
            self._wait(seq - 1, self._others)  # peers done reading this buffer (see module doc)
            self._all_reached = seq - 1
        self._seq = seq
        slots = self._slots(seq & 1, flat.dtype, flat.numel())
        slots[self.local_rank].copy_(flat)
        self._step_sig = sig
        self._native.publish(self._my_counter, seq, self._step_sig)
        return slots

    def _slots(self, buffer: int, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        key = (buffer, dtype, numel)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 256:  # many distinct sizes (prefills of many lengths)
                self._views.clear()
            size = numel * _itemsize(dtype)
            views = [self.segment.bytes[off: off + size].view(dtype)
                     for off in (self.layout.slot_offset(buffer, i) for i in range(self.size))]
            self._views[key] = views
        return views

    def _wait(self, target: int, wanted, sig: int = 0, root_waits_for: str = "") -> None:
        """Until every wanted peer has published step `target`; with `sig` (the step's signature()),
        also that each posted the same size and dtype. root_waits_for: what the awaited peer itself
        waits on before it can post (a clause for the timeout's message; see broadcast_)."""
        status = self._native.wait(self._counters, self._stride, self.size, wanted, target, self.spin_s,
                                   self.yield_s, self.timeout_s, self._pids, self._missing, sig)
        if status == 0:
            return
        if status == 2 and self._closed:  # close() set the pids that ended the wait
            raise CollectivesClosed(self._closed_message("was waiting for a peer when"))
        late = [i for i in range(self.size) if self._missing[i]]
        who = ", ".join(f"rank {self.global_ranks[i]} (pid {self._pids[i] or '?'})" for i in late)
        if status == 3:  # not a timeout: a bug in whoever called the collective, but the group is out of step
            theirs = ", ".join(f"{describe_signature(self._peer_sig(i, target))} from rank {self.global_ranks[i]}"
                               for i in late)
            self._broken = (
                f"shared-memory collective on rank {self.global_ranks[self.local_rank]}: step {target} moves "
                f"{describe_signature(sig)} here but {theirs}; the ranks called different collectives and the "
                f"group cannot continue. Restart the group, and report this as a corelaunch bug")
            raise CollectiveTimeout(self._broken)
        here = f"shared-memory collective on rank {self.global_ranks[self.local_rank]}"
        if status == 1:
            self._broken = (f"{here}: waited {self.timeout_s:g} s for {who} to reach step {target}"
                            f"{root_waits_for}; the group cannot continue. {timeout_advice(self.timeout_s)}")
        else:
            self._broken = (f"{here}: the process of {who} exited before reaching step {target}; the group "
                            f"cannot continue. Restart the group; that rank's own log says why it exited")
        raise CollectiveTimeout(self._broken)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES, start=1)}
_OTHER_DTYPE = 255


REDUCE, BROADCAST, GATHER, REDUCE_SCATTER = 1, 2, 3, 4
_OPERATIONS = {REDUCE: "reduce", BROADCAST: "broadcast", GATHER: "gather", REDUCE_SCATTER: "reduce-scatter"}
_MAX_TOTAL = (1 << 51) - 1  # the word is a signed 64-bit integer: 51 bits of count, 4 of operation, 8 of dtype


def signature(part: torch.Tensor, operation: int, total: int | None = None) -> int:
    """What one step is part of, as a nonzero word every rank computes alike: the operation, the
    element count of the whole call (`total`; default: `part`'s own) and the dtype."""
    total = part.numel() if total is None else total
    return min(total, _MAX_TOTAL) << 12 | operation << 8 | _DTYPE_CODES.get(part.dtype, _OTHER_DTYPE)


def describe_signature(sig: int) -> str:
    code = sig & 0xFF
    dtype = _DTYPES[code - 1] if 1 <= code <= len(_DTYPES) else "another dtype"
    return f"a {_OPERATIONS.get(sig >> 8 & 0xF, 'collective')} of {sig >> 12} elements of {dtype}"
