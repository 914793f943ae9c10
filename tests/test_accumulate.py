"""Micro-batches for accumulation and the batch sizes a plan's splits divide (autopar.runtime.batch).

The multi-rank runs (accumulated training, the loop written with ``no_sync()``, eval at
other batch sizes) are the ``accum:`` and ``eval:`` cases of tests/test_train_distributed.py.
"""

import pytest
import torch

from autopar.runtime.batch import check_divisible, split_batch
from autopar.passes.placements import R, S


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


def test_check_divisible_names_the_sizes_that_work():
    specs = [(S(0), S(0))]  # the batch over both axes of a (2, 2) mesh
    check_divisible([(4, 8)], specs, [(8, 8)], (2, 2))  # half the compiled batch: fine
    with pytest.raises(ValueError, match=r"^autopar: input 0 of shape \(6, 8\) .* multiple of 4 \(sizes that work: "
                                         r"4, 8, 12, \.\.\.; compiled with 8\)"):
        check_divisible([(6, 8)], specs, [(8, 8)], (2, 2))
    with pytest.raises(ValueError, match=r"multiple of 4 .* compiled with 8"):  # 2 micro-batches, each over 2 ranks
        check_divisible([(6, 8)], [(S(0),)], [(8, 8)], (2,), micro_batches=2)
    check_divisible([(3, 8)], [(R, R)], [(8, 8)], (2, 2))  # the batch not split: any size
    with pytest.raises(ValueError, match=r"^autopar: expected input 0 with 2 dims"):
        check_divisible([(8,)], specs, [(8, 8)], (2, 2))
