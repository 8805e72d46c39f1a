"""How the Neuron compiled path drives neuronx-distributed's ModelBuilder V2 where the installed
release takes the documented keywords (workers/compiled_neuron.py), against a stand-in.

No Neuron device or SDK exists here. Checked: each rank compiles with its share of the node's CPUs
(ModelBuilder.compile's max_workers, whose default is a thread pool's, per rank), and each call
names the bucket's graph it runs (NxDModel.forward's model_name), the graph traced for exactly
those input shapes. Whether the real SDK accepts it is unverified.
"""

from __future__ import annotations

import sys
import types

import torch

from shardlib.buckets import Buckets
from tests.test_compiled_neuron import FakeNxD, eager_model
from workers.backends.neuron import NeuronBackend
from workers.compiled_neuron import NeuronCompiledModel, compile_workers, names_graphs
from workers.engine import generate
from workers.sampling import SamplingParams


def test_each_rank_on_a_node_gets_its_share_of_the_cpus_for_compiler_jobs():
    assert compile_workers(192, 24) == 8  # inf2.48xlarge: 192 vCPUs, 24 ranks
    assert compile_workers(128, 32) == 4  # trn1.32xlarge
    assert compile_workers(16, 32) == 1  # more ranks than CPUs: one job each, never none
    assert compile_workers(None, 4) == 1  # CPU count unknown


class DocumentedNxD(FakeNxD):
    """The stand-in with ModelBuilder.compile's max_workers and NxDModel.forward's model_name, as
    the ModelBuilder V2 API reference documents them."""

    def __init__(self) -> None:
        super().__init__()
        fake = self
        self.max_workers, self.calls, self.traced_shapes = [], [], {}
        base_builder, base_model = self.module_api.ModelBuilder, self.module_api.NxDModel

        class NxDModel(base_model):
            def forward(self, *args, model_name=None):
                fake.calls.append((model_name, tuple(tuple(a.shape) for a in args)))
                return base_model.__call__(self, *args)

            def __call__(self, *args, **kwargs):
                return self.forward(*args, **kwargs)

            def get_available_keys(self):  # the graphs by the tags they were traced under
                return set(fake.traced_shapes)

        class ModelBuilder(base_builder):
            def trace(self, args=None, tag=None):
                fake.traced_shapes[tag] = tuple(tuple(a.shape) for a in args)
                return super().trace(args=args, tag=tag)

            def compile(self, compiler_workdir=None, compiler_args=None, max_workers=None):
                fake.max_workers.append(max_workers)
                return NxDModel(super().compile(compiler_workdir, compiler_args).module)

        self.module_api = types.SimpleNamespace(ModelBuilder=ModelBuilder, NxDModel=NxDModel)


def test_compile_takes_the_ranks_cpu_share_and_each_call_names_its_buckets_graph(tmp_path, monkeypatch):
    from workers import compiled_neuron

    # the CPUs the process may use (shardlib/host_cpus.py: a container's quota), not os.cpu_count()
    monkeypatch.setattr(compiled_neuron, "host_cpus", lambda: 8)
    buckets = Buckets.build(context=[8, 16], token=[32], batch=[1, 2])
    fake = DocumentedNxD()
    model = NeuronCompiledModel(eager_model(), buckets, rank=0, world_size=1, cache_dir=str(tmp_path),
                                import_module=fake.import_module, ranks_on_node=4)
    assert fake.max_workers == [2]
    prompts = [[5, 9, 33, 17, 80], [7, 100, 21, 4, 66, 8, 120, 3, 44, 12, 61]]
    tokens = [o.token_ids for o in generate(model, prompts, [SamplingParams()] * 2, 4, [])]
    assert tokens == [o.token_ids for o in generate(eager_model(), prompts, [SamplingParams()] * 2, 4, [])]
    named = {name for name, _ in fake.calls}
    assert {"context-b2-l16", "token-b2-l32"} <= named, named  # a prefill and decode steps, by name
    for name, shapes in fake.calls:  # the named graph is the one traced for these inputs
        assert fake.traced_shapes[name] == shapes, (name, shapes)


def test_graphs_are_named_only_where_the_model_lists_every_buckets_tag():
    """NxDModel asserts that a name agrees with the graph the input shapes route to: a model keying
    its graphs by other names would fail every call that shape routing alone runs."""

    class Model:
        def __init__(self, keys):
            self.keys = keys

        def forward(self, *args, model_name=None):
            return args

        def get_available_keys(self):
            return set(self.keys)

    tags = {"context-b1-l8", "token-b1-l32"}
    assert names_graphs(Model(tags | {"other"}), tags)
    assert not names_graphs(Model({"context-b1-l8"}), tags)  # a bucket's tag missing: routed by shape
    Model.get_available_keys = None
    assert not names_graphs(Model(tags), tags)  # a release that lists none: routed by shape


def test_the_device_is_torch_xlas_documented_one(monkeypatch):
    """torch_xla.device() (torch-xla 2.x's documented call) rather than xm.xla_device()."""
    monkeypatch.setitem(sys.modules, "torch_xla", types.SimpleNamespace(device=lambda: torch.device("meta")))
    assert NeuronBackend().device == torch.device("meta")
    # an older torch-xla without torch_xla.device(): xm.xla_device()
    monkeypatch.setitem(sys.modules, "torch_xla", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "torch_xla.core.xla_model",
                        types.SimpleNamespace(xla_device=lambda: torch.device("cpu")))
    assert NeuronBackend().device == torch.device("cpu")
