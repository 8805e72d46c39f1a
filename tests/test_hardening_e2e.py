"""Issue 12's launcher behaviours with real processes (slow): a launch never joins another
program's private Ray, two launches on one host both succeed, and Ctrl-C during a generate
returns within seconds leaving no workers and no shared-memory segments behind."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.model_factory import build_random_model, save_model
from tests.test_compile_cli import VOCAB, eager_tokens, model_dir, save_word_tokenizer  # noqa: F401 - model_dir: the tiny model with a tokenizer

# exclusive: these watch the host's processes and /dev/shm, and time Ctrl-C to under 3 s
pytestmark = [pytest.mark.slow, pytest.mark.exclusive]

OTHER_PROGRAM = textwrap.dedent("""
    import sys, time, ray
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the test closes stdin
""")

CONNECT = textwrap.dedent("""
    import ray
    from launcher.cluster import ray_cluster
    connection = ray_cluster.connect(None)
    print(connection.started_here, ray.get_runtime_context().gcs_address, flush=True)
    connection.close()
""")


def interactive_sigint() -> None:
    """In the child: SIGINT as a terminal's foreground command has it. A test run started in the
    background by a non-interactive shell inherits SIGINT ignored, and so would the command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def clean_env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return env


def test_a_private_ray_of_another_program_is_never_joined():
    from launcher.cluster.ray_cluster import recorded_cluster

    if recorded_cluster():
        pytest.skip("a cluster started with `ray start` is recorded on this host; the rule joins it")
    other = subprocess.Popen([sys.executable, "-c", OTHER_PROGRAM], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=clean_env())
    try:
        other_address = other.stdout.readline().strip()
        assert other_address, "the other program's Ray did not start"
        out = subprocess.run([sys.executable, "-c", CONNECT], capture_output=True, text=True, timeout=180,
                             env=clean_env())
        assert out.returncode == 0, out.stderr
        started_here, address = out.stdout.split()
        assert started_here == "True" and address != other_address
    finally:
        other.stdin.close()
        other.wait(60)


def generate_command(*prompts: str, new_tokens: int, model: Path, tp: int = 1, quiet: bool = True,
                     seq_len: int = 512, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "launcher", "generate", "--model", str(model), "--no-compile", "--seq-len",
            str(seq_len), "--tp", str(tp), "--max-new-tokens", str(new_tokens), *extra,
            *(["--quiet"] if quiet else []), *prompts]


LONG_RUN_POSITIONS = 8192
LONG_RUN_TOKENS = LONG_RUN_POSITIONS - 64
"""New tokens a prompt is asked for where a signal must land while it generates, all of them
(--min-tokens holds back the end-of-sequence token): thousands of decode steps, far longer than the
1.5 s the tests wait after start-up ends, even for the tiny model (SmolLM2's 400 tokens took longer)."""


@pytest.fixture(scope="module")
def long_run_model(tmp_path_factory) -> Path:
    """A tiny random Llama with the word tokenizer ("t0" .. "t127") for the signal tests: SmolLM2,
    which they loaded before, took 14-21 s a test to load in every rank, and what they check (the
    exit, its time, nothing left) does not depend on the model. One layer; 6 query and 3 KV heads
    split at TP 1 and 3; positions for LONG_RUN_TOKENS."""
    path = save_model(build_random_model("llama", seed=3, vocab_size=VOCAB, num_layers=1, hidden_size=48,
                                         num_heads=6, num_kv_heads=3, intermediate_size=96,
                                         max_position_embeddings=LONG_RUN_POSITIONS),
                      tmp_path_factory.mktemp("long-run"))
    save_word_tokenizer(path)
    return path


def long_generate_command(model: Path, *prompts: str, tp: int = 1) -> list[str]:
    """generate of LONG_RUN_TOKENS a prompt, with progress lines (they say when start-up ends)."""
    return generate_command(*prompts, new_tokens=LONG_RUN_TOKENS, model=model, tp=tp, quiet=False,
                            seq_len=LONG_RUN_POSITIONS, extra=("--min-tokens", str(LONG_RUN_TOKENS)))


ANSWER_FIGURES = re.compile(r"^  \[\w+, \d+ tokens, first token", re.MULTILINE)
"""The line generate writes to stderr after each answer (not --quiet)."""


def assert_signalled_while_generating(err: str) -> None:
    """The command was still generating when the signal came: no answer was printed (a signal
    during the shutdown that follows the answer would be another phase)."""
    assert not ANSWER_FIGURES.search(err), f"the generation had ended before the signal:\n{err[-3000:]}"


