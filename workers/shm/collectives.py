"""Collectives for CPU ranks that share a node: shared memory within the node, gloo between nodes.

- `ShmCollectives`: every rank of the group on one node. all_reduce and all_gather go entirely
  through the node's segment (about 10 us for a decode step's 1 x hidden tensor, against gloo's
  hundreds of microseconds; see benchmarks/allreduce.py).
- `HierarchicalCollectives`: ranks spread over several nodes, some sharing one. all_reduce sums
  within each node through shared memory (local-rank order), all-reduces the node sums over gloo
  among one leader per node, then the leader broadcasts the result within its node. all_gather
  (once per generated token, for the logits) stays on gloo.

Both keep the Collectives contract: results are bit-identical on every rank. Tensors larger than a
slot are processed in slot-sized chunks, so any size works; an element's sum never depends on the
chunking.
"""

from __future__ import annotations

import torch

from workers.collectives import Collectives, TorchDistributedCollectives
from workers.shm.exchange import NodeExchange


def _chunks(numel: int, step: int):
    for start in range(0, numel, step):
        yield start, min(numel, start + step)


class ShmCollectives(Collectives):
    """All ranks of the group on one node; local rank == group rank."""

    def __init__(self, exchange: NodeExchange) -> None:
        self._x = exchange

    @property
    def rank(self) -> int:
        return self._x.local_rank

    @property
    def world_size(self) -> int:
        return self._x.size

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        # Same contract as the gloo path: reduce the caller's storage in place.
        assert tensor.is_contiguous(), "all_reduce_sum_ needs a contiguous tensor"
        flat = tensor.view(-1)
        step = self._x.max_numel(flat.dtype)
        if flat.numel() <= step:
            self._x.reduce_(flat)
        else:
            for start, end in _chunks(flat.numel(), step):
                self._x.reduce_(flat[start:end])
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.contiguous().view(-1)
        n, numel = self._x.size, flat.numel()
        if numel == 0:
            return tensor.new_empty((*tensor.shape[:-1], n * tensor.shape[-1]))
        staged = torch.empty((n, numel), dtype=flat.dtype)  # (ranks, elements of one rank)
        for start, end in _chunks(numel, self._x.max_numel(flat.dtype)):
            self._x.gather(flat[start:end], staged[:, start:end])
        width = tensor.shape[-1]
        # (ranks, rows, width) -> (rows, ranks, width) -> (..., ranks * width): rank order along the last dim
        out = staged.view(n, -1, width).transpose(0, 1).reshape(*tensor.shape[:-1], n * width)
        return out

    def close(self) -> None:
        self._x.close()


class HierarchicalCollectives(Collectives):
    """Ranks over several nodes: shared memory inside a node, gloo among node leaders.

    exchange: this node's NodeExchange, None when this rank is alone on its node.
    leaders: the gloo group of each node's first rank (None on ranks that are not leaders).
    world: gloo over all ranks (all_gather_last_dim).
    chunk_bytes: the slot size, the same on every rank: every node cuts a tensor into the same
        chunks, so the leaders' gloo calls match.
    """

    def __init__(self, exchange: NodeExchange | None, leaders, world: TorchDistributedCollectives,
                 chunk_bytes: int) -> None:
        import torch.distributed as dist

        self._x, self._leaders, self._world, self._dist = exchange, leaders, world, dist
        self._chunk_bytes = chunk_bytes

    @property
    def rank(self) -> int:
        return self._world.rank

    @property
    def world_size(self) -> int:
        return self._world.world_size

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        assert tensor.is_contiguous(), "all_reduce_sum_ needs a contiguous tensor"
        flat = tensor.view(-1)
        for start, end in _chunks(flat.numel(), self._chunk_bytes // flat.element_size()):
            part = flat[start:end]
            if self._x is not None:
                self._x.reduce_(part)  # node sum, on every rank of the node
            if self._leaders is not None:
                self._dist.all_reduce(part, op=self._dist.ReduceOp.SUM, group=self._leaders)
            if self._x is not None:
                self._x.broadcast_(part, root=0)  # the leader's total to the rest of the node
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._world.all_gather_last_dim(tensor)

    def close(self) -> None:
        if self._x is not None:
            self._x.close()
