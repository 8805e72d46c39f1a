"""Choosing and building a CPU group's collectives once gloo is up.

    mode "gloo"  -> gloo only (TorchDistributedCollectives)
    mode "auto"  -> shared memory where ranks share a node, gloo otherwise; if shared memory cannot
                    be set up (no C compiler, no /dev/shm, /dev/shm full) every rank falls back to
                    gloo together, with a warning saying why
    mode "shm"   -> like auto, but a failed set-up raises instead of falling back (tests, benchmarks)

Set-up is collective: every rank calls `build_cpu_collectives` at the same time, after
torch.distributed.init_process_group, and they agree at each step over gloo, so a failure on one
rank never leaves the others waiting.

Segments are named /dev/shm/corelaunch-<id>-node<i>, where <id> is drawn by rank 0 and broadcast
over gloo, so concurrent groups never collide. Each node's leader (its lowest rank) creates the
segment, every local rank attaches, and the leader unlinks the name as soon as all have attached
(seen in the pid each writes into the segment, not after the world-wide round that follows, which a
rank on another node may reach late): from then on nothing is left in /dev/shm, whatever happens to
the processes (the memory is freed when the last rank unmaps it, at close() or exit). The leader
creates its segment only once every rank has loaded the C helpers (a build on a cold cache:
seconds), so only a leader killed between creating and unlinking (the one world-wide round of step
2 between them: milliseconds of work on every rank, but as long as the slowest rank on any node takes
to reach it; attaching without it would need the local ranks to find the segment on their own) could
leave its segment behind; the next leader to
create one removes such orphans (no process holds the shared flock their creator kept on them until
it unlinked them).

Any local user can create names in /dev/shm, so every entry is opened without blocking and without
following symlinks, and used, swept or removed only if it is a regular file of this user's (see
workers/own_files.open_own_entry): a FIFO planted as corelaunch-x stalls nothing, a symlink is refused.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import uuid

import torch.distributed as dist

from shardlib import env_settings
from workers.collectives import Collectives, TorchDistributedCollectives

log = logging.getLogger(__name__)

MODES = env_settings.COLLECTIVES_MODES
ENV_VAR = env_settings.COLLECTIVES
SHM_DIR = "/dev/shm"
DEFAULT_SLOT_BYTES = 1 << 20
"""Bytes one rank moves per step (a decode step's hidden state is a few KiB; a prefill's larger
tensors go in slot-sized chunks). A node's segment is 2 x local ranks x this."""
SPIN_S = 0.0
"""Busy-wait (cpu pause) this long before yielding; the native wait always starts with ~64 pauses.
0, measured: on the shared 2-core machine, 2 ranks, 1 x 1024 (benchmarks/allreduce.py style, four
interleaved runs), spinning 50 us before yielding gave means of 67-195 us against 23-84 us for
yielding at once, and spinning for ever a p99 of 11 ms. A sched_yield on a core with nothing else
to run returns in well under a microsecond, so yielding costs little when cores are free and hands
the core to a peer (or anyone) when they are not."""
YIELD_S = 2e-3
"""sched_yield until this long, then sleep in 50 us naps (a peer far behind: a long prefill chunk)."""


def mode_from_env(default: str = "auto") -> str:
    """CORELAUNCH_COLLECTIVES (auto | gloo | shm), checked."""
    return env_settings.choice(ENV_VAR, MODES) or default


def hostname_groups(world_size: int) -> list[list[int]]:
    """Ranks grouped by hostname, gathered over gloo (used when the launcher passes no node_groups)."""
    names: list = [None] * world_size
    dist.all_gather_object(names, socket.gethostname())
    groups: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        groups.setdefault(name, []).append(rank)
    return list(groups.values())


def check_node_groups(node_groups: list[list[int]], world_size: int) -> list[list[int]]:
    """node_groups sorted, each rank exactly once; ValueError naming the problem otherwise."""
    groups = [sorted(int(r) for r in g) for g in node_groups if len(g)]
    seen = sorted(r for g in groups for r in g)
    if seen != list(range(world_size)):
        raise ValueError(f"node_groups {node_groups} must place each rank 0 .. {world_size - 1} on exactly "
                         f"one node")
    return sorted(groups)


def build_cpu_collectives(rank: int, world_size: int, node_groups: list[list[int]] | None,
                          timeout_s: float, mode: str = "auto",
                          slot_bytes: int = DEFAULT_SLOT_BYTES) -> Collectives:
    """The collectives for this rank of an initialised gloo group (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"collectives mode {mode!r} is not one of {', '.join(MODES)}")
    gloo = TorchDistributedCollectives()
    if mode == "gloo" or world_size == 1:
        return gloo
    groups = check_node_groups(node_groups, world_size) if node_groups is not None else hostname_groups(world_size)
    if all(len(g) == 1 for g in groups):
        return gloo  # nobody shares a node: nothing to gain
    try:
        return _build(rank, world_size, groups, timeout_s, slot_bytes, gloo)
    except _SetupFailed as err:
        if mode == "shm":
            raise RuntimeError(f"shared-memory collectives could not be set up ({err}); unset "
                               f"{ENV_VAR} or set it to auto to fall back to gloo") from None
        if rank == 0:
            log.warning("shared-memory collectives unavailable (%s); using gloo", err)
        return gloo


class _SetupFailed(Exception):
    pass


def _agree(error: str | None, world_size: int) -> None:
    """Every rank learns every rank's error from this step; raise _SetupFailed if there was one."""
    errors: list = [None] * world_size
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise _SetupFailed("; ".join(f"rank {r}: {e}" for r, e in failed))


