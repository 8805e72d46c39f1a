"""Start-up time, as a user meets it: wall seconds of a cold `corelaunch generate` (a new process, a
private Ray, eager TP 1, four tokens), of `corelaunch serve` until GET /health answers 200, and of
the first run's conversion of the built-in model (its GGUF to a float32 folder, in a new process
into an empty cache). Prints JSON.

`--compare DIR` runs the same commands from another checkout (a `git worktree` of another commit)
in alternating rounds (an even number of them: each side runs first in half), so both sides see the
same machine state; ratios are taken per round.

    python benchmarks/startup.py --rounds 3 [--commands generate,serve,convert]
    git worktree add /tmp/base <commit> && python benchmarks/startup.py --compare /tmp/base
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.arguments import positive_seconds  # noqa: E402 - bad values refused before any work
from benchmarks.serving_server import free_port, server_process  # noqa: E402


def run_bounded(command: list[str], what: str, checkout: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own, whose whole process group (a private Ray's processes
    too) is killed past --timeout; RuntimeError naming the flag then (it was a TimeoutExpired
    traceback quoting the whole command)."""
    proc = subprocess.Popen(command, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # a process outside the group holding its pipes
            proc.communicate(timeout=30)
        raise RuntimeError(f"{what} in {checkout} did not finish within --timeout {timeout_s:g} s; raise "
                           f"--timeout") from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def time_generate(checkout: Path, timeout_s: float) -> float:
    """`python -m launcher` from `checkout` (its packages come first on sys.path, the driver's and the
    Ray workers' alike)."""
    start = time.perf_counter()
    proc = run_bounded([sys.executable, "-m", "launcher", "generate", "--tp", "1", "--no-compile",
                        "--max-new-tokens", "4", "--ray-address", "local", "--quiet", "Hello"],
                       "corelaunch generate", checkout, timeout_s)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"corelaunch generate in {checkout} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return elapsed


def time_serve(checkout: Path, timeout_s: float) -> float:
    port = free_port()
    command = [sys.executable, "-m", "launcher", "serve", "--tp", "1", "--no-compile", "--host", "127.0.0.1",
               "--port", str(port)]
    start = time.perf_counter()
    try:
        with server_process(command, f"http://127.0.0.1:{port}/v1", timeout_s, cwd=checkout, poll_s=0.1):
            return time.perf_counter() - start
    except TimeoutError as err:  # its first line names serving.py's --server-timeout; the rest is the log's tail
        tail = str(err).partition("\n")[2]
        raise RuntimeError(f"corelaunch serve in {checkout} was not healthy within --timeout {timeout_s:g} s; raise "
                           f"--timeout\n{tail}") from None


CONVERT = """
import sys
from pathlib import Path
from shardlib.demo_model import ensure_demo_model
ensure_demo_model(Path(sys.argv[1]))
"""


def time_convert(checkout: Path, timeout_s: float) -> float:
    """A new process converts the GGUF into an empty cache directory (what the first generate on a
    fresh machine does before anything else)."""
    with tempfile.TemporaryDirectory(prefix="corelaunch-convert-") as cache:
        start = time.perf_counter()
        proc = run_bounded([sys.executable, "-c", CONVERT, cache], "converting the demo model", checkout, timeout_s)
        elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"converting the demo model in {checkout} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return elapsed


TIMERS = {"generate": time_generate, "serve": time_serve, "convert": time_convert}


def summary(values: list[float]) -> dict:
    return {"median_s": round(statistics.median(values), 2), "min_s": round(min(values), 2),
            "max_s": round(max(values), 2), "runs_s": [round(v, 2) for v in values]}


def sides_in_round(sides: dict, round_: int) -> list:
    """The checkouts in the order round `round_` runs them: alternating from round to round, so an
    order effect (a warm page cache, a warm interpreter) falls on each side alike."""
    return list(sides.items()) if round_ % 2 == 0 else list(sides.items())[::-1]


DEFAULT_ROUNDS = 3
DEFAULT_ROUNDS_COMPARED = 4
"""With --compare: even, so each side runs first in half the rounds."""


def checked_rounds(parser: argparse.ArgumentParser, rounds: int | None, comparing: bool) -> int:
    """--rounds, or its default: at least 1, and even with --compare (sides_in_round alternates the
    order by round; at 3 rounds "this" ran first twice and took an order effect twice as often)."""
    if rounds is None:
        return DEFAULT_ROUNDS_COMPARED if comparing else DEFAULT_ROUNDS
    if rounds < 1:
        parser.error(f"--rounds ({rounds}) must be at least 1")
    if comparing and rounds % 2:
        even = " or ".join(str(r) for r in (rounds - 1, rounds + 1) if r >= 2)
        parser.error(f"--rounds ({rounds}) must be even with --compare: the sides take turns running first, and "
                     f"an odd count lets this checkout run first once more; pass --rounds {even}")
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"default {DEFAULT_ROUNDS}; with --compare an even count, default {DEFAULT_ROUNDS_COMPARED}")
    parser.add_argument("--compare", type=Path, default=None, help="another checkout, run in alternating rounds")
    parser.add_argument("--commands", default=",".join(TIMERS),
                        help=f"comma-separated, from {', '.join(TIMERS)} (default: all)")
    parser.add_argument("--timeout", type=positive_seconds("--timeout"), default=300.0,
                        help="seconds allowed per command")
    args = parser.parse_args()
    args.rounds = checked_rounds(parser, args.rounds, comparing=args.compare is not None)
    if args.compare is not None and not (args.compare / "launcher" / "__main__.py").is_file():
        parser.error(f"--compare ({args.compare}) is not a corelaunch checkout: it has no launcher/__main__.py")
    chosen = [name.strip() for name in args.commands.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in TIMERS]
    if unknown or not chosen:
        parser.error(f"--commands ({args.commands!r}) must name one or more of {', '.join(TIMERS)}")
    sides = {"this": REPO} if args.compare is None else {"this": REPO, "compare": args.compare.resolve()}
    commands = {name: TIMERS[name] for name in chosen}
    runs: dict[str, dict[str, list[float]]] = {side: {name: [] for name in commands} for side in sides}
    stopped = None
    try:
        for round_ in range(args.rounds):
            for name, timer in commands.items():
                for side, checkout in sides_in_round(sides, round_):
                    runs[side][name].append(timer(checkout, args.timeout))
    except RuntimeError as err:  # a command failed or ran past --timeout: the runs measured are reported
        stopped = str(err)
    report: dict = {"rounds": args.rounds, "cpus": os.cpu_count(),
                    **{side: {"checkout": str(path), **{name: summary(v) for name, v in runs[side].items() if v}}
                       for side, path in sides.items()}}
    if args.compare is not None:
        report["this_over_compare"] = {
            name: [round(a / b, 3) for a, b in zip(runs["this"][name], runs["compare"][name])] for name in commands}
    if stopped is not None:
        report["stopped"] = stopped
    print(json.dumps(report, indent=1))
    if stopped is not None:
        print(f"startup.py: {stopped}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
