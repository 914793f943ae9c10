"""The pipelined collective linears (``autopar.passes.collective_matmul``, async TP's
decomposed all-gather -> matmul and matmul -> reduce-scatter): forward and every gradient
equal one process's, on the simulator's threads and on 2 and 4 gloo ranks (one launch each,
a few seconds); their strategies pass the simulator; their price is the critical path; the
solver takes them where that is shorter; compiled models using them train like one process.
"""

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from torch.ops import aten

import autopar
from autopar.models import llama3

from autopar.costmodels.comm import Step
from autopar.costmodels.compute import compute_time
from autopar.costmodels.opkinds import Op
from autopar.costmodels.pipelined import Pipelined, pipelined_time, pipelined_times
from autopar.passes import rules
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.collective_matmul import AxisLink, chunk_count, gather_linear
from autopar.passes.exchange import VirtualExchange
from autopar.passes.op_strategies import OpInfo
from autopar.passes.rules import overlapped
from autopar.passes.rules.overlapped import GATHER, SCATTER
from autopar.passes.simulate import check_strategy
from autopar.passes.strategy_graph import build_strategy_graph
from tests.distributed.collective_matmul_check import check_rank
from tests.test_costmodel_formulas import make_profile
from tests.test_train_distributed import launch

# float64 on both sides; the chunks change only the order of the sums
TOLERANCE = 1e-12


def test_chunks_one_per_rank_or_the_most_that_divide():
    assert chunk_count(12, 2) == 2
    assert chunk_count(12, 4) == 4
    assert chunk_count(6, 4) == 3
    assert chunk_count(7, 4) == 1
    assert chunk_count(1, 8) == 1


