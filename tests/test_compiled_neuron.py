"""The Neuron compiled path (workers/compiled_neuron.py) against a stand-in for neuronx-distributed.

No Neuron device or SDK exists here, so this checks only corelaunch's side: one trace per bucket
shape with inputs of that shape, the graphs saved into the compile cache and loaded back as this
rank alone, a second start loading instead of tracing, the graphs compiled for the plan's LNC, no
buffer written in place (ModelBuilder supports only assigning a buffer a new tensor), and the
traced step's math (run on CPU by the stand-in: device-resident cache prefixes, prefill over the
prompt itself) giving the eager model's greedy tokens. Whether the real SDK accepts it is unverified.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from shardlib.buckets import Buckets
from shardlib.model_config import ModelConfig
from tests.model_factory import build_random_model
from tests.tp_harness import build_rank_model, hf_state_dict
from workers.collectives import SingleRank
from workers.compiled_neuron import NeuronCompiledModel
from workers.engine import generate
from workers.sampling import SamplingParams


class FakeNxD:
    """Records the ModelBuilder / NxDModel calls; its 'compiled' model runs the traced module on CPU."""

    def __init__(self) -> None:
        self.traced, self.loaded, self.saved = [], [], []
        self.module = None  # what the fake NEFF runs: the last module given to ModelBuilder
        fake = self

        class NxDModel:
            def __init__(self, module):
                self.module = module

            def save(self, path):
                fake.saved.append(path)
                open(path, "w").close()

            @classmethod
            def load(cls, path, start_rank=None, local_ranks_size=None):
                fake.loaded.append((path, start_rank, local_ranks_size))
                if fake.module is None:  # nothing traced in this process: a load that is only recorded
                    return cls(None)
                # A loaded model holds no weights until set_weights: the stand-in runs a copy of the
                # traced module with every weight zeroed, so only the weights handed over count.
                blank = copy.deepcopy(fake.module)
                with torch.no_grad():
                    for name, tensor in blank.state_dict().items():
                        if "_cache_" not in name:
                            tensor.zero_()
                return cls(blank)

            def set_weights(self, per_rank):
                fake.weights = per_rank
                if self.module is None:
                    return
                [weights] = per_rank  # one rank per process
                wanted = {name for name in self.module.state_dict() if "_cache_" not in name}
                assert set(weights) == wanted, set(weights) ^ wanted
                result = self.module.load_state_dict(weights, strict=False)
                assert not result.unexpected_keys and all("_cache_" in k for k in result.missing_keys), result

            def to_neuron(self):
                pass

            def __call__(self, *args):
                key = tuple(tuple(a.shape) for a in args)
                assert key in fake.shapes, f"no graph traced for input shapes {key}"
                # ModelBuilder keeps a buffer's update only when forward assigns the buffer a new
                # tensor of its shape and dtype; in-place writes into a buffer are not supported.
                before = {name: (buf, buf.clone()) for name, buf in self.module.named_buffers()}
                with torch.inference_mode():
                    out = self.module(*args)
                for name, buf in self.module.named_buffers():
                    old, contents = before[name]
                    assert torch.equal(old, contents), f"buffer {name} written in place"
                    assert (buf.shape, buf.dtype) == (old.shape, old.dtype), f"buffer {name} changed shape or dtype"
                return out

        class ModelBuilder:
            def __init__(self, module):
                fake.module = module

            def trace(self, args=None, tag=None):
                fake.traced.append(tag)
                fake.shapes.add(tuple(tuple(a.shape) for a in args))
                return self

            def compile(self, compiler_workdir=None, compiler_args=None):
                fake.compiler_args = compiler_args
                return NxDModel(fake.module)

        self.shapes: set = set()
        self.module_api = types.SimpleNamespace(ModelBuilder=ModelBuilder, NxDModel=NxDModel)

    def import_module(self, name):
        assert name == "neuronx_distributed"
        return self.module_api


def eager_model():
    hf = build_random_model("llama", seed=3)
    return build_rank_model(ModelConfig.from_dict(hf.config.to_dict()), hf_state_dict(hf), 0, 1, SingleRank())


def test_one_trace_per_bucket_saved_then_loaded_as_this_rank_and_tokens_match_eager(tmp_path):
    buckets = Buckets.build(context=[8, 16], token=[32], batch=[1, 2])
    fake = FakeNxD()
    model = NeuronCompiledModel(eager_model(), buckets, rank=0, world_size=1, cache_dir=str(tmp_path),
                                import_module=fake.import_module)
    assert fake.traced == [f"{p}-b{b}-l{n}" for p, b, n in buckets.shapes()]
    # built for the plan's LNC (neuronx-cc's own default on trn2 is 2), the documented defaults kept
    assert fake.compiler_args.split()[-1] == "--lnc=1" and "--model-type=transformer" in fake.compiler_args
    assert fake.saved == [str(tmp_path / "neuron-rank-0.pt")]
    assert fake.loaded == [(str(tmp_path / "neuron-rank-0.pt"), 0, 1)]
    assert not any("_cache_" in name for name in fake.weights[0])  # weights only; the cache is device state

    prompts = [[5, 9, 33, 17, 80], [7, 100, 21, 4, 66, 8, 120, 3, 44, 12, 61]]
    eager = eager_model()
    for batch in ([prompts[0]], [prompts[1]], prompts):
        expected = [o.token_ids for o in generate(eager, batch, [SamplingParams()] * len(batch), 6, [])]
        assert [o.token_ids for o in generate(model, batch, [SamplingParams()] * len(batch), 6, [])] == expected

    shapes = [(g.phase, g.batch, g.length) for g in model.stats().graphs]
    assert shapes == list(buckets.shapes()) and all(g.compiled for g in model.stats().graphs)
    again = FakeNxD()
    loaded = NeuronCompiledModel(eager_model(), buckets, rank=0, world_size=1, cache_dir=str(tmp_path),
                                 import_module=again.import_module)
    assert again.traced == [] and again.loaded == [(str(tmp_path / "neuron-rank-0.pt"), 0, 1)]
    # loaded from the saved file: every graph is there, none compiled (the stats said no graph at all)
    assert [(g.phase, g.batch, g.length, g.compiled) for g in loaded.stats().graphs] == [s + (False,) for s in shapes]


def test_graphs_are_compiled_for_the_plans_lnc(tmp_path):
    fake = FakeNxD()
    NeuronCompiledModel(eager_model(), Buckets.build(context=[8], token=[16], batch=[1]), rank=0, world_size=1,
                        cache_dir=str(tmp_path), import_module=fake.import_module, lnc=2)
    assert "--lnc=2" in fake.compiler_args.split()


def test_a_release_without_the_tracing_api_is_refused_naming_it(tmp_path):
    """A neuronx-distributed without ModelBuilder/NxDModel at its top level failed with an
    AttributeError inside the rank's load."""
    fake = FakeNxD()
    del fake.module_api.NxDModel
    with pytest.raises(RuntimeError, match="has no NxDModel at its top level .* or run eagerly with --no-compile"):
        NeuronCompiledModel(eager_model(), Buckets.build(context=[8], token=[16], batch=[1]), rank=0, world_size=1,
                            cache_dir=str(tmp_path), import_module=fake.import_module)
    assert fake.traced == []  # refused before any trace
