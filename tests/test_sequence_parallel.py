"""Sequence parallelism (workers/sequence_parallel.py): a prefill's residual stream split along the
sequence between blocks gives bit-identical logits and keys/values, hence the same tokens.

Every rank is a thread of this process (tests/tp_harness.py), whose collectives sum only their own
rows in a reduce-scatter as the shared-memory path does. Sequences that do not divide by the TP
degree (7 tokens at TP 2, 3 and 4) exercise the zero-token padding; Gemma 3 (sandwich norms,
windows), Mixtral (experts, expert-parallel) and DBRX (fused Wqkv, LayerNorm) the other layer kinds.
The collectives themselves are checked against a fixed-order sum in tests/test_shm_collectives.py.
"""

from __future__ import annotations

import pytest
import torch

from launcher.api import LaunchConfig
from launcher.artifacts.compiled_dir import apply_compiled_dir
from launcher.cli import build_parser
from launcher.cli.generate_command import launch_config
from shardlib.expert_sharding import EXPERT_PARALLEL, TENSOR_PARALLEL
from tests.model_factory import save_random_model
from tests.tp_harness import Case, build_rank_model, on_in_process_ranks, run_tp_in_process, token_ids
from workers.sequence_parallel import SequenceSplit
from workers.step import EAGER, run_step

PROMPT_LEN = 7  # divides by none of the degrees below: the last rank's block is padded


def model_source(name: str):
    """(ModelConfig, state_dict, greedy references, requests) of a model from the family tests."""
    if name in ("gemma3", "qwen3"):
        from tests import test_families as src

        config, state, refs = src.reference(name)
        return config, state, refs, src.requests()
    if name in ("mixtral", "dbrx"):
        from tests import test_moe as src

        _, config, state, refs = src.reference(name)
        return config, state, refs, src.requests()
    from tests import test_model_tp as src

    config, state, refs = src.reference(name)
    return config, state, refs, src.requests_for(name)[:2]


# (model, tp, moe sharding)
STEP_CASES = [("llama_split_tp2", 2, None), ("convert_to_mha_tp3", 3, None), ("gemma3", 2, None),
              ("qwen3", 4, None), ("mixtral", 2, EXPERT_PARALLEL), ("dbrx", 2, TENSOR_PARALLEL)]


def prefill_on_rank(collectives, name: str, tp: int, moe_sharding: str | None, sequence_parallel: bool):
    """(logits, ks, vs, reduce-scatter calls) of one batch-2 prefill of PROMPT_LEN tokens on this rank."""
    config, state, _, _ = model_source(name)
    model = build_rank_model(config, state, collectives.rank, tp, collectives, moe_sharding=moe_sharding)
    model.sequence_parallel = sequence_parallel
    scatters = []
    plain = collectives.reduce_scatter_rows
    collectives.reduce_scatter_rows = lambda t: (scatters.append(tuple(t.shape)), plain(t))[1]
    ids = torch.tensor([[5, 9, 33, 17, 80, 3, 44], [7, 100, 21, 8, 1, 2, 60]])
    positions = torch.arange(PROMPT_LEN).repeat(2, 1)
    model._ensure_rotary(PROMPT_LEN)
    with torch.inference_mode():
        logits, ks, vs = run_step(model, EAGER, ids, positions, torch.ones(2, PROMPT_LEN, dtype=torch.bool),
                                  torch.arange(PROMPT_LEN), None)
    return logits, ks, vs, scatters


