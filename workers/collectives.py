"""The communication a tensor-parallel model needs, behind one small interface.

The model calls two operations, so a backend only has to provide those:
- `all_reduce_sum_`: after each row-parallel block (o_proj, down_proj) and the vocab-parallel
  embedding, every rank holds a partial sum of the same (batch, seq, hidden) tensor.
- `all_gather_last_dim`: the vocab-parallel LM head leaves each rank with its slice of the logits;
  every rank needs the whole row to sample the same token.

Sequence-parallel prefills (workers/sequence_parallel.py) add two more, along the first dimension:
`all_gather_rows` and `reduce_scatter_rows`. Both have exact defaults built on the first two (a
gather through `all_gather_last_dim`, a reduce-scatter as an all-reduce of which each rank keeps
its rows); the shared-memory and torch.distributed paths override them with the cheaper real thing.

Every path sums in one fixed order, global rank order: ((x0 + x1) + x2) + ... (see
`sum_in_rank_order_`). float32 addition is not associative, so this is what makes the results
bit-identical whichever path carries them (gloo, shared memory, or both across nodes) and whatever
the topology. gloo's own ring all-reduce starts each chunk of the tensor at a different rank; at two
ranks that is still exact (a + b == b + a), beyond two it is replaced by an all-gather and the
ordered sum.

gloo (`TorchDistributedCollectives`) works everywhere but costs hundreds of microseconds per call on
one host. Co-located CPU ranks use shared memory instead (`workers/shm/`: `ShmCollectives` when the
whole group shares a node, `HierarchicalCollectives` across nodes); NCCL for CUDA is
`TorchDistributedCollectives` over an NCCL group.

Implementations provide the in-place `all_reduce_sum_` and `all_gather_last_dim`. The model calls
the functional `all_reduce` and `all_gather`, which go through the custom operators of
workers/collective_ops.py so that a compiled step keeps them inside its graph; with
`in_graph = False` they are called as plain Python instead, which makes torch.compile cut its graph
at every collective (the former per-region compilation, kept for comparison in
benchmarks/tp_scaling.py). Outside torch.compile (an eager model, or a compiled model's eager
fallbacks) they are plain calls: an operator's kernel, and the graph-break wrapper, import the
whole of torch._dynamo on their first call (2-3 s of CPU per rank on a 2-core host, which made the
first request of an eager SmolLM2 TP 3 group take 3.6 s on machine I against 0.5 s for the next)
to compute what the plain call computes.
"""

from __future__ import annotations

import abc

import torch

from workers import collective_ops


def sum_in_rank_order_(out: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """out <- ((parts[0] + parts[1]) + parts[2]) + ...; parts in global rank order, at least two,
    none aliasing `out`. The one summation order of every Collectives implementation."""
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)
    return out


def require_contiguous(tensor: torch.Tensor, what: str) -> None:
    """A check, not an assert: python -O strips asserts, and a strided tensor would then be
    reduced through a view of the wrong elements (or fail deep inside the library)."""
    if not tensor.is_contiguous():
        raise ValueError(f"{what} reduces the caller's storage in place and needs a contiguous tensor, got "
                         f"shape {tuple(tensor.shape)} with strides {tuple(tensor.stride())}: pass "
                         f"tensor.contiguous() (and use the result), or call all_reduce, which returns a new tensor")


def require_a_dimension(tensor: torch.Tensor, what: str) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{what} concatenates along the last dimension and needs a tensor with at least one, "
                         f"got a 0-d tensor: pass tensor.reshape(1)")


