"""`corelaunch` command line: a thin dispatcher; each subcommand lives in its own module here.

A subcommand module exposes `add_parser(subparsers)` (registers its arguments) and
`run(args) -> int` (the exit code). Modules are imported lazily so `corelaunch plan` never pays for
importing Ray or transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shlex
import sys

from launcher.cli.leftovers import named_with_their_values, option_like, value_options

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


class _OneLineErrors(argparse.ArgumentParser):
    """argparse's refusals in one line, as the commands' own are: argparse printed the whole usage
    block (28 lines for `generate`) above the line that says what is wrong."""

    words: list[str] = []
    """The command line being parsed (set by _parse_and_run), for _dashed_prompt_hint."""

    def error(self, message: str):
        _usage_error(self.prog, message + _dashed_prompt_hint(self.prog, _OneLineErrors.words, message))


def _dashed_prompt_hint(prog: str, words: list[str], message: str) -> str:
    """How to pass a generate prompt that starts with '-', when argparse's refusal is about one: it
    read the prompt as options (`"-hello world"` as -h given "ello world", or `-x` as an unrecognized
    argument). A word is taken for such a prompt where no option of generate's looks like it (a
    single dash but -h, or whitespace inside; never a negative number, an option's value), before
    any `--` (after it every word is a prompt), and named in the refusal."""
    if prog != "corelaunch generate":
        return ""
    before = words[:words.index("--")] if "--" in words else words
    dashed = next((word for word in before if option_like(word) and word != "-h"
                   and (not word.startswith("--") or any(c.isspace() for c in word))
                   and (f" {word}" in message or f"explicit argument {word[2:]!r}" in message)),
                  None)
    if dashed is None:
        return ""
    shown = shlex.quote(dashed)
    return (f"; a prompt starting with '-' ({shown}) reads as options: give it as --prompt={shown}, or after "
            f"the options and `--` (corelaunch generate --max-new-tokens 32 -- {shown})")


def _usage_error(prog: str, message: str):
    sys.stderr.write(f"{prog}: error: {message} (see `{prog} --help`)\n")
    sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(
        prog="corelaunch",
        description="Ray-based launcher for tensor-parallel LLM inference (Neuron, CPU).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_parser(subparsers)
    parser.subcommand_parsers = subparsers.choices  # name -> its parser: refusals in the subcommand's own way
    return parser


def main(argv: list[str] | None = None) -> int:
    from launcher import termination

    try:
        with termination.sigterm_raises_terminated():  # `kill`, `timeout`, systemd, `ray job stop`: as Ctrl-C
            return _parse_and_run(argv)
    except KeyboardInterrupt:  # the launcher has already stopped its workers (Launcher.__exit__)
        # Terminated, or the plain KeyboardInterrupt Ray's signal check makes of it inside a Ray call
        if termination.received():
            print("corelaunch: terminated (SIGTERM)", file=sys.stderr)
            return termination.TERMINATED_EXIT
        print("corelaunch: interrupted", file=sys.stderr)
        return INTERRUPTED


def _parse_and_run(argv: list[str] | None) -> int:
    # the subcommands' imports too: Ctrl-C in the first half second was a traceback from importlib
    parser = build_parser()
    _OneLineErrors.words = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        command_parser = parser.subcommand_parsers[args.command]
        # `--bogus 7`: not "--bogus" alone
        extra = named_with_their_values(_OneLineErrors.words, extra, value_options(command_parser))
        # `generate "A" --max-new-tokens 4 "B"`: argparse takes one run of positional prompts
        split_prompts = args.command == "generate" and not any(option_like(word) for word in extra)
        hint = ("; prompts go together (all options before or after them), or each with --prompt"
                if split_prompts else "")
        # through the subcommand's own parser: `plan --json --foo` prints its refusal object on
        # stdout there, as it does for any other argparse refusal (an empty stdout was nothing to parse)
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return int(args.run(args) or 0)


INTERRUPTED = 130
"""The exit code after Ctrl-C (128 + SIGINT), as shells report it."""
BROKEN_PIPE = 141
"""The exit code when stdout's reader has gone (128 + SIGPIPE, what a shell reports for a command
killed by it)."""


def run() -> None:
    """The `corelaunch` command: main(), then exit with its code. After Ctrl-C the workers and Ray
    are already stopped, and the interpreter's own teardown (about 1.7 s measured on the
    development machine, mostly library exit hooks) is skipped, so the command returns at once; the
    same after SIGTERM."""
    from launcher.termination import TERMINATED_EXIT

    if sys.stdout is None:  # started with fd 1 closed (`>&-`): the whole run's output would be lost
        print("corelaunch: stdout is closed; run it with stdout open (`> /dev/null` to discard the output)",
              file=sys.stderr)
        sys.exit(2)
    try:
        code = main()
        sys.stdout.flush()  # into a pipe stdout is block-buffered: a reader that left shows here, not at exit
    except BrokenPipeError:
        if not _stdout_reader_gone():
            _exit_on_error_once_ray_left_to_exit()
            raise  # a socket or pipe of the command's own: a real failure
        # `corelaunch plan | head -1`: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        if _ray_teardown_left_to_exit():  # Ray's exit hook would wait on the stopped GCS
            sys.stderr.flush()
            os._exit(BROKEN_PIPE)
        sys.exit(BROKEN_PIPE)
    except BaseException:
        _exit_on_error_once_ray_left_to_exit()
        raise
    if code in (INTERRUPTED, TERMINATED_EXIT) or _ray_teardown_left_to_exit():
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # output lost (a full disk): its traceback and exit 1, by the helper where Ray's
            # teardown was left out, else by the interpreter
            _exit_on_error_once_ray_left_to_exit()
            raise
        os._exit(code)
    sys.exit(code)


def _exit_on_error_once_ray_left_to_exit() -> None:
    """An error escaping the command after `serve` stopped its private Ray for the exit: its
    traceback, and os._exit with its code (1; a SystemExit's own), as the interpreter would end it.
    Left to the interpreter, the error went to Ray's exception hook, which waited 60 s for the
    stopped GCS and then ended the process without the traceback."""
    if not _ray_teardown_left_to_exit():
        return
    import traceback

    err = sys.exc_info()[1]
    if isinstance(err, SystemExit):
        if err.code is None or isinstance(err.code, int):
            code = err.code or 0
        else:  # sys.exit("message"), as the interpreter says it
            print(err.code, file=sys.stderr)
            code = 1
    else:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(OSError, ValueError):  # a stream that cannot take it (the error's own cause)
        sys.stdout.flush()
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    os._exit(code)


def _ray_teardown_left_to_exit() -> bool:
    """`corelaunch serve` stopped its private Ray and left Ray's teardown of this process out
    (launcher.cluster.ray_cluster.RayConnection.close_for_exit): Ray's exit hook must not run it."""
    ray_cluster = sys.modules.get("launcher.cluster.ray_cluster")  # not imported: no Ray was used
    return ray_cluster is not None and ray_cluster.teardown_left_to_exit()


def _stdout_reader_gone() -> bool:
    """True when stdout is a pipe or socket whose reading end has closed (poll reports an error on
    the writing end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a replaced sys.stdout)
        return False


if __name__ == "__main__":
    sys.exit(main())
