"""Collectives for CPU ranks that share a node: shared memory within the node, gloo between nodes.

- `ShmCollectives`: every rank of the group on one node. all_reduce and all_gather go entirely
  through the node's segment (about 10 us for a decode step's 1 x hidden tensor, against gloo's
  hundreds of microseconds; see benchmarks/allreduce.py).
- `HierarchicalCollectives`: ranks spread over several nodes, some sharing one. all_reduce gathers
  each node's partials to its leader through shared memory, the leaders all-gather them over gloo,
  each leader sums every rank's partial in global rank order, then broadcasts the result within its
  node. (Summing within the node first would be cheaper, but ((x0 + x1) + (x2 + x3)) is not
  ((x0 + x1) + x2) + x3 in float32, and results must not depend on which ranks share a node.)
  all_gather (once per generated token, for the logits) stays on gloo.

Sequence parallelism's reduce-scatter goes through the node's segment in `ShmCollectives` (each rank
sums only its own rows of every slot); `HierarchicalCollectives` keeps the base class's exact
defaults (a whole all-reduce, then its rows; the gather over gloo).

Both keep the Collectives contract: results are bit-identical on every rank and equal the gloo
path's (workers.collectives.sum_in_rank_order_). Tensors larger than a slot are processed in
slot-sized chunks, so any size works; an element's sum never depends on the chunking.
"""

from __future__ import annotations

import torch

from workers.collectives import (Collectives, TorchDistributedCollectives, require_a_dimension, require_contiguous,
                                 sum_in_rank_order_)
