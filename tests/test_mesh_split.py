"""Pinned degrees on a flat mesh (``autopar.passes.planner.mesh_split``): an axis split in two so
the degrees lie on whole axes, tensor parallel on the inner factor; the plan records the split
mesh and its export builds it. (Training on the split mesh: ``pinned:4:gpt:tp=2/dp=2`` in
``tests/test_train_distributed.py``.) About 15 s on two loaded cores."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar import Constraints
from autopar.models import GPT, GPTConfig
from autopar.passes.placements import parse_spec
from autopar.passes.planner.mesh_split import refinement, split_mesh, split_names
from tests.profiles import measured_style


def no_pipeline(shape):
    return [1]


@pytest.mark.parametrize("shape, pins, split", [
    ((4,), dict(tp=2, dp=2), (2, 2)),
    ((8,), dict(tp=2, dp=4), (4, 2)),  # tensor parallel on the inner factor (the fast links)
    ((8,), dict(tp=4, dp=2), (2, 4)),
    ((8,), dict(tp=2, dp=2), (2, 2, 2)),  # 2 x 2 of 8: the third factor left to the search
    ((2, 4), dict(tp=2, dp=2), (2, 2, 2)),  # the inner axis split, tensor parallel inside it
    ((2, 4), dict(tp=2, dp=4), (2, 4)),  # lies on the axes as given (tp on the outer one): kept
    ((8, 8), dict(tp=8), (8, 8)),  # lies on an axis as given: nothing split
    ((4,), dict(tp=2, dp=2, axes=("dp",)), (4,)),  # roles pinned per axis as given: kept, refused by the search
    ((4,), dict(tp=3), (4,)),  # no split lays it: kept, refused by the search
])
def test_an_axis_is_split_only_where_the_degrees_lie_on_no_whole_axes(shape, pins, split):
    assert split_mesh(Constraints(**pins), shape, no_pipeline) == split


def test_a_pipeline_takes_its_ranks_out_of_the_split_mesh():
    depths = lambda shape: [1] + [p for p in range(2, shape[0] + 1) if shape[0] % p == 0]  # noqa: E731
    assert split_mesh(Constraints(pp=2, tp=2, dp=2), (8,), depths) == (4, 2)  # then pp 2 x dp 2 x tp 2


def test_a_split_mesh_names_its_parts_and_is_read_back():
    assert split_names(("a0", "a1"), (2, 4), (2, 2, 2)) == ("a0", "a1_0", "a1_1")
    assert refinement((2, 4), (2, 2, 2)) == [[2], [2, 2]]
    assert refinement((2,), (2, 1)) == [[2, 1]]  # a pipeline over the whole axis: an intra-op axis of 1
    with pytest.raises(ValueError, match=r"^autopar: the plan is for a mesh of shape \(2, 4\), found \(4, 2\)"):
        refinement((4, 2), (2, 4))


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=2)), (torch.randint(0, 64, (8, 8)),)


def test_tp_and_dp_pinned_on_a_flat_mesh_plan_on_its_split_and_export_it(gpt, tmp_path):
    model, inputs = gpt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (4,), inputs, hardware="h100", time_limit_s=5, axis_names=("gpus",),
                            constraints=Constraints(tp=2, dp=2))
    assert plan.mesh_shape == (2, 2) and plan.axis_names == ("gpus_0", "gpus_1") and plan.pipeline is None
    for name in ("blocks.0.mlp.up.weight", "blocks.1.attn.q.weight"):  # Megatron on the inner axis, whole outside
        outer, inner = parse_spec(plan.params[name])
        assert isinstance(outer, Replicate) and isinstance(inner, Shard), (name, plan.params[name])
    assert plan.pins["broken"] == ["tp=2", "dp=2"]  # the unpinned plan lays no such degrees on (4,)
    exported = plan.export(model, tmp_path / "parallelize.py", example_inputs=inputs)
    assert "MESH_SHAPE = (2, 2)" in exported.source


def test_a_measured_profile_cannot_price_a_split(gpt):
    model, inputs = gpt
    refused = (r"^autopar: no plan honours the pins tp=2, dp=2 .*: pins tp=2, dp=2 need the mesh \(4,\) split into "
               r"\(2, 2\), which the measured profile")
    with warnings.catch_warnings(), pytest.raises(ValueError, match=refused):
        warnings.simplefilter("ignore")
        autopar.plan(model, (4,), inputs, hardware=measured_style((4,)), time_limit_s=5,
                     constraints=Constraints(tp=2, dp=2))
