"""Failures shared across ranks and collectives agreed, without processes: what a program
says it calls on each mesh axis (``autopar.passes.lowering.agreement``), how a difference is
named, and ``autopar.runtime.faults`` outside a multi-process group (nothing changes)."""

import pickle

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.passes.lowering.agreement import _first_difference, collectives_by_axis
from autopar.passes.lowering.codegen import lower
from autopar.passes.propagate import choose_by_propagation
from autopar.passes.strategy_graph import build_strategy_graph
from autopar.runtime.faults import PeerFailure, failures_shared, shared_failures


@pytest.fixture(scope="module")
def transformer_on_2x2(captured_models):
    _, _, cap = captured_models["torch_transformer"]
    return cap, build_strategy_graph(cap, (2, 2))


def _lowered(cap, graph, tokens_spec):
    tokens = next(n for n in graph.nodes if n.name == cap.user_inputs[0])
    choice = choose_by_propagation(graph, {tokens: tokens_spec})
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        return lower(graph, choice, init_device_mesh("cpu", (2, 2)))
    finally:
        dist.destroy_process_group()


def test_a_program_lists_its_collectives_per_mesh_axis(transformer_on_2x2):
    cap, graph = transformer_on_2x2
    split_on_0 = _lowered(cap, graph, (Shard(0), Replicate()))
    calls = collectives_by_axis(split_on_0.gm, split_on_0.grad_sync, 2)
    # the batch split on axis 0: every parameter's gradient summed there, nothing on axis 1
    assert calls[1] == [] and {c.removeprefix("gradient sum of ") for c in calls[0]} == set(cap.params)
    split_on_1 = _lowered(cap, graph, (Replicate(), Shard(0)))
    other = collectives_by_axis(split_on_1.gm, split_on_1.grad_sync, 2)
    assert other[0] == [] and other[1] == calls[0]


def test_the_first_difference_names_the_collective_and_the_ranks():
    same = ["r1: S(0) -> R of (8, 8) float32", "gradient sum of w"]
    differs = _first_difference([same, same, ["r1: S(0) -> R of (4, 8) float32", "gradient sum of w"], same],
                                [0, 1, 2, 3])
    assert differs == ("collective #1 differs (ranks [0, 1, 3]: r1: S(0) -> R of (8, 8) float32; "
                       "ranks [2]: r1: S(0) -> R of (4, 8) float32)")
    shorter = _first_difference([same, same[:1]], [4, 6])
    assert shorter == "collective #2 differs (ranks [4]: gradient sum of w; ranks [6]: (nothing: its program ends here))"


def test_a_peer_failure_reads_the_same_on_every_rank_and_travels_whole():
    failure = PeerFailure(2, "training step", "ValueError: autopar: bad", here=0)
    assert str(failure).startswith("autopar: rank 2 failed during the training step: ValueError: autopar: bad\n")
    copy = pickle.loads(pickle.dumps(failure))
    assert (copy.rank, copy.what, copy.error, str(copy)) == (2, "training step", failure.error, str(failure))


def test_without_a_multi_process_group_errors_pass_unchanged(one_rank):
    @failures_shared("training step")
    def step():
        raise ValueError("autopar: the batch has 3 rows")

    with pytest.raises(ValueError, match="the batch has 3 rows") as raised:
        step()
    assert not getattr(raised.value, "__notes__", None)  # no peer to tell
    with shared_failures("compile"):  # and nothing is published that a later call would raise
        pass
