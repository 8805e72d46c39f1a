"""`corelaunch` command line: a thin dispatcher; each subcommand lives in its own module here.

A subcommand module exposes `add_parser(subparsers)` (registers its arguments) and
`run(args) -> int` (the exit code). Modules are imported lazily so `corelaunch plan` never pays for
importing Ray or transformers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand name -> module implementing it
SUBCOMMANDS = {
    "plan": "launcher.cli.plan_command",
    "generate": "launcher.cli.generate_command",
    "check": "launcher.cli.check_command",
    "bench": "launcher.cli.bench_command",
    "compile": "launcher.cli.compile_command",
    "serve": "launcher.cli.serve_command",
    "quantize": "launcher.cli.quantize_command",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="corelaunch",
        description="Ray-based launcher for tensor-parallel LLM inference (Neuron, CPU).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:  # the launcher has already stopped its workers (Launcher.__exit__)
        print("corelaunch: interrupted", file=sys.stderr)
        return INTERRUPTED


INTERRUPTED = 130
"""The exit code after Ctrl-C (128 + SIGINT), as shells report it."""


def run() -> None:
    """The `corelaunch` command: main(), then exit with its code. After Ctrl-C the workers and Ray
    are already stopped, and the interpreter's own teardown (about 1.7 s measured on the
    development machine, mostly library exit hooks) is skipped, so the command returns at once."""
    code = main()
    if code == INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
