"""Where the host's CPU went during a stretch of a benchmark: per process, from /proc (Linux only).

On a host whose cores the model's ranks use, every other process that runs takes its CPU from a
rank's compute thread, and the thread's partner then waits at the next barrier (README, Limits).
`snapshot()` before and after a stretch, then `cpu_by_process(before, after)`: each process's CPU
seconds in between (from the process's own counters, which keep the time of threads that have
ended), and the most involuntary context switches any one of its threads took (a compute thread
taken off its core that often; a thread started meanwhile counts from zero).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcessSample:
    name: str
    """The command line (Ray's workers name their role there: ray::RayRankWorker, ...), or
    [comm] for a process without one (a kernel thread)."""
    cpu_s: float
    switches_by_thread: dict[int, int] = field(default_factory=dict)
    """Involuntary context switches so far, by thread id."""


def _stat_fields(path: Path) -> tuple[str, list[str]]:
    stat = path.read_text()
    return stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()


def _involuntary_switches(task: Path) -> int:
    return int((task / "status").read_text().split("nonvoluntary_ctxt_switches:")[1].split()[0])


def snapshot(proc: Path = Path("/proc")) -> dict[tuple[int, str], ProcessSample]:
    """Every readable process now, by (pid, start time): a pid the system reuses meanwhile is
    another key."""
    samples = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm, fields = _stat_fields(entry / "stat")
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            cpu_s = (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime, ended threads included
            tasks = list((entry / "task").iterdir())
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
            continue
        switches = {}
        for task in tasks:
            try:
                switches[int(task.name)] = _involuntary_switches(task)
            except (OSError, IndexError, ValueError):  # this thread ended: the others still count
                continue
        samples[(int(entry.name), fields[19])] = ProcessSample(command or f"[{comm}]", cpu_s, switches)
    return samples


def cpu_by_process(before: dict, after: dict, top: int = 12, min_cpu_s: float = 0.01) -> list[dict]:
    """The `top` processes by CPU seconds between the snapshots (at least min_cpu_s each); a process
    started meanwhile counts from zero."""
    rows = []
    for (pid, started), late in after.items():
        early = before.get((pid, started), ProcessSample(late.name, 0.0))
        cpu_s = late.cpu_s - early.cpu_s
        if cpu_s < min_cpu_s:
            continue
        most = max((n - early.switches_by_thread.get(tid, 0) for tid, n in late.switches_by_thread.items()), default=0)
        rows.append({"pid": pid, "process": late.name[:120], "cpu_s": round(cpu_s, 3),
                     "threads": len(late.switches_by_thread), "most_involuntary_switches_of_a_thread": most})
    return sorted(rows, key=lambda row: -row["cpu_s"])[:top]