class Collectives(abc.ABC):
    """One rank's view of its tensor-parallel group."""

    in_graph: bool = True
    """Traced by torch.compile as operators inside the graph (True), or as graph breaks (False)."""
    _handle: int | None = None

    @property
    def handle(self) -> int:
        """This object's handle for the custom operators (registered on first use)."""
        if self._handle is None:
            self._handle = collective_ops.register(self)
        return self._handle

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over all ranks as a new tensor (what the model calls; see the module docstring)."""
        return self._call(torch.ops.corelaunch.all_reduce_sum, self._summed_copy, tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor concatenated along the last dim, in rank order (what the model calls)."""
        return self._call(torch.ops.corelaunch.all_gather_last_dim, self.all_gather_last_dim, tensor)

    def gather_along(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's tensor concatenated along `dim`, in rank order (sequence parallelism)."""
        return self._call(torch.ops.corelaunch.all_gather_dim, lambda t: gather_along_dim(self, t, dim), tensor, dim)

    def reduce_scatter_along(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's block of `dim` (split into world_size equal blocks) of the sum over ranks."""
        return self._call(torch.ops.corelaunch.reduce_scatter_dim, lambda t: reduce_scatter_along_dim(self, t, dim),
                          tensor, dim)

    def _call(self, operator, plain, tensor: torch.Tensor, *args) -> torch.Tensor:
        """plain(tensor), or, while torch.compile traces, the operator (in_graph) or plain behind a
        graph break (see the module docstring for why eager calls skip both)."""
        if torch.compiler.is_compiling():
            if self.in_graph:
                return operator(tensor, self.handle, *args)
            return _outside_graph(plain, tensor)
        return plain(tensor)

    def _summed_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum_(tensor.clone(memory_format=torch.contiguous_format))

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This rank's index in the group, 0 .. world_size - 1."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group (the TP degree)."""

    @abc.abstractmethod
    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace `tensor` in place with the element-wise sum over all ranks; returns `tensor`.

        Every rank must end with bit-identical values: the ranks sample from the same logits and
        must agree on tokens without another round of communication.
        """

    @abc.abstractmethod
    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` concatenated along the last dim in rank order (a new tensor).

        All ranks pass tensors of the same shape; the result's last dim is world_size times larger.
        """

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` concatenated along the first dim in rank order (a new tensor).

        Default: one all_gather_last_dim of the flattened tensor, whose rank-order concatenation is
        the same bytes."""
        flat = tensor.contiguous().view(1, -1)
        return self.all_gather_last_dim(flat).view(self.world_size * tensor.shape[0], *tensor.shape[1:])

    def reduce_scatter_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows [rank * n, (rank + 1) * n) of the sum over ranks, n = tensor.shape[0] // world_size
        (a new tensor; the first dim must divide evenly). Summed in rank order like all_reduce_sum_,
        so every element equals the all-reduce's.

        Default: the whole all-reduce, of which this rank keeps its rows."""
        rows = _rows_per_rank(tensor, self.world_size)
        total = self.all_reduce_sum_(tensor.clone(memory_format=torch.contiguous_format))
        return total[self.rank * rows: (self.rank + 1) * rows].clone()

    def close(self) -> None:
        """Release what the collectives hold beyond the process group (shared memory); idempotent.

        The process group itself is the backend's to destroy. Subclasses call this too."""
        if self._handle is not None:
            collective_ops.unregister(self._handle)
            self._handle = None


def _rows_per_rank(tensor: torch.Tensor, world_size: int) -> int:
    if tensor.shape[0] % world_size:
        raise ValueError(f"reduce_scatter_rows: {tensor.shape[0]} rows do not split evenly over {world_size} ranks")
    return tensor.shape[0] // world_size


def gather_along_dim(collectives: "Collectives", tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """collectives.all_gather_rows with `dim` moved to the front and back (contiguous result)."""
    rows_first = tensor.movedim(dim, 0).contiguous()
    return collectives.all_gather_rows(rows_first).movedim(0, dim).contiguous()


def reduce_scatter_along_dim(collectives: "Collectives", tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """collectives.reduce_scatter_rows with `dim` moved to the front and back (contiguous result)."""
    rows_first = tensor.movedim(dim, 0).contiguous()
    return collectives.reduce_scatter_rows(rows_first).movedim(0, dim).contiguous()


# torch's own lazy form of torch.compiler.disable: the decorator imports torch._dynamo on the first
# call instead of at import, which saves every process that imports this module (the CLI, a Serve
# replica, an eager rank) about 2 s of start-up on a 2-core host. Tracing treats it as
# torch.compiler.disable does: a graph break around the call.
@torch._disable_dynamo
def _outside_graph(fn, tensor: torch.Tensor) -> torch.Tensor:
    """fn(tensor) run by Python, never traced: torch.compile ends its graph before it."""
    return fn(tensor)


class SingleRank(Collectives):
    """TP degree 1: the rank already holds the whole sum and the whole gather."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    # Nothing to communicate: the traced graph holds no operator at all.
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_along(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor

    def reduce_scatter_along(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor


class TorchDistributedCollectives(Collectives):
    """Collectives over an initialised torch.distributed process group (gloo on CPU, NCCL on CUDA).

    `group=None` means the default (world) group. The process group must already be initialised:
    rendezvous is the launcher's job, not the model's.
    """

    def __init__(self, group: "torch.distributed.ProcessGroup | None" = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed has no initialised process group; call "
                "torch.distributed.init_process_group(backend='gloo', ...) on every rank before "
                "building TorchDistributedCollectives"
            )
        self._dist = dist
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        # torch.distributed reduces contiguous storage only; callers pass fresh matmul outputs.
        require_contiguous(tensor, "all_reduce_sum_")
        if self._world_size == 2:  # a + b == b + a bit for bit: gloo's ring sum is the rank-order sum
            self._dist.all_reduce(tensor, op=self._dist.ReduceOp.SUM, group=self._group)
            return tensor
        flat = tensor.view(-1)
        parts = torch.empty((self._world_size, flat.numel()), dtype=flat.dtype, device=flat.device)
        self._dist.all_gather(list(parts.unbind(0)), flat, group=self._group)
        sum_in_rank_order_(flat, list(parts.unbind(0)))
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        require_a_dimension(tensor, "all_gather_last_dim")
        if self._world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        self._dist.all_gather(parts, tensor, group=self._group)
        return torch.cat(parts, dim=-1)

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor.clone()
        tensor = tensor.contiguous()
        out = tensor.new_empty((self._world_size * tensor.shape[0], *tensor.shape[1:]))
        self._dist.all_gather_into_tensor(out, tensor, group=self._group)
        return out

    def reduce_scatter_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = _rows_per_rank(tensor, self._world_size)
        tensor = tensor.contiguous()
        if self._world_size == 1:
            return tensor.clone()
        out = tensor.new_empty((rows, *tensor.shape[1:]))
        if self._world_size == 2:  # a + b == b + a: the library's own reduce-scatter is the rank-order sum
            self._dist.reduce_scatter_tensor(out, tensor, group=self._group)
            return out
        # Every rank's block of this rank's rows, then the ordered sum (as all_reduce_sum_ does).
        parts = torch.empty_like(tensor)
        self._dist.all_to_all_single(parts, tensor, group=self._group)
        blocks = parts.view(self._world_size, rows, *tensor.shape[1:])
        return sum_in_rank_order_(out, list(blocks.unbind(0)))
