"""`corelaunch bench`'s decode steps of a batch prefilled over several steps, when the TP group fails
mid-run and is restarted: the gap across the restart (spanning two rank 0s' clocks; negative, or
hours, across hosts) was counted as a decode step of the whole batch, inflating p99/p100, or made
the report refuse its latencies ("must be finite and >= 0") after every run had run."""

from __future__ import annotations

import threading
import time

from launcher.api import Launcher
from launcher.cli.bench_command import full_batch_decode_steps
from launcher.errors import WorkerDied
from tests.in_process_cluster import TokenGate
from tests.test_replicas import EAGER, model_and_expected  # noqa: F401 - fixture

PROMPT_LEN, ROWS, PREFILL_BUDGET, NEW_TOKENS = 12, 3, 16, 10
RESTART_S = 2.0
HELD_AFTER = 5
"""Token steps before the loop is held: past the batch's staggered prefill (3 steps of 16 tokens
for 36), so every row has its first token and the batch decodes when the fault lands."""


def test_a_restart_mid_run_is_no_decode_step_of_the_whole_batch(model_and_expected, in_process_cluster,
                                                                  monkeypatch):
    model_dir, _ = model_and_expected
    prompts = [[(7 * row + i) % 100 + 1 for i in range(PROMPT_LEN)] for row in range(ROWS)]
    gate = TokenGate(monkeypatch, after=HELD_AFTER)
    with Launcher(model=model_dir, tp=1, max_num_seqs=ROWS, max_batch_size=0, max_prefill_tokens=PREFILL_BUDGET,
                  prefix_caching=False, seq_len=64, progress=False, **EAGER) as llm:
        make = llm._pool._make_group

        def slow_make(*args, **kwargs):  # a restart that takes seconds, as a real one does
            time.sleep(RESTART_S)
            return make(*args, **kwargs)

        llm._pool._make_group = slow_make
        answers = []
        run = threading.Thread(target=lambda: answers.append(
            llm.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)))
        run.start()
        gate.wait_until_held()
        llm._group.fail_next(WorkerDied("rank 0 (in-process) died while serving"))
        gate.release()
        run.join(120)
    assert answers, "generate did not return"
    [results] = answers
    assert all(r.attempts == 2 and len(r.token_ids) == NEW_TOKENS for r in results), [r.attempts for r in results]
    first_row = min(results, key=lambda r: r.token_times_s[0])
    assert first_row.resumed_at and 0 < first_row.resumed_at[0] < NEW_TOKENS, first_row.resumed_at
    assert max(results, key=lambda r: r.token_times_s[0]) is not first_row  # the prefill was staggered
    steps = full_batch_decode_steps(results)
    assert steps and all(0 <= s < RESTART_S / 2 for s in steps), steps