def on_threads(ranks: int, fn) -> dict:
    """``fn(link, rank)`` on each of ``ranks`` virtual devices, side by side (the simulator's
    ``VirtualExchange``); rank -> its result."""
    exchange, results, failures = VirtualExchange((ranks,)), {}, []

    def device(rank: int) -> None:
        try:
            results[rank] = fn(AxisLink(exchange.bind((rank,)), 0, ranks), rank)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            failures.append(exc)
            exchange.abort()

    threads = [threading.Thread(target=device, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]
    return results


@pytest.mark.parametrize("ranks", [2, 4])
def test_exact_on_the_simulators_threads(ranks):
    for rank, diffs in on_threads(ranks, check_rank).items():
        assert len(diffs) == 6 and all(d < TOLERANCE for d in diffs.values()), (rank, diffs)


@pytest.mark.parametrize("ranks", [2, 4])
def test_exact_on_gloo_ranks(ranks):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", "tests.distributed.collective_matmul_check"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and len(lines) == 1, done.stdout[-2000:] + done.stderr[-3000:]
    diffs = json.loads(lines[0].removeprefix("RESULT "))
    assert len(diffs) == 6 and all(d < TOLERANCE for d in diffs.values()), diffs


def test_pipelined_formula_by_hand():
    # 4 chunks, a matmul of 1 s beside a collective of 2 s
    assert pipelined_time(4, 1.0, 2.0, 1.0) == pytest.approx(2 + 3 * 2 + 1)  # all hidden: the longer
    assert pipelined_time(4, 1.0, 2.0, 0.0) == pytest.approx(4 * (1 + 2))  # nothing hidden: one after the other
    assert pipelined_time(4, 1.0, 2.0, 0.5) == pytest.approx(2 + 3 * (1 + 2 - 0.5) + 1)
    assert pipelined_time(1, 1.0, 2.0, 1.0) == pytest.approx(3.0)  # one chunk: the gather, then the matmul


@pytest.mark.parametrize("gathers_first", [True, False])
def test_critical_path_by_hand(gathers_first):
    # what an all-gather and a reduce-scatter hide beside compute
    p = dataclasses.replace(make_profile((4,)), overlap={"parameter_gather": 1.0, "gradient_reduce_scatter": 0.5})
    chunk, whole = Op(8e9, 1e6, "fp32", "aten.linear.default", 2.5e5), Op(32e9, 4e6, "fp32", "aten.linear.default", 1e6)
    gather, scatter = Step("all_gather", 0, 4_000_000), Step("reduce_scatter", 0, 4_000_000)
    times = pipelined_times(Pipelined(4, chunk, gather, scatter, gathers_first, whole), p)
    c = compute_time(8e9, 1e6, "fp32", p, "aten.linear.default")  # a chunk's matmul; dX and dW alike
    ag = 1e-5 + 3 / 4 * 4e6 / 1e9  # alpha + (N-1)/N X / beta
    rs = ag
    assert c == pytest.approx(8e9 / 1e12, rel=1e-2) and ag < c  # compute-bound chunks, longer than their collective
    # apart: the whole matmul, dX and dW, one gather and one reduce-scatter of all 4 chunks' bytes
    c_whole, ag_whole = compute_time(32e9, 4e6, "fp32", p, "aten.linear.default"), 1e-5 + 3 / 4 * 16e6 / 1e9
    assert times.apart == pytest.approx(3 * c_whole + 2 * ag_whole)
    if gathers_first:  # gather, 3 steps of a matmul beside a gather, the last matmul
        forward = ag + 3 * c + c
        # again for dW (all hidden), then dX's reduce-scatters (half of the shorter hidden)
        backward = (ag + 3 * c + c) + (c + 3 * (c + rs - 0.5 * rs) + rs)
    else:
        forward = c + 3 * (c + rs - 0.5 * rs) + rs
        backward = ag + 3 * 2 * c + 2 * c  # the output's gradient gathered beside dX and dW
    assert times.forward == pytest.approx(forward)
    assert times.backward == pytest.approx(backward)
    assert times.compute_forward == pytest.approx(4 * c) and times.compute_backward == pytest.approx(8 * c)
    assert times.pays == (forward + backward < 3 * c_whole + 2 * ag_whole)


def test_offered_only_where_it_pays():
    """Nothing hidden (profiles without overlap figures): every chunk's latency is a loss, the
    critical path is longer than the op apart, and costing prices the strategy out."""
    p = make_profile((4,))
    chunk, whole = Op(8e9, 1e6, "fp32", "aten.linear.default", 2.5e5), Op(32e9, 4e6, "fp32", "aten.linear.default", 1e6)
    steps = Step("all_gather", 0, 4_000_000), Step("reduce_scatter", 0, 4_000_000)
    for gathers_first in (True, False):
        assert not pipelined_times(Pipelined(4, chunk, *steps, gathers_first, whole), p).pays
    graph = build_strategy_graph(capture(torch.nn.Linear(16, 12), (torch.randn(4, 8, 16),)), (4,))
    costs = build_costs(graph, dataclasses.replace(autopar.costmodels.preset("h100", (4,)), overlap={}))
    node = next(n for n in graph.nodes if n.op == "call_function" and "linear" in n.name)
    times = costs.problem.node_time[costs.index[node]]
    kernels = [s.kernel for s in graph[node].strategies]
    assert {GATHER, SCATTER} <= set(kernels)
    assert all(math.isinf(t) == (k in (GATHER, SCATTER)) for t, k in zip(times, kernels))


# (input, weight, bias) shapes: rows next to the features in a 3-D and a 2-D input
LINEARS = [((4, 8, 16), (12, 16), True), ((8, 16), (8, 16), False)]


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2), (2, 2, 2)], ids=lambda m: "x".join(map(str, m)))
def test_every_strategy_running_a_kernel_passes_the_simulator(mesh):
    rng = random.Random(0)
    checked = set()
    for x_shape, w_shape, bias in LINEARS:
        gen = torch.Generator().manual_seed(3)
        args = [torch.randn(s, generator=gen, dtype=torch.float64)
                for s in (x_shape, w_shape) + (((w_shape[0],),) if bias else ())]
        info = OpInfo.from_call(aten.linear.default, tuple(args))
        strategies = [s for s in rules.strategies_for(info, mesh) if s.kernel in (GATHER, SCATTER)]
        for strategy in strategies:
            check_strategy(info, strategy, args, mesh, rng)
        checked |= {s.kernel for s in strategies}
    assert checked == {GATHER, SCATTER}