def _build(rank: int, world_size: int, groups: list[list[int]], timeout_s: float, slot_bytes: int,
           gloo: TorchDistributedCollectives) -> Collectives:
    from workers.shm.collectives import HierarchicalCollectives, ShmCollectives
    from workers.shm.exchange import TOKEN_PREFIX, NodeExchange, Segment, SegmentLayout, remove_orphans, segment_name

    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    group_id = box[0]
    node = next(i for i, g in enumerate(groups) if rank in g)
    local = groups[node]
    local_rank = local.index(rank)
    token = TOKEN_PREFIX + group_id.encode()
    layout = SegmentLayout(local_size=len(local), slot_bytes=_round_slot(slot_bytes))
    path = os.path.join(SHM_DIR, segment_name(group_id, node))
    shared = len(local) > 1
    segment = None
    native = None

    # Step 1: the helpers, loaded everywhere before any segment exists: a rank still building them
    # (seconds on a cold cache) would otherwise hold a leader's segment named in /dev/shm that long,
    # left behind if the leader were killed meanwhile.
    error = None
    try:
        if shared:
            from workers.shm.native import native as load_native

            native = load_native()
    except Exception as err:  # noqa: BLE001 - reported to every rank, then a fallback
        error = f"{type(err).__name__}: {err}"
    _agree(error, world_size)
    try:
        # Step 2: each sharing node's leader sweeps orphans and creates its segment.
        error = None
        try:
            if shared and local_rank == 0:
                remove_orphans(SHM_DIR)
                segment = Segment(path, layout, create=True, token=token)
        except Exception as err:  # noqa: BLE001 - reported to every rank, then a fallback
            error = f"{type(err).__name__}: {err}"
        _agree(error, world_size)
        # Step 3: the others attach; the leader removes the name once they all have (memory stays
        # mapped), on a thread, not after the world-wide round below: a rank on another node slow to
        # reach that round kept the name, left in /dev/shm if the leader was killed meanwhile.
        error = None
        try:
            if shared and local_rank > 0:
                segment = Segment(path, layout, create=False, token=token)
        except Exception as err:  # noqa: BLE001
            error = f"{type(err).__name__}: {err}"
        exchange = None
        if segment is not None:
            exchange = NodeExchange(segment, local_rank, local, native, timeout_s,
                                    spin_s=SPIN_S, yield_s=YIELD_S)
        unlinker = _UnlinkOnceAttached(segment) if segment is not None and local_rank == 0 else None
        try:
            _agree(error, world_size)  # also orders every pid write before the reads below
        finally:
            if unlinker is not None:
                unlinker.stop()
    except BaseException:
        if segment is not None:
            if local_rank == 0:
                segment.unlink()
            segment.close()
        raise
    finally:
        if segment is not None and local_rank == 0:
            segment.unlink()  # a local rank that failed to attach never wrote its pid
    if exchange is not None:
        exchange.read_peer_pids()
    if len(groups) == 1:
        return ShmCollectives(exchange)
    leaders = [g[0] for g in groups]
    # collective: every rank calls it. Its own timeout: torch gives a new group 30 minutes, not the
    # default group's, so a frozen node held the leaders' collectives (and an idle replica's health) that long
    leader_group = dist.new_group(ranks=leaders, timeout=datetime.timedelta(seconds=timeout_s))
    return HierarchicalCollectives(exchange, leader_group if rank in leaders else None, gloo,
                                   chunk_bytes=layout.slot_bytes, node_groups=groups, timeout_s=timeout_s)


class _UnlinkOnceAttached:
    """On the leader: unlinks `segment`'s name as soon as every local rank has attached (each writes
    its pid into its block when it does, NodeExchange.__init__), while the leader itself waits in
    the world-wide round. A thread, because a local rank that failed to attach writes nothing: only
    that round tells the leader so, and stop() (after it) ends the watch; the caller then unlinks."""

    POLL_S = 1e-3

    def __init__(self, segment) -> None:
        self._segment = segment
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="corelaunch-shm-unlink", daemon=True)
        self._thread.start()

    def _all_attached(self) -> bool:
        layout, words = self._segment.layout, self._segment._map
        return all(words[layout.pid_offset(i): layout.pid_offset(i) + 4] != b"\0\0\0\0"
                   for i in range(layout.local_size))

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._all_attached():
                self._segment.unlink()
                return
            self._stop.wait(self.POLL_S)

    def stop(self) -> None:
        """End the watch; after it returns the segment is the caller's alone (unlink, close)."""
        self._stop.set()
        self._thread.join()


def _round_slot(slot_bytes: int) -> int:
    return max(4096, (int(slot_bytes) + 4095) // 4096 * 4096)

