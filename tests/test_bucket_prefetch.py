"""Bucket gathers and gradient reduce-scatters overlap compute (``autopar.passes.lowering.buckets``).

Rank 0 of a 2-rank ZeRO-3 GPT program (every parameter stored split, gathered per use),
its collectives and its compute recorded in the order they are issued: the all-gather of
the next bucket is started before the ops of the current one run (forward and backward),
at most one bucket ahead, and each gradient reduce-scatter runs while backward computes
(one in flight). The collectives are simulated in process (as if the other
rank held the same shards: deterministic), so that the overlapped run can be checked to
compute what the plain one computes, bit for bit; real gloo ranks run the same code in
``tests/distributed/train_check.py``'s ZeRO cases.
"""

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.passes.capture import capture
from autopar.passes.lowering.codegen import lower
from autopar.passes.placements import local_slice
from autopar.passes.propagate import choose_by_propagation
from autopar.passes.strategy_graph import build_strategy_graph
from tests.models import small_gpt

COMPUTE = {"mm", "addmm", "bmm", "embedding", "native_layer_norm", "_softmax", "gelu",
           "embedding_dense_backward", "native_layer_norm_backward", "_softmax_backward_data", "gelu_backward"}


class Recorder(TorchDispatchMode):
    """Events in issue order: ("op", name) for compute, ("issue"/"wait", kind, id) for collectives."""

    def __init__(self, events: list[tuple]):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in COMPUTE:
            self.events.append(("op", name))
        return func(*args, **(kwargs or {}))


class _Work:
    def __init__(self, log: list, kind: str, ident: int):
        self.log, self.kind, self.ident = log, kind, ident

    def wait(self):
        self.log.append(("wait", self.kind, self.ident))
        return True


def simulated(monkeypatch, log: list) -> None:
    """Collectives of two ranks that hold the same shards, done in process; the asynchronous
    ones (the buckets') logged when issued and when waited for."""
    count = iter(range(1 << 30))

    def all_gather_single(out, x, group=None, async_op=False):
        out.view(2, -1).copy_(x.reshape(1, -1).expand(2, -1))
        return issued("all_gather", async_op)

    def reduce_scatter_single(out, x, op=None, group=None, async_op=False):
        out.view(-1).copy_(x.view(2, -1).sum(0))
        return issued("reduce_scatter", async_op)

    def all_to_all_single(out, x, *args, group=None, async_op=False, **kwargs):
        out.copy_(x)
        return issued("all_to_all", async_op)

    def issued(kind: str, async_op: bool) -> _Work | None:
        if not async_op:  # a reshard's, done at once
            return None
        ident = next(count)
        log.append(("issue", kind, ident))
        return _Work(log, kind, ident)

    for f in (all_gather_single, reduce_scatter_single, all_to_all_single):
        monkeypatch.setattr(dist, f.__name__, f)


@pytest.fixture(scope="module")
def program():
    """Rank 0's ZeRO-3 program of a 2-layer GPT: 4 buckets (embeddings, block 0, block 1, head)."""
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    model, (tokens,) = small_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (tokens,))
    graph = build_strategy_graph(cap, (2,))
    choice = choose_by_propagation(graph, {next(n for n in graph.nodes if n.name == "tokens"): (Shard(0),)})
    for node, ns in graph.nodes.items():
        if node.name in cap.params and node.meta["val"].shape[0] % 2 == 0:
            choice[node] = [s.output for s in ns.strategies].index((Shard(0),))
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        lowered = lower(graph, choice, init_device_mesh("cpu", (2,)), gather_per_use=frozenset(cap.params))
        whole = {**cap.state_values(model), "tokens": tokens}
        values = {ph: local_slice(v, lowered.input_specs[ph], (2,), (0,)) if ph in lowered.input_specs else v
                  for ph, v in whole.items()}  # rank 0's shards
        yield lowered, cap, values
    finally:
        dist.destroy_process_group()


def leaves(cap, values):
    return {ph: values[ph].detach().clone().requires_grad_(True) for ph in cap.params}