def test_a_gather_over_an_outer_axis_of_rows_an_inner_axis_splits_is_not_offered():
    info = OpInfo.from_call(aten.linear.default, (torch.randn(4, 8, 16), torch.randn(12, 16)))
    texts = {str(s) for s in rules.strategies_for(info, (2, 2))}
    assert "(RS(1), RS(0)) -> RS(2) [gather_linear]" in texts  # over the inner axis
    assert "(S(1)S(1), S(0)R) -> S(2)S(1) [gather_linear]" not in texts  # its rows interleaved: not S(1) on axis 1
    assert "(S(1)S(1), RS(0)) -> S(1)S(2) [gather_linear]" in texts  # the inner gather keeps the outer blocks whole


def test_the_solver_takes_them_where_they_pay(monkeypatch):
    """Llama-3 70B's layer shapes (2 layers, 8 x 4096 tokens) on 8 H100s with tensor
    parallelism pinned: the o and down projections reduce-scatter inside their matmuls (the
    sequence split after them), the plan dry-runs, and the predicted step is shorter than
    without the fused strategies; ~15 s."""
    with torch.device("meta"):
        model = llama3("70b", 4096, 2)
    tokens = torch.zeros(8, 4096, dtype=torch.long, device="meta")

    def planned():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.plan(model, (8,), (tokens,), hardware="h100", pipeline=False,
                                constraints=autopar.Constraints(tp=8))

    fused = planned()
    kernels = [s.split("[")[-1].rstrip("]") for s in fused.strategies.values() if "[" in s]
    assert kernels.count(SCATTER) >= 4, fused.strategies  # both layers' o and down projections
    said = f"{kernels.count(SCATTER)} linears reduce-scattering the sum"
    assert f"async tensor parallel (the collective in chunks, each beside another chunk's matmul): {said}" \
        in fused.explain(), fused.explain()
    # it runs at its size (fake tensors), its activations as predicted
    run = autopar.dry_run(fused, model, (tokens,))
    run.raise_if_failed()
    for rank in run.ranks:
        assert rank.memory["activations"] == pytest.approx(rank.predicted["activations"], rel=0.05), rank
    monkeypatch.setattr(overlapped, "options", lambda info: [])
    apart = planned()
    assert not any(GATHER in s or SCATTER in s for s in apart.strategies.values())
    assert "async tensor parallel" not in apart.explain()
    assert fused.predicted.step_time < apart.predicted.step_time
    assert fused.predicted.communication < apart.predicted.communication


# compiled models with every tensor-parallel linear's collective inside it, trained against
# one process (``tests/distributed/plans.py``'s ``fused_plan``); a few seconds a launch
FUSED = {2: ["2:gpt:fused-tp", "2:mlp:fused-tp"], 4: ["2x2:gpt:fused-tp+sp", "4:gpt:fused-tp"]}


@pytest.mark.parametrize("nproc", sorted(FUSED))
def test_compiled_training_with_the_collectives_inside_the_linears_matches_one_process(nproc):
    for case, r in launch(nproc, FUSED[nproc]).items():
        assert "error" not in r, f"{case}: {r['error']}"
        assert {GATHER, SCATTER} <= set(r["kernels"]), f"{case}: {r['kernels']}"
        assert r["loss_err"] <= 1e-9 and r["param_err"] <= 1e-9, f"{case}: {r}"


def test_the_gathered_linear_keeps_its_rows_as_a_shard_for_backward():
    """What the cost model charges its strategy (the input as read: a shard); backward
    gathers the rows again."""

    def saved(link: AxisLink, rank: int) -> list[tuple[int, ...]]:
        x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
        w = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            y = gather_linear(x, w, None, link, 1)
        y.sum().backward()
        return shapes

    # x's shard and w, not the gathered (2, 12, 8)
    assert on_threads(2, saved) == {0: [(2, 6, 8), (4, 8)], 1: [(2, 6, 8), (4, 8)]}