from workers.shm.exchange import CollectiveTimeout, NodeExchange, timeout_advice


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
        require_contiguous(tensor, "all_reduce_sum_")
        flat = tensor.view(-1)
        step = self._x.max_numel(flat.dtype)
        if flat.numel() <= step:
            self._x.reduce_(flat)
        else:  # each chunk signed with the call's whole count: a call of other length fails at once
            for start, end in _chunks(flat.numel(), step):
                self._x.reduce_(flat[start:end], total=flat.numel())
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        require_a_dimension(tensor, "all_gather_last_dim")
        flat = tensor.contiguous().view(-1)
        n, numel = self._x.size, flat.numel()
        if numel == 0:
            return tensor.new_empty((*tensor.shape[:-1], n * tensor.shape[-1]))
        staged = torch.empty((n, numel), dtype=flat.dtype)  # (ranks, elements of one rank)
        for start, end in _chunks(numel, self._x.max_numel(flat.dtype)):
            self._x.gather(flat[start:end], staged[:, start:end], total=numel)
        width = tensor.shape[-1]
        # (ranks, rows, width) -> (rows, ranks, width) -> (..., ranks * width): rank order along the last dim
        out = staged.view(n, -1, width).transpose(0, 1).reshape(*tensor.shape[:-1], n * width)
        return out

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        # all_gather_last_dim's staging buffer, (ranks, elements of one rank), already is the
        # rank-order concatenation along the first dim.
        flat = tensor.contiguous().view(-1)
        staged = torch.empty((self._x.size, flat.numel()), dtype=flat.dtype)
        for start, end in _chunks(flat.numel(), self._x.max_numel(flat.dtype)):
            self._x.gather(flat[start:end], staged[:, start:end], total=flat.numel())
        return staged.view(self._x.size * tensor.shape[0], *tensor.shape[1:])

    def reduce_scatter_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        n = self._x.size
        if tensor.shape[0] % n:
            raise ValueError(f"reduce_scatter_rows: {tensor.shape[0]} rows do not split evenly over {n} ranks")
        blocks = tensor.contiguous().view(n, -1)  # (ranks, elements of one rank's rows)
        out = torch.empty((tensor.shape[0] // n, *tensor.shape[1:]), dtype=tensor.dtype)
        flat_out = out.view(-1)
        step = max(1, self._x.max_numel(tensor.dtype) // n)  # every rank's block of a chunk in one slot
        if blocks.shape[1] <= step:
            self._x.reduce_scatter(blocks, flat_out)
        else:
            for start, end in _chunks(blocks.shape[1], step):
                self._x.reduce_scatter(blocks[:, start:end].contiguous(), flat_out[start:end], total=blocks.numel())
        return out

    def close(self) -> None:
        super().close()
        self._x.close()


def _leader_failure(rank: int, other_leaders: str, gloo_text: str, timeout_s: float) -> str:
    """What a node leader says when its gloo round with the other nodes' leaders failed: a wait
    that ran out (the timeout, and the setting behind it) or a connection lost (a peer's process
    exited or its node dropped: no timeout to raise, which the first wording advised for both)."""
    said = (f"node leader rank {rank}: the gloo all-gather of every node's partials failed waiting for the other "
            f"nodes' leaders ({other_leaders}): {gloo_text}.")
    text = gloo_text.lower()
    if "timed out" in text or "timeout" in text:
        return f"{said} A rank on one of those nodes is stuck, or its node frozen. {timeout_advice(timeout_s)}"
    return (f"{said} The connection to one of them was lost: a rank's process on that node exited, or the "
            f"node dropped off the network (that rank's own log says why). Restart the group.")


class HierarchicalCollectives(Collectives):
    """Ranks over several nodes: shared memory inside a node, gloo among node leaders.

    exchange: this node's NodeExchange, None when this rank is alone on its node.
    leaders: the gloo group of each node's first rank (None on ranks that are not leaders); its
        rank i leads node_groups[i].
    world: gloo over all ranks (all_gather_last_dim).
    chunk_bytes: the slot size, the same on every rank: every node cuts a tensor into the same
        chunks, so the leaders' gloo calls match.
    node_groups: the global ranks on each node, each sorted, the nodes sorted by first rank.
    timeout_s: the process group's timeout, named in the leaders' errors.
    """

    def __init__(self, exchange: NodeExchange | None, leaders, world: TorchDistributedCollectives,
                 chunk_bytes: int, node_groups: list[list[int]], timeout_s: float) -> None:
        import torch.distributed as dist

        self._x, self._leaders, self._world, self._dist = exchange, leaders, world, dist
        self._chunk_bytes = chunk_bytes
        self._groups = node_groups
        self._max_local = max(len(g) for g in node_groups)
        # (node, local index) of each global rank, in rank order: where its partial lands
        self._place = sorted((r, node, i) for node, g in enumerate(node_groups) for i, r in enumerate(g))
        self._timeout_s = timeout_s
        rank = world.rank
        others = ", ".join(str(g[0]) for g in node_groups if rank not in g)
        self._other_leaders = f"rank{'s' if ',' in others else ''} {others}"
        # Said by a rank whose node leader never broadcast the sum: that leader was the messenger,
        # stuck in the gloo round below while some other node's rank held its leader back.
        self._leader_waits_for = (f", this node's leader, which itself waits over gloo for the other nodes' "
                                  f"leaders ({self._other_leaders}) to send their nodes' partials: the rank "
                                  f"stuck is most likely on one of those nodes")

    @property
    def rank(self) -> int:
        return self._world.rank

    @property
    def world_size(self) -> int:
        return self._world.world_size

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        require_contiguous(tensor, "all_reduce_sum_")
        flat = tensor.view(-1)
        for start, end in _chunks(flat.numel(), self._chunk_bytes // flat.element_size()):
            part = flat[start:end]
            local = self._gather_node(part, flat.numel())  # (ranks on this node, n): every rank takes part
            if self._leaders is not None:
                self._sum_over_nodes_(part, local)
            if self._x is not None:
                self._x.broadcast_(part, root=0, total=flat.numel(),  # the leader's total to the rest of the node
                                   root_waits_for=self._leader_waits_for)
        return tensor

    def _gather_node(self, part: torch.Tensor, total: int) -> torch.Tensor:
        if self._x is None:
            return part.unsqueeze(0)
        out = torch.empty((self._x.size, part.numel()), dtype=part.dtype)
        self._x.gather(part, out, total=total)
        return out

    def _sum_over_nodes_(self, part: torch.Tensor, local: torch.Tensor) -> None:
        """part <- every rank's partial summed in global rank order (node leaders only)."""
        # gloo's all_gather needs equal sizes: each node's block padded to the largest node
        block = torch.zeros((self._max_local, part.numel()), dtype=part.dtype)
        block[: local.shape[0]] = local
        blocks = torch.empty((len(self._groups), *block.shape), dtype=part.dtype)
        try:
            self._dist.all_gather(list(blocks.unbind(0)), block, group=self._leaders)
        except RuntimeError as err:  # gloo's own text names neither a rank nor a setting
            raise CollectiveTimeout(_leader_failure(self.rank, self._other_leaders, str(err).strip(),
                                                    self._timeout_s)) from err
        sum_in_rank_order_(part, [blocks[node, i] for _, node, i in self._place])

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._world.all_gather_last_dim(tensor)

    def close(self) -> None:
        super().close()
        if self._x is not None:
            self._x.close()
