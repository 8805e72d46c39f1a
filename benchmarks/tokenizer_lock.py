"""The driver's shared tokenizer under load: how long a one-prompt tokenize (an astream() on the
event loop) waits while another thread tokenizes a large call, with Launcher._encode's handover
against a plain lock taken a prompt at a time (Python's lock is not fair: the bulk call took it
back at once, prompt after prompt). Also the bulk call's own time, alone and beside the waiter.
Prints JSON. No Ray: the built-in model's tokenizer in this process.

    python benchmarks/tokenizer_lock.py [--prompts 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import machine  # noqa: E402


def main(out=None) -> None:
    """out: where the JSON report goes (stdout when None)."""
    out = out or sys.stdout
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=5000, help="prompts of the bulk call (default 5000)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    args = parser.parse_args()
    if args.prompts < 1 or args.rounds < 1:
        parser.error(f"--prompts ({args.prompts}) and --rounds ({args.rounds}) must be at least 1")
    from launcher.api import Launcher

    llm = Launcher(progress=False)
    llm.prepare()
    llm._await_tokenizer()
    prompts = ["The quick brown fox jumps over the lazy dog " * 20] * args.prompts

    def plain_lock() -> None:  # the lock a prompt at a time, no handover
        for prompt in prompts:
            with llm._lock:
                list(llm.tokenizer(prompt)["input_ids"])

    def handover() -> None:
        llm._tokenize(prompts)

    def run(bulk, waiter: bool) -> dict:
        timed: dict[str, float] = {}

        # Timed in the bulk call's own thread: timed from the main thread it included the waiter's
        # first 50 ms sleep, which was all of a short call's figure.
        def bulk_timed() -> None:
            start = time.perf_counter()
            bulk()
            timed["bulk_s"] = time.perf_counter() - start

        thread = threading.Thread(target=bulk_timed)
        thread.start()
        waits = []
        time.sleep(0.05)
        while waiter and thread.is_alive():
            asked = time.perf_counter()
            llm._tokenize(["hello there"])
            waits.append(time.perf_counter() - asked)
            time.sleep(0.05)
        thread.join()
        out = {"bulk_s": timed["bulk_s"]}
        if waiter:  # none when the bulk call ended before the first wait (few --prompts, a fast host)
            out.update(waits=len(waits), wait_ms_mean=1e3 * statistics.mean(waits) if waits else None,
                       wait_ms_max=1e3 * max(waits) if waits else None)
        return out

    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):  # alternated: the host's speed drifts
        for name, bulk in (("plain_lock", plain_lock), ("handover", handover)):
            for waiter in (False, True):
                results.setdefault(f"{name}_{'with' if waiter else 'without'}_waiter", []).append(run(bulk, waiter))
    # bulk_s to 10 us: a call of a few prompts takes well under the millisecond that 3 decimals show
    summary = {key: {field: median_of((r[field] for r in runs), 5 if field == "bulk_s" else 3) for field in runs[0]}
               for key, runs in results.items()}
    alone = {key: statistics.median(r["bulk_s"] for r in results[f"{key}_without_waiter"])  # unrounded
             for key in ("plain_lock", "handover")}
    waited = summary["plain_lock_with_waiter"]["wait_ms_mean"], summary["handover_with_waiter"]["wait_ms_mean"]
    report = {"machine": machine(), "prompts": args.prompts, "rounds": args.rounds, "median": summary,
              "ratios": {
                  "bulk_alone_handover_over_plain": round(alone["handover"] / alone["plain_lock"], 3),
                  "wait_mean_handover_over_plain": round(waited[1] / waited[0], 4) if None not in waited else None}}
    if None in waited:
        report["note"] = ("a bulk call ended before the waiter's first wait in every round: no wait to compare; "
                          "raise --prompts")
    print(json.dumps(report, indent=2), file=out)


def median_of(values, digits: int = 3) -> float | None:
    """The median of the values that were measured (None: a round without a wait), rounded to
    `digits` decimals; None when none was."""
    measured = [v for v in values if v is not None]
    return round(statistics.median(measured), digits) if measured else None


if __name__ == "__main__":
    from launcher.cli.command_stdout import run_reporting

    run_reporting(main)