def run(program, cap, values, params, overlap: bool, log: list) -> int:
    """One forward and backward, events appended to ``log``; with ``overlap``, as the runtime
    calls the program. Returns where backward's events start."""
    args = [params.get(ph, values.get(ph)) for ph in cap.placeholders]
    recorder = Recorder(log)
    context = program.saving(overlap_backward=True) if overlap else contextlib.nullcontext()
    with recorder:
        with context:
            logits = pytree.tree_leaves(program.gm(*args))[0]
        forward_end = len(log)
        logits.float().pow(2).mean().backward()
    return forward_end


def second_call(program, monkeypatch) -> tuple[list[tuple], int, dict]:
    """The events of the second overlapped call (the first records the order buckets come
    in), where its backward starts, and the parameters."""
    lowered, cap, values = program
    params = leaves(cap, values)
    log: list[tuple] = []
    simulated(monkeypatch, log)
    run(lowered, cap, values, params, overlap=True, log=log)
    log.clear()
    return log, run(lowered, cap, values, params, overlap=True, log=log), params


def spans(events: list[tuple], kind: str) -> list[tuple[int, int, int]]:
    """Per collective of ``kind``: (issue position, wait position, compute ops between them)."""
    issued = {e[2]: i for i, e in enumerate(events) if e[0] == "issue" and e[1] == kind}
    waited = {e[2]: i for i, e in enumerate(events) if e[0] == "wait" and e[1] == kind}
    return [(issued[k], waited[k], sum(e[0] == "op" for e in events[issued[k]:waited[k]])) for k in sorted(issued)]


def most_in_flight(events: list[tuple], kind: str) -> int:
    flying, most = 0, 0
    for e in events:
        if e[0] in ("issue", "wait") and e[1] == kind:
            flying += 1 if e[0] == "issue" else -1
            most = max(most, flying)
    return most


def test_the_next_bucket_is_gathered_while_this_one_computes(program, monkeypatch):
    log, forward_end, _ = second_call(program, monkeypatch)
    forward = spans(log[:forward_end], "all_gather")
    assert len(forward) == 4, forward  # embeddings, block 0, block 1, head
    # the first is needed at once; each later one was started a bucket earlier, and the ops
    # of the bucket before it ran while it was in flight
    assert forward[0][2] == 0
    assert all(ops > 0 for _, _, ops in forward[1:]), forward
    assert most_in_flight(log[:forward_end], "all_gather") == 1  # at most one bucket ahead


def test_backward_gathers_the_bucket_it_needs_next_ahead(program, monkeypatch):
    log, forward_end, _ = second_call(program, monkeypatch)
    backward = spans(log[forward_end:], "all_gather")
    assert len(backward) == 3, backward  # head, block 1, block 0 (the embeddings' backward reads no weight)
    assert all(ops > 0 for _, _, ops in backward[1:]), backward
    assert most_in_flight(log[forward_end:], "all_gather") == 1


def test_gradient_reduce_scatters_run_while_backward_computes(program, monkeypatch):
    log, forward_end, params = second_call(program, monkeypatch)
    backward = log[forward_end:]
    scatters = spans(backward, "reduce_scatter")
    assert len(scatters) == 4, scatters
    # each waited for only after more of backward ran (the embeddings', last, has none left
    # to run beside), the last once backward's compute is done
    assert all(ops > 0 for _, _, ops in scatters[:-1]), scatters
    last_op = max(i for i, e in enumerate(backward) if e[0] == "op")
    assert max(w for _, w, _ in scatters) > last_op
    assert most_in_flight(backward, "reduce_scatter") == 1  # its buffers freed before the next are taken
    assert all(p.grad is not None for p in params.values())


def test_overlapped_run_computes_what_the_plain_run_computes(program, monkeypatch):
    lowered, cap, values = program
    simulated(monkeypatch, [])
    plain, overlapped = leaves(cap, values), leaves(cap, values)
    run(lowered, cap, values, plain, overlap=False, log=[])
    for _ in range(2):  # the second call prefetches
        for p in overlapped.values():
            p.grad = None
        run(lowered, cap, values, overlapped, overlap=True, log=[])
        for ph in cap.params:
            assert torch.equal(overlapped[ph].grad, plain[ph].grad), ph
