"""Where the host's CPU went during a stretch of a benchmark: per process, from /proc (Linux only).

On a host whose cores the model's ranks use, every other process that runs takes its CPU from a
rank's compute thread, and the thread's partner then waits at the next barrier (README, Limits).
`snapshot()` before and after a stretch, then `cpu_by_process(before, after)`: each process's CPU
seconds in between (its threads summed, only threads alive at both ends), and the most involuntary
context switches any one of its threads took (a compute thread taken off its core that often).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ThreadSample:
    process: str
    """The process's command line (Ray's workers name their role there: ray::RayRankWorker, ...)."""
    cpu_s: float
    involuntary_switches: int


def _thread(task: Path) -> tuple[float, int]:
    stat = (task / "stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after the name, which may hold spaces
    cpu_s = (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime
    status = (task / "status").read_text()
    switches = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
    return cpu_s, switches


def snapshot(proc: Path = Path("/proc")) -> dict[tuple[int, int], ThreadSample]:
    """Every thread of every process readable now, by (pid, tid)."""
    samples = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            for task in (entry / "task").iterdir():
                cpu_s, switches = _thread(task)
                samples[(int(entry.name), int(task.name))] = ThreadSample(command or f"[{entry.name}]", cpu_s, switches)
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return samples


def cpu_by_process(before: dict, after: dict, top: int = 12, min_cpu_s: float = 0.01) -> list[dict]:
    """The `top` processes by CPU seconds between the snapshots (at least min_cpu_s each)."""
    processes: dict[int, dict] = {}
    for (pid, tid), late in after.items():
        early = before.get((pid, tid))
        if early is None:
            continue
        row = processes.setdefault(pid, {"pid": pid, "process": late.process[:120], "cpu_s": 0.0,
                                         "threads": 0, "most_involuntary_switches_of_a_thread": 0})
        row["cpu_s"] += late.cpu_s - early.cpu_s
        row["threads"] += 1
        row["most_involuntary_switches_of_a_thread"] = max(row["most_involuntary_switches_of_a_thread"],
                                                           late.involuntary_switches - early.involuntary_switches)
    rows = [dict(row, cpu_s=round(row["cpu_s"], 3)) for row in processes.values() if row["cpu_s"] >= min_cpu_s]
    return sorted(rows, key=lambda row: -row["cpu_s"])[:top]
