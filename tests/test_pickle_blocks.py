"""A pickled checkpoint's slices are copied a block of rows at a time, each block's file pages
dropped before the next (shardlib/checkpoint.py _PickleFile.read): copied whole, a row-parallel
slice faulted in its whole tensor first. Whatever the blocks, the slice is apply_slice's."""

from __future__ import annotations

import pytest
import torch

from shardlib import checkpoint
from shardlib.sharding import TensorSlice, apply_slice

SLICES = [TensorSlice(0, ((3, 11),)), TensorSlice(0, ((0, 2), (7, 13)), pad_to=12), TensorSlice(1, ((5, 17),)),
          TensorSlice(1, ((0, 3), (9, 12)), pad_to=8), TensorSlice(2, ((1, 3),)), TensorSlice(None)]


@pytest.mark.parametrize("block_bytes", [1, 96, 1 << 20], ids=["a-row-a-block", "a-few-rows", "one-block"])
def test_a_pickled_slice_read_in_blocks_equals_the_slice_of_the_whole(tmp_path, monkeypatch, block_bytes):
    monkeypatch.setattr(checkpoint, "PICKLE_BLOCK_BYTES", block_bytes)
    tensors = {"w": torch.randn(13, 20), "e": torch.randn(13, 4, 3), "b": torch.randn(13),
               "none": torch.randn(0, 20), "t": torch.randn(20, 13).t(), "f8": torch.randn(13, 20).to(torch.float8_e4m3fn)}
    path = tmp_path / "pytorch_model.bin"
    torch.save(tensors, path)
    with checkpoint._PickleFile(path) as pickled:
        for name, tensor in tensors.items():
            for tslice in SLICES:
                if tslice.dim is not None and (tslice.dim >= tensor.dim()
                                               or tslice.ranges[-1][1] > tensor.shape[tslice.dim]):
                    continue  # not a cut this tensor has
                if tslice.dim == 0 and tensor.shape[0] == 0 and tslice.ranges:
                    continue
                got, expected = pickled.read(name, tslice), apply_slice(tensor, tslice)
                assert got.dtype == expected.dtype and got.shape == expected.shape, (name, tslice)
                as_bytes = [t.contiguous().view(torch.uint8) for t in (got, expected)]  # fp8 has no equal()
                assert torch.equal(*as_bytes), (name, tslice)
                assert got.is_contiguous() or tslice.is_whole  # a whole tensor is cloned as it is stored
