"""Each pipeline stage is built with what it receives and sends (``autopar.runtime.stages.stage_io``),
so that torch's ``PipelineStage`` infers nothing by running a stage on uninitialised tensors
(an int64 index received from there points anywhere: ``gather`` out of range, or a hang).
What one stage says it sends is what the next says it receives, and both are what the
stages' programs make, dtypes (int64, bool) and gradients included. Real processes:
``indices`` cases of tests/test_train_distributed.py."""

import operator
import warnings

import torch

from autopar.passes.capture import capture
from autopar.passes.costing import carrying_gradient
from autopar.passes.lowering.codegen import lower
from autopar.passes.strategy_graph import build_strategy_graph
from autopar.runtime.stages import stage_io, stage_parts
from tests.models import CutIndices


def _described(tensors):
    return [(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]


def test_what_a_stage_sends_is_what_the_next_receives_in_every_dtype():
    torch.manual_seed(0)
    model = CutIndices(vocab=64, seq=8)
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, (tokens,))
    graph = build_strategy_graph(captured, ())  # stages of one device each: every value whole
    choice = {node: 0 for node in graph.nodes}
    ops = list(captured.nodes("call_function"))
    stage_of = {}
    for i, node in enumerate(ops):
        producer = node.args[0] if node.target is operator.getitem else None
        stage_of[node.name] = stage_of[producer.name] if producer is not None else i * 2 // len(ops)
    parts = stage_parts(captured, stage_of, 2)
    graded = carrying_gradient(captured)
    values = captured.state_values(model)
    received = tokens,
    for index, part in enumerate(parts):
        program = lower(graph, choice, None, part=part)
        inputs = [n for n in part.inputs if n.name not in values]
        metas_in, metas_out = stage_io(part, program, inputs, graded, ())
        if index > 0:  # as the stage before says it sends
            assert _described(metas_in) == _described(sent_metas)
        assert [(tuple(t.shape), t.dtype) for t in received] == [(tuple(m.shape), m.dtype) for m in metas_in]
        state = [values[n.name] for n in part.inputs if n.name in values]
        outputs = program.gm(*state, *received)
        # the program's outputs, as the metadata says: a gradient flows back exactly where one is made
        assert _described(outputs) == _described(metas_out)
        received, sent_metas = [t.detach().requires_grad_(t.requires_grad) for t in outputs], metas_out
        if index == 0:
            crossing = {m.dtype: m.requires_grad for m in metas_out}
            assert crossing == {torch.int64: False, torch.bool: False, torch.float32: True}, crossing
    torch.testing.assert_close(received[0], model(tokens))
