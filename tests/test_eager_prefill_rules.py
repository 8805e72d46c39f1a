"""Which prefill calls a compiled cpu serving loop runs eagerly (workers/serving/loop.py): a call its
bucket pads by a fifth or more, every call continuing its sequences, and, where the prefill attention
kernel does not cover the model (its head_dim, or the kernel turned off), every call padded to chunks
of EAGER_PREFILL_WIDTH tokens or more (its eager attention goes by query blocks:
workers/attention_blocks.py); and the warm-up's shapes leave out the graphs no call then takes."""

from __future__ import annotations

import torch

from shardlib.buckets import Buckets
from shardlib.model_config import ModelConfig
from shardlib.serving_shapes import PREFILL_CONTINUE, PREFILL_START, ServingShapes
from tests.model_factory import build_random_model
from tests.native_kernels import skip_unless_built
from tests.tp_harness import build_rank_model, hf_state_dict
from workers.collectives import SingleRank
from workers.compiled import CompiledCausalLM
from workers.kernels import prefill_attention
from workers.serving.loop import EAGER_PREFILL_WIDTH, ServingConfig, ServingLoop, warm_up_shapes, warm_up_shapes_for
from workers.serving.step_plan import PrefillChunk

BUCKETS = Buckets.build(max_seq_len=4096, context=(256, 512, 1024, 2048), token=(4096,))


UNTILED_HEAD_DIM = 8
"""A head_dim the prefill attention kernel tiles on no build (its panel width is 16 with AVX2, 32 with
AVX-512: the tests took 16, which an AVX2 build tiles, and failed on such machines)."""


def untiled_model():
    hf = build_random_model(hidden_size=64, num_heads=64 // UNTILED_HEAD_DIM, num_kv_heads=2)
    return build_rank_model(ModelConfig.from_dict(hf.config.to_dict()), hf_state_dict(hf), 0, 1, SingleRank())


def compiled_loop(model=None) -> ServingLoop:
    """By default a model of UNTILED_HEAD_DIM, which the prefill attention kernel does not cover."""
    shapes = ServingShapes.build(BUCKETS, max_num_seqs=4, max_prefill_tokens=2048)
    return ServingLoop(CompiledCausalLM(model or untiled_model(), BUCKETS, announce=lambda line: None),
                       ServingConfig(4, 2048, 4096, shapes))


def head_dim_64_model():
    hf = build_random_model(hidden_size=128, num_heads=2, num_kv_heads=1, max_position_embeddings=4096)
    return build_rank_model(ModelConfig.from_dict(hf.config.to_dict()), hf_state_dict(hf), 0, 1, SingleRank())


def chunks(*lengths: int, start: int = 0) -> list[PrefillChunk]:
    return [PrefillChunk(row, start, tuple(range(1, n + 1))) for row, n in enumerate(lengths)]


def test_wide_chunks_run_eagerly_on_cpu_narrow_unpadded_ones_through_their_graph():
    loop = compiled_loop()
    assert EAGER_PREFILL_WIDTH == 1024 and loop.eager_from_width == EAGER_PREFILL_WIDTH
    assert not loop._prefill_eagerly(chunks(512))  # fills its bucket: the graph
    assert not loop._prefill_eagerly(chunks(512, 450))  # 2 x 512 for 962 real tokens: padded by 1.06
    assert loop._prefill_eagerly(chunks(512, 512, 480))  # 4 x 512 for 1504: padded by 1.36
    assert loop._prefill_eagerly(chunks(500, 12))  # 2 x 512 for 512 real tokens: padded by 2
    assert loop._prefill_eagerly(chunks(1024))  # no padding, but 1024 wide
    assert loop._prefill_eagerly(chunks(1000, 1000))  # 2 x 1024
    assert loop._prefill_eagerly(chunks(2048))
    assert loop._prefill_eagerly(chunks(100, start=300))  # continuing


def test_the_cpu_warm_up_builds_no_graph_for_wide_or_continuing_chunks():
    shapes = ServingShapes.build(BUCKETS, max_num_seqs=4, max_prefill_tokens=2048)
    built = shapes.shapes(continuing=False, chunks_below=EAGER_PREFILL_WIDTH)
    prefills = sorted({(phase, length) for phase, _, length in built if phase != "serve-decode"})
    assert prefills == [(PREFILL_START, 256), (PREFILL_START, 512)]
    everything = {(phase, length) for phase, _, length in shapes.shapes() if phase != "serve-decode"}
    assert {(PREFILL_START, 1024), (PREFILL_START, 2048), (PREFILL_CONTINUE, 512)} <= everything
    decode = [s for s in shapes.shapes() if s[0] == "serve-decode"]
    assert [s for s in built if s[0] == "serve-decode"] == decode  # decode graphs all kept


def test_a_ranks_warm_up_takes_its_loops_rules_which_compile_works_out_alike():
    """The rank's warm-up builds the graphs for the rules its loop holds (continues_eagerly,
    eager_from_width); `corelaunch compile`, with no loop, works them out from the backend, head_dim
    and dtype: the same shapes."""
    loop = compiled_loop()
    shapes = loop.config.shapes
    built = warm_up_shapes_for(shapes, loop.continues_eagerly, loop.eager_from_width)
    assert built == warm_up_shapes(shapes, True, UNTILED_HEAD_DIM, torch.float32)
    assert built == shapes.shapes(continuing=False, chunks_below=EAGER_PREFILL_WIDTH)
    assert warm_up_shapes_for(shapes, False, None, 1024) == warm_up_shapes(shapes, False, UNTILED_HEAD_DIM, torch.float32, 1024)
    assert warm_up_shapes_for(shapes, False, None) == shapes.shapes()  # not cpu: every graph


@skip_unless_built(prefill_attention, "the prefill attention kernel")
def test_with_the_prefill_attention_kernel_wide_unpadded_chunks_take_their_graph(monkeypatch):
    """Its graphs compute only the tiles their queries may read, as the eager step does: only padding
    and continuing send a call eagerly, and the warm-up builds the wide chunks' graphs; turned off,
    the width rule is back."""
    model = head_dim_64_model()
    assert prefill_attention.covers(64, torch.float32) and not prefill_attention.covers(UNTILED_HEAD_DIM, torch.float32)
    assert not prefill_attention.covers(64, torch.bfloat16)  # the kernel takes float32 only
    loop = compiled_loop(model)
    assert loop.eager_from_width is None
    assert not loop._prefill_eagerly(chunks(1024))
    assert not loop._prefill_eagerly(chunks(1000, 1000))  # 2 x 1024 for 2000: padded by 1.02
    assert not loop._prefill_eagerly(chunks(2048))
    assert loop._prefill_eagerly(chunks(1100))  # 2048 for 1100: padded by 1.86
    assert loop._prefill_eagerly(chunks(100, start=300))  # continuing
    shapes = ServingShapes.build(BUCKETS, max_num_seqs=4, max_prefill_tokens=2048)
    wide = {(PREFILL_START, 1024), (PREFILL_START, 2048)}
    assert wide <= {(phase, length) for phase, _, length in warm_up_shapes(shapes, True, 64, torch.float32)}
    assert not wide & {(phase, length) for phase, _, length in warm_up_shapes(shapes, True, UNTILED_HEAD_DIM, torch.float32)}
    monkeypatch.setenv("CORELAUNCH_PREFILL_ATTENTION", "0")
    assert compiled_loop(model).eager_from_width == EAGER_PREFILL_WIDTH
    assert not wide & {(phase, length) for phase, _, length in warm_up_shapes(shapes, True, 64, torch.float32)}
