"""In-place writes into views (Hugging Face's ``shift_tokens_right``, which BART and Whisper
run on their labels: ``new_zeros``, then ``copy_`` into a slice of it and ``fill_`` into a
column) are planned where the value they write into lies (issue #18): the strategy graph
lists each write's path (``StrategyGraph.in_place``), every plan reads it in place, and
lowering still refuses a hand-made choice that moves it (``codegen.check_write_reaches``).
One process, a toy model; about 10 s."""

import contextlib
import random
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.passes.capture import capture
from autopar.passes.lowering.codegen import Reshard, lower
from autopar.passes.plan import choice_from_plan
from autopar.passes.simulate import simulate_graph
from autopar.passes.strategy_graph import build_strategy_graph

VOCAB, HIDDEN, BATCH, SEQ, START, PAD = 16, 8, 4, 6, 2, 1


class ShiftedDecoder(nn.Module):
    """Embeds ids and the labels shifted right, as BART and Whisper make decoder inputs;
    ``zeros`` reads the value before it is written into."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.proj = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, labels):
        shifted = labels.new_zeros(labels.shape)
        zeros = (shifted == 0).sum()
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = START
        shifted.masked_fill_(shifted == -100, PAD)
        return self.proj(self.embed(ids) + self.embed(shifted)) + zeros


def _case():
    torch.manual_seed(0)
    model = ShiftedDecoder().double()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    labels[0, 2] = -100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, (ids, labels), capture(model, (ids, labels))


@pytest.fixture(scope="module")
def case():
    return _case()


def _named(captured):
    return {n.name: n for n in captured.graph.nodes}


def test_the_write_paths_run_from_the_base_through_the_views_to_the_writers(case):
    _, _, cap = case
    graph = build_strategy_graph(cap, (2, 2))
    kept = {(str(value.target), str(reader.target)) for value, reader in graph.in_place}
    assert kept == {("aten.new_zeros.default", "aten.slice.Tensor"), ("aten.slice.Tensor", "aten.copy_.default"),
                    ("aten.new_zeros.default", "aten.select.int"), ("aten.select.int", "aten.fill_.Tensor")}


@pytest.mark.parametrize("layout", ["dp", "fsdp", "auto"])  # tp keeps the labels whole: nothing to move
def test_every_plan_reads_the_write_paths_where_they_lie_and_computes_the_model(case, layout):
    model, inputs, cap = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (2, 2), inputs, layout=None if layout == "auto" else layout, pipeline=False,
                            time_limit_s=5)
    graph = build_strategy_graph(cap, (2, 2))
    choice = choice_from_plan(graph, plan)
    for value, reader in graph.in_place:
        need = graph[reader].strategies[choice[reader]].inputs[0]
        assert need in (None, graph.output_specs(value)[choice[value]]), (layout, value.name, reader.name)
    outputs = simulate_graph(graph, choice, cap.placeholder_values(model, inputs), random.Random(0))
    torch.testing.assert_close(outputs[cap.user_outputs[0]], model(*inputs), rtol=0, atol=1e-12)


def _moving_choice(graph, cap) -> dict:
    """Everything replicated but the base, split by rows, which the slice reads whole: moved."""
    named = _named(cap)
    choice = {node: 0 for node in graph.nodes}
    split = (Shard(0),)
    choice[named["new_zeros"]] = graph.output_specs(named["new_zeros"]).index(split)
    return choice


def test_a_choice_that_moves_a_write_path_computes_wrong_values_and_lowering_refuses_it(case, tmp_path):
    model, inputs, cap = case
    graph = build_strategy_graph(cap, (2,))
    choice = _moving_choice(graph, cap)
    assert graph[_named(cap)["slice_2"]].strategies[choice[_named(cap)["slice_2"]]].inputs[0] == (Replicate(),)
    # what the refusal guards against: the write lands in a moved copy
    outputs = simulate_graph(graph, choice, cap.placeholder_values(model, inputs), random.Random(0))
    assert not torch.allclose(outputs[cap.user_outputs[0]], model(*inputs))
    with one_device(tmp_path) as mesh:
        graph = build_strategy_graph(cap, (1,))
        with pytest.raises(ValueError, match=r"^autopar: copy_ .* writes in place into slice_2, a view of new_zeros"):
            lower(graph, _moving_choice(graph, cap), mesh)


def test_a_value_moved_before_it_is_written_is_moved_again_for_the_readers_after(case, tmp_path):
    """Codegen shares one move of a value among its readers; a write in between makes the
    earlier copy stale: the readers after it get a move of their own."""
    model, inputs, cap = case
    order = list(cap.graph.nodes)
    with one_device(tmp_path) as mesh:
        graph = build_strategy_graph(cap, (1,))
        choice = _moving_choice(graph, cap)
        # the write paths read in place (from the base on), the other readers moved
        for value, reader in sorted(graph.in_place, key=lambda edge: order.index(edge[1])):
            choice[reader] = next(i for i, s in enumerate(graph[reader].strategies)
                                  if s.inputs[0] == graph.output_specs(value)[choice[value]])
        program = lower(graph, choice, mesh)
        moves = {n.meta.get("autopar_node"): n.args[0] for n in program.gm.graph.nodes
                 if n.op == "call_function" or n.op == "call_module"}
        before, after = moves["eq"], moves["eq_1"]  # both read new_zeros moved to R
        assert isinstance(program.gm.get_submodule(before.target), Reshard) and before is not after
        values = dict(zip(cap.placeholders, cap.placeholder_values(model, inputs)))
        out = program.gm(*[values[name] for name in cap.placeholders])
        torch.testing.assert_close(out[cap.user_outputs[0]], model(*inputs), rtol=0, atol=1e-12)


@contextlib.contextmanager
def one_device(tmp_path):
    """A one-rank gloo group and its mesh: lowering needs a mesh, moves still build copies."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