@pytest.mark.parametrize("name, tp, moe_sharding", STEP_CASES)
def test_a_split_prefill_is_bit_identical_to_plain_tensor_parallelism(name, tp, moe_sharding):
    model_source(name)  # built once, before the rank threads read it
    both = {sp: on_in_process_ranks(tp, lambda c, sp=sp: prefill_on_rank(c, name, tp, moe_sharding, sp))
            for sp in (False, True)}
    layers = model_source(name)[0].num_hidden_layers
    for rank in range(tp):
        plain, split = both[False][rank], both[True][rank]
        assert torch.equal(plain[0], split[0]), f"{name} rank {rank}: logits differ"
        assert all(torch.equal(a, b) for a, b in zip(plain[1] + plain[2], split[1] + split[2])), f"{name}: k/v differ"
        # The split really ran: one reduce-scatter per block plus the embedding's, over the padded length.
        padded = SequenceSplit(type("G", (), {"world_size": tp})(), PROMPT_LEN).padded
        assert plain[3] == [] and len(split[3]) == 2 * layers + 1, split[3]
        assert all(shape[0] == padded for shape in split[3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_split_prefill_is_bit_identical_in_half_precision_with_projection_biases(dtype):
    """Qwen2 (biased q/k/v) at TP 3, two rows of 10 tokens (padded to 12): the trimmed gather must
    feed the biased projections what plain TP does (a strided slice took two roundings in bf16)."""
    from shardlib.model_config import ModelConfig
    from tests.model_factory import build_random_model
    from tests.tp_harness import hf_state_dict

    hf = build_random_model("qwen2", num_heads=6, num_kv_heads=2, hidden_size=192, intermediate_size=250,
                            vocab_size=301, num_layers=2)
    config, state = ModelConfig.from_dict(hf.config.to_dict()), hf_state_dict(hf)
    batch, seq, tp = 2, 10, 3
    ids = (torch.arange(batch * seq).view(batch, seq) * 13 + 5) % 301

    def prefill(collectives, sequence_parallel: bool):
        model = build_rank_model(config, state, collectives.rank, tp, collectives, dtype=dtype)
        model.sequence_parallel = sequence_parallel
        scatters = []
        reduce_scatter = collectives.reduce_scatter_rows
        collectives.reduce_scatter_rows = lambda t: (scatters.append(tuple(t.shape)), reduce_scatter(t))[1]
        model._ensure_rotary(seq)
        with torch.inference_mode():
            return (*run_step(model, EAGER, ids, torch.arange(seq).repeat(batch, 1),
                              torch.ones(batch, seq, dtype=torch.bool), torch.arange(seq), None), scatters)

    plain = on_in_process_ranks(tp, lambda c: prefill(c, False))
    split = on_in_process_ranks(tp, lambda c: prefill(c, True))
    for rank in range(tp):
        assert torch.equal(plain[rank][0], split[rank][0]), (rank, (plain[rank][0] - split[rank][0]).abs().max())
        assert all(torch.equal(a, b) for a, b in zip(plain[rank][1] + plain[rank][2], split[rank][1] + split[rank][2]))
        # The split really ran in this dtype (equal logits alone held with it silently off): one
        # reduce-scatter per block plus the embedding's, over the length padded to 12.
        assert plain[rank][3] == [] and len(split[rank][3]) == 2 * config.num_hidden_layers + 1, split[rank][3]
        assert all(shape[0] == 12 for shape in split[rank][3]), split[rank][3]


def test_the_split_pads_and_trims_the_sequence():
    group = type("G", (), {"world_size": 3})()
    split = SequenceSplit(group, 7)
    assert (split.block, split.padded) == (3, 9)
    assert SequenceSplit(group, 9).padded == 9


# (name, tp, moe sharding): greedy tokens of each prompt alone and (families) as a left-padded batch
TOKEN_CASES = {2: [("gemma3", None), ("mixtral", EXPERT_PARALLEL), ("dbrx", TENSOR_PARALLEL)],
               3: [("convert_to_mha_tp3", None)]}


@pytest.mark.parametrize("tp", sorted(TOKEN_CASES))
def test_split_prefills_give_the_transformers_tokens(tp):
    cases = []
    for name, sharding in TOKEN_CASES[tp]:
        config, state, _, requests = model_source(name)
        cases.append(Case(name, config, state, requests, moe_sharding=sharding, sequence_parallel=True))
    by_rank = run_tp_in_process(tp, cases, timeout_s=180)
    for name, _ in TOKEN_CASES[tp]:
        refs = model_source(name)[2]
        for rank in range(tp):
            outputs = by_rank[rank][name]
            assert [token_ids(o)[0] for o in outputs[:2]] == refs, f"{name} rank {rank}"
            if len(outputs) > 2:
                assert token_ids(outputs[2]) == refs, f"{name}: the left-padded batch"


def test_the_serving_engine_splits_its_prefill_chunks():
    """Chunked prefills of several sequences in one step (rows of different lengths) at TP 2."""
    from tests.serving_driver import collect, request, run_loops, stop
    from tests.tp_harness import InProcessGroup
    from workers.serving.loop import ServingConfig, ServingLoop

    config, state, refs, _ = model_source("gemma3")
    from tests.test_families import NEW_TOKENS, PROMPTS, EOS

    loops, scatters = [], []
    for rank in InProcessGroup(2, timeout_s=60).ranks():
        model = build_rank_model(config, state, rank.rank, 2, rank)
        model.sequence_parallel = True
        plain = rank.reduce_scatter_rows
        rank.reduce_scatter_rows = lambda t, plain=plain: (scatters.append(t.shape), plain(t))[1]
        loops.append(ServingLoop(model, ServingConfig(2, 5, 64)))
    threads = run_loops(loops)
    loops[0].submit([request(f"r{i}", p, NEW_TOKENS, stop_token_ids=[EOS]) for i, p in enumerate(PROMPTS)])
    got = collect(loops[0], {"r0", "r1"})
    stop(loops, threads)
    assert [got.tokens["r0"], got.tokens["r1"]] == refs
    assert scatters, "no step was split"


# ---- the option, from the command line to the ranks and compiled directories ---------------------------
@pytest.mark.parametrize("command", ["generate", "serve", "compile", "check", "bench"])
def test_every_command_that_runs_a_model_offers_the_flag(command):
    extra = {"generate": ["hello"], "compile": ["--out", "x"]}.get(command, [])
    assert build_parser().parse_args([command, "--sequence-parallel", *extra]).sequence_parallel
    assert not build_parser().parse_args([command, *extra]).sequence_parallel


LAUNCH_PROMPT = [5, 9, 33, 17, 80, 3, 44, 12, 61]


def saved_model_and_tokens(path) -> list[int]:
    """Save a random TP-2-able Llama at `path`; transformers' 6 greedy tokens for LAUNCH_PROMPT."""
    from tests.model_factory import build_random_model, save_model
    from tests.test_model_tp import hf_greedy

    hf = build_random_model(num_heads=4, num_kv_heads=2)
    save_model(hf, path, "safetensors")
    with torch.inference_mode():
        return hf_greedy(hf, LAUNCH_PROMPT, 6)


def test_the_flag_reaches_every_rank_of_a_launched_group(tmp_path, in_process_cluster):
    """--sequence-parallel through LaunchConfig and LoadSpec to the ranks' models (no Ray)."""
    from launcher.api import Launcher

    want = saved_model_and_tokens(tmp_path)
    args = build_parser().parse_args(["generate", "--model", str(tmp_path), "--tp", "2", "--no-compile",
                                      "--sequence-parallel", "--quiet", "hi"])
    with Launcher(launch_config(args)) as llm:
        assert [w._model.sequence_parallel for w in llm._group.actors] == [True, True]
        [out] = llm.generate([LAUNCH_PROMPT], max_new_tokens=6, stop_token_ids=[2])
    assert out.token_ids == want


def test_a_compiled_directory_keeps_its_choice(tmp_path):
    from tests.test_compile_cli import fake_compiled_dir

    model = save_random_model(tmp_path / "m")
    with_split = fake_compiled_dir(tmp_path / "sp", model, sequence_parallel=True)
    assert apply_compiled_dir(LaunchConfig(compiled_dir=str(with_split))).sequence_parallel
    without = fake_compiled_dir(tmp_path / "plain", model)
    assert not apply_compiled_dir(LaunchConfig(compiled_dir=str(without))).sequence_parallel
    with pytest.raises(ValueError, match=r"launch: sequence_parallel: compiled without it, asked for"):
        apply_compiled_dir(LaunchConfig(compiled_dir=str(without), sequence_parallel=True))


@pytest.mark.slow  # Ray, two processes, torch.compile
def test_compiled_ray_group_with_split_prefills_gives_the_transformers_tokens(tmp_path, ray_session):
    from launcher.api import Launcher

    want = saved_model_and_tokens(tmp_path)
    with Launcher(model=str(tmp_path), tp=2, sequence_parallel=True, context_buckets=(16,), token_buckets=(32,),
                  progress=False) as llm:
        [out] = llm.generate([LAUNCH_PROMPT], max_new_tokens=6, stop_token_ids=[2])
    assert out.token_ids == want


def test_layout_options_that_change_nothing_at_the_degree_are_said_at_start_up(tmp_path, capsys):
    """--sequence-parallel at TP 1 and --pad-q-heads at a degree dividing the heads ran without a word:
    a user measuring them measured the plain layout. plan_launch says so, before anything starts."""
    from launcher.launch_plan import plan_launch
    from launcher.progress import Progress

    model = str(save_random_model(tmp_path, "llama", num_heads=4, num_kv_heads=2))
    plan_launch(LaunchConfig(model=model, tp=1, sequence_parallel=True, pad_q_heads=True), Progress(True))
    said = " ".join(capsys.readouterr().err.split())  # rich wraps long lines at the console's width
    assert "sequence_parallel (--sequence-parallel) does nothing at tp_degree 1" in said
    assert "pad_q_heads (--pad-q-heads) pads nothing: tp_degree 1 divides num_attention_heads (4)" in said
    plan_launch(LaunchConfig(model=model, tp=2, sequence_parallel=True), Progress(True))
    plan_launch(LaunchConfig(model=model, tp=1), Progress(True))
    quiet = capsys.readouterr().err
    assert "does nothing" not in quiet and "pads nothing" not in quiet
    # from a directory compiled with it, the note names where it came from (no flag was passed)
    from types import SimpleNamespace

    from launcher.launch_plan import layout_notes

    tp1 = plan_launch(LaunchConfig(model=model, tp=1), Progress(False)).plan
    [note] = layout_notes(SimpleNamespace(pad_q_heads=False, sequence_parallel=True, compiled_dir="/c"), tp1)
    assert note.startswith("sequence_parallel (--sequence-parallel, a compiled directory's setting) does nothing")
