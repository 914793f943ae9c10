"""Micro-batches for accumulation and the input dims a compiled model takes (autopar.runtime.batch).

The multi-rank runs (accumulated training, the loop written with ``no_sync()``, eval at
other batch sizes) are the ``accum:`` and ``eval:`` cases of tests/test_train_distributed.py.
"""

import pytest
import torch

from autopar.runtime.batch import check_dims, split_batch


def test_split_batch_cuts_every_input_and_the_target_along_dim_0():
    x = torch.arange(24).reshape(6, 4)
    mask = torch.arange(12).reshape(6, 2)
    target = torch.arange(6)
    pieces = split_batch(((x, {"mask": mask}),), target, 3)
    assert len(pieces) == 3
    for i, ((px, kw), pt) in enumerate((p[0][0], p[1]) for p in pieces):
        assert torch.equal(px, x[2 * i:2 * i + 2])
        assert torch.equal(kw["mask"], mask[2 * i:2 * i + 2])
        assert torch.equal(pt, target[2 * i:2 * i + 2])


def test_split_batch_keeps_a_missing_target_and_refuses_uneven_batches():
    x = torch.zeros(6, 4)
    assert all(t is None for _, t in split_batch((x,), None, 2))
    assert split_batch((x,), None, 1) == [((x,), None)]
    with pytest.raises(ValueError, match=r"^autopar: accumulate=4 cuts dim 0 .* found shapes \[\(6, 4\)\]"):
        split_batch((x,), None, 4)
    with pytest.raises(ValueError, match=r"^autopar: expected accumulate to be a positive int"):
        split_batch((x,), None, 0)


def test_check_dims_takes_any_sizes_of_the_compiled_dims():
    check_dims([(3, 8), (1, 5)], [(8, 8), (8, 8)])  # any batch and length: the plan lays every capture out
    with pytest.raises(ValueError, match=r"^autopar: expected input 1 with 2 dims, as in the example inputs "
                                         r"\(\(8, 8\)\); found shape \(8,\)"):
        check_dims([(8, 8), (8,)], [(8, 8), (8, 8)])
