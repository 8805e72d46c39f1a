"""The collectives as torch custom operators, so a compiled graph keeps them inside itself.

torch.compile cannot trace into a collective: the shared-memory path is ctypes calls into a small C
library, gloo and NCCL are opaque C++ calls. Called as plain Python, each one ends the graph, and a
decode step falls apart into two graphs per layer with a Python round trip between them. Registered
as operators with a fake implementation (which only says what shape comes out), the compiler keeps
them as calls inside one graph: the whole step is one graph at any TP degree, and the model code
never knows which collectives run under it.

The operators take an integer handle, not the Collectives object (an operator's arguments are
tensors and plain values): `register` gives a Collectives object its handle, and the operator looks
it up in this process's table at run time. Both are functional (they return a new tensor, never
change their input), the form the compiler handles without copies of its own.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.collectives import Collectives

_GROUPS: dict[int, "Collectives"] = {}
_NEXT_HANDLE = itertools.count(1)


def register(collectives: "Collectives") -> int:
    """A new handle through which the operators reach `collectives` in this process."""
    handle = next(_NEXT_HANDLE)
    _GROUPS[handle] = collectives
    return handle


def unregister(handle: int) -> None:
    _GROUPS.pop(handle, None)


def _group(handle: int) -> "Collectives":
    try:
        return _GROUPS[handle]
    except KeyError:
        raise RuntimeError(
            f"collectives handle {handle} is not registered in this process (closed, or the graph was "
            f"built in another process); build the model with live collectives"
        ) from None


@torch.library.custom_op("corelaunch::all_reduce_sum", mutates_args=())
def all_reduce_sum(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    """The element-wise sum of `tensor` over the group's ranks, in global rank order."""
    out = tensor.clone(memory_format=torch.contiguous_format)  # one fresh, contiguous copy: never the input
    return _group(handle).all_reduce_sum_(out)


@all_reduce_sum.register_fake
def _all_reduce_sum_shape(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


@torch.library.custom_op("corelaunch::all_gather_last_dim", mutates_args=())
def all_gather_last_dim(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    """Every rank's `tensor` concatenated along the last dimension, in rank order."""
    out = _group(handle).all_gather_last_dim(tensor)
    # A group of one may hand its input back; an operator's output must never alias its input.
    return out.clone() if out.data_ptr() == tensor.data_ptr() else out


@all_gather_last_dim.register_fake
def _all_gather_last_dim_shape(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    ranks = _group(handle).world_size
    return tensor.new_empty((*tensor.shape[:-1], ranks * tensor.shape[-1]))


@torch.library.custom_op("corelaunch::all_gather_dim", mutates_args=())
def all_gather_dim(tensor: torch.Tensor, handle: int, dim: int) -> torch.Tensor:
    """Every rank's `tensor` concatenated along `dim`, in rank order (sequence parallelism)."""
    from workers.collectives import gather_along_dim

    out = gather_along_dim(_group(handle), tensor, dim)
    return out.clone() if out.data_ptr() == tensor.data_ptr() else out


@all_gather_dim.register_fake
def _all_gather_dim_shape(tensor: torch.Tensor, handle: int, dim: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] *= _group(handle).world_size
    return tensor.new_empty(shape)


@torch.library.custom_op("corelaunch::reduce_scatter_dim", mutates_args=())
def reduce_scatter_dim(tensor: torch.Tensor, handle: int, dim: int) -> torch.Tensor:
    """This rank's block along `dim` of the sum over ranks (summed in global rank order)."""
    from workers.collectives import reduce_scatter_along_dim

    out = reduce_scatter_along_dim(_group(handle), tensor, dim)
    return out.clone() if out.data_ptr() == tensor.data_ptr() else out


@reduce_scatter_dim.register_fake
def _reduce_scatter_dim_shape(tensor: torch.Tensor, handle: int, dim: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] //= _group(handle).world_size
    return tensor.new_empty(shape)
