"""The decode step replayed as a CUDA graph (``autopar.runtime.cuda_graphs``): exact against
Hugging Face's ``generate``, and a step that cannot be recorded falls back, loudly, to eager.
These need a GPU (the suite's nccl cases: the ``one_gpu`` fixture); without one they are skipped."""

import warnings

import pytest
import torch

import autopar
from autopar.runtime.cuda_graphs import GraphFallbackWarning, GraphedStep
from tests.models import llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_greedy_generation_with_the_decode_step_graphed_equals_hugging_face(one_gpu):
    model = llama()[0].eval().to(torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                  pad_token_id=0)
    pm = autopar.compile(model, one_gpu, inference=autopar.Inference(batch=4, prompt_len=8, max_len=24))
    assert pm.cuda_graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphFallbackWarning)
        got = pm.generate(ids.cuda(), max_new_tokens=12)
        again = pm.generate(ids.cuda(), max_new_tokens=12)  # replays the graph recorded above
    assert pm._graphed[0].graph is not None and not pm._graphed[0].eager
    assert torch.equal(got.cpu(), want) and torch.equal(again.cpu(), want)
    pm.cuda_graphs = False
    assert torch.equal(pm.generate(ids.cuda(), max_new_tokens=12).cpu(), want)


def test_a_step_that_cannot_be_recorded_runs_eagerly_and_says_so(one_gpu):
    def step(x, state):
        if float(x.sum()) > -1:  # a copy to the host: not allowed while recording a graph
            state.add_(x)
        return state * 2

    state = torch.zeros(4, device="cuda")
    graphed = GraphedStep(step, [False, True], "a test step")
    with pytest.warns(GraphFallbackWarning, match="autopar: a test step runs eagerly"):
        first = graphed(torch.ones(4, device="cuda"), state)
    assert graphed.eager and torch.equal(first[0], torch.full((4,), 2.0, device="cuda"))
    second = graphed(torch.ones(4, device="cuda"), state)
    assert torch.equal(second[0], torch.full((4,), 4.0, device="cuda"))  # eager from then on, state in place


def test_a_graphed_step_reads_new_inputs_and_writes_its_state_in_place(one_gpu):
    def step(x, slot, cache):  # as decode writes its cache: new values at a slot, then a read of all of it
        cache.index_copy_(0, slot, x)
        return cache.sum(dim=0)

    cache = torch.zeros(3, 2, device="cuda")
    graphed = GraphedStep(step, [False, False, True], "a test step")
    outs = [graphed(torch.full((1, 2), float(i + 1), device="cuda"), torch.tensor([i], device="cuda"), cache)[0]
            for i in range(3)]
    assert graphed.graph is not None and not graphed.eager
    assert [o.tolist() for o in outs] == [[1.0, 1.0], [3.0, 3.0], [6.0, 6.0]]
    assert cache.tolist() == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
