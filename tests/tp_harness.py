"""Run real tensor parallelism in tests, two ways with the same results.

- `run_tp_in_process`: every rank's shard in this process, one thread per rank, the ranks'
  collectives exchanging tensors through memory (`InProcessGroup`, summing in rank order like every
  production path). No process is started, so it is cheap enough for the fast lane.
- `run_tp`: one spawned process per rank, gloo between them (the real process groups; slow lane).

Both pass each rank the full Hugging Face state_dict; each rank cuts its own slices with shardlib's
slice_for/apply_slice, builds a ShardedCausalLM over its collectives and runs engine.generate. Both
return every rank's outputs, so tests can check that the ranks agreed; rank 0's are the answer.

Several cases run in one process group: starting a process (importing torch) costs about a second
on the development machine, far more than a tiny model's generation.

This module imports no transformers, so the spawned ranks start quickly.
"""

from __future__ import annotations

import datetime
import threading
import time
import traceback
from dataclasses import dataclass, field
from queue import Empty

import torch

from shardlib.model_config import ModelConfig
from shardlib.sharding import ShardLayout, apply_slice, slice_for
from workers.collectives import Collectives, sum_in_rank_order_
from workers.net import free_port_for_a_late_bind
from workers.sampling import SamplingParams


@dataclass
class Request:
    """One engine.generate call."""

    prompts: list[list[int]]
    max_new_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)
    params: list[SamplingParams] | None = None
    """None: greedy for every prompt."""

    def sampling(self) -> list[SamplingParams]:
        return self.params if self.params is not None else [SamplingParams()] * len(self.prompts)


