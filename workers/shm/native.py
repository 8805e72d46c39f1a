"""The few lines of C the shared-memory collectives need: publish a counter, wait for counters.

Why C and not Python: the data moves through torch (copies and adds on views of the segment), but
the hand-off between processes needs an atomic store with release order and loads with acquire
order, so that a peer that sees a counter also sees the data written before it. Python has no
atomics: plain stores happen to work on x86 (total store order) but not on Arm (Graviton hosts).
Python spinning also costs microseconds per check. These functions are compiled once with the
system C compiler (under a second, no torch headers) and loaded with ctypes by
workers/native_build.py, which keeps the library in this user's own directory of the cache. Without a C compiler the CPU backend falls back
to gloo (see workers/shm/group.py).

Waiting is a brief spin, then yield, then sleep. A rank that busy-waits while its peer waits for
a core (more ranks than cores, e.g. TP 3 on 2 cores, or other work on the host) steals the very
time the peer needs: pure spinning measured 4-11 ms per all-reduce at TP 3 here, against ~0.1 ms
yielding. So after ~64 pauses (and `spin_s`, 0 by default, see workers/shm/group.py) the waiter
calls sched_yield, which returns at once when the core has nothing else to run, and after
`yield_s` it sleeps in 50 us naps.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from workers.native_build import LibrarySpec, NativeUnavailable, build_and_load, library_dir

_SOURCE = r"""
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

/* 1 when process `pid` is gone: no such process, or a zombie (exited, not yet reaped). */
static int process_gone(int32_t pid) {
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return 1;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;  /* no /proc: trust kill() */
    size_t got = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[got] = 0;
    char *end = strrchr(buf, ')');  /* "pid (comm) S ...": the state follows the last ')' */
    return end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

/* Make every store this thread (and threads it joined) made before the call visible to a peer
   that reads `value` from `counter` with acquire order. A nonzero `sig` (what the step moves: its
   element count and dtype) is stored first in the word of the step's buffer, counter[2 + value % 2]:
   a peer may post step value + 1 while this one is still read, never value + 2. */
void cl_publish(uint64_t *counter, uint64_t value, uint64_t sig) {
    if (sig) __atomic_store_n(&counter[2 + (value & 1)], sig, __ATOMIC_RELAXED);
    __atomic_store_n(counter, value, __ATOMIC_RELEASE);
}

/* 1 when a wanted peer published another signature than `sig` for step `target` (read after its
   counter reached target with acquire order); missing[i] marks each such peer. */
static int sigs_differ(uint64_t *counters, int stride, int n, const int32_t *wanted, uint64_t target,
                       uint64_t sig, int32_t *missing) {
    int differ = 0;
    for (int i = 0; i < n; i++) {
        missing[i] = wanted[i] &&
            __atomic_load_n(&counters[(long)i * stride + 2 + (target & 1)], __ATOMIC_RELAXED) != sig;
        differ |= missing[i];
    }
    return differ;
}

/* Wait until counters[i * stride] >= target for each i in 0 .. n-1 where wanted[i] != 0.
   Returns 0 when all have arrived, 1 on timeout, 2 when a peer's process has exited (pids[i] > 0;
   checked every 0.2 s once past the spin phase), 3 when `sig` is nonzero and an arrived peer
   published another one for step `target` (the ranks' calls differ in size or dtype). missing[i]
   is set to 1 for each wanted counter that had not arrived (status 3: whose sig differs) when the
   call gave up, 0 otherwise. */
int cl_wait(uint64_t *counters, int stride, int n, const int32_t *wanted, uint64_t target,
            double spin_s, double yield_s, double timeout_s, const int32_t *pids,
            int32_t *missing, uint64_t sig) {
    double start = 0.0, next_liveness = 0.0;
    long spins = 0;
    struct timespec nap = {0, 50000};  /* 50 us */
    for (;;) {
        int all = 1;
        for (int i = 0; i < n; i++) {
            if (wanted[i] && __atomic_load_n(&counters[(long)i * stride], __ATOMIC_ACQUIRE) < target) {
                all = 0;
                break;
            }
        }
        if (all) return sig && sigs_differ(counters, stride, n, wanted, target, sig, missing) ? 3 : 0;
        if (spins++ < 64) {  /* the first few checks without even reading the clock */
            cpu_relax();
            continue;
        }
        double now = now_s();
        if (start == 0.0) {
            start = now;
            next_liveness = now + 0.2;
        }
        double waited = now - start;
        if (waited < spin_s) {
            for (int k = 0; k < 32; k++) cpu_relax();
            continue;
        }
        int status = 0;
        if (waited > timeout_s) status = 1;
        if (!status && now > next_liveness) {
            next_liveness = now + 0.2;
            for (int i = 0; i < n; i++)
                if (wanted[i] && pids[i] > 0 && process_gone(pids[i])
                    && __atomic_load_n(&counters[(long)i * stride], __ATOMIC_ACQUIRE) < target)
                    status = 2;
        }
        if (status) {
            for (int i = 0; i < n; i++)
                missing[i] = wanted[i] &&
                    __atomic_load_n(&counters[(long)i * stride], __ATOMIC_ACQUIRE) < target;
            return status;
        }
        if (waited < yield_s) sched_yield();
        else nanosleep(&nap, NULL);
    }
}
"""

SPEC = LibrarySpec("corelaunch_shm_sync", _SOURCE, ("-O2",), "the shared-memory collectives' synchronisation helpers")


def library_path() -> Path:
    """Where the compiled helpers live: one file per version of the source."""
    return library_dir() / SPEC.name


class Native:
    """ctypes bindings of the helpers (one instance per process is enough)."""

    def __init__(self, directory: Path | None = None) -> None:
        lib = build_and_load(SPEC, directory)
        u64p, i32p = ctypes.c_void_p, ctypes.c_void_p
        lib.cl_publish.argtypes = [u64p, ctypes.c_uint64, ctypes.c_uint64]
        lib.cl_publish.restype = None
        lib.cl_wait.argtypes = [u64p, ctypes.c_int, ctypes.c_int, i32p, ctypes.c_uint64, ctypes.c_double,
                                ctypes.c_double, ctypes.c_double, i32p, i32p, ctypes.c_uint64]
        lib.cl_wait.restype = ctypes.c_int
        self.publish = lib.cl_publish
        self.wait = lib.cl_wait


_native: Native | None = None


def native() -> Native:
    """The process-wide bindings, built on first use; raises NativeUnavailable."""
    global _native
    if _native is None:
        _native = Native()
    return _native