def test_two_launches_at_once_on_one_host_both_succeed(model_dir):  # noqa: F811
    # Two private Rays and their groups side by side are the subject, not the model: the tiny one
    # (a word-level tokenizer) loads in a fraction of SmolLM2's time.
    prompts = ["t3 t9 t33", "t5 t9 t33"]
    runs = [subprocess.Popen([*generate_command(prompt, new_tokens=8, model=model_dir), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
            for prompt in prompts]
    for prompt, run in zip(prompts, runs):
        out, err = run.communicate(timeout=400)
        assert run.returncode == 0, err
        [output] = json.loads(out)["outputs"]
        assert output["token_ids"] == eager_tokens(model_dir, prompt, 8), prompt  # each its own answer


def session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return found


def command_line(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # gone, or a zombie
        return ""


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_when_ready(command: list[str], marker: str, after_s: float, send,
                      **popen) -> tuple[int, str, float, int]:
    """Run command (in a session of its own), send(pid) once a stderr line starting with marker
    has come and after_s more have passed; (exit code, stderr, seconds from the signal to the exit,
    its pid: the session's id)."""
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                           start_new_session=True, **popen)
    stderr_lines: list[str] = []
    ready = threading.Event()

    def read_stderr() -> None:
        for line in run.stderr:
            stderr_lines.append(line)
            if line.startswith(marker):
                ready.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not ready.wait(0.2):
            assert run.poll() is None, "".join(stderr_lines)
            assert time.monotonic() < deadline, f"{marker!r} never came:\n" + "".join(stderr_lines)
        time.sleep(after_s)
        assert run.poll() is None, "the command finished before the signal"
        signalled = time.monotonic()
        send(run.pid)
        run.wait(60)
        took_s = time.monotonic() - signalled
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    reader.join(30)
    return run.returncode, "".join(stderr_lines), took_s, run.pid


def assert_nothing_left(sid: int, segments_before: set[str]) -> None:
    """No process of the session alive 20 s on, and no shared-memory segment beyond those before.
    Helpers such as multiprocessing's resource tracker exit once they see EOF on their pipe; on a
    loaded machine (the whole suite on 2 cores) that has taken more than 5 s."""
    deadline = time.monotonic() + 20.0
    while [p for p in session_processes(sid) if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [command_line(p) for p in session_processes(sid) if alive(p)]
    assert left == [], "still running 20 s after the command returned:\n" + "\n".join(left)
    assert set(glob.glob("/dev/shm/corelaunch-*")) <= segments_before


def test_ctrl_c_during_generate_returns_within_seconds_and_leaves_nothing_behind(long_run_model):
    segments_before = set(glob.glob("/dev/shm/corelaunch-*"))
    # Three prompts, thousands of tokens each: still generating when the interrupt comes. TP 3: the
    # ranks share a shared-memory segment, which must be gone too.
    # Not --quiet: the progress line that ends start-up says when the generation begins; 1.5 s
    # after it is well into the generation.
    code, err, took_s, sid = signal_when_ready(
        long_generate_command(long_run_model, "t5 t9", "t7 t33", "t12 t44", tp=3), "✓ starting", 1.5,
        lambda pid: os.killpg(pid, signal.SIGINT), preexec_fn=interactive_sigint)
    assert_signalled_while_generating(err)
    assert code == 130 and "interrupted" in err, err
    assert took_s < 3.0, f"Ctrl-C took {took_s:.1f} s to return"
    assert_nothing_left(sid, segments_before)


EXITS_WITHOUT_SHUTDOWN = """
import sys
from launcher.api import Launcher

llm = Launcher(model=sys.argv[1], tp=1, compile=False, seq_len=64, progress=False).start()
print(llm.generate("t5 t9", max_new_tokens=2)[0].token_ids, flush=True)
sys.exit(0)  # no shutdown(): the program just ends
"""


def test_a_driver_program_that_exits_without_shutdown_exits_0_and_leaves_nothing(model_dir):  # noqa: F811
    """Ray's exit hook disconnected the program while its replica threads still called Ray: the
    program exited 1 whatever its code ("The core worker has already been shutdown"), and Ray's
    agents outlived it by a minute or more. The launcher now shuts itself down at exit, first."""
    run = subprocess.Popen([sys.executable, "-c", EXITS_WITHOUT_SHUTDOWN, str(model_dir)],
                           cwd=Path(__file__).parent.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=clean_env(), start_new_session=True)
    try:
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0, err[-3000:]
    assert out.startswith("["), out  # it generated
    assert "already been shutdown" not in err, err[-3000:]
    deadline = time.monotonic() + 20.0
    while [p for p in session_processes(run.pid) if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [command_line(p) for p in session_processes(run.pid) if alive(p)]
    assert left == [], "still running 20 s after the program exited:\n" + "\n".join(left)