@dataclass
class Case:
    """One model and the generate calls to run on it."""

    name: str
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    requests: list[Request]
    kv_strategy: str | None = None
    pad_q_heads: bool = False
    moe_sharding: str | None = None
    """Mixture-of-experts models: tensor_parallel or expert_parallel; None: the planner's choice."""
    fused_projections: bool = False
    sequence_parallel: bool = False
    packed_weights: bool = False
    """Repack the float32 linear weights as the cpu backend does (workers/packed_weight.py)."""


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """A detached copy of a transformers model's weights."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def shard_for_rank(config: ModelConfig, state_dict: dict[str, torch.Tensor], rank: int,
                   layout: ShardLayout) -> dict[str, torch.Tensor]:
    """The tensors `rank` holds, cut from the full checkpoint as the checkpoint reader would."""
    shard = {}
    for name, tensor in state_dict.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # a tied checkpoint stores the embedding only
        tslice = slice_for(config.model_type, name, tuple(tensor.shape), rank, layout)
        if tslice is not None:
            shard[name] = apply_slice(tensor, tslice)
    return shard


def build_rank_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], rank: int, tp_degree: int,
                     collectives, kv_strategy: str | None = None, dtype=None, pad_q_heads: bool = False,
                     moe_sharding: str | None = None):
    from workers.model import ShardedCausalLM

    layout = ShardLayout.for_model(config, tp_degree, kv_strategy, pad_q_heads, moe_sharding)
    return ShardedCausalLM(config, layout, rank, shard_for_rank(config, state_dict, rank, layout),
                           collectives, dtype)


def run_case(case: Case, rank: int, tp_degree: int, collectives) -> list[list]:
    """Outputs of every request of `case` on this rank (list of lists of GenerationOutput)."""
    from workers.engine import generate

    model = build_rank_model(case.config, case.state_dict, rank, tp_degree, collectives, case.kv_strategy,
                             pad_q_heads=case.pad_q_heads, moe_sharding=case.moe_sharding)
    if case.fused_projections:
        from workers.fused_projections import fuse_projections

        fuse_projections(model)
    if case.packed_weights:
        from workers.packed_weight import pack_linear_weights

        assert pack_linear_weights(model) > 0, "no weight was packed"
    model.sequence_parallel = case.sequence_parallel
    return [generate(model, r.prompts, r.sampling(), r.max_new_tokens, r.stop_token_ids)
            for r in case.requests]


class InProcessGroup:
    """The ranks of one TP group as threads of this process: each collective is a rendezvous where
    every rank posts a copy of its tensor, then reads everyone's (a barrier on each side)."""

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self._posted: list[torch.Tensor | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)

    def ranks(self) -> list["InProcessRank"]:
        return [InProcessRank(self, rank) for rank in range(self.world_size)]

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order (each rank calls this once per collective)."""
        self._posted[rank] = tensor.detach().contiguous().clone()
        self._barrier.wait()
        parts = list(self._posted)
        self._barrier.wait()  # nobody posts the next call's tensor before everyone has read this one
        return parts

    def abort(self) -> None:
        """Wake every rank waiting in a collective (with BrokenBarrierError): a peer has failed."""
        self._barrier.abort()


class InProcessRank(Collectives):
    """One rank's collectives over an InProcessGroup: the rank-order sum and the rank-order gather."""

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self._group, self._rank = group, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._group.world_size

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return sum_in_rank_order_(tensor, self._group.exchange(self._rank, tensor))

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._group.exchange(self._rank, tensor), dim=-1)

    def reduce_scatter_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Only this rank's rows of every rank's tensor, summed in rank order (as shared memory does)."""
        rows = tensor.shape[0] // self.world_size
        mine = [part[self._rank * rows: (self._rank + 1) * rows] for part in self._group.exchange(self._rank, tensor)]
        return sum_in_rank_order_(torch.empty_like(mine[0]), mine)


def run_tp_in_process(world_size: int, cases: list[Case],
                      timeout_s: float = 120.0) -> dict[int, dict[str, list[list]]]:
    """Like run_tp, with every rank a thread of this process (see InProcessGroup); same result shape.

    Raises RuntimeError with the rank's traceback if a rank fails (its peers are released), and
    TimeoutError if the ranks do not finish within timeout_s."""
    return on_in_process_ranks(
        world_size, lambda c: {case.name: run_case(case, c.rank, world_size, c) for case in cases}, timeout_s,
        what=f"cases {[c.name for c in cases]}")


def on_in_process_ranks(world_size: int, fn, timeout_s: float = 120.0, what: str = "") -> dict:
    """{rank: fn(collectives)} with every rank a thread of this process over one InProcessGroup; errors
    and time-outs as run_tp_in_process."""
    group = InProcessGroup(world_size, timeout_s)
    results: dict[int, dict] = {}
    errors: dict[int, tuple[bool, str]] = {}  # rank -> (released by a peer's failure, traceback)

    def rank_main(collectives: InProcessRank) -> None:
        try:
            results[collectives.rank] = fn(collectives)
        except BaseException as err:  # noqa: BLE001 - reported below, on the caller's thread
            errors[collectives.rank] = (isinstance(err, threading.BrokenBarrierError), traceback.format_exc())
            group.abort()
        finally:
            collectives.close()

    threads = [threading.Thread(target=rank_main, args=(c,), daemon=True, name=f"tp-rank-{c.rank}")
               for c in group.ranks()]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if errors:
        first = min(errors, key=lambda rank: (errors[rank][0], rank))  # the cause, not a released peer
        raise RuntimeError(f"rank {first} of {world_size} failed:\n{errors[first][1]}")
    if len(results) < world_size:
        group.abort()
        raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} of {world_size} did not "
                           f"finish within {timeout_s} s; {what}")
    return results


def _rank_main(rank: int, world_size: int, port: int, cases: list[Case], queue) -> None:
    import torch.distributed as dist

    from workers.collectives import TorchDistributedCollectives

    torch.set_num_threads(1)  # the ranks share two cores; more threads only contend
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
        collectives = TorchDistributedCollectives()
        results = {case.name: run_case(case, rank, world_size, collectives) for case in cases}
        queue.put((rank, "ok", results))
    except BaseException:  # report any failure to the parent instead of leaving it waiting
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_tp(world_size: int, cases: list[Case], timeout_s: float = 120.0) -> dict[int, dict[str, list[list]]]:
    """Run `cases` on `world_size` spawned ranks; {rank: {case name: outputs per request}}.

    Raises RuntimeError with the rank's traceback if a rank fails, TimeoutError if the ranks do not
    all report within timeout_s (the processes are then killed, so nothing hangs).
    """
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port_for_a_late_bind()  # rank 0 binds it once spawned and torch is imported
    procs = [ctx.Process(target=_rank_main, args=(rank, world_size, port, cases, queue), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    results: dict[int, dict] = {}
    try:
        while len(results) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, status, payload = queue.get(timeout=max(remaining, 0.1))
            except Empty:
                alive = [p.pid for p in procs if p.is_alive()]
                raise TimeoutError(
                    f"{world_size - len(results)} of {world_size} ranks did not report within "
                    f"{timeout_s} s (still alive: pids {alive}); cases {[c.name for c in cases]}"
                ) from None
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
            results[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return results


def token_ids(outputs: list) -> list[list[int]]:
    return [out.token_ids for out in outputs]

