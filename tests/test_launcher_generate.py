"""End to end: greedy tokens of a TP group equal Hugging Face transformers' greedy tokens.

Real checkpoints written to disk in each format. Each case runs through the Launcher with its
groups' ranks as threads of this process (tests/in_process_cluster.py: planning, loading, the
replica pool and the engine are the real ones); TP 1 and one eager TP 2 case (the fast lane's Ray
smoke test) also run through real Ray actors and real process groups (RAY_CASES). Then the errors
generate and stream raise: a static batch's part's own, and a stream's refusals of its one prompt.
"""

from __future__ import annotations

import pytest
import torch

from launcher.api import Launcher
from tests.model_factory import build_random_model, save_model

PROMPTS = [[5, 17, 42, 9, 77, 3], [8, 60, 21]]
NEW_TOKENS = 8


def hf_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation, stopping at the config's EOS (kept) as corelaunch does."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=model.config.eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# Every case runs eagerly: compiled equals eager per bucket at TP 1, 2 and 3 in
# tests/test_compiled.py, compiled TP 1 through Ray gives transformers' tokens for SmolLM2 in
# tests/test_smollm2_e2e.py and eager's from a compiled directory in tests/test_compile_cli.py, and
# compiling every shape here would add minutes to the suite.
CASES = [
    # (id, model_type, shape, format, tp, expected kv strategy)
    ("llama-tp1", "llama", dict(num_heads=4, num_kv_heads=2), "safetensors", 1, "shard"),
    ("llama-tp2-shard-sharded-st", "llama", dict(num_heads=4, num_kv_heads=2), "safetensors_sharded", 2, "shard"),
    ("llama-tp2-replicate-bin", "llama", dict(num_heads=4, num_kv_heads=1), "bin", 2, "replicate_to_tp"),
    ("qwen2-tp3-mha-bin-sharded", "qwen2", dict(hidden_size=96, num_heads=6, num_kv_heads=2, vocab_size=130),
     "bin_sharded", 3, "convert_to_mha"),
    ("llama-tp3-tied-replicate", "llama", dict(hidden_size=48, num_heads=3, num_kv_heads=1,
                                                tie_word_embeddings=True), "safetensors", 3, "replicate_to_tp"),
]


RAY_SMOKE = "llama-tp2-replicate-bin"
"""The one case run through Ray in the fast lane (eager TP 2: worker start, gloo and shared memory)."""
RAY_CASES = ("llama-tp1", RAY_SMOKE)
"""The cases also run through Ray. Checkpoint formats and KV strategies are read and applied by
each rank the same way whether it is a thread or a Ray process, so the other cases run in-process
only; TP 3 through Ray is proven with compiled graphs (tests/test_compiled.py), with SmolLM2's logits
(tests/test_check_bench_cli.py) and by the Ctrl-C test (tests/test_hardening_e2e.py), compiled TP 2
through Ray in tests/test_compiled.py and tests/test_compile_message_e2e.py."""


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0], marks=() if c[0] == RAY_SMOKE else pytest.mark.slow)
                                  for c in CASES if c[0] in RAY_CASES])
def test_tp_group_matches_transformers_greedy(case, tmp_path, ray_session):
    check_case(case, tmp_path)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_in_process_group_matches_transformers_greedy(case, tmp_path, in_process_cluster):
    """The same cases with no Ray: eager (compiled equals eager is tests/test_compiled.py's)."""
    check_case(case, tmp_path)
    assert [group.tp_degree for group in in_process_cluster.groups] == [case[4]]


def check_case(case, tmp_path, **launch) -> None:
    """launch: further Launcher options (pad_q_heads, ...)."""
    _, model_type, shape, fmt, tp, strategy = case
    model = build_random_model(model_type, seed=tp, **shape)
    save_model(model, tmp_path, fmt)
    expected = [hf_greedy(model, p) for p in PROMPTS]
    with Launcher(model=str(tmp_path), tp=tp, compile=False, progress=False, **launch) as launcher:
        assert launcher.plan.tp_degree == tp
        assert str(launcher.plan.kv_strategy) in (strategy, f"KVStrategy.{strategy.upper()}")
        batch = launcher.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        alone = [launcher.generate([p], max_new_tokens=NEW_TOKENS)[0] for p in PROMPTS]
    assert [r.token_ids for r in batch] == expected
    assert [r.token_ids for r in alone] == expected
    for r in batch:
        assert r.finish_reason == ("length" if len(r.token_ids) == NEW_TOKENS else "stop")
    assert all(r.prompt_tokens == len(p) for r, p in zip(batch, PROMPTS))


def test_static_batch_raises_a_parts_own_timeout_error(tmp_path, in_process_cluster):
    """A part that failed with its own TimeoutError (or a subclass: Ray's GetTimeoutError) raises that
    error: on Python >= 3.11 it is the TimeoutError future.result(timeout=) raises when its wait runs
    out, and it was reported as the static watchdog firing ("no replica answered ... within N s")."""
    model = build_random_model("llama", seed=1, num_heads=4, num_kv_heads=2)
    save_model(model, tmp_path, "safetensors")
    with Launcher(model=str(tmp_path), tp=1, compile=False, progress=False, max_batch_size=2) as launcher:
        launcher._group.fail_next(TimeoutError("rank 0's own wait timed out"))
        with pytest.raises(TimeoutError, match=r"^rank 0's own wait timed out$"):
            launcher.generate(PROMPTS, max_new_tokens=NEW_TOKENS, batching="static")


def test_a_streams_refusals_name_no_index_for_its_one_prompt(in_process_cluster):
    """stream takes one prompt: the checks it shares with generate said "prompt 0 is empty", an index
    its caller never gave, where generate's length checks say "the prompt" for one prompt."""
    from shardlib.demo_model import ensure_demo_model

    with Launcher(model=str(ensure_demo_model()), tp=1, compile=False, progress=False, max_num_seqs=2,
                  seq_len=256) as launcher:
        vocab = launcher.model_config.vocab_size
        for prompt, said in (("", "the prompt is empty; every prompt needs at least one token"),
                             ([1, vocab], f"the prompt holds token ids [{vocab}] outside the vocabulary [0, {vocab})"),
                             ("bad \udcff byte", "the prompt is not valid UTF-8 text")):
            with pytest.raises(ValueError) as caught:
                launcher.stream(prompt)
            assert str(caught.value).startswith(said), caught.value
